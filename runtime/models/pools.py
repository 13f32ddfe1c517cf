"""Pooled windows, whatever the model: the compressors whose pooled row overlaps the window before it (omlx's
DeepSeek-V4 at ratio 4) make a forward's result depend on where it starts and how many windows it completes,
so forwards are cut into the pieces that decoding one position at a time would give. Pure arithmetic over
positions, but for reading the windows off a model."""

from __future__ import annotations


def attention(layer):
    """A layer's attention (None for a layer without: a recurrent one)."""
    return getattr(layer, "self_attn", None) or getattr(layer, "attn", None)


def overlap_windows(model) -> tuple[int, ...]:
    """The window sizes of the model's compressors whose pooled row overlaps the window before it (omlx's
    DeepSeek-V4 at ratio 4, in its attention and its indexer). omlx overlaps only windows that arrive in one
    forward: the first window of a forward pools alone, as every window of a one-position decode does."""
    sizes = set()
    for layer in model.layers:
        attn = attention(layer)
        for compressor in (getattr(attn, "compressor", None), getattr(getattr(attn, "indexer", None), "compressor", None)):
            if getattr(compressor, "overlap", False):
                sizes.add(int(compressor.compress_ratio))
    return tuple(sorted(sizes))


def verify_width(num_draft_tokens: int, block: int, windows: tuple[int, ...]) -> int:
    """How many drafts a verify feeds a step: what was asked (the stages' whole block when 0), at most the
    block, and fewer than the smallest overlapping window, so that a verify completes at most one of each and
    is one forward (a verify of 6 places on ratio-4 windows completes two about half the time: two pieces,
    two forwards, for two drafts that rarely both land; a lone request 1.21x as fast at 3 as at 5,
    bench/scheduler.py in docs/BENCHMARKS.md)."""
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
