"""Structured output on the ranks: the grammar an answer is held to (common/grammars.py builds it from the
request) compiled on each rank and masking its logits.

A request's grammar travels to every rank as data, llguidance's grammar text, inside its sampling settings;
each rank compiles it against its own copy of the model's tokenizer (`serve`), the compiled grammar cached by
its text, and masks the answer's logits with it (runtime/engine/sampling.py's `GrammarMask`). Rank 0 builds its
requests' grammars with the served model's tool format and this compiler (`builder`).

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

from common.grammars import UNSERVED, Builder, GrammarError, ToolFormat, tool_format

CACHED_GRAMMARS = 64


@dataclass
class _Served:
    tokenizer: llguidance.LLTokenizer
    tools: ToolFormat | None
    think: tuple[int, int] | None  # the ids of <think> and </think>, for a model that thinks
    compiled: OrderedDict  # grammar text -> its compiled matcher, fresh (copied for each answer)
    lock: threading.Lock


_served: _Served | None = None


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


def eos_tokens() -> list[int]:
    return _served.tokenizer.eos_tokens


def builder() -> Builder:
    """How this process builds its requests' grammars: once a tokenizer is served, with its model's tool format,
    each grammar compiled against it (and kept for the answer); before, checked without one."""
    return UNSERVED if _served is None else Builder(_served.tools, _compiled_text)


def _compiled_text(text: str) -> str:
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
