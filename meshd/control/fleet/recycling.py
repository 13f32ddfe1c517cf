"""When a serving generation is due its planned recycle ([recycle]): its age, rank 0's step
count, the daily window, and whether it is idle enough to end now. Pure; time is an argument."""

from __future__ import annotations

from datetime import datetime, timedelta

from common.states import Phase
from meshd.config import Recycle
from meshd.control.fleet.model import FleetState


def window_opened(recycle: Recycle, now: float) -> float | None:
    """When the daily window that `now` is inside opened (local time), or None outside it."""
    start, end = recycle.minutes
    t = datetime.fromtimestamp(now)
    minute = t.hour * 60 + t.minute
    inside = start <= minute < end if start < end else (minute >= start or minute < end)
    if not inside:
        return None
    day = t.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=minute < start)
    return (day + timedelta(minutes=start)).timestamp()


def worn(state: FleetState, now: float, recycle: Recycle) -> tuple[str, str] | None:
    """(trigger, what it saw) when the serving generation is due a recycle, idle or not: it has served
    `after` seconds, or its rank 0 made `steps` steps, or it is inside the daily window and was ready
    before the window opened; else None."""
    if not recycle.enabled or state.phase != Phase.READY or state.ready_since is None:
        return None
    age = now - state.ready_since
    if recycle.after and age >= recycle.after:
        return "age", f"generation {state.generation} served {age:.0f}s (recycle.after {recycle.after:g}s)"
    if recycle.steps and state.steps >= recycle.steps:
        return "steps", (f"generation {state.generation}'s rank 0 made {state.steps} steps (recycle.steps "
                         f"{recycle.steps})")
    opened = window_opened(recycle, now) if recycle.window else None
    if opened is not None and state.ready_since < opened:
        return "window", f"generation {state.generation} in the daily window {recycle.window}"
    return None


def recycle_due(state: FleetState, now: float, recycle: Recycle) -> tuple[str, str] | None:
    """(trigger, what it saw) when the serving generation is to be recycled now, else None: it is due
    (`worn`) and no rank has been busy for `idle_for` seconds, or it has waited `idle_deadline` seconds
    since it was due (`state.due_since`) for that and recycles under load."""
    due = worn(state, now, recycle)
    if due is None:
        return None
    trigger, seen = due
    if state.idle_since is not None and now - state.idle_since >= recycle.idle_for:
        return trigger, f"{seen}, no request in flight for {now - state.idle_since:.0f}s"
    if recycle.idle_deadline and state.due_since is not None and now - state.due_since >= recycle.idle_deadline:
        return trigger, (f"{seen}, busy {now - state.due_since:.0f}s since it was due (recycle.idle_deadline "
                         f"{recycle.idle_deadline:g}s)")
    return None
