"""Structured output on omlx's REAL DeepSeek-V4 (flyto-mlx's omlx.patches.deepseek_v4, pinned env): a forced
tool call is written in DSML, V4's own format, through V4's real chat template and tokenizer, and omlx's own
tool parser reads it back as a call whose arguments validate against the strict schema, with thinking off
and after a think block with it on (the tiny random model writes no DSML by itself); DSpark drafting under
a grammar answers exactly as plain constrained decoding, its drafts masked by the grammar and accepted.
The engines run in this process on one rank.

Run: .venv-omlx/bin/python -m pytest tests/pinned/test_v4_structured.py"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest

from kit.held import held_tokens
from pinned.test_v4_tools import build_v4_tokenizer_checkpoint, build_v4_weights
from runtime.engine import grammar
from kit.drafters import undrafted
from runtime.engine.proposers import Stages
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days", "units"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "units": {"enum": ["metric", "imperial"]}}}}}
ASK = [{"role": "user", "content": "Is it warm in Oslo?"}]
ORDER = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "rush"], "properties": {
    "sku": {"enum": ["a1", "b2", "c3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
    "rush": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """omlx's V4 with the tokenizer meshd-rank loads for it (V4's DSML template and tool parser on it)."""
    from runtime import rank
    from runtime.models.overlay import OMLX, set_up

    set_up(OMLX)
    path = build_v4_weights(build_v4_tokenizer_checkpoint(tmp_path_factory.mktemp("v4") / "ckpt"))
    tokenizer = rank.load_tokenizer(path, eos_token_ids=json.loads((path / "config.json").read_text())["eos_token_id"])
    model = rank.load_sharded(path, mx.distributed.init(), lambda done, total: None, OMLX)
    return model, tokenizer


def the_call(tokenizer, text: str) -> dict:
    """The one call of the answer's DSML block, as omlx's parser reads it."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    assert text.count(start) == 1 and text.endswith(end), text
    return tokenizer.tool_parser(text.split(start)[1][:-len(end)], [WEATHER])


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinks_first"])
def test_a_forced_call_is_v4_dsml_that_omlxs_parser_reads_and_the_schema_validates(v4, thinking):
    model, tokenizer = v4
    grammar.serve(tokenizer)
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 300, "temperature": 1.0, "seed": 1,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if thinking:  # V4's template leaves <think> open; a bias on its close has the random model close it
        body["logit_bias"] = {str(tokenizer.convert_tokens_to_ids("</think>")): 4}
    else:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    text = tokenizer.decode(held_tokens(undrafted(model, set(tokenizer.eos_token_ids)), tokenizer, body))
    if thinking:
        reasoning, text = text.split("</think>")
        assert reasoning and "DSML" not in reasoning, reasoning
    call = the_call(tokenizer, text)
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_dspark_drafts_under_a_grammar_are_accepted_and_the_answer_is_plain_constrained_decodings(
        model, checkpoint, sampling):
    from runtime.rank import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    grammar.serve(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    body = {"messages": ASK, "max_tokens": 120, **sampling,
            "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}}
    drafter = RowwiseEngine(model, eos, Stages(model), prefixes=PrefixStore(model, prefill_step_size=32), prefill_step_size=32)
    drafted = held_tokens(drafter, tokenizer, body)
    assert drafted == held_tokens(undrafted(model, eos, prefill_step_size=32), tokenizer, body)
    jsonschema.validate(json.loads(tokenizer.decode(drafted)), ORDER)
    stats = drafter.stats()
    print(sampling, stats)
    assert stats["draft_fallbacks"] == 0 and stats["draft_accepted"] > stats["draft_proposed"] // 4, stats
