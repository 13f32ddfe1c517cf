"""Caches cut back to checkpoints: a cache that went on past a position is brought back to exactly what it held
there, for every cache type the runtime serves, without a fork of the model's cache classes.

A cache's parts are of two kinds. The append-only ones (a plain KV cache's keys and values, a pool's pooled
rows) are shared: a checkpoint keeps only their length, and cutting back truncates them. The parts written in
place (a rotating window, a pool's partial window and its gates, a recurrent state) are small: a checkpoint
holds them as they were, each array a view of that moment's buffer (no copy; the cache's next write copies
on write, never into the view), and cutting back puts them back. A checkpoint is taken between two forwards,
at a position every run of the same prompt also stops at (`stops`), so that a cache cut back there and fed
the rest answers as a fresh prefill of the whole prompt does, also on omlx's DeepSeek-V4, whose pooled
windows depend on where each forward starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache

from runtime.prefix.rollback import leaves, view

GROWING = (KVCache, QuantizedKVCache, ConcatenateKVCache)  # what a trim cuts back exactly, whatever came after
POOL = "PoolingCache"  # omlx's DeepSeek-V4 compressor and indexer pools (cache_extras.py)


@dataclass(frozen=True)
class Trim:
    """A growing cache's length: cut back by trimming."""

    offset: int


@dataclass(frozen=True)
class Pool:
    """A pool's rows (shared, truncated) and its partial window as it was (held)."""

    rows: int
    buf_kv: mx.array | None
    buf_gate: mx.array | None
    remainder: int


@dataclass(frozen=True)
class Held:
    """Any other cache's attributes as they were, its arrays held as views."""

    attributes: dict


@dataclass(frozen=True)
class Checkpoint:
    """A cache as it was once it held `at` tokens, leaf by leaf; `nbytes` what its held parts take."""

    at: int
    parts: tuple
    nbytes: int


def _bytes(value) -> int:
    if isinstance(value, mx.array):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    return 0


def _part(leaf):
    if type(leaf) in GROWING:
        return Trim(leaf.offset)
    if type(leaf).__name__ == POOL:
        return Pool(leaf.offset, view(leaf.buf_kv), view(leaf.buf_gate), leaf.remainder)
    return Held({k: view(v) for k, v in vars(leaf).items()})


def _made(at: int, parts: tuple) -> Checkpoint:
    held = sum(_bytes(p.attributes) if isinstance(p, Held) else _bytes((p.buf_kv, p.buf_gate))
               for p in parts if not isinstance(p, Trim))
    return Checkpoint(at, parts, held)


def checkpoint(caches, at: int) -> Checkpoint:
    """`caches` (a request's, between two forwards) as they are now, when they hold `at` tokens."""
    return _made(at, tuple(_part(leaf) for leaf in leaves(caches)))


def _saved(value, put):
    if isinstance(value, mx.array):
        return {"array": put(value)}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_saved(v, put) for v in value]}
    if isinstance(value, dict):
        return {"dict": {k: _saved(v, put) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a cache attribute of type {type(value).__name__} cannot be saved")


def _loaded(value, array):
    if not isinstance(value, dict):
        return value
    [(kind, inner)] = value.items()
    if kind == "array":
        return array(inner)
    if kind == "dict":
        return {k: _loaded(v, array) for k, v in inner.items()}
    return {"list": list, "tuple": tuple}[kind](_loaded(v, array) for v in inner)


def saved(point: Checkpoint, put) -> dict:
    """`point` as JSON for a snapshot, each of its arrays handed to `put`, which returns the name it is kept
    under; TypeError when a cache holds what cannot be saved."""
    def part(p):
        if isinstance(p, Trim):
            return {"trim": p.offset}
        if isinstance(p, Pool):
            return {"pool": [p.rows, p.remainder, _saved(p.buf_kv, put), _saved(p.buf_gate, put)]}
        return {"held": _saved(p.attributes, put)}
    return {"at": point.at, "parts": [part(p) for p in point.parts]}


def loaded(data: dict, array) -> Checkpoint:
    """A checkpoint `saved` wrote, its arrays got by name from `array`; KeyError, TypeError or ValueError when
    `data` is not one."""
    def part(p):
        [(kind, value)] = p.items()
        if kind == "trim":
            return Trim(int(value))
        if kind == "pool":
            rows, remainder, buf_kv, buf_gate = value
            return Pool(int(rows), _loaded(buf_kv, array), _loaded(buf_gate, array), int(remainder))
        if kind == "held":
            return Held(_loaded(value, array))
        raise ValueError(f"a checkpoint part of kind {kind!r}")
    return _made(int(data["at"]), tuple(part(p) for p in data["parts"]))


def cut(caches, point: Checkpoint) -> None:
    """`caches`, which went on from where `point` was taken (or are a copy of caches that did), back to it."""
    found = leaves(caches)
    if len(found) != len(point.parts):
        raise ValueError(f"a checkpoint of {len(point.parts)} cache leaves cannot cut caches of {len(found)}")
    for leaf, part in zip(found, point.parts):
        if isinstance(part, Trim):
            leaf.trim(leaf.offset - part.offset)
        elif isinstance(part, Pool):
            leaf.pooled = None if part.rows == 0 else leaf.pooled[:, :part.rows]
            # views of their own: a write into the cache must not reach into the checkpoint's
            leaf.buf_kv, leaf.buf_gate, leaf.remainder = view(part.buf_kv), view(part.buf_gate), part.remainder
        else:
            leaf.__dict__.clear()
            leaf.__dict__.update({k: view(v) for k, v in part.attributes.items()})


def needed(caches) -> bool:
    """Whether these caches need checkpoints to be cut back: some part of them is written in place."""
    return any(type(leaf) not in GROWING for leaf in leaves(caches))


def stops(prompt, markers: frozenset[int], every: int, gap: int = 4) -> tuple[int, ...]:
    """Where every prefill of `prompt` breaks its forwards (and may take a checkpoint): each multiple of
    `every`, before each message marker (the tokens a chat template opens and closes messages with) at least
    `gap` tokens past the last marker it stopped before (one of a cluster: a message's end and the next one's
    start), and before its last token (which the step that samples
    takes). Whether a place before the last token is a stop depends on the tokens up to it alone, so any prompt
    that shares them breaks its forwards there too: a cache cut back to a checkpoint was fed as a fresh prefill
    of the new prompt would feed it (omlx's DeepSeek-V4 pools a window otherwise when a forward starts
    elsewhere)."""
    end = len(prompt) - 1
    if end <= 0:
        return ()
    found, last = set(range(every, end, every)), -gap
    for i, t in enumerate(prompt[:end]):
        if i > 0 and t in markers and i - last >= gap:
            found.add(i)
            last = i
    found.add(end)
    return tuple(sorted(found))


@dataclass(frozen=True)
class Stopping:
    """Where a model's prompts stop and take checkpoints: only where its caches need them (`on`), before the
    chat template's message `markers` and every `every` tokens."""

    markers: frozenset[int] = frozenset()
    every: int = 2048
    on: bool = False

    def stops(self, prompt) -> tuple[int, ...]:
        return stops(prompt, self.markers, self.every) if self.on else ()


class Taken:
    """One request's checkpoints: those its cache inherited from the tape it came from, and one taken each time
    its prefill reaches one of its `stops`."""

    def __init__(self, stops: tuple[int, ...], inherited: tuple[Checkpoint, ...] = ()):
        self.stops = stops
        self.points: list[Checkpoint] = list(inherited)

    def reached(self, caches, at: int) -> None:
        if at in self.stops and not any(p.at == at for p in self.points):
            self.points.append(checkpoint(caches, at))


def message_markers(tokenizer) -> frozenset[int]:
    """The tokens the model's chat template opens and closes messages with (its role markers, a think block's),
    read off a short conversation it renders: those of its tokenizer's added tokens, special or not (DeepSeek's
    `<｜User｜>` and `<｜Assistant｜>` are not), but its first; none without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return frozenset()
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    try:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "s"}, *turns], add_generation_prompt=True)
    except Exception:  # a template that refuses a system message
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = set(getattr(hf, "all_special_ids", ()) or ()) | set(getattr(hf, "get_added_vocab", dict)().values())
    return frozenset(int(t) for t in ids[1:] if t in added)
