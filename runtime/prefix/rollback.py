"""Exact undo of a step's cache writes, for every cache type a drafter verifies over.

A verify feeds drafts through the target; the drafts it rejects must leave no trace, on every path (kept
in part, the verify refused, a refusal in the middle of a layer). Caches write in place: a slice assigned
into an array rebinds that array object, so a shallow copy of a cache shares what it writes, and a cache
that holds others (DeepSeek-V4's `CacheList` of a rotating window and one or two `PoolingCache`s) is shared
whole. A checkpoint therefore goes to the leaves (`caches` of a CacheList, recursively) and keeps each
leaf's own attributes with every array held as a view of its own (a handle on today's buffer, no copy; a
later write copies on write, never into the view). A leaf whose trim is exact for the step ahead keeps only
its offset: undoing it is a trim, so the common case costs no copy on write.

A checkpoint that records also keeps each held leaf's writes of the step (the keys and values a window takes,
the rows a pool accumulates and the pooled rows it appends: the arguments of their calls, no copy). Cutting the
step back to its first places then undoes each held leaf and writes the kept part of those calls again, which is
what feeding the kept places again would write, without a second forward of the target.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache


def leaves(caches) -> list:
    """The caches that hold state, a CacheList's members in its place."""
    out = []
    for c in caches:
        out.extend(leaves(c.caches) if hasattr(c, "caches") else (c,))
    return out


def trims_exactly(cache, ahead: int) -> bool:
    """Whether trimming `cache` by up to `ahead` positions after it took them in gives back exactly what it
    held: a growing cache always, a sliding window only while the step keeps it inside its window (past it,
    the window rotates over what it drops), anything else never (a pool, a recurrent state)."""
    if type(cache) in (KVCache, QuantizedKVCache):
        return True
    if type(cache) is RotatingKVCache:
        return cache.offset + ahead <= cache.max_size
    return False


def view(value):
    """An attribute's value with each array in it a view of its own: a handle on today's buffer, no copy; a
    later write into the cache copies on write, never into the view."""
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, (list, tuple)):
        return type(value)(view(v) for v in value)
    return value


POOLS = ("PoolingCache", "BatchPoolingCache")  # omlx's DeepSeek-V4 compressor and indexer pools


def writes(leaf) -> tuple[str, ...]:
    """The methods through which a step writes into `leaf`, when all its writes can be written again from their
    arguments: a key-value cache's update (positions on axis 2), a pool's accumulation (axis 1) and its pooled
    rows; () for anything else (a recurrent state, written from what the model computes inside)."""
    if type(leaf).__name__ in POOLS:
        return ("accumulate_windows", "update_and_fetch")
    if hasattr(leaf, "update_and_fetch") and hasattr(leaf, "offset"):
        return ("update_and_fetch",)
    return ()


def record(leaf, calls: list) -> None:
    """Until `release`, each write into `leaf` also goes into `calls` as (method, arguments)."""
    for name in writes(leaf):
        method = getattr(leaf, name)

        def recorded(*args, _name=name, _method=method):
            calls.append((_name, args))
            return _method(*args)
        setattr(leaf, name, recorded)


def release(leaf) -> None:
    for name in writes(leaf):
        leaf.__dict__.pop(name, None)


def replay(leaf, calls: list, places: int) -> None:
    """The recorded `calls` into `leaf`, as far as they wrote its step's first `places` positions: a call over
    positions past them cut short, a pool's pooled rows cut to those its accumulation of them completed."""
    left, rows = places, 0
    for name, args in calls:
        if name == "accumulate_windows":
            if left == 0:
                break
            kv, gate, offset = args
            n = min(left, kv.shape[1])
            left -= n
            ready = leaf.accumulate_windows(kv[:, :n], gate[:, :n], offset)[0]
            rows = ready.shape[1] // leaf.ratio
        elif type(leaf).__name__ in POOLS:
            leaf.update_and_fetch(args[0][:, :rows])
        else:
            if left == 0:
                break
            keys, values = args
            n = min(left, keys.shape[2])
            left -= n
            leaf.update_and_fetch(keys[..., :n, :], values[..., :n, :])


@dataclass
class Checkpoint:
    """Each leaf as a step found it: its offset where a trim undoes the step, else its attributes (and, when
    recording, the step's writes into it)."""

    trimmed: list  # (leaf, offset)
    held: list  # (leaf, attributes, the recorded calls or None)

    @property
    def trims(self) -> bool:
        """Every leaf is undone by a trim: the caches can be cut to any place the step reached."""
        return not self.held

    @property
    def replays(self) -> bool:
        """Every held leaf's writes were recorded: the caches can be cut to any place the step reached."""
        return all(calls is not None for _, _, calls in self.held)

    def undo(self) -> None:
        """The caches back where the step found them (repeatable), no longer recording."""
        for leaf, offset in self.trimmed:
            leaf.trim(leaf.offset - offset)
        self._restore_held()

    def _restore_held(self) -> None:
        """Each held leaf's attributes as the step found them (its recording wrappers gone with the rest)."""
        for leaf, attributes, _ in self.held:
            leaf.__dict__.clear()
            leaf.__dict__.update({k: view(v) for k, v in attributes.items()})

    def release(self) -> None:
        """Stop recording: the caches as the step left them."""
        for leaf, _, calls in self.held:
            if calls is not None:
                release(leaf)

    def cut(self, places: int, around=nullcontext()) -> bool:
        """The caches back to the step's first `places` positions, without feeding them again: trimmed leaves
        trimmed, held ones undone and their kept writes replayed (inside `around`: a batch's padding). False
        (nothing cut) unless it `replays`."""
        if not self.replays:
            return False
        for leaf, offset in self.trimmed:
            leaf.trim(leaf.offset - offset - places)
        self._restore_held()
        with around:
            for leaf, _, calls in self.held:
                replay(leaf, calls, places)
        return True


def checkpoint(caches, ahead: int, recording: bool = False) -> Checkpoint:
    """A checkpoint of `caches` before a step that feeds them `ahead` positions; `recording`, it records the
    step's writes into the held leaves that allow it (then `cut`, `undo` or `release` ends the recording)."""
    trimmed, held = [], []
    for leaf in leaves(caches):
        if trims_exactly(leaf, ahead):
            trimmed.append((leaf, leaf.offset))
            continue
        calls = [] if recording and writes(leaf) else None
        held.append((leaf, {k: view(v) for k, v in vars(leaf).items()}, calls))
        if calls is not None:
            record(leaf, calls)
    return Checkpoint(trimmed, held)
