"""When is a rank stalled? A pure verdict over its status file.

`progress_at` moves on every load step, prefill chunk, decode step and idle
liveness exchange. A rank whose peer is stopped or wedged stops moving it
while its heartbeat keeps writing; a stopped rank stops both. The window a
rank gets depends on what it is doing: loading has its own long deadline, the
warm-up generation of an armed rank (the first steps on a GPU compile their
kernels) its own, and a request in prefill gets more time the longer its
prompt, so neither a cold load nor a 100k-token prefill is ever called a hang.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.states import RankState
from common.statusfile import RankStatus


@dataclass(frozen=True)
class StallWindows:
    base: float = 30.0  # seconds without progress while ready or decoding
    min_prefill_rate: float = 50.0  # prompt tokens per second the slowest prefill still reaches
    load_deadline: float = 1800.0  # seconds without a load step
    warmup: float = 300.0  # seconds the armed rank's warm-up generation may take (it compiles kernels)
    start_deadline: float = 120.0  # seconds from spawn to a first status file


# The heartbeat thread rewrites the status file every 0.5 s even while the
# loop is blocked; a file this old means the whole process is stopped. With a
# short window the stall is judged when the heartbeat is barely older than
# that, so half the time without progress is enough there: a stopped process's
# heartbeat is about as old as its last progress, a live one's under a second.
FROZEN_AFTER = 3.0


@dataclass(frozen=True)
class Stall:
    phase: str
    idle_for: float
    window: float
    frozen: bool = False  # the heartbeat stopped too: the process itself is stopped or wedged


def window_for(status: RankStatus, w: StallWindows) -> float:
    if status.state == RankState.LOADING:
        return w.load_deadline
    if status.state == RankState.ARMED:
        return w.warmup
    return w.base + status.prompt_tokens_in_flight / w.min_prefill_rate


def stall_verdict(status: RankStatus | None, now: float, spawned_at: float, w: StallWindows) -> Stall | None:
    if status is None:
        waited = now - spawned_at
        return Stall("starting", waited, w.start_deadline) if waited > w.start_deadline else None
    if status.state == RankState.EXITED:
        return None
    window = window_for(status, w)
    idle_for = now - status.progress_at
    if idle_for <= window:
        return None
    frozen = now - status.updated_at > min(FROZEN_AFTER, idle_for / 2)
    return Stall(status.state, idle_for, window, frozen)


# A serving rank moves `progress_at` at least every idle interval (0.5 s) and
# its heartbeat writes it at least every 0.5 s: older than this, it is not
# running its loop.
BLOCKED_AFTER = 1.5


def blocked_on_peer(status: RankStatus | None, peer_lost: bool, now: float) -> bool:
    """Is this rank stuck in a collective with a dead peer? Such a rank runs no
    Python signal handler, so SIGTERM only waits out the grace: stop it at once."""
    if peer_lost:
        return True
    if not status or status.state not in (RankState.READY, RankState.BUSY, RankState.DRAINING):
        return False
    return now - status.progress_at > BLOCKED_AFTER
