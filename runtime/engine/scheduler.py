"""The scheduler's decisions, pure: which requests start alone and which batched, when one running alone hands
over to the batch, and when the tapes restored behind serving join the token tape. Every engine and the rank
loop ask here, so each is decided once; every rank asks with the same facts at the same step (the lockstep
loop's), so every rank decides alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """What the requests waiting at a step boundary do, in this order."""

    alone: bool = False  # the one waiting starts alone (the plain loop's speed, or drafted by a drafter)
    hand_over: bool = False  # the request running alone goes on in the batch, its place kept exactly
    join: int = 0  # how many of the waiting, first come first, join the batch


def admit(waiting: int, alone: bool, batched: bool) -> Admission:
    """A request alone runs alone while nothing else does; a second one ends that: the one alone hands over to
    the batch and every waiting request joins it. `alone`: a request runs alone; `batched`: the batch has rows."""
    if not waiting:
        return Admission()
    if waiting == 1 and not (alone or batched):
        return Admission(alone=True)
    return Admission(hand_over=alone, join=waiting)


def adopt_restored(warm: bool, draining: bool, busy: bool, awaited: bool) -> bool:
    """Whether the tapes restored behind serving join the token tape at this step: once the warm-up finished
    (ready comes first), while nothing is decoding (building a cache stalls the step) unless a request waits
    for one of them (`awaited`), never while draining."""
    return warm and not draining and (not busy or awaited)
