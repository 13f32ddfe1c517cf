"""Exact undo of a step's cache writes, for every cache type a drafter verifies over.

A verify feeds drafts through the target; the drafts it rejects must leave no trace, on every path (kept
in part, the verify refused, a refusal in the middle of a layer). Caches write in place: a slice assigned
into an array rebinds that array object, so a shallow copy of a cache shares what it writes, and a cache
that holds others (DeepSeek-V4's `CacheList` of a rotating window and one or two `PoolingCache`s) is shared
whole. A checkpoint therefore goes to the leaves (`caches` of a CacheList, recursively) and keeps each
leaf's own attributes with every array held as a view of its own (a handle on today's buffer, no copy; a
later write copies on write, never into the view). A leaf whose trim is exact for the step ahead keeps only
its offset: undoing it is a trim, so the common case costs no copy on write.
"""

from __future__ import annotations

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


@dataclass
class Checkpoint:
    """Each leaf as a step found it: its offset where a trim undoes the step, else its attributes."""

    trimmed: list  # (leaf, offset)
    held: list  # (leaf, attributes)

    @property
    def trims(self) -> bool:
        """Every leaf is undone by a trim: the caches can be cut to any place the step reached."""
        return not self.held

    def undo(self) -> None:
        """The caches back where the step found them (repeatable)."""
        for leaf, offset in self.trimmed:
            leaf.trim(leaf.offset - offset)
        for leaf, attributes in self.held:
            leaf.__dict__.clear()
            leaf.__dict__.update({k: view(v) for k, v in attributes.items()})


def checkpoint(caches, ahead: int) -> Checkpoint:
    """A checkpoint of `caches` before a step that feeds them `ahead` positions."""
    trimmed, held = [], []
    for leaf in leaves(caches):
        if trims_exactly(leaf, ahead):
            trimmed.append((leaf, leaf.offset))
        else:
            held.append((leaf, {k: view(v) for k, v in vars(leaf).items()}))
    return Checkpoint(trimmed, held)
