"""The fleet: a pure state machine, `step(state, event, now, policy) -> (state, actions)`.

It never awaits, never reads the clock (time is an argument) and holds no live
objects; backoff and failure history live in the state. The reconciler feeds
it events and carries out its actions. Each event kind has its own small
function (`_on_<event>`); the clock's rules are a chain tried in order.

Phases (common.states.Phase; one generation G at a time):

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

from common.states import Phase, RankState


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
class RankView:
    """One node's rank of the current generation, as its agent last reported it."""

    node: str
    state: RankState = RankState.SPAWNED
    load_done: int = 0
    load_total: int = 0


@dataclass(frozen=True)
class FleetState:
    phase: Phase = Phase.STOPPED
    generation: int = 0
    failures: tuple[float, ...] = ()  # times of failures still inside the window
    ladder_step: int = 0  # index into policy.ladder for the next recovery
    backoff_until: float | None = None
    ready_since: float | None = None
    started_at: float | None = None
    incident: Incident | None = None
    reason: str = ""  # why failed / what is pending
    reboot_nodes: tuple[str, ...] = ()
    restart_requested: bool = False  # the generation ends on purpose: start the next, count no failure
    ranks: tuple[RankView, ...] = ()


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
    state: RankState
    load_done: int = 0
    load_total: int = 0


@dataclass(frozen=True)
class RankDied:
    """Death evidence about one rank: cause is exit, signature, stall, launch, probe, proxy, agent."""
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


@dataclass(frozen=True)
class LeftoversFound:
    """A restarted controller found ranks that make no whole generation (the
    newest of them is `generation`): they must stop before anything starts, and
    their generation numbers are never reused. `up`: the operator's last word
    was up, so the next generation starts once they are gone."""
    generation: int
    up: bool


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


Result = tuple[FleetState, list]


def backoff(policy: Policy, failures: int) -> float:
    """No wait for the first failure in the window, then base * 2^(n-2), capped."""
    if failures <= 1:
        return 0.0
    return min(policy.backoff_max, policy.backoff_base * 2 ** (failures - 2))


def _start_next(state: FleetState, now: float, policy: Policy) -> Result:
    g = state.generation + 1
    new = replace(state, phase=Phase.STARTING, generation=g, backoff_until=None, started_at=now,
                  ranks=tuple(RankView(n) for n in policy.nodes), reason="", restart_requested=False)
    return new, [StartGeneration(g), NoteGeneration(g, "started")]


def _mark_reboot(state: FleetState, nodes, policy: Policy) -> FleetState:
    """These nodes need a reboot: the ladder jumps to its reboot step (when it has one)."""
    if not nodes or "reboot" not in policy.ladder:
        return state
    return replace(state, ladder_step=max(state.ladder_step, policy.ladder.index("reboot")),
                   reboot_nodes=tuple(sorted(set(state.reboot_nodes) | set(nodes))))


def _fail(state: FleetState, now: float, policy: Policy, ev: RankDied) -> Result:
    """Death evidence for the current generation: end it everywhere."""
    failures = tuple(t for t in state.failures if now - t < policy.window) + (now,)
    incident = state.incident or Incident(now, ev.cause, ev.node, ev.rank, ev.generation, ev.detail)
    actions: list = [] if state.incident else [OpenIncident(incident)]
    new = replace(state, phase=Phase.RECOVERING, failures=failures, ready_since=None, incident=incident,
                  reason=f"{ev.cause} on {ev.node} rank {ev.rank}: {ev.detail}".strip(": "))
    if ev.reboot:
        new = _mark_reboot(new, (ev.node,), policy)
    actions += [StopGeneration(ev.generation, "kill", policy.stop_grace),
                NoteGeneration(ev.generation, "ended", new.reason)]
    return new, actions


def _with_step(state: FleetState, name: str) -> Result:
    """Record a ladder step on the open incident."""
    if state.incident is None:
        return state, []
    incident = replace(state.incident, steps=state.incident.steps + (name,))
    return replace(state, incident=incident), [IncidentUpdated(incident)]


def _give_up(state: FleetState, reason: str) -> Result:
    state, actions = _with_step(state, "failed")
    return replace(state, phase=Phase.FAILED, reason=reason, backoff_until=None), actions


def _climb(state: FleetState, now: float, policy: Policy) -> Result:
    """The dead generation is gone everywhere: the next ladder step, or give up."""
    if len(state.failures) > policy.max_failures:
        return _give_up(state, f"{len(state.failures)} failures within {policy.window:.0f}s (limit "
                               f"{policy.max_failures}); last: {state.reason}. Fix the cause, then `meshctl up`")
    step = policy.ladder[min(state.ladder_step, len(policy.ladder) - 1)]
    state, actions = _with_step(state, step)
    if step == "restart" or state.ladder_step >= len(policy.ladder):
        wait = backoff(policy, len(state.failures))
        return replace(state, backoff_until=now + wait, ladder_step=state.ladder_step + 1), actions
    nodes = state.reboot_nodes if step == "reboot" and state.reboot_nodes else policy.nodes
    return replace(state, backoff_until=None), actions + [RunStep(step, nodes)]


def decide_adoption(views: dict[str, list[dict] | None], nodes: tuple[str, ...], *, desired_up: bool,
                    rank0_ready: bool):
    """What a restarted controller makes of the ranks its agents report (`views`:
    node -> that agent's rank records, None when it did not answer): the event
    to feed, or None.

    One generation with each node running exactly its own rank: adopt it.
    Nothing running: start when the operator's last word was up. Anything
    else is the leftovers of a broken generation."""
    live = {node: [r for r in views.get(node) or [] if r["state"] != "exited"] for node in nodes}
    gens = {r["generation"] for rs in live.values() for r in rs}
    whole = len(gens) == 1 and all(views.get(n) is not None and len(live[n]) == 1 and live[n][0]["rank"] == i
                                   for i, n in enumerate(nodes))
    if whole:
        return Adopted(gens.pop(), ready=rank0_ready)
    if gens:
        return LeftoversFound(max(gens), desired_up)
    return UpRequested() if desired_up else None


# --- one function per event ----------------------------------------------------
def _on_up(state: FleetState, ev: UpRequested, now: float, policy: Policy) -> Result:
    if state.phase not in (Phase.STOPPED, Phase.FAILED):
        return state, []
    return _start_next(replace(state, failures=(), ladder_step=0, reboot_nodes=(), incident=None), now, policy)


def _on_down(state: FleetState, ev: DownRequested, now: float, policy: Policy) -> Result:
    if state.phase == Phase.STOPPED:
        return state, []
    if state.phase == Phase.FAILED:
        return replace(state, phase=Phase.STOPPED, reason=""), [StopGeneration(state.generation, "kill", 0.0)]
    mode, grace = ("kill", policy.stop_grace) if ev.force else ("drain", policy.drain_grace)
    return (replace(state, phase=Phase.DRAINING, ready_since=None, backoff_until=None, restart_requested=False),
            [StopGeneration(state.generation, mode, grace)])


def _on_restart(state: FleetState, ev: RestartRequested, now: float, policy: Policy) -> Result:
    if state.phase not in (Phase.READY, Phase.STARTING):
        return state, []
    return (replace(state, phase=Phase.RECOVERING, ready_since=None, backoff_until=None, reason="restart requested",
                    restart_requested=True),
            [StopGeneration(state.generation, "drain", policy.drain_grace),
             NoteGeneration(state.generation, "ended", "restart requested")])


def _on_adopted(state: FleetState, ev: Adopted, now: float, policy: Policy) -> Result:
    if state.phase not in (Phase.STOPPED, Phase.STARTING, Phase.RECOVERING, Phase.READY) \
            or ev.generation < state.generation:
        return state, []
    rank_state = RankState.READY if ev.ready else RankState.LOADING
    new = replace(state, phase=Phase.READY if ev.ready else Phase.STARTING, generation=ev.generation,
                  ready_since=now if ev.ready else None, started_at=state.started_at or now,
                  ranks=tuple(RankView(n, rank_state) for n in policy.nodes), backoff_until=None)
    if ev.ready and state.incident:  # an incident a restarted controller inherited
        return replace(new, incident=None), [CloseIncident(state.incident, now, state.incident.steps)]
    return new, []


def _on_leftovers(state: FleetState, ev: LeftoversFound, now: float, policy: Policy) -> Result:
    if state.phase != Phase.STOPPED:
        return state, []
    g = max(state.generation, ev.generation)
    phase = Phase.RECOVERING if ev.up else Phase.DRAINING
    return (replace(state, phase=phase, generation=g, restart_requested=ev.up, reason="leftovers of a broken generation"),
            [StopGeneration(g, "kill", policy.stop_grace)])


def _on_mesh_ready(state: FleetState, ev: MeshReady, now: float, policy: Policy) -> Result:
    if state.phase != Phase.STARTING or ev.generation != state.generation:
        return state, []
    new = replace(state, phase=Phase.READY, ready_since=now, reason="",
                  ranks=tuple(replace(r, state=RankState.READY) for r in state.ranks))
    actions: list = [NoteGeneration(ev.generation, "ready")]
    if state.incident:
        actions.append(CloseIncident(state.incident, now, state.incident.steps))
        new = replace(new, incident=None)
    return new, actions


def _on_rank_reported(state: FleetState, ev: RankReported, now: float, policy: Policy) -> Result:
    if ev.generation != state.generation or state.phase not in (Phase.STARTING, Phase.READY):
        return state, []
    view = RankView(ev.node, ev.state, ev.load_done, ev.load_total)
    return replace(state, ranks=tuple(view if r.node == ev.node else r for r in state.ranks)), []


def _on_rank_died(state: FleetState, ev: RankDied, now: float, policy: Policy) -> Result:
    if ev.generation == state.generation and state.phase in (Phase.STARTING, Phase.READY):
        return _fail(state, now, policy, ev)
    if ev.reboot and state.phase == Phase.RECOVERING:
        return _mark_reboot(state, (ev.node,), policy), []
    return state, []


def _on_generation_stopped(state: FleetState, ev: GenerationStopped, now: float, policy: Policy) -> Result:
    if ev.generation != state.generation:
        return state, []
    if state.phase == Phase.DRAINING:
        return replace(state, phase=Phase.STOPPED, ranks=(), reason=""), [NoteGeneration(ev.generation, "ended", "down")]
    if state.phase != Phase.RECOVERING:
        return state, []
    state = _mark_reboot(state, ev.survivors, policy)
    if state.restart_requested:
        return _start_next(state, now, policy)
    return _climb(state, now, policy)


def _on_step_done(state: FleetState, ev: StepDone, now: float, policy: Policy) -> Result:
    if state.phase != Phase.RECOVERING:
        return state, []
    if not ev.ok:
        failed = replace(state, ladder_step=state.ladder_step + 1, reason=f"{ev.step} failed: {ev.detail}")
        if failed.ladder_step >= len(policy.ladder):
            return _give_up(failed, f"recovery ladder exhausted; {ev.step} failed: {ev.detail}. "
                                    "Fix the nodes, then `meshctl up`")
        return _climb(failed, now, policy)
    nxt = replace(state, ladder_step=state.ladder_step + 1,
                  reboot_nodes=() if ev.step == "reboot" else state.reboot_nodes)
    if ev.step == "reboot" and "reprovision" in policy.ladder:
        nxt, actions = _with_step(nxt, "reprovision")
        return nxt, actions + [RunStep("reprovision", policy.nodes)]
    return _start_next(nxt, now, policy)


# --- the clock's rules, tried in order; each returns a result or None ------------
def _backoff_over(state: FleetState, now: float, policy: Policy) -> Result | None:
    if state.phase == Phase.RECOVERING and state.backoff_until is not None and now >= state.backoff_until:
        return _start_next(state, now, policy)
    return None


def _healthy_long_enough(state: FleetState, now: float, policy: Policy) -> Result | None:
    if state.phase == Phase.READY and state.ready_since is not None and state.failures \
            and now - state.ready_since >= policy.healthy_reset:
        return replace(state, failures=(), ladder_step=0, reboot_nodes=()), []
    return None


def _start_overdue(state: FleetState, now: float, policy: Policy) -> Result | None:
    if state.phase == Phase.STARTING and state.started_at is not None \
            and now - state.started_at > policy.start_deadline:
        return _fail(state, now, policy, RankDied("-", -1, state.generation, "start_timeout",
                                                  f"not ready after {policy.start_deadline:.0f}s"))
    return None


TICK_RULES = (_backoff_over, _healthy_long_enough, _start_overdue)


def _on_tick(state: FleetState, ev: Tick, now: float, policy: Policy) -> Result:
    for rule in TICK_RULES:
        result = rule(state, now, policy)
        if result is not None:
            return result
    return state, []


HANDLERS = {UpRequested: _on_up, DownRequested: _on_down, RestartRequested: _on_restart, Adopted: _on_adopted,
            LeftoversFound: _on_leftovers, MeshReady: _on_mesh_ready, RankReported: _on_rank_reported,
            RankDied: _on_rank_died, GenerationStopped: _on_generation_stopped, StepDone: _on_step_done,
            Tick: _on_tick}


def step(state: FleetState, event, now: float, policy: Policy) -> Result:
    """One transition. Unknown or stale events leave the state as it is."""
    handler = HANDLERS.get(type(event))
    return handler(state, event, now, policy) if handler else (state, [])
