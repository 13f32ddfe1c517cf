"""DeepSeek's wire, as DeepSeek Harness (the `deepseek-harness` client, unmodified) speaks it to meshd.

Rank 0's real frontend (runtime/server.py on a real port, the demo model's thinking tokenizer with its json_tools
tool format) answered by scripted ranks (kit/scripted.py), for what a random model never writes: calls with their
reasoning apart, several answers of one request, a call cut by max_tokens, a thinking turn cut before its answer,
DeepSeek's multi-turn rule, usage in both vocabularies. Then the harness against a real mesh (controller, proxy,
agent, rank) serving the thinking demo model: chat, stream_chat and a five-turn tool loop, thinking on and off."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import requests
from deepseek_harness import DeepSeekHarness
from mlx_lm.utils import load_tokenizer

from common import openai_api as oa
from kit.meshctl import mesh_up
from kit.openai import sse_events, validate
from kit.scripted import Script, scripted_rank0
from runtime.engine import grammar
from runtime.models.demo_model import DemoModelSpec, build_demo_model

LIMITS = oa.Limits("demo", 0, 4096)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Is it warm in Oslo?"}]
THOUGHT = "I look the weather up."


def call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("thinks") / "model", DemoModelSpec(thinking=True))


@pytest.fixture(scope="module")
def rank0(thinking_model):
    """Rank 0's frontend on a real port over the thinking demo tokenizer, as meshd-rank loads it; its doors
    opened by the warm-up through the scripted ranks."""
    config = json.loads((thinking_model / "config.json").read_text())
    tok = load_tokenizer(thinking_model, eos_token_ids=config["eos_token_id"])
    grammar.serve(tok)  # what the rank does at load: forced calls are compiled against its tokenizer
    with scripted_rank0(tok, LIMITS) as (url, ranks):
        yield SimpleNamespace(url=url, ranks=ranks, tok=tok)


def post(rank0, body: dict, *answers: Script | str) -> requests.Response:
    for a in answers:
        rank0.ranks.answers.put(a)
    return requests.post(f"{rank0.url}/chat/completions", json=body, timeout=30)


def streamed(r: requests.Response) -> list:
    assert r.status_code == 200, r.text
    return sse_events(r.iter_lines(decode_unicode=True))


def harness(rank0, **kwargs) -> DeepSeekHarness:
    return DeepSeekHarness(api_key="unused", base_url=rank0.url, **kwargs)


# --- the harness, call by call -------------------------------------------------------------------------------

def test_the_harness_gets_a_call_with_its_reasoning_apart_and_usage_in_deepseeks_words(rank0):
    rank0.ranks.answers.put(Script(f"{THOUGHT}</think>\n\n{call('Oslo')}", cached=4))
    out = harness(rank0).chat(model="demo", messages=ASK, tools=[WEATHER], max_tokens=64)
    message = out["message"]
    assert out["finish_reason"] == "tool_calls" and out["salvage"] is None  # parsed by meshd, not rescued
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Oslo"})]
    assert message["reasoning_content"] == THOUGHT
    sent = out["raw"].usage.model_dump()  # as meshd sent it, before the harness fills anything in
    prompt = sent["prompt_tokens"]
    assert (sent["prompt_cache_hit_tokens"], sent["prompt_cache_miss_tokens"]) == (4, prompt - 4)
    assert sent["prompt_tokens_details"]["cached_tokens"] == 4


def test_the_harness_streams_parallel_calls_by_their_indexes_and_the_usage_last(rank0):
    rank0.ranks.answers.put(Script(f"{THOUGHT}</think>\n\n{call('Oslo')}\n{call('Lima')}", cached=3))
    events = list(harness(rank0).stream_chat(model="demo", messages=ASK, tools=[WEATHER], max_tokens=128))
    deltas = [e["data"] for e in events if e["type"] == "tool_call_delta"]
    assert [d["index"] for d in deltas] == [0, 1] and all(d["id"] and d["name"] == "get_weather" for d in deltas)
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls" and done["salvage"] is None
    assert [json.loads(c["function"]["arguments"]) for c in done["message"]["tool_calls"]] == \
        [{"city": "Oslo"}, {"city": "Lima"}]
    assert done["message"]["reasoning_content"] == THOUGHT
    assert done["usage"]["prompt_cache_hit_tokens"] == 3 and done["usage"]["prompt_cache_miss_tokens"] > 0


def test_the_harness_switches_thinking_off_and_the_template_closes_the_think_block(rank0):
    rank0.ranks.answers.put("Yes, warm.")
    out = harness(rank0, disable_thinking_by_default=True).chat(model="demo", messages=ASK, max_tokens=16,
                                                                  reasoning_effort="high")
    assert out["message"]["content"] == "Yes, warm." and "reasoning_content" not in out["message"]
    prompt = rank0.tok.decode(rank0.ranks.prompts[-1])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the template's switch, off


# --- several answers ------------------------------------------------------------------------------------------

def test_n_answers_are_rows_each_with_its_own_seed_whole_and_streamed(rank0):
    body = {"messages": ASK, "n": 3, "seed": 7, "max_tokens": 16, "thinking": {"type": "disabled"}}
    r = post(rank0, body, "one", "two two", "three three three")
    assert r.status_code == 200, r.text
    validate(r.json(), "CreateChatCompletionResponse")
    choices = r.json()["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == \
        [(0, "one", "stop"), (1, "two two", "stop"), (2, "three three three", "stop")]
    jobs = rank0.ranks.jobs[-3:]
    assert [j.seed for j in jobs] == [oa.row_seed(7, i) for i in range(3)] and len({j.rid for j in jobs}) == 3
    rows = [oa.usage(r.json()["usage"]["prompt_tokens"], 0, len(rank0.tok.encode(t, add_special_tokens=False)), 0)
            for t in ("one", "two two", "three three three")]
    assert r.json()["usage"] == oa.summed_usage(rows)

    events = streamed(post(rank0, {**body, "stream": True, "stream_options": {"include_usage": True}},
                           "one", "two two", "three three three"))
    assert events[-1] == "[DONE]" and events[-2]["usage"] == r.json()["usage"] and not events[-2]["choices"]
    texts, finished = ["", "", ""], {}
    for chunk in events[:-2]:
        validate(chunk, "CreateChatCompletionStreamResponse")
        c = chunk["choices"][0]
        texts[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finished[c["index"]] = c["finish_reason"]
    assert texts == ["one", "two two", "three three three"] and finished == {0: "stop", 1: "stop", 2: "stop"}
    indexes = [chunk["choices"][0]["index"] for chunk in events[:-2]]
    assert indexes[:3] == [0, 1, 2]  # each row's role first, then their tokens as the batch gave them


# --- answers cut by max_tokens --------------------------------------------------------------------------------

CUT_CALL = f'{THOUGHT}</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Os'


def test_a_call_cut_by_max_tokens_comes_back_as_far_as_it_was_written_whole_and_streamed(rank0):
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 40}
    whole = post(rank0, body, Script(CUT_CALL, "length")).json()
    validate(whole, "CreateChatCompletionResponse")
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("get_weather", '{"city": "Os')]
    events = streamed(post(rank0, {**body, "stream": True}, Script(CUT_CALL, "length")))
    calls = [c for e in events[:-1] for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["arguments"]) for c in calls] == [(0, '{"city": "Os')]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # DeepSeek Harness takes it as the call it is, cut, rather than salvaging anything from the content
    rank0.ranks.answers.put(Script(CUT_CALL, "length"))
    out = harness(rank0).chat(model="demo", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40)
    assert out["finish_reason"] == "length" and out["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_thinking_turn_cut_before_its_answer_ends_length_with_its_reasoning_and_no_content(rank0):
    body = {"messages": ASK, "max_tokens": 8}
    message = post(rank0, body, Script("Let me think about Oslo", "length")).json()["choices"][0]
    assert (message["finish_reason"], message["message"]["content"], message["message"]["reasoning_content"]) == \
        ("length", "", "Let me think about Oslo")
    events = streamed(post(rank0, {**body, "stream": True}, Script("Let me think about Oslo", "length")))
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think about Oslo"
    assert not "".join(d.get("content") or "" for d in deltas) and events[-2]["choices"][0]["finish_reason"] == "length"


# --- DeepSeek's multi-turn rule -------------------------------------------------------------------------------

CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"}


@pytest.mark.parametrize("called,thinking,status", [
    (CALLED, None, 400),
    ({**CALLED, "reasoning_content": THOUGHT}, None, 200),
    (CALLED, {"type": "disabled"}, 200),
], ids=["reasoning left out", "reasoning passed back", "thinking off"])
def test_a_tool_turn_without_its_reasoning_gets_deepseeks_400_while_the_model_thinks(rank0, called, thinking, status):
    body = {"messages": [*ASK, called, RESULT], "tools": [WEATHER], "max_tokens": 16,
            **({"thinking": thinking} if thinking else {})}
    r = post(rank0, body, *(["</think>Warm."] if status == 200 else []))
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert error["message"].startswith("The reasoning_content in the thinking mode must be passed back to the API")
        assert (error["type"], error["param"]) == ("invalid_request_error", "messages[1].reasoning_content")


# --- a real mesh ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(thinking_model, tmp_path_factory):
    """A mesh of one node (controller, proxy, agent, rank) serving the thinking demo model."""
    with mesh_up(tmp_path_factory.mktemp("dsh"), thinking_model, 1,
                 runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096}}) as (path, _):
        from meshd import config as mesh_config
        yield f"http://{mesh_config.load(path).proxy.listen}/v1"


ONE_CALL = {"type": "function", "function": {"name": "get_weather"}}  # "required" lets a random model call on and on


def think_end(thinking_model) -> str:
    """The token id of `</think>`: a bias on it has the random model close its reasoning after a while."""
    return str(load_tokenizer(thinking_model).convert_tokens_to_ids("</think>"))


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "thinking off"])
def test_the_harness_drives_a_five_turn_tool_loop_through_a_mesh(mesh, thinking_model, thinking):
    client = DeepSeekHarness(api_key="unused", base_url=mesh, disable_thinking_by_default=not thinking)
    sampling = {"temperature": 1.0, "seed": 5, "logit_bias": {think_end(thinking_model): 3}} if thinking else {}
    hello = client.chat(model="demo", messages=ASK, max_tokens=24, **sampling)
    assert hello["finish_reason"] in ("stop", "length") and hello["usage"]["prompt_tokens"] > 0
    done = list(client.stream_chat(model="demo", messages=ASK, max_tokens=24, **sampling))[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] > 0

    messages = [*ASK]
    for turn in range(5):
        last = turn == 4
        out = client.chat(model="demo", messages=messages, tools=[WEATHER], max_tokens=400,
                          **({} if last else {"tool_choice": ONE_CALL}), **sampling)
        message, usage = out["message"], out["raw"].usage.model_dump()
        assert usage["prompt_tokens"] == usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"]
        if turn:  # the conversation so far is the tape's: each turn after the first reuses it
            assert usage["prompt_cache_hit_tokens"] > 0, (turn, usage)
        assert bool(message.get("reasoning_content")) == thinking, (turn, message)
        if last:
            assert not message.get("tool_calls") and out["finish_reason"] in ("stop", "length")
            break
        assert out["finish_reason"] == "tool_calls" and out["salvage"] is None, out
        calls = message["tool_calls"]
        assert all(c["function"]["name"] == "get_weather" and json.loads(c["function"]["arguments"])["city"]
                   in ("Oslo", "Lima") for c in calls)
        messages.append(message)  # its reasoning_content with it, as DeepSeek's rule wants
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "21 degrees"} for c in calls]


def test_n_answers_through_the_proxy_are_seeded_rows_the_first_the_single_answers(mesh):
    body = {"model": "demo", "messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": 11,
            "thinking": {"type": "disabled"}}
    single = requests.post(f"{mesh}/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    whole = requests.post(f"{mesh}/chat/completions", json={**body, "n": 3}, timeout=120).json()
    texts = [c["message"]["content"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and texts[0] == single["content"]
    assert len(set(texts)) == 3, texts  # each row sampled with its own seed
    events = streamed(requests.post(f"{mesh}/chat/completions", json={**body, "n": 3, "stream": True}, timeout=120,
                                    stream=True))
    again = ["", "", ""]
    for chunk in events[:-1]:
        again[chunk["choices"][0]["index"]] += chunk["choices"][0]["delta"].get("content") or ""
    assert again == texts
