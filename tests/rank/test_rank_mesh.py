"""A real 4-rank ring mesh on loopback serving the demo model: correctness,
the OpenAI contract, lockstep under sampling, cancellation, prefix reuse and
bad input."""

import json
import time

import pytest
import requests
from openai import OpenAI

from kit.demo_answers import endless
from kit.openai import sse_events, validate
from kit.ranks import StatusTrace, start_mesh
from kit.waiting import wait_for

PROMPTS = ["hello world", "What is the answer?", "The quick brown fox", "Drain before close."]


@pytest.fixture(scope="module")
def mesh4(demo_model, tmp_path_factory):
    with start_mesh(demo_model, 4, tmp_path_factory.mktemp("mesh4"), "--heartbeat-interval", "0.05") as mesh:
        mesh.wait_ready()
        yield mesh


@pytest.fixture(scope="module")
def mesh2(demo_model, tmp_path_factory):
    """Two ranks for the heavier scenarios: four ranks on two cores decode slowly
    because the ring transport busy-polls while it waits."""
    with start_mesh(demo_model, 2, tmp_path_factory.mktemp("mesh2"), "--heartbeat-interval", "0.05") as mesh:
        mesh.wait_ready()
        yield mesh


def chat(mesh, content, **kw):
    body = {"messages": [{"role": "user", "content": content}], **kw}
    return requests.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=60)


def in_flight_everywhere(mesh) -> list[int]:
    return [mesh.status(r)["requests_in_flight"] for r in range(len(mesh.procs))]


def test_four_ranks_decode_the_same_greedy_tokens_as_one_process(mesh4, reference):
    for content in PROMPTS:
        r = chat(mesh4, content, max_tokens=16, temperature=0)
        assert r.status_code == 200, r.text
        body = r.json()
        validate(body, "CreateChatCompletionResponse")
        ids = reference.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                      add_generation_prompt=True)
        assert body["choices"][0]["message"]["content"] == reference(ids, 16)
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_text_completion_matches_one_process(mesh4, reference):
    r = requests.post(f"{mesh4.url}/v1/completions", json={"prompt": "The ranks step", "max_tokens": 16},
                      timeout=60)
    body = r.json()
    validate(body, "CreateCompletionResponse")
    ids = reference.tokenizer.encode("The ranks step")
    assert body["choices"][0]["text"] == reference(ids, 16)


def test_openai_client_streams_to_done_and_reads_whole(mesh4):
    client = OpenAI(base_url=f"{mesh4.url}/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    validate(models.model_dump(), "ListModelsResponse")

    whole = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=12)
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens > 0

    pieces, reasons = [], []
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_raw_stream_is_http11_chunked_and_ends_with_done(mesh4):
    r = requests.post(f"{mesh4.url}/v1/chat/completions", stream=True, timeout=60,
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "stream": True})
    assert r.raw.version == 11
    assert r.headers.get("Transfer-Encoding") == "chunked"
    events = sse_events(r.iter_lines(decode_unicode=True))
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        validate(e, "CreateChatCompletionStreamResponse")


def test_seeded_sampling_stays_in_lockstep_and_replays(mesh2):
    def run():
        outs = []
        for i in range(10):
            r = chat(mesh2, PROMPTS[i % 4], max_tokens=20, temperature=1.0, top_p=0.95, seed=1000 + i)
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["message"]["content"])
        return outs

    first, replay = run(), run()
    assert first == replay
    assert len(set(first)) > 1  # sampling really varied with the seed
    assert chat(mesh2, "still alive?", max_tokens=4).status_code == 200


def test_client_disconnect_cancels_on_every_rank(mesh2):
    r = requests.post(f"{mesh2.url}/v1/chat/completions", stream=True, timeout=60,
                      json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000,
                            "stream": True, "temperature": 0.8, "seed": 5})
    lines = r.iter_lines(decode_unicode=True)
    assert next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: all(n == 1 for n in in_flight_everywhere(mesh2)), 30, "the request on every rank")
    r.close()
    wait_for(lambda: all(n == 0 for n in in_flight_everywhere(mesh2)), 30,
             "the cancel to reach every rank")
    steps = [mesh2.status(i)["tokens"] for i in range(len(mesh2.procs))]
    assert len(set(steps)) == 1, f"ranks left the request at different steps: {steps}"
    assert max(steps) < 3000
    assert chat(mesh2, "next", max_tokens=5).status_code == 200


def test_prefix_reuse_counts_cached_tokens_and_keeps_output(mesh2, reference):
    system = {"role": "system", "content": "You are a mesh. " * 8}
    turn1 = [system, {"role": "user", "content": "hello world"}]
    r1 = requests.post(f"{mesh2.url}/v1/chat/completions", timeout=60,
                       json={"messages": turn1, "max_tokens": 10}).json()
    answer = r1["choices"][0]["message"]["content"]
    lookups, hits = tape_counts_after(mesh2, time.time())
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    r2 = requests.post(f"{mesh2.url}/v1/chat/completions", timeout=60,
                       json={"messages": turn2, "max_tokens": 10}).json()
    validate(r2, "CreateChatCompletionResponse")
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    ids = reference.tokenizer.apply_chat_template(turn2, add_generation_prompt=True)
    assert len(ids) > cached >= len(reference.tokenizer.apply_chat_template(turn1, add_generation_prompt=True))
    assert r2["choices"][0]["message"]["content"] == reference(ids, 10)
    assert tape_counts_after(mesh2, time.time()) == (lookups + 1, hits + 1)


def tape_counts_after(mesh, t: float) -> tuple[int, int]:
    """The token tape's lookups and hits, the same on every rank, in status files written after `t` (a
    rank counts a lookup at the request's insert, long before its last step)."""
    def read():
        statuses = [mesh.status(r) for r in range(len(mesh.procs))]
        if any(s is None or s["updated_at"] <= t for s in statuses):
            return None
        counts = {(s["tape_hits"] + s["tape_misses"] + s["tape_not_reusable"], s["tape_hits"]) for s in statuses}
        assert len(counts) == 1, statuses
        return counts.pop()
    return wait_for(read, 10, "every rank's status file written after the request")


def test_status_file_shows_decode_progress(mesh2):
    with StatusTrace(mesh2.status_files[1]) as trace:
        assert chat(mesh2, "count", max_tokens=200, temperature=0.7, seed=1).status_code == 200
    busy = [s for s in trace.snapshots if s["state"] == "busy"]
    assert len(busy) >= 2, trace.snapshots
    assert busy[-1]["tokens"] > busy[0]["tokens"] and busy[-1]["step"] > busy[0]["step"]
    assert all(s["generation"] == 1 and s["rank"] == 1 and s["world"] == 2 for s in trace.snapshots)


BAD = [
    ("not json", "/v1/chat/completions", b"{nope", 400, None),
    ("array body", "/v1/chat/completions", [1, 2], 400, None),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("max_tokens zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("max_tokens over limit", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ("max_tokens string", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400, "max_tokens"),
    ("temperature wrong type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ("top_p out of range", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_p": 3}, 400, "top_p"),
    ("stop wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 4},
     400, "stop"),
    ("prompt longer than context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "mesh " * 5000}], "max_tokens": 8}, 400, "messages"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("unknown route", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_json_error_and_the_next_request_is_served(mesh4, name, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(f"{mesh4.url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    validate(r.json(), "ErrorResponse")
    if param is not None:
        assert r.json()["error"]["param"] == param
    good = chat(mesh4, "fine", max_tokens=3)
    assert good.status_code == 200
    assert all(p.poll() is None for p in mesh4.procs)


def test_a_stop_sequence_cuts_the_text_and_ends_the_work_on_every_rank(mesh2, demo_model):
    body = {"max_tokens": 2000, **endless(demo_model)}
    whole = chat(mesh2, "hello world", max_tokens=24, **endless(demo_model)).json()["choices"][0]["message"]["content"]
    stop = whole[5:8]
    before = [mesh2.status(r)["tokens"] for r in range(2)]
    r = chat(mesh2, "hello world", stop=[stop], **body).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == whole[: whole.find(stop)]
    wait_for(lambda: in_flight_everywhere(mesh2) == [0, 0], 60, "the ranks to drop the stopped request")
    decoded = [mesh2.status(rank)["tokens"] - before[rank] for rank in range(2)]
    assert max(decoded) < 200, f"the ranks decoded {decoded} tokens of an answer cut after a few"




def test_logprobs_whole_and_streamed_in_the_openai_shapes(mesh2, demo_model):
    client = OpenAI(base_url=f"{mesh2.url}/v1", api_key="unused", max_retries=0)
    ask = dict(model="demo", messages=[{"role": "user", "content": "hello world"}], max_tokens=12,
               temperature=0, logprobs=True, top_logprobs=3, extra_body=endless(demo_model))
    whole = client.chat.completions.create(**ask)
    validate(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 12
    for e in entries:  # greedy: each token is its own most likely one, and probabilities are at most 1
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.logprob == e.top_logprobs[0].logprob <= 0 and e.bytes == list(e.token.encode())
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)

    streamed = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        streamed += [e for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]

    plain = client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_completions_logprobs_and_their_limits(mesh2):
    r = requests.post(f"{mesh2.url}/v1/completions", timeout=60,
                      json={"prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "logprobs": 2})
    body = r.json()
    validate(body, "CreateCompletionResponse")
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"] and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for bad, param in (({"logprobs": 9}, "logprobs"),):
        r = requests.post(f"{mesh2.url}/v1/completions", json={"prompt": "x", **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = chat(mesh2, "hi", top_logprobs=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert "'logprobs': true" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def thinker(thinking_model, tmp_path_factory):
    with start_mesh(thinking_model, 2, tmp_path_factory.mktemp("thinker"), "--heartbeat-interval", "0.05") as mesh:
        mesh.wait_ready()
        yield mesh


def test_a_thinking_model_answers_its_reasoning_apart_and_the_template_takes_its_kwargs(thinker, thinking_model):
    """The template opens a think block; with the close biased away the whole answer is reasoning, whole and
    streamed alike, and a stop string inside the reasoning cuts nothing. `enable_thinking: false` closes
    the block in the prompt: the answer is content."""
    client = OpenAI(base_url=f"{thinker.url}/v1", api_key="unused", max_retries=0)
    added = json.loads((thinking_model / "tokenizer.json").read_text())["added_tokens"]
    think_end = next(t["id"] for t in added if t["content"] == "</think>")
    bias = {**endless(thinking_model)["logit_bias"], str(think_end): -100}
    ask = dict(model="thinking", messages=[{"role": "user", "content": "hello world"}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**ask, extra_body={"logit_bias": bias})
    validate(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    message = whole.choices[0].message.model_dump()
    assert message["reasoning"] and message["content"] == ""

    streamed = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True, extra_body={"logit_bias": bias}):
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        for c in chunk.choices:
            delta = c.delta.model_dump()
            streamed = {k: v + (delta.get(k) or "") for k, v in streamed.items()}
    assert streamed == {"reasoning": message["reasoning"], "content": ""}

    stop = message["reasoning"][3:6]
    kept = client.chat.completions.create(**ask, stop=[stop], extra_body={"logit_bias": bias})
    assert kept.choices[0].finish_reason == "length" and kept.choices[0].message.model_dump()["reasoning"] == \
        message["reasoning"]

    plain = client.chat.completions.create(**ask, extra_body={"logit_bias": bias,
                                                              "chat_template_kwargs": {"enable_thinking": False}})
    validate(plain.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    assert plain.choices[0].message.content and "reasoning" not in plain.choices[0].message.model_dump()
    assert plain.usage.prompt_tokens > whole.usage.prompt_tokens  # the template closed the block


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_a_tool_round_trip_with_the_official_client_whole_and_streamed(mesh2, demo_model):
    """The demo model's random weights never write a tool call, so the test writes its first one: the
    request carries the call's tokens as an answer already begun (the `meshd.resume` the proxy sends rank 0
    when it resumes a cut answer, with nothing yet delivered) and the end token biased in, so the model
    ends its turn right after. Rank 0 parses the call out of the answer with the model's own tool parser
    (mlx-lm's json_tools, which the demo template selects); the call and the tool's result then go back
    as history, rendered by the template."""
    from tokenizers import Tokenizer

    said = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = Tokenizer.from_file(str(demo_model / "tokenizer.json")).encode(said).ids
    eos = json.loads((demo_model / "config.json").read_text())["eos_token_id"]
    begun = {"logit_bias": {str(eos): 100},
             "meshd": {"resume": {"ids": ids, "chars": 0, "id": "chatcmpl-begun", "created": 1, "seed": 1}}}
    client = OpenAI(base_url=f"{mesh2.url}/v1", api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model="demo", messages=question, tools=[WEATHER], max_tokens=len(ids) + 8, temperature=0)

    whole = client.chat.completions.create(**ask, extra_body=begun)
    validate(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather",
                                                                                    {"city": "Paris"})

    content, calls, reasons = "", [], []
    for chunk in client.chat.completions.create(**ask, stream=True, extra_body=begun):
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert content == "Let me check.\n" and reasons[-1] == "tool_calls"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]

    history = question + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(**{**ask, "messages": history, "max_tokens": 8})
    validate(answer.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    assert answer.choices[0].finish_reason in ("length", "stop") and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > whole.usage.prompt_tokens + len(ids)  # the call and its result in the prompt


def test_each_sampling_parameter_changes_what_it_must(mesh2, demo_model):
    """On every rank alike (the ranks would diverge otherwise, and the divergence check would end them)."""
    def tokens(**kw):
        r = requests.post(f"{mesh2.url}/v1/completions", timeout=60,
                          json={"prompt": "The quick brown fox", "max_tokens": 64, "logprobs": 0, **endless(demo_model),
                                **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    greedy = tokens(temperature=0)
    assert tokens(temperature=2.0, top_k=1, seed=5) == greedy  # one candidate left: the argmax
    assert tokens(temperature=2.0, min_p=1.0, seed=5) == greedy  # only tokens as likely as the best
    assert tokens(temperature=2.0, seed=5) != greedy
    forced = tokens(temperature=0, logit_bias={"100": 100, **endless(demo_model)["logit_bias"]})
    assert len(set(forced)) == 1
    for penalty in ({"repetition_penalty": 5.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalised = tokens(temperature=0, **penalty)
        assert penalised != greedy, penalty
        assert len(set(penalised)) > len(set(greedy)), penalty  # a repeated token costs: more kinds of them
