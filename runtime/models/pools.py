"""Pooled windows, whatever the model: the compressors whose pooled row overlaps the window before it (omlx's
DeepSeek-V4 at ratio 4) make a forward's result depend on where it starts and how many windows it completes,
so prompts are cut into the pieces that decoding one position at a time would give. Pure arithmetic over
positions, but for reading the windows off a model and `pool_alone`, which lets a forward that stands for
decoding (a verify) complete any number of windows as decoding would."""

from __future__ import annotations

import sys
from contextlib import contextmanager

_DECODING = [False]  # inside `decoding()`: every window a forward completes is pooled alone


def attention(layer):
    """A layer's attention (None for a layer without: a recurrent one)."""
    return getattr(layer, "self_attn", None) or getattr(layer, "attn", None)


def overlap_windows(model) -> tuple[int, ...]:
    """The window sizes of the model's compressors whose pooled row overlaps the window before it (omlx's
    DeepSeek-V4 at ratio 4, in its attention and its indexer). omlx overlaps only windows that arrive in one
    forward: the first window of a forward pools alone, as every window of a one-position decode does."""
    return tuple(sorted({int(c.compress_ratio) for layer in model.layers for c in _compressors(attention(layer))
                         if getattr(c, "overlap", False)}))


def _compressors(attn) -> list:
    """An attention's compressors: its own and its indexer's (omlx's DeepSeek-V4)."""
    return [c for c in (getattr(attn, "compressor", None), getattr(getattr(attn, "indexer", None), "compressor", None))
            if c is not None]


def pool_alone(model) -> bool:
    """Have the model's overlapping compressors pool each window a forward completes alone while `decoding()`
    is on, as a one-position decode pools every window (omlx overlaps only the windows after the first of a
    forward): a verify of many places then completes two windows, or more, and its caches and logits are
    decoding's, in one forward. Installed once for the model's module (omlx's `_overlap_compress_kv`, kept as
    it was outside `decoding()`); False where the model has no such compressor or pools otherwise, and its
    verifies stay under the smallest window (`verify_width`)."""
    compressors = [c for layer in model.layers for c in _compressors(attention(layer)) if getattr(c, "overlap", False)]
    if not compressors:
        return False
    module = sys.modules[type(compressors[0]).__module__]
    pooled = getattr(module, "_overlap_compress_kv", None)
    if pooled is None:
        return False
    if not getattr(pooled, "alone_when_decoding", False):
        def compress(kv, gate, ape, head_dim):
            windows = kv.shape[1]
            if not _DECODING[0] or windows == 1:
                return pooled(kv, gate, ape, head_dim)
            alone = pooled(kv.reshape(-1, 1, *kv.shape[2:]), gate.reshape(-1, 1, *gate.shape[2:]), ape, head_dim)
            return alone.reshape(kv.shape[0], windows, alone.shape[-1])
        compress.alone_when_decoding = True
        module._overlap_compress_kv = compress
    return True


def verify_windows(model) -> tuple[int, ...]:
    """The windows a verify must not complete two of in one forward (`verify_width`, `pieces`): none once the
    model's overlapping windows pool alone (`pool_alone`, installed here), else all of them."""
    return () if pool_alone(model) else overlap_windows(model)


@contextmanager
def decoding():
    """The forwards inside stand for decoding their places one at a time: windows pooled alone (`pool_alone`)."""
    _DECODING[0] = True
    try:
        yield
    finally:
        _DECODING[0] = False


def verify_width(num_draft_tokens: int, block: int, windows: tuple[int, ...]) -> int:
    """How many drafts a verify feeds a step: what was asked (the stages' whole block when 0), at most the
    block, and fewer than the smallest of `windows` (the overlapping ones a verify must not complete two of:
    none where each pools alone, `pool_alone`), so that a verify is one forward (fed in `pieces`, a verify of
    6 places on ratio-4 windows took two forwards about every second step, for two drafts that rarely both
    landed)."""
    width = min(num_draft_tokens or block, block)
    return min(width, min(windows) - 1) if windows else width


def pieces(offset: int, length: int, windows: tuple[int, ...]) -> list[int]:
    """The lengths in which to feed `length` positions from position `offset` so that each forward completes
    at most one window of each size in `windows`: then each is what decoding its positions one at a time
    gives (a window completes at position p when p + 1 is a multiple of its size)."""
    out, start, end = [], offset, offset + length
    while start < end:
        stop = end
        for w in windows:
            first = -(-(start + 1) // w) * w - 1  # the first completion at or after `start`
            stop = min(stop, first + w)  # the next one starts the next piece
        out.append(stop - start)
        start = stop
    return out


def prompt_piece(at: int, length: int, said: int, chunk: int, windows: tuple[int, ...],
                 stops: tuple[int, ...] = ()) -> int:
    """How many positions from `at` of a prompt of `length` tokens its next forward feeds (never its last,
    left for the step that samples): `chunk` at a time, as the plain decoder prefills, up to a resumed
    answer's tokens (the `said` its prompt ends with) and the token before them; those, which decoding fed one
    at a time, in the next of `pieces`, at most `chunk`, so that the caches hold what that decoding's held.
    A forward also ends at each of `stops` (where the prompt's caches take checkpoints)."""
    last, answer = length - 1, length - 1 - said
    n = min(chunk, answer - at) if at < answer else min(chunk, pieces(at, last - at, windows)[0])
    return min(n, next((s - at for s in stops if s > at), n))
