"""What the data plane and the agents observe, and what it means to the fleet,
as pure functions. An agent event (decoded at the controller's edge) becomes a
rank's progress, death evidence, or nothing; each piece of death evidence says
whether the rank failed by itself or only lost a peer (a consequence), and
whether any restart could fix it (deterministic: a launch the agent refuses, a
probe answered 4xx) or it died before serving saying something (the same line
twice in a row is deterministic too, judged by the fleet).
"""

from __future__ import annotations

from common.protocol import Event, RankExited, RankSignature, RankStalled, RankStateChanged, RebootRequired
from common.states import RankState, Role, Severity
from meshd.control import fleet
from meshd.control.fleet import Cause
from meshd.seam import Observation, Source
from meshd.upstream import COMPLETION, ReadinessSeen

BEFORE_SERVING = (RankState.SPAWNED, RankState.LOADING, RankState.ARMED)


def meaning_of(ev: Event) -> fleet.RankDied | fleet.RankReported | None:
    """What an agent event means to the fleet: a rank's progress, death evidence, or nothing."""
    where = (ev.node, ev.rank, ev.generation)
    match ev:
        case RankStateChanged(state=state, load_done=done, load_total=total):
            return fleet.RankReported(ev.node, ev.generation, state, done, total, ev.at)
        case RankExited(expected=False, signal=sig, code=code, state=state, last_line=last, peer_lost=lost,
                        alive_at=alive_at):
            how = f"signal {sig}" if sig else (f"exit code {code}" if code is not None else
                                               "gone (not the agent's child)")
            at_load = state in BEFORE_SERVING and code not in (None, 0) and not lost
            # A rank died after its last heartbeat, however late its agent saw the exit (a slow reap).
            return fleet.RankDied(*where, Cause.EXIT, f"{how}: {last}" if last and code else how, consequence=lost,
                                  load_line=last if at_load else "", at=min(ev.at, alive_at or ev.at))
        case RankSignature(signature=name, severity=severity, role=role, line=line):
            return fleet.RankDied(*where, Cause.SIGNATURE, f"{name}: {line[-200:]}",
                                  reboot=severity == Severity.REBOOT, consequence=role == Role.CONSEQUENCE, at=ev.at)
        case RankStalled(idle_for=idle, window=window, phase=phase, frozen=frozen):
            # A stall happened when the rank stopped moving, not when its window ran out: a frozen rank's
            # window (a longer prompt's) can run out after those of the peers that only wait for it.
            return fleet.RankDied(*where, Cause.STALL, f"no progress for {idle:.1f}s (window {window:.1f}s) while "
                                                       f"{phase}" + ("" if frozen else ", its heartbeat alive"),
                                  consequence=not frozen, at=ev.at - idle)
        case RebootRequired(reason=reason):
            return fleet.RankDied(*where, Cause.REBOOT_REQUIRED, reason, reboot=True, at=ev.at)
    return None


def refused_for_good(status: int | None) -> bool:
    """A 4xx answer: the request is wrong, and will be whenever it is made again."""
    return status is not None and 400 <= status < 500


def launch_refused(node: str, rank: int, generation: int, status: int | None, message: str) -> fleet.RankDied:
    """An agent that would not start its rank: a 4xx other than 409 (another generation still
    running there) is a spec it will never run."""
    deterministic = refused_for_good(status) and status != 409
    return fleet.RankDied(node, rank, generation, Cause.LAUNCH, message, deterministic=deterministic)


def observed(obs: Observation, rank0_node: str) -> fleet.RankDied | fleet.RequestServed | fleet.RequestMigrated:
    """What the proxy saw: a request served, or evidence against rank 0. Such evidence is a symptom
    (a cut stream, a silent rank 0), so a rank that failed by itself takes the incident over. A probe
    answered 4xx is a request the runtime will always refuse (a model name it does not serve, say):
    deterministic."""
    if obs.source == Source.SERVED:
        return fleet.RequestServed(obs.generation)
    if obs.source == Source.MIGRATED:
        return fleet.RequestMigrated(obs.generation)
    deterministic = obs.source == Source.PROBE and refused_for_good(obs.status)
    return fleet.RankDied(rank0_node, 0, obs.generation, Cause(obs.source), obs.detail, consequence=True,
                          deterministic=deterministic)


def readiness(seen: ReadinessSeen, rank0_node: str, generation: int) -> tuple[bool, fleet.RankDied | None]:
    """Does rank 0 serve, and is what it answered evidence against it? A readiness route that refuses this
    generation's secret, or an error from a server that is up (a 4xx: deterministic)."""
    if seen.secret_refused:
        return False, fleet.RankDied(rank0_node, 0, generation, Cause.READINESS,
                                     f"{seen.url} refused this generation's rank secret: another generation's "
                                     "rank 0 (or another program) holds runtime.port")
    if seen.route != COMPLETION or seen.status is None:
        return seen.status == 200, None
    if seen.status == 200 and '"choices"' in seen.body:
        return True, None
    return False, fleet.RankDied(rank0_node, 0, generation, Cause.READINESS,
                                 f"a one-token completion answered {seen.status}: {seen.body[:200]}",
                                 deterministic=refused_for_good(seen.status))
