"""Structured output on the demo mesh of two ranks (ring backend, loopback), through its proxy: answers held
to a JSON schema, to any JSON object and to a forced tool call parse and validate, though the demo model's
own answers (random weights) are far from JSON; greedy answers are those of one process; four at once
each hold; a rank killed mid-answer leaves a stream that resumes into a valid document. One mesh for all."""

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import mlx.core as mx
import numpy as np
import mlx_lm.utils
import pytest
import requests
from mlx_lm import load
from mlx_lm.utils import load_tokenizer
from openai import APIError, OpenAI, UnprocessableEntityError
from pydantic import BaseModel, Field

from kit.held import held_tokens
from kit.meshctl import Demo, demo_home, demo_meshctl
from kit.openai import sse_events
import runtime.models.overlays.demo_mtp  # noqa: F401  (registers the demo model with an MTP head)
from runtime.engine import grammar
from runtime.models.demo_model import DemoModelSpec, build_demo_model
from runtime.engine.proposers import DraftModel, Head
from kit.drafters import drafting, undrafted

ASK = [{"role": "user", "content": "hi"}]
ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "rush"], "properties": {
    "customer": {"type": "object", "additionalProperties": False, "required": ["name", "tier"],
                 "properties": {"name": {"type": "string", "maxLength": 10}, "tier": {"enum": ["gold", "silver"]}}},
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"enum": ["a1", "b2", "c3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "rush": {"type": "boolean"}}}
ROWS = {"type": "object", "additionalProperties": False, "required": ["rows"], "properties": {"rows": {
    "type": "array", "minItems": 20, "maxItems": 20, "items": {
        "type": "object", "additionalProperties": False, "required": ["k", "n"],
        "properties": {"k": {"enum": ["up", "down", "left"]},
                       "n": {"type": "integer", "minimum": 0, "maximum": 999}}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
# No finite document: a required property that is the whole schema again. llguidance compiles it; its parser
# gives up one token into the answer (too many items), so the grammar leaves no token.
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# A seed whose sampled object ends: "any JSON object" lets the demo model write a key until its tokens run out.
OBJECT_SEED = 2


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "fox"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home")
    demo_meshctl(home, "up", "--nodes", "2")
    yield Demo(home)
    demo_meshctl(home, "down", "--force", check=False)


@pytest.fixture(scope="module")
def client(demo):
    return OpenAI(base_url=demo.proxy, api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def one_process(demo):
    """The answer of one process (the runtime's batch engine) to a chat body, as its text."""
    model, tokenizer = load(str(demo.home / "demo" / "model"))
    grammar.serve(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    return lambda body: tokenizer.decode(held_tokens(undrafted(model, eos), tokenizer, body))


def not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def test_each_format_holds_the_answer_and_greedy_equals_one_process(demo, client, one_process):
    free = client.chat.completions.create(model="demo", messages=ASK, max_tokens=60).choices[0].message.content
    assert not_json(free), free  # what the demo model says unheld

    parsed = client.chat.completions.parse(model="demo", messages=ASK, response_format=Pet, max_tokens=200)
    pet = parsed.choices[0].message
    assert isinstance(pet.parsed, Pet) and parsed.choices[0].finish_reason == "stop", pet
    fmt = schema_format("Pet", Pet.model_json_schema() | {"additionalProperties": False})
    assert one_process({"messages": ASK, "max_tokens": 200, "response_format": fmt}) == pet.content

    order = client.chat.completions.create(model="demo", messages=ASK, max_tokens=300,
                                           response_format=schema_format("order", ORDER)).choices[0].message.content
    jsonschema.validate(json.loads(order), ORDER)
    assert one_process({"messages": ASK, "max_tokens": 300, "response_format": schema_format("order", ORDER)}) == order

    sampled = {"messages": ASK, "max_tokens": 300, "temperature": 1.0, "seed": OBJECT_SEED}
    assert not_json(client.chat.completions.create(model="demo", **sampled).choices[0].message.content)
    obj = client.chat.completions.create(model="demo", **sampled, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert one_process({**sampled, "response_format": {"type": "json_object"}}) == obj.choices[0].message.content

    ask = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 100, "tools": [WEATHER]}
    call = client.chat.completions.create(model="demo", **ask, tool_choice="required").choices[0]
    assert call.finish_reason == "tool_calls" and call.message.tool_calls[0].function.name == "get_weather"
    arguments = json.loads(call.message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    said = one_process({**ask, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(said.split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == \
        {"name": "get_weather", "arguments": arguments}


@pytest.mark.parametrize("proposer", ["mtp", "draft model"])
def test_drafts_held_to_the_grammar_are_accepted_and_the_answer_is_the_plain_one(tmp_path, proposer):
    """The MTP head's drafts, and a draft model's (the target itself here), taken from what the grammar allows
    after what was said: the grammar's forced keys and punctuation are drafted and kept, and the answer is
    plain decoding's."""
    path = build_demo_model(tmp_path / "mtp", DemoModelSpec(mtp=True, mtp_train_steps=30))
    model, tokenizer = mlx_lm.utils.load_model(path)[0], load_tokenizer(path)
    grammar.serve(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    for sampling in ({}, {"temperature": 1.0, "seed": 3}):
        body = {"messages": ASK, "max_tokens": 300, "response_format": schema_format("order", ORDER), **sampling}
        drafter = drafting(model, eos, Head(model) if proposer == "mtp" else DraftModel(model, model),
                           num_draft_tokens=2)
        drafted = held_tokens(drafter, tokenizer, body)
        assert drafted == held_tokens(undrafted(model, eos), tokenizer, body)
        jsonschema.validate(json.loads(tokenizer.decode(drafted)), ORDER)
        stats = drafter.stats()
        print(sampling, stats)
        # the drafts masked as the verify masks them: the grammar's forced keys and punctuation are taken
        assert stats["draft_accepted"] > stats["draft_proposed"] // 4, stats


@pytest.mark.parametrize("width, words", [
    (151936, 4748),  # Qwen's row: a bit for each logit
    (1000, 32),  # bits past the row (the tokenizer's vocabulary rounded up to a word) are no logits
    (1100, 30),  # an embedding padded past the tokenizer's vocabulary: the logits past its bits are refused
])
@pytest.mark.parametrize("on_host", [True, False], ids=["unpacked on the host", "unpacked on the device"])
def test_a_held_steps_mask_allows_the_tokens_the_grammars_bits_allow_wherever_it_is_unpacked(width, words, on_host):
    bits = np.random.default_rng(width).integers(0, 1 << 32, words, dtype=np.uint32)
    want = [t < 32 * words and bool(bits[t >> 5] >> (t & 31) & 1) for t in range(width)]
    assert grammar.allowed_tokens(bits.tobytes(), width, [3], on_host).tolist() == want
    stuck = grammar.allowed_tokens(bytes(4 * words), width, [3, width + 5], on_host)  # allows nothing: the end
    assert stuck.tolist() == [t == 3 for t in range(width)]


@pytest.mark.parametrize("device, on_host", [(mx.Device(mx.cpu), True), (mx.Device(mx.gpu), False)])
def test_a_gpu_is_sent_a_masks_bits_and_a_cpu_its_bools(device, on_host):
    assert grammar.unpack_on_host(device) is on_host


def test_a_model_that_thinks_reasons_freely_then_writes_the_document(tmp_path):
    path = build_demo_model(tmp_path / "thinks", DemoModelSpec(thinking=True))
    model, tokenizer = mlx_lm.utils.load_model(path)[0], load_tokenizer(path)
    grammar.serve(tokenizer)
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    # the template leaves <think> open; a bias on its close has the random model close it after a while
    body = {"messages": ASK, "max_tokens": 400, "temperature": 1.0, "seed": 5, "logit_bias": {str(think_end): 3},
            "response_format": schema_format("order", ORDER)}
    said = held_tokens(undrafted(model, set(tokenizer.eos_token_ids)), tokenizer, body)
    reasoning, document = tokenizer.decode(said).split("</think>")
    assert len(tokenizer.encode(reasoning)) > 3 and not_json(reasoning), reasoning
    jsonschema.validate(json.loads(document), ORDER)


def test_a_grammar_that_leaves_no_token_ends_the_answer_with_its_reason_streamed_and_not(demo, client):
    fmt = schema_format("endless", ENDLESS)
    with pytest.raises(UnprocessableEntityError) as whole:
        client.chat.completions.create(model="demo", messages=ASK, max_tokens=50, response_format=fmt)
    error = whole.value.body
    assert error["code"] == "grammar_stuck" and error["param"] == "response_format", error
    assert "Too many items" in error["message"] and "response_format.json_schema.schema" in error["message"]
    with pytest.raises(APIError, match="Too many items"):
        list(client.chat.completions.create(model="demo", messages=ASK, max_tokens=50, response_format=fmt,
                                            stream=True))
    r = requests.post(f"{demo.proxy}/chat/completions", timeout=120, json={
        "messages": ASK, "max_tokens": 50, "response_format": fmt, "stream": True})
    events = sse_events(r.iter_lines(decode_unicode=True))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "grammar_stuck", events[-3:]
    assert events[-2]["error"]["code"] == "grammar_stuck"


def test_four_answers_at_once_each_hold_to_their_own_schema(client):
    formats = [schema_format("order", ORDER), schema_format("rows", ROWS), {"type": "json_object"},
               schema_format("order", ORDER)]
    answers: dict[int, object] = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=600, temperature=1.0,
                                           seed=OBJECT_SEED if i == 2 else 10 + i, response_format=formats[i])
        answers[i] = r.choices[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, choice in sorted(answers.items()):
        document = json.loads(choice.message.content)
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(document, formats[i]["json_schema"]["schema"] if i != 2 else {"type": "object"})
    assert len(answers) == 4


def big_enum(tag: object, values: int) -> dict:
    """A schema of one enum of `values` distinct strings: compiling it takes its size's time and memory."""
    return {"type": "object", "additionalProperties": False, "required": ["k"],
            "properties": {"k": {"enum": [f"item-{tag}-{j:05d}-abcdefghij" for j in range(values)]}}}


def test_large_schemas_compile_while_another_clients_stream_goes_on(demo):
    """Ten distinct schemas near the cost limit (each ~0.1 s a compile, on the proxy and on every rank) sent
    while another client streams: its tokens keep coming, the gaps between them within a generous multiple of
    those while ten plain requests arrive instead; the held answers all start with their enum's key."""
    eos = load_tokenizer(demo.home / "demo" / "model").eos_token_ids
    streamed = {"messages": ASK, "max_tokens": 300, "stream": True, "logit_bias": {str(t): -100 for t in eos}}

    def largest_gap(others: list[dict]) -> tuple[float, list]:
        times, going = [], threading.Event()

        def stream() -> None:
            r = requests.post(f"{demo.proxy}/chat/completions", json=streamed, stream=True, timeout=300)
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    if len(times) == 5:
                        going.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert going.wait(120), "the stream did not start"
        fired = time.monotonic()
        with ThreadPoolExecutor(len(others)) as pool:
            answers = list(pool.map(lambda body: requests.post(f"{demo.proxy}/chat/completions", json=body,
                                                               timeout=300), others))
        reader.join()
        assert len(times) > 100, len(times)  # chunks: a chunk may carry more than one token
        return max(b - a for a, b in zip(times, times[1:]) if b >= fired), answers

    plain_gap, _ = largest_gap([{"messages": ASK, "max_tokens": 8} for _ in range(10)])
    held_gap, answers = largest_gap([{"messages": ASK, "max_tokens": 8, "response_format": schema_format(
        f"big{i}", big_enum(i, 3500))} for i in range(10)])
    print(f"largest gap: {plain_gap:.3f}s beside plain requests, {held_gap:.3f}s beside large schemas")
    assert [r.status_code for r in answers] == [200] * 10, [r.text for r in answers if r.status_code != 200]
    assert all(r.json()["choices"][0]["message"]["content"].startswith('{"k": "') for r in answers)
    assert held_gap < 3 * plain_gap + 0.3, (held_gap, plain_gap)


def test_a_schema_too_costly_to_compile_is_refused_before_any_rank_compiles_it(demo):
    body = {"messages": ASK, "max_tokens": 8, "response_format": schema_format("huge", big_enum("x", 6000))}
    r = requests.post(f"{demo.proxy}/chat/completions", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format.json_schema.schema", r.text
    assert "KiB of grammar meshd compiles" in error["message"] and "shorten its enums" in error["message"], error
    url, auth = demo.rank0(demo.wait_ready()["generation"])  # rank 0 asked directly refuses it the same way
    r = requests.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 400 and "KiB of grammar meshd compiles" in r.json()["error"]["message"], r.text


def test_a_rank_killed_mid_answer_resumes_it_into_a_valid_document(demo):
    g = demo.wait_ready()["generation"]
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 600, "temperature": 1.0, "seed": 4,
            "stream": True, "response_format": schema_format("rows", ROWS)}
    r = requests.post(f"{demo.proxy}/chat/completions", json=body, stream=True, timeout=300)
    lines = r.iter_lines(decode_unicode=True)
    data = (line for line in lines if line.startswith("data: "))
    first = [json.loads(next(data)[6:]) for _ in range(8)]
    os.kill(demo.rank_pid(1), signal.SIGKILL)
    rest = sse_events(lines)
    assert rest[-1] == "[DONE]" and not [e for e in rest if "error" in e], rest[-3:]
    text = "".join(c["delta"].get("content") or "" for e in first + rest[:-1] for c in e["choices"])
    jsonschema.validate(json.loads(text), ROWS)
    assert rest[-2]["choices"][0]["finish_reason"] == "stop"
    assert demo.wait_ready(after=g)["generation"] == g + 1
