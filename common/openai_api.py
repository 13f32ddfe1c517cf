"""The OpenAI wire, as pure functions: request validation and response shapes, which the proxy and rank 0
both stand on.

Every body built here validates against the official response schemas: `logprobs`
(null unless asked for) and `refusal` are present, errors are `{"error": {message, type, param,
code}}`. Validation turns a bad request into an `ApiError` naming the field, so a
bad request never reaches the lockstep loop. A request's grammar is built by the caller's `Builder`
(common/grammars.py): the proxy's checks it without a tokenizer, rank 0's with its served model's.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from common.errors import ApiError, error_body
from common.grammars import UNSERVED, Builder, GrammarError

ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int  # the request's, or its server's default when it named none (`named` false)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted
    named: bool = True  # the request set max_tokens itself (else the answer may stop at the context's end)
    logprobs: int = -1  # -1: none; k >= 0: each token's log probability and its k most likely alternatives
    grammar: str = ""  # llguidance's grammar the answer is held to (common/grammars.py); "": none
    held_by: str = ""  # the parameter that asked for it: "response_format" or "tool_choice"
    draft_tokens: int | None = None  # meshd's: at most this many drafts a step (None: the mesh's own; 0: none)

    def sampling(self) -> dict:
        """What every rank needs to sample alike (it travels with the request through the lockstep; each rank
        compiles the grammar itself)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": [list(b) for b in self.logit_bias],
                "grammar": self.grammar or None}


@dataclass(frozen=True)
class Resume:
    """An answer cut by a generation's death, resumed on the next one (the proxy
    sends it on the internal hop): the token ids and the characters of text the
    client already has, and the id, created and seed of that answer."""

    ids: tuple[int, ...]
    chars: int
    id: str
    created: int
    seed: int


@dataclass(frozen=True)
class Internal:
    """meshd's own `meshd` object of a request, between its proxy and rank 0 (refused from clients): `ids` asks
    for the token ids of each streamed chunk, `resume` continues an answer, `tenant` names whose prefix cache
    it uses (runtime/prefix/tape.py; the proxy's scope of the caller's API key)."""

    ids: bool = False
    resume: Resume | None = None
    tenant: str = ""

    def wire(self) -> dict:
        out: dict = {}
        if self.ids:
            out["ids"] = True
        if self.resume is not None:
            r = self.resume
            out["resume"] = {"ids": list(r.ids), "chars": r.chars, "id": r.id, "created": r.created, "seed": r.seed}
        if self.tenant:
            out["tenant"] = self.tenant
        return out

    @classmethod
    def from_wire(cls, raw: Any) -> "Internal":
        """The object as the proxy sends it, or ApiError(400) saying what is malformed."""
        try:
            resume = raw.get("resume")
            tenant = raw.get("tenant", "")
            if not isinstance(tenant, str) or len(tenant) > 64:
                raise ValueError(f"tenant {tenant!r} is not a scope of at most 64 characters")
            return cls(bool(raw.get("ids")), None if resume is None else Resume(
                tuple(int(t) for t in resume["ids"]), int(resume["chars"]), str(resume["id"]),
                int(resume["created"]), int(resume["seed"])), tenant)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise _bad("meshd", f"'meshd' is malformed ({e})")


MAX_CHOICES = 16  # `n`: the most answers one request asks for (each a row of the batch)
MAX_DRAFT_TOKENS = 64  # `draft_tokens`: the most drafts a step a request may ask for (its mesh's width caps it)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request; `kind` is "chat" or "text". `internal` comes only from the proxy (the body's
    `meshd` object, refused from clients)."""

    kind: str
    model: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    messages: tuple[dict, ...] = ()
    prompt: str = ""
    internal: Internal = Internal()
    # for the chat template: chat_template_kwargs, with the switches `thinking` and `reasoning_effort` set
    template_kwargs: dict = field(default_factory=dict)
    tools: tuple[dict, ...] = ()  # the functions the answer may call (none when tool_choice is "none")
    n: int = 1  # how many answers (choices), each from its own seed (`row_seed`)

    @property
    def thinking_off(self) -> bool:
        """The request switched the model's thinking off (else it thinks if its template does, by default)."""
        return self.template_kwargs.get("enable_thinking") is False


@dataclass(frozen=True)
class Thinking:
    """A model that thinks: the texts that open and close its reasoning."""

    start: str
    end: str


def answer_regions(text: str, thinking: Thinking | None, reasoning_first: bool) -> tuple[int, int, int]:
    """Where an answer's reasoning and its content lie in its text, as (reasoning start, reasoning end,
    content start). It reasons when its prompt left a think block open (`reasoning_first`) or when it
    opens one itself before anything else; the reasoning runs to the close (the end of the text while it
    is still thinking), and the content starts after the close and the whitespace after it."""
    if thinking is None:
        return 0, 0, 0
    start = 0
    if not reasoning_first:
        lead = len(text) - len(text.lstrip())
        if not text.startswith(thinking.start, lead):
            return 0, 0, 0
        start = lead + len(thinking.start)
    end = text.find(thinking.end, start)
    if end < 0:
        return start, len(text), len(text)
    content = end + len(thinking.end)
    return start, end, content + len(text[content:]) - len(text[content:].lstrip())


@dataclass(frozen=True)
class Limits:
    """What a server serves: its model's name, and the answer length when a request names none
    (`default_max_tokens`; 0: until the end of the context or a stop), never above `max_tokens_limit`."""

    model_name: str
    default_max_tokens: int
    max_tokens_limit: int
    aliases: tuple[str, ...] = ()  # other names clients may ask for it by (its path, a Hugging Face id)

    def unnamed_max_tokens(self) -> int:
        return min(self.default_max_tokens or self.max_tokens_limit, self.max_tokens_limit)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"'{name}' must be a number between {lo} and {hi}, got {value!r}")
    if not lo <= value <= hi:
        raise _bad(name, f"'{name}' must be between {lo} and {hi}, got {value}")
    return float(value)


def _integer(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, f"'{name}' must be an integer between {lo} and {hi}, got {value!r}")
    return value


def _max_tokens(body: dict, limits: Limits) -> int:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(name)
    if value is None:
        return limits.unnamed_max_tokens()
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {value!r}")
    if value <= 0:
        raise _bad(name, f"'{name}' must be at least 1, got {value}")
    if value > limits.max_tokens_limit:
        raise _bad(
            name,
            f"'{name}' is {value}, above this server's limit of {limits.max_tokens_limit}; "
            "ask for fewer tokens",
        )
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "'stop' must be a non-empty string or a list of up to 4 of them")
    if len(stop) > 4:
        raise _bad("stop", f"'stop' holds {len(stop)} sequences; at most 4 are allowed")
    return tuple(stop)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > 300:
        raise _bad("logit_bias", "'logit_bias' must be an object of at most 300 token ids to biases, "
                                 'e.g. {"50256": -100}')
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) or isinstance(value, bool) \
                or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _bad("logit_bias", f"'logit_bias' maps token ids (digit strings) to numbers between -100 and "
                                     f"100; got {key!r}: {value!r}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _logprobs(kind: str, body: dict) -> int:
    """Chat: `logprobs` true, with `top_logprobs` alternatives (0-20); completions: `logprobs` = how many
    alternatives (0-5). -1: none asked for."""
    if kind == "text":
        return -1 if body.get("logprobs") is None else _integer(body, "logprobs", 0, 0, 5)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("logprobs", f"'logprobs' must be true or false, got {wanted!r}")
    top = _integer(body, "top_logprobs", 0, 0, 20)
    if body.get("top_logprobs") is not None and not wanted:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return top if wanted else -1


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of arguments for the "
                                           "chat template, e.g. {\"enable_thinking\": false}")
    return kwargs


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _bad("seed", f"'seed' must be an integer, got {seed!r}")
    return seed % (2**63)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"'{where}' must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(
                        f"{where}.content[{j}]",
                        f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"'{where}.content' must be a string, got {type(content).__name__}")
        message = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _history_calls(m["tool_calls"], f"{where}.tool_calls")
        reasoning = m.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            if not isinstance(reasoning, str):
                raise _bad(f"{where}.reasoning_content", f"'{where}.reasoning_content' must be a string, got "
                                                          f"{type(reasoning).__name__}")
            message["reasoning_content"] = reasoning  # a thinking template renders it back into the prompt
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return tuple(out)


def _history_calls(calls: Any, where: str) -> list[dict]:
    """An assistant turn's tool calls as chat templates take them: the arguments as the client sent them,
    a JSON object in a string (DeepSeek's template parses them; others print a string as it is)."""
    if not isinstance(calls, list):
        raise _bad(where, f"'{where}' must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise _bad(f"{where}[{i}]", f"'{where}[{i}]' must be {{\"type\": \"function\", \"function\": "
                                        "{\"name\": ..., \"arguments\": \"<JSON>\"}}")
        try:
            arguments = fn["arguments"] or "{}"
            if not isinstance(json.loads(arguments), dict):
                raise ValueError
        except ValueError:
            raise _bad(f"{where}[{i}].function.arguments", f"'{where}[{i}].function.arguments' must be a JSON "
                                                           f"object in a string, got {fn['arguments']!r}")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tools(body: dict, grammars: Builder) -> tuple[tuple[dict, ...], str]:
    """The request's functions (none when `tool_choice` is "none"), and the grammar of the calls it forces
    ("required": one or more, a named function: one call to it; "" when it forces none)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not FUNCTION_NAME.match(fn["name"]):
            raise _bad(f"tools[{i}]", f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": "
                                      "...}}}} with a name of letters, digits, '_' or '-' (at most 64)")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"tools[{i}].function.parameters", f"'tools[{i}].function.parameters' must be a JSON Schema "
                                                          "object")
        names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None:  # absent or null: OpenAI's and DeepSeek's default
        choice = "auto" if tools else "none"
    if choice == "none" or not tools:
        if choice not in ("none", "auto", None):
            raise _bad("tool_choice", "'tool_choice' names a function, but the request has no 'tools'")
        return (), ""
    if choice == "auto":
        return tuple(tools), ""
    if choice == "required" or isinstance(choice, dict):
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if isinstance(choice, dict) and named not in names:
            raise _bad("tool_choice", f"'tool_choice' names {named!r}, which is not among 'tools' ({', '.join(names)})")
        forced = [t for t in tools if named in (None, t["function"]["name"])]
        try:
            return tuple(tools), grammars.tool_calls(forced, several=named is None)
        except GrammarError as e:
            raise ApiError(400, f"'tool_choice' forces a call, but {e}; use \"auto\", or check each function's "
                                "'parameters'", param="tool_choice", code="unsupported_parameter")
    raise _bad("tool_choice", f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")


def tool_spans(text: str, start: str, end: str, begin: int) -> tuple[list[tuple[int, int]], int | None]:
    """The closed tool calls in `text` from `begin` on, as (start, end) positions around their markers,
    and where an unclosed one opens (None: none is open)."""
    spans, at = [], begin
    while (s := text.find(start, at)) >= 0:
        e = text.find(end, s + len(start))
        if e < 0:
            return spans, s
        at = e + len(end)
        spans.append((s, at))
    return spans, None


def outside(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The stretches of [lo, hi) that no span covers."""
    out, at = [], lo
    for s, e in spans:
        if s > at:
            out.append((at, min(s, hi)))
        at = max(at, e)
    if at < hi:
        out.append((at, hi))
    return [(a, b) for a, b in out if a < b]


def tool_call_body(call: dict, index: int | None = None) -> dict:
    """A parsed call ({name, arguments}) in OpenAI's shape; streamed calls carry their index. Arguments that are
    a string are a call's JSON as far as it was written (`partial_calls`), passed on as they are."""
    arguments = call.get("arguments", {})
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)(</｜DSML｜invoke>|$)', re.S)
DSML_PARAMETER = re.compile(r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)(</｜DSML｜parameter>|$)', re.S)
JSON_CALL_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.S)


def partial_calls(block: str) -> list[dict]:
    """The calls of a tool-call block cut before its closing marker (`block`: its text after the opening one),
    as far as they were written: [{name, arguments}], the arguments the call's JSON so far, a string (what
    OpenAI returns for a call cut by max_tokens). DeepSeek's DSML invokes (the closed ones whole), or one
    json_tools call ({"name": ..., "arguments": ...}); none where not even a name was written."""
    if "<｜DSML｜invoke" in block:
        calls = []
        for name, body, closed in DSML_INVOKE.findall(block):
            items = []
            for key, string, value, done in DSML_PARAMETER.findall(body):
                if string == "true":
                    text = json.dumps(value, ensure_ascii=False)
                    value = text if done else text[:-1]
                items.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
            calls.append({"name": name, "arguments": "{" + ", ".join(items) + ("}" if closed else "")})
        return calls
    if m := JSON_CALL_NAME.match(block):
        return [{"name": json.loads(f'"{m.group(1)}"'), "arguments": block[m.end():].rstrip()}]
    return []


JSON_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _response_format(body: dict, grammars: Builder) -> str:
    """The grammar `response_format` holds the answer to: any JSON object ("json_object"), a document valid
    against a schema ("json_schema", held to it whether `strict` or not); "" for "text"."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return ""
    if kind == "json_object":
        return grammars.json({"type": "object"})
    if kind != "json_schema":
        raise _bad("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                                      "or {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": "
                                      f"{{...}}}}}}, got {fmt!r}")
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not JSON_SCHEMA_NAME.match(spec["name"]):
        raise _bad(where, f"'{where}' must be an object with a 'name' of letters, digits, '_' or '-' (at most 64) "
                          "and a 'schema'")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad(f"{where}.schema", f"'{where}.schema' must be a JSON Schema object, got {schema!r}")
    try:
        return grammars.json(schema)
    except GrammarError as e:
        raise ApiError(400, f"'{where}.schema' cannot hold an answer: {e}. Leave that part out or rewrite it",
                       param=f"{where}.schema", code="invalid_value")


def _internal(body: dict, internal: bool) -> Internal:
    raw = body.get("meshd")
    if raw is None:
        return Internal()
    if not internal:
        raise _bad("meshd", "'meshd' is meshd's own field between its proxy and rank 0; leave it out")
    return Internal.from_wire(raw)


# DeepSeek's `reasoning_effort` values and the effort each means (DeepSeek's own mapping)
EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


def _thinking(body: dict, kwargs: dict) -> dict:
    """chat_template_kwargs with DeepSeek's switches set: `thinking` {"type": "enabled" | "disabled"} as the
    template's `enable_thinking` (absent or null: the model's default), `reasoning_effort` as its
    `reasoning_effort`, by DeepSeek's mapping (a template without it ignores it; none while thinking is off)."""
    thinking, effort = body.get("thinking"), body.get("reasoning_effort")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is not None and kind not in ("enabled", "disabled"):
        raise _bad("thinking", f"'thinking' must be {{\"type\": \"enabled\"}} or {{\"type\": \"disabled\"}}, "
                               f"got {thinking!r}")
    if effort is not None and effort not in EFFORTS:
        raise _bad("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {effort!r}")
    out = dict(kwargs)
    if kind is not None:
        on = kind == "enabled"
        if out.setdefault("enable_thinking", on) != on:
            raise _bad("thinking", f"'thinking' is {kind}, but chat_template_kwargs.enable_thinking is "
                                   f"{out['enable_thinking']!r}; send one of them")
    if effort is not None and out.get("enable_thinking") is not False:
        out.setdefault("reasoning_effort", EFFORTS[effort])
    return out


def row_seed(seed: int, row: int) -> int:
    """The seed of a request's `row`th answer (`n` > 1): the request's own for the first, one apart from
    every other row's for each of the others."""
    return (seed + row * 0x9E3779B97F4A7C15) % 2**63


# What each route honours; fields that change nothing about an answer (accepted, not acted on: OpenAI's
# bookkeeping); anything else is refused with a 400 that names it, never silently dropped (docs/RUNTIME.md).
HONOURED = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
            "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty",
            "draft_tokens", "meshd"}
HONOURED_BY = {"chat": HONOURED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                   "chat_template_kwargs", "tools", "tool_choice", "response_format", "thinking",
                                   "reasoning_effort"},
               "text": HONOURED | {"prompt", "logprobs"}}
HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier"}


def _refuse_unhonoured(kind: str, body: dict) -> None:
    for name in sorted(set(body) - HONOURED_BY[kind] - HARMLESS):
        if name == "response_format" and body[name] in ({"type": "text"}, None):
            continue
        raise ApiError(400, f"'{name}' is not supported by this server; leave it out (this server honours "
                            f"{', '.join(sorted(HONOURED_BY[kind] - {'meshd'}))})", param=name,
                       code="unsupported_parameter")


def parse_request(kind: str, body: Any, limits: Limits, internal: bool = False,
                  grammars: Builder = UNSERVED) -> CompletionRequest:
    """Validate a decoded JSON body for `/v1/chat/completions` ("chat") or
    `/v1/completions` ("text"). Raises ApiError naming the field at fault.
    `internal`: the body comes from meshd's proxy (rank 0 takes its `meshd` object);
    `grammars`: how its structured output's grammar is built (rank 0: runtime/engine/grammar.py's `builder()`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object", code="invalid_json")
    _refuse_unhonoured(kind, body)
    model = body.get("model", limits.model_name)
    if not isinstance(model, str):
        raise _bad("model", f"'model' must be a string, got {model!r}")
    if model not in (limits.model_name, "default", "", *limits.aliases):
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{limits.model_name}' (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object")
    params = SamplingParams(
        max_tokens=_max_tokens(body, limits),
        named=body.get("max_tokens", body.get("max_completion_tokens")) is not None,
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=_seed(body),
        stop=_stop(body),
        top_k=_integer(body, "top_k", 0, 0, 1 << 20),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        logit_bias=_logit_bias(body),
        logprobs=_logprobs(kind, body),
        draft_tokens=_integer(body, "draft_tokens", None, 0, MAX_DRAFT_TOKENS),
    )
    meshd = _internal(body, internal)
    if meshd.resume is not None and n > 1:
        raise _bad("meshd", "'meshd.resume' continues one answer; a request of n > 1 is never resumed")
    tools, forced = _tools(body, grammars) if kind == "chat" else ((), "")
    if kind == "chat":  # a forced call wins over the answer's format: its turn is the call
        answer_format = _response_format(body, grammars)
        params = replace(params, grammar=forced or answer_format,
                         held_by="tool_choice" if forced else "response_format" if answer_format else "")
    common = dict(
        kind=kind,
        model=limits.model_name,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        params=params,
        internal=meshd,
        n=n,
    )
    if kind == "chat":
        return CompletionRequest(messages=_messages(body), template_kwargs=_thinking(body, _template_kwargs(body)),
                                 tools=tools, **common)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "'prompt' must be a non-empty string")
    return CompletionRequest(prompt=prompt, **common)


def missing_reasoning(req: CompletionRequest) -> ApiError | None:
    """DeepSeek's multi-turn rule for a model that thinks (asked of a request that did not switch thinking
    off): an assistant turn that called tools since the last user turn carries its `reasoning_content` back
    (its template renders it into the prompt), else DeepSeek's 400, naming the turn."""
    since = max((i + 1 for i, m in enumerate(req.messages) if m["role"] in ("user", "developer")), default=0)
    for i, m in enumerate(req.messages[since:], since):
        if m["role"] == "assistant" and m.get("tool_calls") and "reasoning_content" not in m:
            return ApiError(400, f"The reasoning_content in the thinking mode must be passed back to the API: "
                                 f"'messages[{i}]' called tools in thinking mode without its reasoning_content. Send "
                                 "each such turn back with the reasoning_content it came with, or switch thinking "
                                 "off ({\"thinking\": {\"type\": \"disabled\"}})",
                            param=f"messages[{i}].reasoning_content", code="invalid_request_error")
    return None


def new_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, resumed: int, generated: int, cached: int,
          drafts: tuple[int, int] | None = None) -> dict:
    """One answer's usage as its client sees it. The engine was given the prompt followed by the `resumed`
    tokens of the answer that a dead generation already sent (none for a fresh answer), took `cached` of
    those from its cache and generated `generated` more. The answer so far counts once, as completion:
    only the prompt's share of the cache is cached, said in OpenAI's words (`cached_tokens`) and DeepSeek's
    (`prompt_cache_hit_tokens`, `prompt_cache_miss_tokens`). A drafting engine's answer says its `drafts`
    (proposed, accepted: those that are tokens of the answer; a resumed answer's are those of the generation
    that finished it), in OpenAI's words for predictions and meshd's own (`draft_tokens`)."""
    completion_tokens = resumed + generated
    hit = min(cached, prompt_tokens)
    return _with_drafts({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": hit},
        "prompt_cache_hit_tokens": hit,
        "prompt_cache_miss_tokens": prompt_tokens - hit,
    }, drafts)


def _with_drafts(usage_: dict, drafts: tuple[int, int] | None) -> dict:
    if drafts is None:
        return usage_
    proposed, accepted = drafts
    return {**usage_, "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                                    "rejected_prediction_tokens": proposed - accepted},
            "draft_tokens": {"proposed": proposed, "accepted": accepted}}


def drafts_of(usage_: dict) -> tuple[int, int] | None:
    """The (proposed, accepted) drafts a usage says, None when its answer was not drafted."""
    drafted = usage_.get("draft_tokens")
    return None if drafted is None else (drafted["proposed"], drafted["accepted"])


def summed_usage(rows: list[dict]) -> dict:
    """The usage of a request's several answers (`n`), as OpenAI counts it: the prompt once, every answer's
    tokens (and drafts); cached what every row took from the cache."""
    prompt, hit = rows[0]["prompt_tokens"], min(r["prompt_cache_hit_tokens"] for r in rows)
    completion = sum(r["completion_tokens"] for r in rows)
    drafted = [d for r in rows if (d := drafts_of(r)) is not None]
    return _with_drafts({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                         "prompt_tokens_details": {"cached_tokens": hit}, "prompt_cache_hit_tokens": hit,
                         "prompt_cache_miss_tokens": prompt - hit},
                        tuple(map(sum, zip(*drafted))) if drafted else None)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token as the logprobs report it: its text, log probability, the offset of its text
    in the answer, and the most likely alternatives as (text, log probability)."""

    text: str
    logprob: float
    offset: int
    top: tuple[tuple[str, float], ...] = ()


def logprobs_body(req: CompletionRequest, tokens: list[TokenLogprob]) -> dict | None:
    """The choice's `logprobs` in the route's OpenAI shape (None when the request asked for none)."""
    if req.params.logprobs < 0:
        return None
    if req.kind == "chat":
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(a, lp) for a, lp in t.top]}
                            for t in tokens], "refusal": None}
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens], "text_offset": [t.offset for t in tokens]}


def completion_body(req: CompletionRequest, rid: str, created: int, text: str, finish_reason: str,
                    usage_: dict, logprobs: list[TokenLogprob] = (), reasoning: str = "",
                    tool_calls: list[dict] = (), index: int = 0) -> dict:
    """A whole answer; a request of several (`n`) joins its rows' `choices` (`index`: the row's)."""
    if req.kind == "chat":
        message = {"role": "assistant", "content": None if tool_calls and not text else text, "refusal": None}
        if reasoning:  # under both names: DeepSeek's API (and its clients, dsh) says reasoning_content
            message["reasoning"] = message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = [tool_call_body(c) for c in tool_calls]
        choice = {
            "index": index,
            "message": message,
            "logprobs": logprobs_body(req, list(logprobs)),
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs_body(req, list(logprobs)),
                  "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": [choice], "usage": usage_}


def chunk_body(req: CompletionRequest, rid: str, created: int, text: str | None,
               finish_reason: str | None, first: bool = False, logprobs: list[TokenLogprob] = (),
               reasoning: str = "", tool_calls: list[tuple[int, dict]] = (), index: int = 0) -> dict:
    """One streamed chunk of the answer of row `index`; `logprobs` are those of the tokens this chunk's text
    completes, `tool_calls` the calls that closed in it, with their indexes in the answer."""
    lp = logprobs_body(req, list(logprobs)) if logprobs else None
    if req.kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [tool_call_body(c, i) for i, c in tool_calls]
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}


GRAMMAR_STUCK = "grammar_stuck"  # the finish_reason and error code of an answer its grammar left no token


def grammar_stuck(req: CompletionRequest, why: str, said: str) -> dict:
    """The error of an answer whose grammar allowed no token after what it said (runtime/engine/grammar.py's
    `dead_end`): the answer so far cannot become a valid one."""
    where = "response_format.json_schema.schema" if req.params.held_by == "response_format" else "tool_choice"
    tail = said if len(said) <= 80 else "..." + said[-80:]
    return error_body(f"The grammar of '{where}' allowed no token after {tail!r}, so the answer stops short of a "
                      f"valid one: {why}. Rewrite the part of the schema no finite answer the model's vocabulary "
                      "can write meets (a required property that requires itself, say)", "invalid_request_error", req.params.held_by, GRAMMAR_STUCK)


def usage_chunk(req: CompletionRequest, rid: str, created: int, usage_: dict) -> dict:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": [], "usage": usage_}


def models_body(model_name: str, created: int | None = None, aliases: tuple[str, ...] = ()) -> dict:
    at = int(created if created is not None else time.time())
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": at, "owned_by": "meshd"}
                     for name in dict.fromkeys((model_name, *aliases))]}


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop sequence starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could still grow into a stop
    sequence, and so must not be sent yet."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-k:]):
                keep = max(keep, k)
                break
    return keep
