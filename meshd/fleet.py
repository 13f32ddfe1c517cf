"""The fleet: a pure state machine, `step(state, event, now) -> (state, actions)`.

It never awaits, never reads the clock (time is an argument) and holds no live
objects; backoff and failure history live in the state. The reconciler feeds
it events and carries out its actions.

Phases (one generation G at a time):

    stopped --Up--> starting(G+1) --MeshReady(G)--> ready(G)
    starting(G) | ready(G) --death evidence for G--> recovering(G)
        recovering --GenerationStopped(G)--> (wait out the backoff) --> starting(G+1)
        recovering --too many failures in the window--> failed   (serves 503)
    any --Down--> draining --GenerationStopped--> stopped
    failed --Up--> starting(G+1)

Death evidence: an unexpected exit of any code, a fatal or reboot signature, a
stall, a failed launch, a failed probe, an agent that is gone. One rank dying
ends the generation on every node; recovery starts the next one.

The recovery ladder (configured, in order, each step taken only when the one
before did not hold): `restart` -> `reprovision` (then restart) -> `reboot`
(then re-provision and restart) -> failed. Reboot-severity evidence jumps to
the reboot step when the ladder has one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

STOPPED, PROVISIONING, STARTING, READY, RECOVERING, DRAINING, FAILED = (
    "stopped", "provisioning", "starting", "ready", "recovering", "draining", "failed")
PHASES = (STOPPED, PROVISIONING, STARTING, READY, RECOVERING, DRAINING, FAILED)


@dataclass(frozen=True)
class Recovery:
    """The recovery knobs ([recovery] in mesh.toml)."""

    ladder: tuple[str, ...] = ("restart",)
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    max_failures: int = 5
    window: float = 600.0
    healthy_reset: float = 300.0
    stop_grace: float = 10.0
    drain_grace: float = 30.0
    start_deadline: float = 900.0


@dataclass(frozen=True)
class Policy(Recovery):
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Incident:
    opened_at: float
    cause: str
    node: str
    rank: int
    generation: int
    detail: str
    steps: tuple[str, ...] = ()


@dataclass(frozen=True)
class FleetState:
    phase: str = STOPPED
    generation: int = 0
    failures: tuple[float, ...] = ()  # times of failures still inside the window
    ladder_step: int = 0  # index into policy.ladder for the next recovery
    backoff_until: float | None = None
    ready_since: float | None = None
    started_at: float | None = None
    incident: Incident | None = None
    reason: str = ""  # why failed / what is pending
    reboot_nodes: tuple[str, ...] = ()
    ranks: tuple = ()  # ((node, state, load_done, load_total), ...) of the current generation

    def rank_state(self, node: str) -> tuple | None:
        return next((r for r in self.ranks if r[0] == node), None)


# --- events (past tense) -------------------------------------------------------
@dataclass(frozen=True)
class UpRequested:
    pass


@dataclass(frozen=True)
class DownRequested:
    force: bool = False


@dataclass(frozen=True)
class RestartRequested:
    pass


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class MeshReady:
    generation: int


@dataclass(frozen=True)
class RankReported:
    """A rank's own state, as its agent reported it."""
    node: str
    generation: int
    state: str
    load_done: int = 0
    load_total: int = 0


@dataclass(frozen=True)
class RankDied:
    """Death evidence about one rank: cause is exit, signature, stall, launch, probe, agent."""
    node: str
    rank: int
    generation: int
    cause: str
    detail: str = ""
    reboot: bool = False


@dataclass(frozen=True)
class GenerationStopped:
    generation: int
    survivors: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepDone:
    """A ladder step other than restart (reprovision, reboot) finished."""
    step: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Adopted:
    """A restarted controller found generation G running on every node."""
    generation: int
    ready: bool


# --- actions (imperative) -----------------------------------------------------
@dataclass(frozen=True)
class StartGeneration:
    generation: int


@dataclass(frozen=True)
class StopGeneration:
    generation: int
    mode: str  # drain | kill
    grace: float


@dataclass(frozen=True)
class RunStep:
    step: str  # reprovision | reboot
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpenIncident:
    incident: Incident


@dataclass(frozen=True)
class IncidentUpdated:
    incident: Incident


@dataclass(frozen=True)
class CloseIncident:
    incident: Incident
    serving_back_at: float
    steps: tuple[str, ...]


@dataclass(frozen=True)
class NoteGeneration:
    generation: int
    what: str  # started | ready | ended
    detail: str = ""


def backoff(policy: Policy, failures: int) -> float:
    """No wait for the first failure in the window, then base * 2^(n-2), capped."""
    if failures <= 1:
        return 0.0
    return min(policy.backoff_max, policy.backoff_base * 2 ** (failures - 2))


def _start_next(state: FleetState, now: float, policy: Policy) -> tuple[FleetState, list]:
    g = state.generation + 1
    ranks = tuple((n, "starting", 0, 0) for n in policy.nodes)
    new = replace(state, phase=STARTING, generation=g, backoff_until=None, started_at=now, ranks=ranks,
                  reason="")
    return new, [StartGeneration(g), NoteGeneration(g, "started")]


def _fail(state: FleetState, now: float, policy: Policy, ev: RankDied) -> tuple[FleetState, list]:
    """Death evidence for the current generation: end it everywhere."""
    failures = tuple(t for t in state.failures if now - t < policy.window) + (now,)
    incident = state.incident or Incident(now, ev.cause, ev.node, ev.rank, ev.generation, ev.detail)
    actions: list = [] if state.incident else [OpenIncident(incident)]
    ladder_step = state.ladder_step
    reboot_nodes = state.reboot_nodes
    if ev.reboot and "reboot" in policy.ladder:
        ladder_step = max(ladder_step, policy.ladder.index("reboot"))
        reboot_nodes = tuple(sorted(set(reboot_nodes) | {ev.node}))
    new = replace(state, phase=RECOVERING, failures=failures, ready_since=None, incident=incident,
                  ladder_step=ladder_step, reboot_nodes=reboot_nodes,
                  reason=f"{ev.cause} on {ev.node} rank {ev.rank}: {ev.detail}".strip(": "))
    actions += [StopGeneration(ev.generation, "kill", policy.stop_grace),
                NoteGeneration(ev.generation, "ended", new.reason)]
    return new, actions


def _with_step(state: FleetState, name: str) -> tuple[FleetState, list]:
    """Record a ladder step on the open incident."""
    if state.incident is None:
        return state, []
    incident = replace(state.incident, steps=state.incident.steps + (name,))
    return replace(state, incident=incident), [IncidentUpdated(incident)]


def _after_stop(state: FleetState, now: float, policy: Policy) -> tuple[FleetState, list]:
    """The dead generation is gone everywhere: climb the ladder or give up."""
    if len(state.failures) > policy.max_failures:
        reason = (f"{len(state.failures)} failures within {policy.window:.0f}s (limit {policy.max_failures}); "
                  f"last: {state.reason}. Fix the cause, then `meshctl up`")
        state, actions = _with_step(state, "failed")
        return replace(state, phase=FAILED, reason=reason, backoff_until=None), actions
    step = policy.ladder[min(state.ladder_step, len(policy.ladder) - 1)]
    state, actions = _with_step(state, step)
    if step == "restart" or state.ladder_step >= len(policy.ladder):
        wait = backoff(policy, len(state.failures))
        return replace(state, backoff_until=now + wait, ladder_step=state.ladder_step + 1), actions
    nodes = state.reboot_nodes if step == "reboot" and state.reboot_nodes else policy.nodes
    return replace(state, backoff_until=None), actions + [RunStep(step, nodes)]


def step(state: FleetState, event, now: float, policy: Policy) -> tuple[FleetState, list]:
    """One transition. Unknown or stale events leave the state as it is."""
    match event:
        case UpRequested():
            if state.phase in (STOPPED, FAILED):
                cleared = replace(state, failures=(), ladder_step=0, reboot_nodes=(), incident=None)
                return _start_next(cleared, now, policy)
            return state, []

        case DownRequested(force=force):
            if state.phase in (STOPPED,):
                return state, []
            if state.phase == FAILED:
                return replace(state, phase=STOPPED, reason=""), [StopGeneration(state.generation, "kill", 0.0)]
            mode, grace = ("kill", policy.stop_grace) if force else ("drain", policy.drain_grace)
            return (replace(state, phase=DRAINING, ready_since=None, backoff_until=None),
                    [StopGeneration(state.generation, mode, grace)])

        case RestartRequested():
            if state.phase not in (READY, STARTING):
                return state, []
            return (replace(state, phase=RECOVERING, ready_since=None, backoff_until=None, reason="restart requested"),
                    [StopGeneration(state.generation, "drain", policy.drain_grace),
                     NoteGeneration(state.generation, "ended", "restart requested")])

        case Adopted(generation=g, ready=ready):
            if state.phase in (STOPPED, STARTING, RECOVERING, READY) and g >= state.generation:
                ranks = tuple((n, "ready" if ready else "loading", 0, 0) for n in policy.nodes)
                phase = READY if ready else STARTING
                new = replace(state, phase=phase, generation=g, ready_since=now if ready else None,
                              started_at=state.started_at or now, ranks=ranks, backoff_until=None)
                if ready and state.incident:  # an incident a restarted controller inherited
                    return replace(new, incident=None), [CloseIncident(state.incident, now, state.incident.steps)]
                return new, []
            return state, []

        case MeshReady(generation=g):
            if state.phase != STARTING or g != state.generation:
                return state, []
            ranks = tuple((n, "ready", d, t) for n, _, d, t in state.ranks)
            new = replace(state, phase=READY, ready_since=now, ranks=ranks, reason="")
            actions: list = [NoteGeneration(g, "ready")]
            if state.incident:
                actions.append(CloseIncident(state.incident, now, state.incident.steps))
                new = replace(new, incident=None)
            return new, actions

        case RankReported(node=node, generation=g, state=rstate, load_done=d, load_total=t):
            if g != state.generation or state.phase not in (STARTING, READY):
                return state, []
            ranks = tuple((n, rstate, d, t) if n == node else r for r in state.ranks for n in [r[0]])
            return replace(state, ranks=ranks), []

        case RankDied(generation=g) as ev:
            if g != state.generation or state.phase not in (STARTING, READY):
                if ev.reboot and "reboot" in policy.ladder and state.phase == RECOVERING:
                    return replace(state, reboot_nodes=tuple(sorted(set(state.reboot_nodes) | {ev.node})),
                                   ladder_step=max(state.ladder_step, policy.ladder.index("reboot"))), []
                return state, []
            return _fail(state, now, policy, ev)

        case GenerationStopped(generation=g, survivors=survivors):
            if g != state.generation:
                return state, []
            if state.phase == DRAINING:
                return replace(state, phase=STOPPED, ranks=(), reason=""), [NoteGeneration(g, "ended", "down")]
            if state.phase == RECOVERING:
                if survivors and "reboot" in policy.ladder:
                    state = replace(state, ladder_step=max(state.ladder_step, policy.ladder.index("reboot")),
                                    reboot_nodes=tuple(sorted(set(state.reboot_nodes) | set(survivors))))
                if state.reason == "restart requested":
                    return _start_next(state, now, policy)
                return _after_stop(state, now, policy)
            return state, []

        case StepDone(step=name, ok=ok, detail=detail):
            if state.phase != RECOVERING:
                return state, []
            if not ok:
                failed = replace(state, ladder_step=state.ladder_step + 1,
                                 reason=f"{name} failed: {detail}")
                if failed.ladder_step >= len(policy.ladder):
                    failed, actions = _with_step(failed, "failed")
                    return replace(failed, phase=FAILED,
                                   reason=f"recovery ladder exhausted; {name} failed: {detail}. "
                                          "Fix the nodes, then `meshctl up`"), actions
                return _after_stop(failed, now, policy)
            nxt = replace(state, ladder_step=state.ladder_step + 1, reboot_nodes=() if name == "reboot" else
                          state.reboot_nodes)
            if name == "reboot" and "reprovision" in policy.ladder:
                nxt, actions = _with_step(nxt, "reprovision")
                return nxt, actions + [RunStep("reprovision", policy.nodes)]
            return _start_next(nxt, now, policy)

        case Tick():
            if state.phase == RECOVERING and state.backoff_until is not None and now >= state.backoff_until:
                return _start_next(state, now, policy)
            if state.phase == READY and state.ready_since is not None and state.failures \
                    and now - state.ready_since >= policy.healthy_reset:
                return replace(state, failures=(), ladder_step=0, reboot_nodes=()), []
            if state.phase == STARTING and state.started_at is not None \
                    and now - state.started_at > policy.start_deadline:
                return _fail(state, now, policy, RankDied("-", -1, state.generation, "start_timeout",
                                                          f"not ready after {policy.start_deadline:.0f}s"))
            return state, []
    return state, []
