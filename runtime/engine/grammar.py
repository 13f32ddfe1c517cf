"""Structured output on the ranks: the grammar an answer is held to (common/grammars.py builds it from the
request) compiled on each rank and masking its logits.

A request's grammar travels to every rank as data, llguidance's grammar text, inside its sampling settings;
each rank compiles it against its own copy of the model's tokenizer (`serve`) and masks the answer's logits
with it (runtime/engine/sampling.py's `GrammarMask`). Rank 0 builds its requests' grammars with the served
model's tool format and this compiler (`builder`).

Compiles never run on a serving loop: each rank compiles in one worker thread (`prepare`, llguidance drops the
GIL), once per grammar text however many ask at once, and keeps the compiled grammars in a cache bounded by
bytes (`--grammar-cache-mb`), each entry's size measured as the memory its compile and first mask took; the
least recently used go first. An answer held to a grammar joins the batch once every rank has it
(runtime/compiles.py).

llguidance rather than xgrammar: one 3 MB wheel with no dependencies on Linux and macOS alike (xgrammar's
brings torch and CUDA, gigabytes on a CPU host), JSON Schema with `$ref`, `anyOf`, formats and patterns, an
unknown keyword refused by name (the 400's text), a Lark grammar for tool calls, and a mask computed in
tens of microseconds without a precompile of the whole vocabulary (bench/grammar.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass
from functools import lru_cache

import llguidance
import mlx.core as mx
import numpy as np
import psutil

from common.grammars import UNSERVED, Builder, GrammarError, ToolFormat, tool_format

CACHE_BYTES = 256 << 20  # --grammar-cache-mb's default


class ByteBoundCache:
    """Compiled grammars by their text, least recently used first, their sizes summing to at most `budget`
    bytes: a put evicts the oldest until they fit (the newest stays, even alone past the budget)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self._items: OrderedDict = OrderedDict()  # key -> (value, nbytes)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key):
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key, value, nbytes: int) -> list:
        """Keep `value`; returns the keys evicted to make room."""
        if key in self._items:
            self.nbytes -= self._items.pop(key)[1]
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        evicted = []
        while self.nbytes > self.budget and len(self._items) > 1:
            old, (_, size) = self._items.popitem(last=False)
            self.nbytes -= size
            evicted.append(old)
        return evicted


def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "mallinfo2") else None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_LIBC = _libc()
if _LIBC is not None:
    _LIBC.mallinfo2.restype = _MallInfo2


def allocated() -> int:
    """The bytes this process holds from the allocator (glibc's count of what is in use; elsewhere, the
    resident set)."""
    if _LIBC is None:
        return psutil.Process().memory_info().rss
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def _give_back() -> None:
    """Return freed heap to the system (glibc keeps it otherwise: evicted grammars would leave the rank's
    resident set where it peaked)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class Compiler:
    """One process's grammars compiled against its tokenizer: in one worker thread, each text once while it
    is compiling or cached (`prepare`), kept in a ByteBoundCache."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, budget: int):
        self.tokenizer = tokenizer
        self.cache = ByteBoundCache(budget)
        self._compiling: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def prepare(self, text: str) -> Future:
        """The compiled grammar of `text`, as a future: done when it is cached, else its compile in the worker
        (the one already under way, when there is one); it fails with GrammarError."""
        with self._lock:
            matcher = self.cache.get(text)
            if matcher is not None:
                done: Future = Future()
                done.set_result(matcher)
                return done
            if text not in self._compiling:
                self._compiling[text] = self._pool.submit(self._compile, text)
            return self._compiling[text]

    def _compile(self, text: str) -> llguidance.LLMatcher:
        try:
            before = allocated()
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            matcher.deep_copy().compute_bitmask()  # the first mask builds the lexer's start: part of its cost
            size = max(allocated() - before, len(text))
            with self._lock:
                evicted = self.cache.put(text, matcher, size)
        finally:
            with self._lock:
                self._compiling.pop(text, None)
        if evicted:
            _give_back()
        return matcher

    def stats(self) -> dict:
        with self._lock:
            return {"grammars_cached": len(self.cache), "grammar_cache_bytes": self.cache.nbytes}


@dataclass
class _Served:
    tokenizer: llguidance.LLTokenizer
    tools: ToolFormat | None
    think: tuple[int, int] | None  # the ids of <think> and </think>, for a model that thinks
    compiler: Compiler


_served: _Served | None = None


def _terminal(tokenizer, text: str) -> str:
    """A marker as a Lark terminal: its special token when it is one (a string never matches those)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in set(getattr(tokenizer, "all_special_ids", ())):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def serve(tokenizer, cache_bytes: int = CACHE_BYTES) -> None:
    """Compile grammars against this mlx-lm tokenizer from now on (every rank, once it is loaded), keeping
    at most `cache_bytes` of them."""
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
    compiler = Compiler(llguidance.LLTokenizer(backend.to_str(), eos_token=sorted(tokenizer.eos_token_ids)),
                        cache_bytes)
    _served = _Served(compiler.tokenizer, tools, think, compiler)


def eos_tokens() -> list[int]:
    return _served.tokenizer.eos_tokens


def builder() -> Builder:
    """How this process builds its requests' grammars: once a tokenizer is served, with its model's tool format,
    each grammar's compile against it started in the background (`prepare`: await it for its errors); before,
    checked without one."""
    return UNSERVED if _served is None else Builder(_served.tools, _compile_behind)


def _compile_behind(text: str) -> str:
    prepare(text)
    return text


def prepare(text: str) -> Future:
    """The grammar compiled in the background (Compiler.prepare)."""
    return _served.compiler.prepare(text)


def compiled(text: str) -> llguidance.LLMatcher:
    """A fresh matcher of the grammar, waiting for its compile when it is not cached."""
    return prepare(text).result().deep_copy()


def stats() -> dict:
    """The grammar cache's entries and bytes (none before a tokenizer is served)."""
    return _served.compiler.stats() if _served else {"grammars_cached": 0, "grammar_cache_bytes": 0}


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


def unpack_on_host(device: mx.Device) -> bool:
    """Where a held step's mask is unpacked from llguidance's bits: on the host for a CPU device (numpy's unpack
    runs beside the step's forward, the device's own would queue behind it); a GPU is sent the bits, an eighth of
    the bytes, and unpacks them (on CUDA what the host writes reaches the device as page faults of managed memory,
    behind the step's forward: a held token cost 1.15x a free one on an H100 with the bools sent,
    bench/grammar.py)."""
    return device.type == mx.cpu


def allowed_tokens(bitmask: bytes, width: int, eos: list[int], on_host: bool = True) -> mx.array:
    """llguidance's bitmask (a bit per token, little-endian 32-bit words) as one bool per logit of a row `width`
    wide, unpacked `on_host` or on the device (`unpack_on_host`); a mask that allows nothing allows the end
    instead, so a stuck grammar ends the answer (which rank 0's frontend then reports: `dead_end`)."""
    words = np.zeros(-(-width // 32), dtype=np.uint32)
    got = np.frombuffer(bitmask, dtype=np.uint32)[:len(words)]
    words[:len(got)] = got
    if width % 32:  # no bit past the row
        words[-1] &= np.uint32((1 << width % 32) - 1)
    if not words.any():
        for t in eos:
            if t < width:
                words[t >> 5] |= np.uint32(1 << (t & 31))
    if on_host:
        return mx.array(np.unpackbits(words.view(np.uint8), bitorder="little")[:width].view(bool))
    word, bit = _bit_places(width)
    return ((mx.array(words)[word] >> bit) & 1).astype(mx.bool_)


@lru_cache(maxsize=8)
def _bit_places(width: int) -> tuple[mx.array, mx.array]:
    """Each logit's word of the bitmask and its bit in it, on the device once."""
    i = mx.arange(width, dtype=mx.uint32)
    places = (i >> 5, i & 31)
    mx.eval(places)
    return places


@lru_cache(maxsize=8)
def refused(dtype: mx.Dtype) -> mx.array:
    """The logit of a token a mask refuses, made once: a scalar the host writes each step is a page the device
    faults in on CUDA."""
    minus_inf = mx.array(-mx.inf, dtype=dtype)
    mx.eval(minus_inf)
    return minus_inf


@lru_cache(maxsize=8)
def reasoning_tokens(width: int, eos: tuple[int, ...]) -> mx.array:
    """What a held answer may say inside its think block: anything but the end (its grammar is still to
    come)."""
    bits = np.ones(width, dtype=bool)
    bits[[t for t in eos if t < width]] = False
    return mx.array(bits)
