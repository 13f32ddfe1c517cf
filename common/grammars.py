"""Structured output as a request asks for it: the grammar text its `response_format` or forced tool call holds
the answer to (llguidance's: a JSON schema, or a Lark grammar around the model's tool-call markers), built and
checked here by whoever reads the request: the proxy without a tokenizer (a forced call in a stand-in of the
json_tools format: the schemas are what a client can get wrong), rank 0 with its served model's tool format and
its compiler (runtime/engine/grammar.py's `builder`). The text travels to every rank inside the request's sampling
settings.

A grammar too costly to compile is refused here, before any rank sees it (`too_costly`): llguidance's compile
time and memory grow with its text (bench/grammar.py: an enum of 10,000 values is a 240 KB grammar, ~0.1-0.3 s
and megabytes a compile), so a request's grammar is held to MAX_GRAMMAR_BYTES.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import llguidance

# Compact JSON, one space after ':' and ',': a model can end a document, never pad it with whitespace until
# its tokens run out.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_GRAMMAR_BYTES = 128 << 10


class GrammarError(ValueError):
    """A grammar llguidance cannot hold an answer to; the message names the part at fault."""


def too_costly(text: str, limit: int = MAX_GRAMMAR_BYTES) -> str | None:
    """Why the grammar is refused before it is compiled (None when it is not): its text past `limit` bytes,
    which is what its compile's time and memory grow with."""
    size = len(text.encode())
    if size <= limit:
        return None
    return (f"it is {size // 1024} KiB, more than the {limit // 1024} KiB of grammar meshd compiles (the "
            "compile's time and memory grow with it); shorten its enums (thousands of values, say) or its schema, "
            "or split the request")


@dataclass(frozen=True)
class ToolFormat:
    """How the served model writes a tool call: its markers (as Lark terminals) around either one JSON object
    {"name", "arguments"} (`kind` "json_tools", mlx-lm's family: Qwen, Hermes) or DeepSeek's DSML invokes
    (`kind` "dsml": V3.2's and V4's template and omlx's parser); `parser` names the model's tool parser."""

    start: str
    end: str
    parser: str
    kind: str  # "json_tools", "dsml", or "" (a format no grammar here writes)


STAND_IN = ToolFormat('"<tool_call>"', '"</tool_call>"', "json_tools", "json_tools")  # where no tokenizer is served


def tool_format(parser: str, start: str) -> str:
    """Which of the formats a grammar here writes the model's calls are in, by its parser's module and its
    calls' opening marker ("" for none of them)."""
    if parser == "json_tools":
        return "json_tools"
    if DSML in start:
        return "dsml"
    return ""


def validated(text: str) -> str:
    """The grammar, or GrammarError with llguidance's reason when it does not compile (checked without a
    tokenizer)."""
    if error := llguidance.LLMatcher.validate_grammar(text):
        raise GrammarError(error)
    return text


def asks_for_grammar(body) -> bool:
    """Whether a request body may hold its answer to a grammar (`response_format` or a `tool_choice` that
    forces a call), whose check then runs off a serving loop."""
    return isinstance(body, dict) and bool(body.get("response_format") or
                                           body.get("tool_choice") not in (None, "none", "auto"))


@dataclass(frozen=True)
class Builder:
    """How a reader of requests builds their grammars: the served model's tool format (None: it calls no tools)
    and the check each grammar's text passes (`validated`, or rank 0's compile against its tokenizer)."""

    tools: ToolFormat | None = STAND_IN
    check: Callable[[str], str] = validated

    def json(self, schema: dict) -> str:
        """The grammar of documents valid against `schema` (a JSON Schema object), or GrammarError naming what
        llguidance cannot hold (an unknown keyword, a bad $ref, an impossible pattern) or that it costs too much
        to compile."""
        if why := too_costly(json.dumps(schema)):  # before building its grammar, which takes as long as it is big
            raise GrammarError(why)
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        return self._checked(text)

    def tool_calls(self, tools: list[dict], several: bool) -> str:
        """The grammar of the served model's calls to `tools`, or GrammarError when its tool format is not one
        a grammar here writes (json_tools, DSML) or a function's parameters are not ones its calls can hold."""
        fmt = self.tools
        if fmt is None or not fmt.kind:
            why = "has no tool calling" if fmt is None else f"writes calls in the {fmt.parser} format"
            raise GrammarError(f"this model {why}, which meshd cannot hold an answer to yet (it holds the "
                               "json_tools format of Qwen and Hermes, and DeepSeek's DSML)")
        return self._checked(llguidance.LLMatcher.grammar_from_lark(tool_call_lark(tools, fmt, several)))

    def _checked(self, text: str) -> str:
        if why := too_costly(text):
            raise GrammarError(why)
        return self.check(text)


UNSERVED = Builder()  # the proxy's: no tokenizer


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
