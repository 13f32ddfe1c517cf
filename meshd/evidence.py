"""What the agents' observations mean to the fleet, as pure functions: an
agent event (already decoded at the controller's edge) becomes a rank's
progress, death evidence, or nothing."""

from __future__ import annotations

from common.protocol import Event, RankExited, RankSignature, RankStalled, RankStateChanged, RebootRequired
from meshd import fleet


def meaning_of(ev: Event) -> fleet.RankDied | fleet.RankReported | None:
    """What an agent event means to the fleet: a rank's progress, death evidence, or nothing."""
    where = (ev.node, ev.rank, ev.generation)
    match ev:
        case RankStateChanged(state=state, load_done=done, load_total=total):
            return fleet.RankReported(ev.node, ev.generation, state, done, total)
        case RankExited(expected=False, signal=sig, code=code):
            how = f"signal {sig}" if sig else (f"exit code {code}" if code is not None else
                                               "gone (not the agent's child)")
            return fleet.RankDied(*where, "exit", how)
        case RankSignature(signature=name, severity=severity, line=line):
            return fleet.RankDied(*where, "signature", f"{name}: {line[-200:]}", reboot=severity == "reboot")
        case RankStalled(idle_for=idle, window=window, phase=phase):
            return fleet.RankDied(*where, "stall", f"no progress for {idle:.1f}s (window {window:.1f}s) "
                                                   f"while {phase}")
        case RebootRequired(reason=reason):
            return fleet.RankDied(*where, "reboot_required", reason, reboot=True)
    return None
