"""Structured output: the grammar an answer is held to, built from a request and compiled on each rank.

A request's grammar travels to every rank as data, llguidance's grammar text (a JSON schema, or a Lark
grammar around the model's tool-call markers), inside its sampling settings; each rank compiles it against
its own copy of the model's tokenizer (`serve`), the compiled grammar cached by its text, and masks the
answer's logits with it (runtime/sampling.py's `GrammarMask`). Where no tokenizer is served (the proxy,
which checks requests before any rank sees them) a grammar is checked without one, a forced call's in a
stand-in of the json_tools format: the schemas are what a client can get wrong.

llguidance rather than xgrammar: one 3 MB wheel with no dependencies on Linux and macOS alike (xgrammar's
brings torch and CUDA, gigabytes on a CPU host), JSON Schema with `$ref`, `anyOf`, formats and patterns, an
unknown keyword refused by name (the 400's text), a Lark grammar for tool calls, and a mask computed in
tens of microseconds without a precompile of the whole vocabulary (bench/grammar.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass

import llguidance
import numpy as np

# Compact JSON, one space after ':' and ',': a model can end a document, never pad it with whitespace until
# its tokens run out.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64


class GrammarError(ValueError):
    """A grammar llguidance cannot hold an answer to; the message names the part at fault."""


@dataclass(frozen=True)
class ToolFormat:
    """How the served model writes a tool call: its markers (as Lark terminals) around one JSON object
    {"name", "arguments"} (mlx-lm's json_tools family: Qwen, Hermes); `parser` names the model's tool parser."""

    start: str
    end: str
    parser: str
    json_calls: bool


@dataclass
class _Served:
    tokenizer: llguidance.LLTokenizer
    tools: ToolFormat | None
    compiled: OrderedDict  # grammar text -> its compiled matcher, fresh (copied for each answer)
    lock: threading.Lock


_served: _Served | None = None
STAND_IN = ToolFormat('"<tool_call>"', '"</tool_call>"', "json_tools", True)  # where no tokenizer is served


def _terminal(tokenizer, text: str) -> str:
    """A marker as a Lark terminal: its special token when it is one (a string never matches those)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in set(getattr(tokenizer, "all_special_ids", ())):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def serve(tokenizer) -> None:
    """Compile grammars against this mlx-lm tokenizer from now on (every rank, once it is loaded)."""
    global _served
    hf = tokenizer._tokenizer
    backend = copy(hf.backend_tokenizer)  # llguidance reads the fast tokenizer's own JSON, without padding
    backend.no_padding()
    backend.no_truncation()
    tools = None
    if tokenizer.has_tool_calling:
        parser = getattr(tokenizer.tool_parser, "__module__", "") or ""
        tools = ToolFormat(_terminal(hf, tokenizer.tool_call_start), _terminal(hf, tokenizer.tool_call_end),
                           parser.rsplit(".", 1)[-1], parser.endswith(".json_tools"))
    _served = _Served(llguidance.LLTokenizer(backend.to_str(), eos_token=sorted(tokenizer.eos_token_ids)), tools,
                      OrderedDict(), threading.Lock())


def eos_tokens() -> list[int]:
    return _served.tokenizer.eos_tokens


def json_grammar(schema: dict) -> str:
    """The grammar of documents valid against `schema` (a JSON Schema object), or GrammarError naming what
    llguidance cannot hold (an unknown keyword, a bad $ref, an impossible pattern)."""
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    return _checked(text)


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_lark(tools: list[dict], fmt: ToolFormat, several: bool) -> str:
    """Lark for the model's tool calls to these functions (`several`: one or more, else exactly one), each
    call's arguments held to its function's parameters."""
    schema = {"anyOf": [_call_schema(t) for t in tools], "x-guidance": JSON_STYLE}
    calls = 'call ("\\n" call)*' if several else "call"
    return f'start: {calls}\ncall: {fmt.start} "\\n" %json {json.dumps(schema)} "\\n" {fmt.end}\n'


def tool_call_grammar(tools: list[dict], several: bool) -> str:
    """The grammar of the served model's calls to `tools`, or GrammarError when its tool format is not one a
    grammar here writes (json_tools only, so far)."""
    fmt = _served.tools if _served else STAND_IN
    if fmt is None or not fmt.json_calls:
        why = "has no tool calling" if fmt is None else f"writes calls in the {fmt.parser} format"
        raise GrammarError(f"this model {why}, which meshd cannot hold an answer to yet (it holds the json_tools "
                           "format: Qwen, Hermes)")
    return _checked(llguidance.LLMatcher.grammar_from_lark(tool_call_lark(tools, fmt, several)))


def _checked(text: str) -> str:
    """The grammar, compiled against the served tokenizer when there is one (cached for this rank's own use);
    GrammarError with llguidance's reason when it does not compile."""
    if _served is None:
        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise GrammarError(error)
        return text
    compiled(text)
    return text


def compiled(text: str) -> llguidance.LLMatcher:
    """A fresh matcher of the grammar (compiled once per text, kept while it is among the recent ones)."""
    s = _served
    with s.lock:
        matcher = s.compiled.get(text)
        if matcher is not None:
            s.compiled.move_to_end(text)
            return matcher.deep_copy()
    matcher = llguidance.LLMatcher(s.tokenizer, text, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    with s.lock:
        s.compiled[text] = matcher
        while len(s.compiled) > CACHED_GRAMMARS:
            s.compiled.popitem(last=False)
    return matcher.deep_copy()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def allowed_tokens(bitmask: bytes, width: int, eos: list[int]) -> np.ndarray:
    """llguidance's bitmask (a bit per token, little-endian words) as one bool per logit of a row `width`
    wide; a mask that allows nothing allows the end instead, so a stuck grammar ends the answer."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:width].astype(bool)
    if bits.shape[0] < width:
        bits = np.concatenate([bits, np.zeros(width - bits.shape[0], dtype=bool)])
    if not bits.any():
        bits[[t for t in eos if t < width]] = True
    return bits
