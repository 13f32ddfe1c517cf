"""DeepSeek-V4's tools through meshd with the REAL omlx (flyto-mlx's omlx.patches.deepseek_v4): the tokenizer
meshd's rank loads for a deepseek_v4 checkpoint once `[runtime] model_package = "omlx"` is set up (omlx's load
patch puts its DSML chat template and tool parser on it), then a DeepSeek Harness (dsh) loop through rank 0's
real frontend (runtime/server.py on a real port, requests parsed by common/openai_api.py, prompts rendered by
the template meshd applies): tools offered, the model's DSML call (the real tokenizer's tokens, played one at
a time by a scripted stand-in for the lockstep loop, kit/scripted.py, since a tiny random model writes no DSML)
answered as OpenAI `tool_calls` with its reasoning apart, streamed and not, and the next turn's prompt carrying
the call, its reasoning and the tool's result as V4's template renders them; DeepSeek Harness itself over five
turns; and dsh through meshd-proxy in front of a real mesh serving this V4 under the omlx overlay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from common import openai_api as oa
from kit.scripted import Script, scripted_rank0

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
# A published V4 checkpoint's chat_template.jinja is minimal: no tools, no reasoning, no DSML
MINIMAL_JINJA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                 "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}" + EOS + "{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
LIMITS = oa.Limits("v4", 0, 8192)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "You are dsh, a coding agent."}
ASK = {"role": "user", "content": "Is it warm in Oslo?"}
# dsh's turn after a tool call: the call's reasoning sent back with it, then the tool's result
DSH_TURN = [SYSTEM, ASK,
            {"role": "assistant", "content": None, "reasoning_content": "I should look the weather up.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 degrees, sunny"}]


def dsml(*calls: tuple[str, dict]) -> str:
    """A V4 tool-call block as the model writes it (and V4's template renders it back)."""
    def param(k, v):
        s = isinstance(v, str)
        value = v if s else json.dumps(v)
        return f'<｜DSML｜parameter name="{k}" string="{str(s).lower()}">{value}</｜DSML｜parameter>'
    invokes = [f'<｜DSML｜invoke name="{name}">\n' + "\n".join(param(k, v) for k, v in args.items())
               + "\n</｜DSML｜invoke>" for name, args in calls]
    return "<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def build_v4_tokenizer_checkpoint(path: Path) -> Path:
    """A deepseek_v4 checkpoint's tokenizer side: a byte-level BPE with DeepSeek's special tokens and think
    tokens, the minimal jinja, no chat_template_type nor tool_parser_type (what omlx's patch fills in)."""
    from runtime.models.demo_model import _train_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(512, SPECIAL)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "chat_template": MINIMAL_JINJA, "model_max_length": 4096}))
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "eos_token_id": tok.token_to_id(EOS),
                                                  "max_position_embeddings": 4096, "vocab_size": 512}))
    return path


# omlx's real DeepSeek-V4, two local-attention layers (tests/pinned/dsv4.py's checkpoint has the demo tokenizer,
# whose Qwen-style jinja makes mlx-lm infer json_tools: omlx's patch then keeps that parser, not V4's)
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "sliding_window": 16, "compress_ratios": [0, 0], "hc_mult": 2, "hc_sinkhorn_iters": 3,
        "num_hash_layers": 0, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
        "num_nextn_predict_layers": 0, "torch_dtype": "float32"}


def build_v4_weights(path: Path) -> Path:
    """Seeded weights of omlx's real deepseek_v4 Model (omlx set up in this process) beside the tokenizer."""
    import mlx.core as mx
    import mlx_lm.models.deepseek_v4 as v4  # registered by omlx's patch
    from mlx.utils import tree_flatten

    config = {**json.loads((path / "config.json").read_text()), **TINY}
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(v4.Model(v4.ModelArgs.from_dict(config))
                                                                          .parameters())), metadata={"format": "mlx"})
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_v4_tokenizer_checkpoint(tmp_path_factory.mktemp("v4") / "ckpt")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    """The tokenizer as meshd-rank's main() gets it: the overlay set up first, then runtime.rank's own
    load_tokenizer with the config's eos."""
    from runtime import rank
    from runtime.models.overlay import OMLX, set_up

    set_up(OMLX)
    config = json.loads((checkpoint / "config.json").read_text())
    return rank.load_tokenizer(checkpoint, eos_token_ids=config.get("eos_token_id"))


@pytest.fixture(scope="module")
def rank0(tokenizer):
    """Rank 0's real frontend on a real port, its doors opened by the warm-up through the scripted ranks."""
    with scripted_rank0(tokenizer, LIMITS) as (url, ranks):
        yield f"{url}/chat/completions", ranks


def chat(rank0, answer: str, body: dict) -> dict:
    """One non-streamed request answered with `answer`: the response body."""
    url, ranks = rank0
    ranks.answers.put(answer)
    r = requests.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(rank0, answer: str, body: dict) -> tuple[list[dict], dict]:
    """One streamed request answered with `answer`: its deltas, and the message a client assembles from them
    (reasoning_content and content concatenated, tool calls by index)."""
    url, ranks = rank0
    ranks.answers.put(answer)
    r = requests.post(url, json={**body, "stream": True}, timeout=30, stream=True)
    assert r.status_code == 200, r.text
    deltas, finish = [], None
    for line in r.iter_lines(decode_unicode=True):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        deltas.append(choice["delta"])
        finish = choice["finish_reason"] or finish
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            calls.setdefault(c["index"], c)
    message = {"reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas),
               "content": "".join(d.get("content") or "" for d in deltas),
               "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}
    return deltas, message


def called(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# --- the tokenizer meshd loads ----------------------------------------------------------------------------

def test_the_tokenizer_meshd_loads_for_a_v4_checkpoint_carries_omlxs_dsml_template_and_parser(tokenizer):
    from omlx.patches.deepseek_v4 import chat_template_v4, tool_parser_v4

    # the checkpoint's jinja knows no tools: without omlx's load patch there would be no parser at all
    assert tokenizer.has_tool_calling, "omlx's load patch did not reach the tokenizer meshd-rank loads"
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>")
    assert tokenizer.tool_parser is tool_parser_v4.parse_tool_call
    assert tokenizer._chat_template is chat_template_v4.apply_chat_template
    assert tokenizer.has_thinking and (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(EOS)}


# --- the prompt of a dsh turn -----------------------------------------------------------------------------

def test_a_dsh_turn_after_a_tool_call_reaches_the_ranks_as_v4s_template_renders_it(rank0, tokenizer):
    from omlx.patches.deepseek_v4 import chat_template_v4

    chat(rank0, "Yes.", {"messages": DSH_TURN, "tools": [WEATHER], "max_tokens": 64})
    prompt = rank0[1].prompts[-1]
    said = chat_template_v4.apply_chat_template(DSH_TURN, tools=[WEATHER], add_generation_prompt=True,
                                                thinking_mode="thinking")
    assert prompt == tokenizer.encode(said, add_special_tokens=False)  # nothing lost on meshd's way
    text = tokenizer.decode(prompt)
    assert text.startswith(BOS + "You are dsh, a coding agent.\n\n## Tools")
    assert '"name": "get_weather"' in text  # the function's schema, in the system turn
    # the call as DSML, after the reasoning passed back on the tool turn, then the result, then thinking again
    assert ("<｜User｜>Is it warm in Oslo?<｜Assistant｜><think>I should look the weather up.</think>\n\n"
            + dsml(("get_weather", {"city": "Oslo", "days": 3})) + EOS) in text
    assert text.endswith("\n\n<function_results>\n<result>21 degrees, sunny</result>\n</function_results>\n\n<think>")


def test_without_thinking_the_turn_closes_the_think_block_and_drops_the_reasoning(rank0, tokenizer):
    chat(rank0, "Yes.", {"messages": DSH_TURN, "tools": [WEATHER], "max_tokens": 64,
                         "chat_template_kwargs": {"enable_thinking": False}})
    text = tokenizer.decode(rank0[1].prompts[-1])
    assert "I should look the weather up." not in text and text.endswith("</function_results>\n\n</think>")
    assert dsml(("get_weather", {"city": "Oslo", "days": 3})) in text


# --- the model's calls, as OpenAI tool_calls --------------------------------------------------------------

CALL = dsml(("get_weather", {"city": "Oslo", "days": 3}))
THOUGHT = "The user wants Oslo's weather; I call the tool."
FIRST = {"messages": [SYSTEM, ASK], "tools": [WEATHER], "max_tokens": 512}


def test_a_v4_call_comes_back_as_tool_calls_with_the_reasoning_apart(rank0):
    body = chat(rank0, f"{THOUGHT}</think>\n\n{CALL}", FIRST)
    choice = body["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert called(message["tool_calls"]) == [("get_weather", {"city": "Oslo", "days": 3})]  # days a number
    assert message["reasoning_content"] == THOUGHT and message["content"] is None


def test_a_streamed_v4_call_comes_back_as_one_tool_call_delta_and_no_dsml_leaks(rank0):
    deltas, message = chat_stream(rank0, f"{THOUGHT}</think>\n\n{CALL}", FIRST)
    assert message["finish_reason"] == "tool_calls"
    assert called(message["tool_calls"]) == [("get_weather", {"city": "Oslo", "days": 3})]
    assert message["tool_calls"][0]["index"] == 0 and message["tool_calls"][0]["id"].startswith("call_")
    assert message["reasoning_content"] == THOUGHT
    assert message["content"].strip() == ""
    # the call, written over ~100 tokens, never shows up in pieces as content or reasoning
    shown = [(d.get("content") or "") + d.get("reasoning_content", "") for d in deltas]
    assert not any("DSML" in piece or "<｜" in piece for piece in shown), shown


def test_content_before_a_call_stays_content_streamed_and_not(rank0):
    answer = f"{THOUGHT}</think>I will check the forecast.\n\n{CALL}"
    message = chat(rank0, answer, FIRST)["choices"][0]["message"]
    _, streamed = chat_stream(rank0, answer, FIRST)
    for m in (message, streamed):
        assert m["content"].strip() == "I will check the forecast."
        assert called(m["tool_calls"]) == [("get_weather", {"city": "Oslo", "days": 3})]


def test_two_calls_in_one_v4_block_come_back_as_two_tool_calls_streamed_and_not(rank0):
    # V4 writes parallel calls as invokes in one <｜DSML｜tool_calls> block; its parser returns a list
    both = dsml(("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen", "days": 2}))
    want = [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen", "days": 2})]
    choice = chat(rank0, f"{THOUGHT}</think>\n\n{both}", FIRST)["choices"][0]
    assert called(choice["message"]["tool_calls"]) == want and choice["finish_reason"] == "tool_calls"
    _, streamed = chat_stream(rank0, f"{THOUGHT}</think>\n\n{both}", FIRST)
    assert called(streamed["tool_calls"]) == want and [c["index"] for c in streamed["tool_calls"]] == [0, 1]
    assert streamed["finish_reason"] == "tool_calls"


def test_a_call_cut_off_by_the_end_of_the_answer_is_not_shown_as_content(rank0):
    cut = CALL[:len(CALL) // 2]
    for m in (chat(rank0, f"{THOUGHT}</think>\n\n{cut}", FIRST)["choices"][0]["message"],
              chat_stream(rank0, f"{THOUGHT}</think>\n\n{cut}", FIRST)[1]):
        assert "DSML" not in (m["content"] or "") and not m.get("tool_calls")


# --- the whole dsh loop -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_dsh_loop_call_result_answer_continues_exactly_what_the_model_said(rank0, tokenizer, stream):
    """dsh sends tools, gets a call, runs it, sends the call (with its reasoning) and the result back, gets the
    answer. The second prompt holds the model's first answer verbatim: the call it wrote, as V4 renders it."""
    first = f"{THOUGHT}</think>\n\n{CALL}"
    if stream:
        _, message = chat_stream(rank0, first, FIRST)
        calls = [{k: c[k] for k in ("id", "type", "function")} for c in message["tool_calls"]]
        assistant = {"role": "assistant", "content": message["content"] or None,
                     "reasoning_content": message["reasoning_content"], "tool_calls": calls}
    else:
        assistant = chat(rank0, first, FIRST)["choices"][0]["message"]  # sent back as it came
    result = {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "21 degrees, sunny"}
    second = {**FIRST, "messages": [SYSTEM, ASK, assistant, result]}
    answer = "21 degrees is mild.</think>Yes: 21 degrees and sunny."
    done = chat_stream(rank0, answer, second)[1] if stream else chat(rank0, answer, second)["choices"][0]["message"]
    assert done["content"] == "Yes: 21 degrees and sunny." and done["reasoning_content"] == "21 degrees is mild."
    assert not done.get("tool_calls")
    first_prompt, second_prompt = (tokenizer.decode(p) for p in rank0[1].prompts[-2:])
    assert second_prompt.startswith(first_prompt + first + EOS)  # a prefix the tape can reuse
    assert second_prompt.endswith("<result>21 degrees, sunny</result>\n</function_results>\n\n<think>")


# --- one real rank ----------------------------------------------------------------------------------------

def test_a_real_rank_under_the_omlx_overlay_renders_the_dsh_turn_with_v4s_template_and_thinks(tokenizer, tmp_path):
    from omlx.patches.deepseek_v4 import chat_template_v4

    from kit.ranks import start_mesh

    model = build_v4_weights(build_v4_tokenizer_checkpoint(tmp_path / "v4"))  # the same tokenizer, built alike
    said = tokenizer.encode(chat_template_v4.apply_chat_template(
        DSH_TURN, tools=[WEATHER], add_generation_prompt=True, thinking_mode="thinking"), add_special_tokens=False)
    with start_mesh(model, 1, tmp_path, "--model-package", "omlx", "--snapshots", "off") as mesh:
        mesh.wait_ready(120)
        body = {"messages": DSH_TURN, "tools": [WEATHER], "max_tokens": 6}
        r = requests.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text + mesh.log(0)
        assert r.json()["usage"]["prompt_tokens"] == len(said)  # the DSML prompt, not the checkpoint's jinja
        message = r.json()["choices"][0]["message"]
        # the prompt leaves V4's think block open: what the model says is its reasoning, not content
        assert message["reasoning_content"] and message["content"] == ""
        s = requests.post(f"{mesh.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120, stream=True)
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines(decode_unicode=True)
                  if line.startswith("data: {") and '"choices": [{' in line]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]


def test_a_v4_call_cut_by_max_tokens_comes_back_as_far_as_it_was_written(rank0):
    cut = f"{THOUGHT}</think>\n\n" + CALL[:CALL.index('string="false">') + len('string="false">3')]
    for m in (chat(rank0, Script(cut, "length"), FIRST)["choices"][0]["message"],
              chat_stream(rank0, Script(cut, "length"), FIRST)[1]):
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == \
            [("get_weather", '{"city": "Oslo", "days": 3')]
        assert "DSML" not in (m["content"] or "")


# --- DeepSeek Harness itself ------------------------------------------------------------------------------

def dsh(rank0, **kwargs):
    """DeepSeek Harness (the `deepseek-harness` client, unmodified) pointed at rank 0's OpenAI routes."""
    from deepseek_harness import DeepSeekHarness

    return DeepSeekHarness(api_key="unused", base_url=rank0[0].removesuffix("/chat/completions"), **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["chat", "stream_chat"])
def test_dsh_drives_five_v4_turns_its_calls_parsed_and_its_reasoning_passed_back(rank0, tokenizer, stream):
    """Five turns with dsh's defaults (thinking on, tool_choice null): four calls, each run and sent back with its
    reasoning, then the answer; each turn's prompt holds the last one's whole, a prefix the tape can reuse."""
    client, (_, ranks) = dsh(rank0), rank0
    messages, said = [SYSTEM, ASK], None
    for turn in range(5):
        thought = f"Turn {turn}: I look again."
        answer = f"{thought}</think>\n\n" + ("Yes, warm." if turn == 4 else
                                              dsml(("get_weather", {"city": "Oslo", "days": turn + 1})))
        ranks.answers.put(answer)
        out = list(client.stream_chat(model="v4", messages=messages, tools=[WEATHER], max_tokens=512))[-1] \
            if stream else client.chat(model="v4", messages=messages, tools=[WEATHER], max_tokens=512)
        message, prompt = out["message"], tokenizer.decode(ranks.prompts[-1])
        assert message["reasoning_content"] == thought and out["salvage"] is None, out
        if said is not None:
            assert prompt.startswith(said)
        if turn == 4:
            assert message["content"] == "Yes, warm." and out["finish_reason"] == "stop"
            break
        assert out["finish_reason"] == "tool_calls"
        assert called(message["tool_calls"]) == [("get_weather", {"city": "Oslo", "days": turn + 1})]
        said = prompt + answer + EOS
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "21 C"}]


def test_dsh_with_thinking_disabled_asks_v4s_template_for_its_chat_mode(rank0, tokenizer):
    rank0[1].answers.put("Yes, warm.")
    out = dsh(rank0, disable_thinking_by_default=True).chat(model="v4", messages=[SYSTEM, ASK], max_tokens=64)
    assert out["message"]["content"] == "Yes, warm." and "reasoning_content" not in out["message"]
    assert tokenizer.decode(rank0[1].prompts[-1]).endswith("<｜Assistant｜></think>")


def test_a_v4_tool_turn_without_its_reasoning_gets_deepseeks_400(rank0):
    turn = [*DSH_TURN[:2], {k: v for k, v in DSH_TURN[2].items() if k != "reasoning_content"}, DSH_TURN[3]]
    r = requests.post(rank0[0], json={"messages": turn, "tools": [WEATHER]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[2].reasoning_content", r.text
    assert r.json()["error"]["message"].startswith("The reasoning_content in the thinking mode must be passed back")


# --- dsh through a real mesh ------------------------------------------------------------------------------

FORECAST = {"type": "function", "function": {  # values a random model's held call closes
    "name": "get_weather", "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"enum": ["Oslo", "Bergen"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking off", "thinking"])
def test_dsh_through_meshd_proxy_in_front_of_a_real_mesh_serving_v4_on_omlx(tmp_path, thinking):
    """dsh's chat, stream_chat and a five-turn loop of calls (forced: a random model writes none itself) against
    meshd-proxy, its controller, an agent and a rank under the omlx overlay: every turn answered, each call parsed
    by the client, the reasoning sent back, usage in DeepSeek's words, every turn after the first served in part
    from the tape (the conversation so far)."""
    from deepseek_harness import DeepSeekHarness

    from kit.meshctl import mesh_up
    from meshd import config as mesh_config

    from tokenizers import Tokenizer

    model = build_v4_weights(build_v4_tokenizer_checkpoint(tmp_path / "v4"))
    think_end = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("</think>")
    # the random model closes its reasoning after a while when `</think>` is favoured
    sampling = {"temperature": 1.0, "seed": 3, "logit_bias": {str(think_end): 4}} if thinking else {}
    with mesh_up(tmp_path / "mesh", model, 1, runtime={"model_package": "omlx",
                                                       "args": {"model_name": "v4", "max_tokens_limit": 4096}}) \
            as (path, _):
        client = DeepSeekHarness(api_key="unused", base_url=f"http://{mesh_config.load(path).proxy.listen}/v1",
                                 disable_thinking_by_default=not thinking)
        hello = client.chat(model="v4", messages=[ASK], max_tokens=16, **sampling)
        assert hello["usage"]["prompt_tokens"] > 0 and hello["finish_reason"] in ("stop", "length")
        done = list(client.stream_chat(model="v4", messages=[ASK], max_tokens=16, **sampling))[-1]
        assert done["type"] == "done" and done["usage"]["completion_tokens"] > 0
        messages = [SYSTEM, ASK]
        for turn in range(5):
            forced = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}} if turn < 4 else {}
            out = client.chat(model="v4", messages=messages, tools=[FORECAST], max_tokens=256, **forced, **sampling)
            message, usage = out["message"], out["raw"].usage.model_dump()
            assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
            if turn:
                assert usage["prompt_cache_hit_tokens"] > 0, (turn, usage)
            assert bool(message.get("reasoning_content")) == thinking, (turn, message)
            if turn == 4:
                break
            assert out["finish_reason"] == "tool_calls" and out["salvage"] is None, out
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "21 C"}]
