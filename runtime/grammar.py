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
    """How the served model writes a tool call: its markers (as Lark terminals) around either one JSON object
    {"name", "arguments"} (`kind` "json_tools", mlx-lm's family: Qwen, Hermes) or DeepSeek's DSML invokes
    (`kind` "dsml": V3.2's and V4's template and omlx's parser); `parser` names the model's tool parser."""

    start: str
    end: str
    parser: str
    kind: str  # "json_tools", "dsml", or "" (a format no grammar here writes)


@dataclass
class _Served:
    tokenizer: llguidance.LLTokenizer
    tools: ToolFormat | None
    think: tuple[int, int] | None  # the ids of <think> and </think>, for a model that thinks
    compiled: OrderedDict  # grammar text -> its compiled matcher, fresh (copied for each answer)
    lock: threading.Lock


_served: _Served | None = None
STAND_IN = ToolFormat('"<tool_call>"', '"</tool_call>"', "json_tools", "json_tools")  # where no tokenizer is served


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
        parser = (getattr(tokenizer.tool_parser, "__module__", "") or "").rsplit(".", 1)[-1]
        tools = ToolFormat(_terminal(hf, tokenizer.tool_call_start), _terminal(hf, tokenizer.tool_call_end), parser,
                           tool_format(parser, tokenizer.tool_call_start))
    think = None
    if tokenizer.has_thinking:
        think = (hf.convert_tokens_to_ids(tokenizer.think_start), hf.convert_tokens_to_ids(tokenizer.think_end))
    _served = _Served(llguidance.LLTokenizer(backend.to_str(), eos_token=sorted(tokenizer.eos_token_ids)), tools,
                      think, OrderedDict(), threading.Lock())


def tool_format(parser: str, start: str) -> str:
    """Which of the formats a grammar here writes the model's calls are in, by its parser's module and its
    calls' opening marker ("" for none of them)."""
    if parser == "json_tools":
        return "json_tools"
    if DSML in start:
        return "dsml"
    return ""


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
    return (dsml_lark if fmt.kind == "dsml" else json_tools_lark)(tools, fmt, several)


def json_tools_lark(tools: list[dict], fmt: ToolFormat, several: bool) -> str:
    """Lark for the model's tool calls to these functions (`several`: one or more, else exactly one), each
    call's arguments held to its function's parameters."""
    schema = {"anyOf": [_call_schema(t) for t in tools], "x-guidance": JSON_STYLE}
    calls = 'call ("\\n" call)*' if several else "call"
    return f'start: {calls}\ncall: {fmt.start} "\\n" %json {json.dumps(schema)} "\\n" {fmt.end}\n'


DSML = "｜DSML｜"
DSML_PARAMETER_END = f"</{DSML}parameter>"
NOT_VALUE = ("type", "description", "title")  # keys of a plain string's schema that hold nothing
RAW, AS_JSON = json.dumps('string="true">'), json.dumps('string="false">')


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _dsml_value(schema: dict, defs: dict) -> str:
    """Lark for one parameter's attribute and value as omlx's DSML parser reads them back: a plain string, or
    an enum of strings, raw (`string="true"`, as V4's template writes strings); anything else as JSON held
    to its schema (`string="false"`, which the parser decodes as JSON)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    end = _lark(DSML_PARAMETER_END)
    if schema.get("type") == "string" and set(schema) <= set(NOT_VALUE):
        return f"{RAW} dsml_text"
    if values and all(isinstance(v, str) and v.strip("\n") == v and DSML_PARAMETER_END not in v for v in values):
        return f'{RAW} ({" | ".join(_lark(v) for v in values)}) {end}'
    held = {**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_STYLE}
    return f"{AS_JSON} %json {json.dumps(held)} {end}"


def _dsml_invoke(tool: dict) -> str:
    """Lark for one invoke of the function: its parameters in the order of its schema, the required ones
    always, each held to its schema (the arguments omlx's parser returns then validate against it)."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    where = f"function {fn['name']!r}'s parameters"
    if params.get("type", "object") != "object" or not isinstance(params.get("properties", {}), dict):
        raise GrammarError(f"{where} are not an object of named properties, which DSML calls are written as")
    props, required = params.get("properties", {}), params.get("required", [])
    if missing := [k for k in required if k not in props]:
        raise GrammarError(f"{where} require {missing}, which are not among its properties")
    if any(k in params for k in ("anyOf", "oneOf", "allOf", "patternProperties", "$ref", "not")):
        raise GrammarError(f"{where} combine schemas at the top (anyOf, oneOf, allOf, $ref, not, "
                           "patternProperties), which DSML calls (one named parameter each) cannot hold")
    defs = params.get("$defs") or params.get("definitions") or {}
    out = _lark(f'<{DSML}invoke name="{fn["name"]}">')
    for key, schema in props.items():
        one = f'{_lark(chr(10) + f"<{DSML}parameter name={json.dumps(key)} ")} {_dsml_value(schema, defs)}'
        out += f" ({one})" + ("" if key in required else "?")
    return f'{out} {_lark(("" if props else chr(10)) + f"{chr(10)}</{DSML}invoke>")}'


def dsml_lark(tools: list[dict], fmt: ToolFormat, several: bool) -> str:
    """Lark for DeepSeek's DSML calls to these functions, as V4's template renders them and omlx's parser
    reads them: one block (after the blank line the template puts before it) of one invoke, or of one or
    more with `several`, each of a forced function."""
    nl = _lark("\n")
    invokes = "".join(f"invoke_{i}: {_dsml_invoke(t)}\n" for i, t in enumerate(tools))
    calls = f"invoke ({nl} invoke)*" if several else "invoke"
    return (f"start: {_lark(chr(10) * 2)}? {fmt.start} {nl} {calls} {nl} {fmt.end}\n"
            f"invoke: {' | '.join(f'invoke_{i}' for i in range(len(tools)))}\n{invokes}"
            f"dsml_text[suffix={_lark(DSML_PARAMETER_END)}]: /(?s:.*)/\n")


def tool_call_grammar(tools: list[dict], several: bool) -> str:
    """The grammar of the served model's calls to `tools`, or GrammarError when its tool format is not one a
    grammar here writes (json_tools, DSML) or a function's parameters are not ones its calls can hold."""
    fmt = _served.tools if _served else STAND_IN
    if fmt is None or not fmt.kind:
        why = "has no tool calling" if fmt is None else f"writes calls in the {fmt.parser} format"
        raise GrammarError(f"this model {why}, which meshd cannot hold an answer to yet (it holds the json_tools "
                           "format of Qwen and Hermes, and DeepSeek's DSML)")
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


def think_open(prompt) -> bool:
    """Whether the prompt leaves a think block open, so that the answer starts in its reasoning (as rank 0's
    frontend reads it, runtime/server.py's `reasoning_first`)."""
    think = _served.think if _served else None
    if think is None:
        return False
    prompt = list(prompt)
    last = [len(prompt) - 1 - prompt[::-1].index(t) if t in prompt else -1 for t in think]
    return last[0] > last[1]


def held(answer: list[int], reasoning_first: bool) -> list[int] | None:
    """The answer's tokens its grammar holds: all of them, or, when the prompt left a think block open, those
    after the block closes (None while it is open: the reasoning is free)."""
    if not reasoning_first:
        return answer
    end = _served.think[1]
    return answer[answer.index(end) + 1:] if end in answer else None


def dead_end(text: str, prompt, answer: list[int]) -> str | None:
    """Why an answer that ended on EOS had to (its grammar, after these tokens, allowed no token, so its mask
    let only the end through), or None when its grammar ends there: llguidance's reason, or that no token of
    the vocabulary continues it."""
    part = held(answer, think_open(prompt))
    if part is None:
        return None
    matcher = compiled(text)
    for token in part:  # each token after its mask, as decoding saw it (llguidance's parser may give up in either)
        matcher.compute_bitmask()
        if matcher.is_error() or not matcher.consume_token(token):
            break
    matcher.compute_bitmask()
    if not matcher.is_error() and matcher.is_accepting():
        return None
    if matcher.is_error():
        return matcher.get_error().split("\n")[0]
    return "no token of the model's vocabulary continues it"


def allowed_tokens(bitmask: bytes, width: int, eos: list[int]) -> np.ndarray:
    """llguidance's bitmask (a bit per token, little-endian words) as one bool per logit of a row `width`
    wide; a mask that allows nothing allows the end instead, so a stuck grammar ends the answer (which rank
    0's frontend then reports: `dead_end`)."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:width].astype(bool)
    if bits.shape[0] < width:
        bits = np.concatenate([bits, np.zeros(width - bits.shape[0], dtype=bool)])
    if not bits.any():
        bits[[t for t in eos if t < width]] = True
    return bits


def reasoning_tokens(width: int, eos: list[int]) -> np.ndarray:
    """What a held answer may say inside its think block: anything but the end (its grammar is still to
    come)."""
    bits = np.ones(width, dtype=bool)
    bits[[t for t in eos if t < width]] = False
    return bits
