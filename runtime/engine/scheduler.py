"""The scheduler's decisions, pure: each step of the batch, whose prompts go in apart from it (which prompts a piece
goes in, which join, how wide the verify drafts, whether the next step is queued before this one is read back), when
the tapes restored behind serving join the token tape, and how long idle ranks doze before their next exchange. The
engine and the rank loop ask here and carry out the answer, so each is decided once; every rank asks with the same
facts at the same step (the lockstep loop's), so every rank decides alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """A request of a batch as the scheduler sees it at a step boundary."""

    rid: str
    left: int = 1  # its prompt not yet through the target; 1: its last token, its first pending one
    piece: int = 0  # how much of that prompt its next prefill feeds (the executor's pools.prompt_piece)
    width: int = 0  # the drafts it has for this step (0: none yet, or it is decoded plainly)
    at: int = 0  # how much of its prompt its caches hold (a prompt going in)


@dataclass(frozen=True)
class Plan:
    """One step of a batch whose prompts go in apart from it, in their own caches, and join it at their last
    token."""

    prefill: tuple[str, ...] = ()  # the prompts a piece of each goes in, in one forward: the first that came,
    # while more than its last token is left, and every other prompt at its place with a piece as long
    join: tuple[str, ...] = ()  # the prompts that join the batch, first come first: each once its last token is
    # all that is left, while the batch has room
    width: int = 0  # the drafts a row the step's verify feeds: the most any row has
    verify: bool = False  # the batch takes a step: it has rows


def plan(joining: Sequence[Row], rows: Sequence[Row], room: int) -> Plan:
    """A batch's step: a piece of the first prompt going in (first come first; the others wait behind it), and
    of every other at the same place whose piece is as long, all in one forward (rows of one shape: no pads;
    unless `room` is one row: a model served one request at a time never has its caches merged);
    the prompts join the batch in the step their last piece goes in, first come first, and verify in it, while
    the batch has fewer than `room` rows (else they wait, their prompts in, for a row to end); every row
    verifies as wide as the row with the most drafts (a row with fewer fills the rest with guesses, never kept;
    no drafts at all, as in a lone row's first step, one place a row)."""
    first = joining[0] if joining else None
    prefill = [r for r in joining if r.left > 1 and (r.at, r.piece) == (first.at, first.piece)
               and (r is first or room > 1)] if first is not None and first.left > 1 else []
    join: list[Row] = []
    for r in joining:
        if r.left - (r.piece if r in prefill else 0) != 1 or len(rows) + len(join) >= room:
            break
        join.append(r)
    batch = [*rows, *join]
    return Plan(tuple(r.rid for r in prefill), tuple(r.rid for r in join), max((r.width for r in batch), default=0),
                bool(batch))


def ahead(joining: int, plain: Sequence[bool]) -> bool:
    """Whether a batch's next step can be queued on the device before this one is read back, as mlx-lm's
    generate_step queues the next token: the batch has rows, each `plain` (it drafts nothing: its next step
    feeds one token, whatever this one sampled), and no prompt is `joining` (the batch stays as it is)."""
    return bool(plain) and not joining and all(plain)


def adopt_restored(warm: bool, draining: bool, busy: bool, awaited: bool) -> bool:
    """Whether the tapes restored behind serving join the token tape at this step: once the warm-up finished
    (ready comes first), while nothing is decoding (building a cache stalls the step) unless a request waits
    for one of them (`awaited`), never while draining."""
    return warm and not draining and (not busy or awaited)


def doze_before(idle_for: float, idle_interval: float, behind: bool, awaited: bool) -> float:
    """How long the ranks doze before their next exchange while they have nothing to step, having been idle for
    `idle_for` seconds: a fourth of that (10 ms at least, so a burst of requests stays snappy), `idle_interval`
    at most; at most 50 ms while work goes on `behind` serving (restores, grammar compiles), which every
    exchange moves on; none while a request waits for a restore whose tape is read and being built (`awaited`):
    every exchange builds a part of it, and a doze between parts is time the request waits for nothing (while
    the tape is still being read, the doze leaves the reading thread the interpreter)."""
    if awaited:
        return 0.0
    return min(idle_interval, max(0.01, idle_for / 4), 0.05 if behind else 1.0)
