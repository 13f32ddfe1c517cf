"""The fleet's rules: `step(state, event, now, policy) -> Result(state, actions)`.

It never awaits, never reads the clock (time is an argument) and holds no live
objects; backoff and failure history live in the state (meshd/control/fleet/model.py).
The reconciler feeds it events and carries out its actions. Each event kind has
its own small function (`_on_<event>`); the clock's rules are a chain tried in
order (when a generation is due its recycle: recycling.py).

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

Judgement:
- Deterministic evidence (a start the preflight or an agent refuses, the same
  fatal line at load in two consecutive generations, a 4xx from a probe) goes
  to `failed` at once with its reason: no restart, re-provision or reboot can
  fix a mistake in mesh.toml or a broken model.
- Root cause: the incident names the first rank that failed by itself. Evidence
  that a rank merely lost a peer (a closed socket, a blocked collective) and
  happened within `death_window` of the incident (by the agent's clock, so an
  agent that reconnects late still counts, even once the next generation has
  started or served) is listed under it as a
  consequence; a rank that failed by itself within that window takes the
  incident over from a consequence that happened to arrive first. An exit is
  dated by the rank's last heartbeat, and also belongs to the incident when
  it happened before the generation's stop ended, however late it arrives.
- Each incident keeps a timeline: detected, stopped, swept, backoff, started,
  loaded, ready, and served (the first request answered after it).

What the reconciler asks of the world is decided here too: a stopped generation's
sweep (`StopsEnded` -> `Sweep` -> `GenerationStopped`), rank 0's readiness
while a generation starts (`LaunchesSent` or `Adopted` not ready ->
`ProbeReadiness` -> `MeshReady`, death evidence or `NotReadyYet` -> the next
probe), and rank 0's step count while [recycle] steps asks for it (a tick ->
`CountSteps` -> `StepsCounted`).

Generation numbers are never reused: the next one is above the current one and
above every number the agents have used (`GenerationsFound`, from the
controller's round, so a fresh or restored store does not start again at 1); a
running generation is adopted under its own number.

Planned recycling ([recycle]): a generation that reached its age, its count of
rank 0's steps or the daily window, with no rank busy for `idle_for` (or still
busy `idle_deadline` after it was due), ends and the next one starts; `meshctl
restart` does the same at once. Its incident (cause "recycle") is planned: no
failure, no ladder step, no backoff. How it ends is `planned_restart`: "drain"
lets its requests finish on it (the proxy cuts none of them), "cut" has the
proxy resume them on the next generation at once (`planned` says which).
"""

from __future__ import annotations

from dataclasses import replace

from common.states import LadderStep, Phase, RankState, StopMode
from meshd.control.fleet.model import (
    RECYCLE, Action, Adopted, Cause, CloseIncident, CountSteps, DiedUnwatched, DownRequested, FleetEvent, FleetState,
    GenerationNote, GenerationsFound, GenerationStopped, Incident, IncidentUpdated, LaunchesSent, LeftoversFound,
    MeshReady, Moment, NoteGeneration, NotReadyYet, OpenIncident, Policy, ProbeReadiness, RankDied, RankReported,
    RankView, RequestMigrated, RequestServed, RestartRequested, Result, RunStep, StartGeneration, StartRefused,
    StepDone, StepsCounted, StopGeneration, StopsEnded, Sweep, Tick, UpRequested)
from meshd.control.fleet.recycling import recycle_due, worn

READINESS_POLL = 0.1  # seconds between two readiness probes of a starting generation's rank 0
STEPS_EVERY = 1.0  # seconds between two counts of rank 0's steps while [recycle] steps asks for them


def backoff(policy: Policy, failures: int) -> float:
    """No wait for the first failure in the window, then base * 2^(n-2), capped."""
    if failures <= 1:
        return 0.0
    return min(policy.backoff_max, policy.backoff_base * 2 ** (failures - 2))


def _mark(state: FleetState, step: Moment, when: float) -> Result:
    """Add a step to the open incident's timeline."""
    if state.incident is None:
        return Result(state, [])
    incident = state.incident.at(step, when)
    return Result(replace(state, incident=incident), [IncidentUpdated(incident)])


def _start_next(state: FleetState, now: float, policy: Policy) -> Result:
    g = max(state.generation, state.numbered_to) + 1
    new = replace(state, phase=Phase.STARTING, generation=g, backoff_until=None, started_at=now,
                  ranks=tuple(RankView(n) for n in policy.nodes), reason="", restart_requested=False, steps=0,
                  planned="", due_since=None)
    new, actions = _mark(new, Moment.STARTED, now)
    return Result(new, [StartGeneration(g), NoteGeneration(g, GenerationNote.STARTED), *actions])


def _mark_reboot(state: FleetState, nodes, policy: Policy) -> FleetState:
    """These nodes need a reboot: the ladder jumps to its reboot step (when it has one)."""
    if not nodes or LadderStep.REBOOT not in policy.ladder:
        return state
    return replace(state, ladder_step=max(state.ladder_step, policy.ladder.index(LadderStep.REBOOT)),
                   reboot_nodes=tuple(sorted(set(state.reboot_nodes) | set(nodes))))


def counts_restart(incident: Incident, counted: bool, closing: bool) -> bool:
    """Whether a failure's incident is counted as a restart now (once): when its root cause is known (a rank
    that failed by itself), or when it closes with only a consequence known; never a planned one."""
    return not counted and incident.cause != RECYCLE and (incident.primary or closing)


def _fail(state: FleetState, now: float, policy: Policy, ev: RankDied) -> Result:
    """Death evidence for the current generation: end it everywhere, then climb the ladder,
    or give up at once when no restart can fix it."""
    repeated = bool(ev.load_line) and ev.load_line == state.last_load_failure
    deterministic = ev.deterministic or repeated
    failures = tuple(t for t in state.failures if now - t < policy.window) + (now,)
    if state.incident is not None and state.incident.cause == RECYCLE:  # a failure is never the planned one's
        state = replace(state, incident=None)
    incident = state.incident or Incident(now, ev.cause, ev.node, ev.rank, ev.generation, ev.detail,
                                          primary=not ev.consequence, timeline=((Moment.DETECTED, now),))
    opened = state.incident is None
    if not opened:  # an incident a restart did not cure goes on
        incident = incident.at(Moment.DETECTED, now)
    new = replace(state, phase=Phase.RECOVERING, failures=failures, ready_since=None, incident=incident,
                  closing=None, last_load_failure=ev.load_line,
                  reason=f"{ev.cause} on {ev.node} rank {ev.rank}: {ev.detail}".strip(": "))
    actions: list[Action] = [OpenIncident(incident)] if opened else [IncidentUpdated(incident)]
    actions += [StopGeneration(ev.generation, StopMode.KILL, policy.stop_grace),
                NoteGeneration(ev.generation, GenerationNote.ENDED, new.reason)]
    if deterministic:
        why = "the same failure at load as the generation before" if repeated and not ev.deterministic else \
            "no restart can fix it"
        new, more = _give_up(new, f"{new.reason} ({why}). Fix the cause, then `meshctl up`")
        return Result(new, actions + more)
    if ev.reboot:
        new = _mark_reboot(new, (ev.node,), policy)
    return Result(new, actions)


def _attribute(state: FleetState, now: float, policy: Policy, ev: RankDied) -> Result:
    """More evidence about a generation that died. Within the death window, a rank that failed by
    itself takes the incident over from one that only lost it; the rest are consequences. The
    incident takes it while its recovery runs and after it closed: an agent that reconnects late
    delivers its evidence after the next generation has started, or even served."""
    field = "incident" if state.incident is not None and state.incident.generation == ev.generation else "closing"
    incident = getattr(state, field)
    if incident is None or incident.generation != ev.generation or not _belongs(incident, ev, now, policy):
        return Result(state, [])
    if not incident.primary and not ev.consequence:
        former = f"{incident.node} rank {incident.rank}: {incident.cause}: {incident.detail}"
        incident = replace(incident, cause=ev.cause, node=ev.node, rank=ev.rank, detail=ev.detail, primary=True,
                           consequences=incident.consequences + (former,))
        if field == "incident" and state.phase in (Phase.RECOVERING, Phase.STARTING, Phase.FAILED):
            state = replace(state, reason=f"{ev.cause} on {ev.node} rank {ev.rank}: {ev.detail}".strip(": "))
    elif ev.describe() not in incident.consequences:
        incident = replace(incident, consequences=incident.consequences + (ev.describe(),))
    else:
        return Result(state, [])
    return Result(replace(state, **{field: incident}), [IncidentUpdated(incident)])


def _belongs(incident: Incident, ev: RankDied, now: float, policy: Policy) -> bool:
    """Evidence belongs to the incident by when it happened, not by when it arrived: within the death
    window of its opening. An exit also when it happened before the generation's stop ended: no stop made
    it (the agent's own are expected), so however late it was seen (a process slow to reap, a starved
    agent), the generation died of it or with it."""
    happened = now if ev.at is None else min(ev.at, now)
    if happened - incident.opened_at <= policy.death_window:
        return True
    stopped = next((when for step, when in incident.timeline if step == Moment.STOPPED), None)
    return ev.cause == Cause.EXIT and (stopped is None or happened <= stopped)


def _with_step(state: FleetState, name: str) -> Result:
    """Record a ladder step on the open incident."""
    if state.incident is None:
        return Result(state, [])
    incident = replace(state.incident, steps=state.incident.steps + (name,))
    return Result(replace(state, incident=incident), [IncidentUpdated(incident)])


def _give_up(state: FleetState, reason: str) -> Result:
    state, actions = _with_step(state, "failed")
    return Result(replace(state, phase=Phase.FAILED, reason=reason, backoff_until=None), actions)


def _climb(state: FleetState, now: float, policy: Policy) -> Result:
    """The dead generation is gone everywhere: the next ladder step, or give up."""
    if len(state.failures) > policy.max_failures:
        return _give_up(state, f"{len(state.failures)} failures within {policy.window:.0f}s (limit "
                               f"{policy.max_failures}); last: {state.reason}. Fix the cause, then `meshctl up`")
    step = LadderStep(policy.ladder[min(state.ladder_step, len(policy.ladder) - 1)])
    state, actions = _with_step(state, step)
    if step == LadderStep.RESTART or state.ladder_step >= len(policy.ladder):
        wait = backoff(policy, len(state.failures))
        state = replace(state, backoff_until=now + wait, ladder_step=state.ladder_step + 1)
        if wait > 0:
            state, marked = _mark(state, Moment.BACKOFF, now)
            actions += marked
        return Result(state, actions)
    nodes = state.reboot_nodes if step == LadderStep.REBOOT and state.reboot_nodes else policy.nodes
    return Result(replace(state, backoff_until=None), actions + [RunStep(step, nodes)])


# --- one function per event ----------------------------------------------------
def _on_up(state: FleetState, ev: UpRequested, now: float, policy: Policy) -> Result:
    if state.phase not in (Phase.STOPPED, Phase.FAILED):
        return Result(state, [])
    return _start_next(replace(state, failures=(), ladder_step=0, reboot_nodes=(), incident=None), now, policy)


def _on_down(state: FleetState, ev: DownRequested, now: float, policy: Policy) -> Result:
    if state.phase == Phase.STOPPED:
        return Result(state, [])
    if state.phase == Phase.FAILED:
        return Result(replace(state, phase=Phase.STOPPED, reason=""),
                      [StopGeneration(state.generation, StopMode.KILL, 0.0)])
    mode, grace = (StopMode.KILL, policy.stop_grace) if ev.force else (StopMode.DRAIN, policy.drain_grace)
    return Result(replace(state, phase=Phase.DRAINING, ready_since=None, backoff_until=None, restart_requested=False),
                  [StopGeneration(state.generation, mode, grace)])


def _end_on_purpose(state: FleetState, policy: Policy, why: str) -> Result:
    """Drain the generation, then start the next one, counting no failure. Its requests in flight finish on it
    (planned_restart "drain"), or the proxy resumes them on the next at once ("cut": the drain finds none)."""
    return Result(replace(state, phase=Phase.RECOVERING, ready_since=None, idle_since=None, backoff_until=None,
                          reason=why, restart_requested=True, planned=policy.planned_restart, due_since=None),
                  [StopGeneration(state.generation, StopMode.DRAIN, policy.drain_grace),
                   NoteGeneration(state.generation, GenerationNote.ENDED, why)])


def _planned(state: FleetState, now: float, policy: Policy, trigger: str, detail: str) -> Result:
    """End the generation on purpose as a planned incident (a recycle), unless a failure's is open."""
    new, actions = _end_on_purpose(state, policy, f"{RECYCLE}: {detail}")
    if state.incident is not None:
        return Result(new, actions)
    incident = Incident(now, RECYCLE, "-", -1, state.generation, f"planned: {detail}", steps=(RECYCLE,),
                        timeline=((Moment.PLANNED, now),))
    return Result(replace(new, incident=incident), [OpenIncident(incident, planned=trigger), *actions])


def _on_restart(state: FleetState, ev: RestartRequested, now: float, policy: Policy) -> Result:
    if state.phase not in (Phase.READY, Phase.STARTING):
        return Result(state, [])
    return _planned(state, now, policy, "restart", f"`meshctl restart` of generation {state.generation}")


def _on_adopted(state: FleetState, ev: Adopted, now: float, policy: Policy) -> Result:
    if state.phase not in (Phase.STOPPED, Phase.STARTING, Phase.RECOVERING, Phase.READY) \
            or ev.generation < state.generation:
        return Result(state, [])
    rank_state = RankState.READY if ev.ready else RankState.LOADING
    new = replace(state, phase=Phase.READY if ev.ready else Phase.STARTING, generation=ev.generation,
                  ready_since=now if ev.ready else None, idle_since=now if ev.ready else None, due_since=None,
                  started_at=state.started_at or now,
                  ranks=tuple(RankView(n, rank_state) for n in policy.nodes), backoff_until=None)
    if not ev.ready:  # it loads: rank 0 is asked until it serves
        return Result(new, [ProbeReadiness(ev.generation)])
    if state.incident:  # an incident a restarted controller inherited
        incident = state.incident.at(Moment.READY, now)
        return Result(replace(new, incident=None, closing=incident), [CloseIncident(incident, now, incident.steps)])
    return Result(new, [])


def awaiting_ready(state: FleetState, generation: int) -> bool:
    """Whether rank 0 of `generation` is still to be asked whether it serves: that generation is starting."""
    return state.phase == Phase.STARTING and state.generation == generation


def _on_launches_sent(state: FleetState, ev: LaunchesSent, now: float, policy: Policy) -> Result:
    return Result(state, [ProbeReadiness(ev.generation)] if awaiting_ready(state, ev.generation) else [])


def _on_not_ready_yet(state: FleetState, ev: NotReadyYet, now: float, policy: Policy) -> Result:
    return Result(state, [ProbeReadiness(ev.generation, READINESS_POLL)] if awaiting_ready(state, ev.generation)
                  else [])


def _on_stops_ended(state: FleetState, ev: StopsEnded, now: float, policy: Policy) -> Result:
    """Whatever the stop left, and whatever generation it was: every node is swept before the next starts."""
    return Result(state, [Sweep(ev.generation, ev.survivors, ev.stopped_at)])


def _on_generations_found(state: FleetState, ev: GenerationsFound, now: float, policy: Policy) -> Result:
    return Result(replace(state, numbered_to=max(state.numbered_to, ev.highest)), [])


def _on_died_unwatched(state: FleetState, ev: DiedUnwatched, now: float, policy: Policy) -> Result:
    if state.phase != Phase.STOPPED:
        return Result(state, [])
    g = max(state.generation, ev.died.generation)
    return _fail(replace(state, phase=Phase.READY, generation=g), now, policy, replace(ev.died, generation=g))


def _on_leftovers(state: FleetState, ev: LeftoversFound, now: float, policy: Policy) -> Result:
    if state.phase != Phase.STOPPED:
        return Result(state, [])
    g = max(state.generation, ev.generation)
    phase = Phase.RECOVERING if ev.up else Phase.DRAINING
    return Result(replace(state, phase=phase, generation=g, restart_requested=ev.up,
                          reason="leftovers of a broken generation"),
                  [StopGeneration(g, StopMode.KILL, policy.stop_grace)])


def _on_mesh_ready(state: FleetState, ev: MeshReady, now: float, policy: Policy) -> Result:
    if state.phase != Phase.STARTING or ev.generation != state.generation:
        return Result(state, [])
    new = replace(state, phase=Phase.READY, ready_since=now, idle_since=now, reason="", last_load_failure="",
                  ranks=tuple(replace(r, state=RankState.READY) for r in state.ranks))
    actions: list[Action] = [NoteGeneration(ev.generation, GenerationNote.READY)]
    if state.incident:
        incident = state.incident.at(Moment.READY, now)
        actions.append(CloseIncident(incident, now, incident.steps))
        new = replace(new, incident=None, closing=incident)
    return Result(new, actions)


def _on_request_served(state: FleetState, ev: RequestServed, now: float, policy: Policy) -> Result:
    if state.closing is None or ev.generation != state.generation:
        return Result(state, [])
    incident = state.closing.at(Moment.SERVED, now)
    return Result(replace(state, closing=None), [IncidentUpdated(incident)])


def _on_request_migrated(state: FleetState, ev: RequestMigrated, now: float, policy: Policy) -> Result:
    incident = state.incident
    if incident is None or incident.generation != ev.generation:
        return Result(state, [])
    incident = replace(incident, migrated=incident.migrated + 1)
    return Result(replace(state, incident=incident), [IncidentUpdated(incident)])


LOADED = (RankState.ARMED, RankState.READY, RankState.BUSY)


def _on_rank_reported(state: FleetState, ev: RankReported, now: float, policy: Policy) -> Result:
    if ev.generation != state.generation or state.phase not in (Phase.STARTING, Phase.READY):
        return Result(state, [])
    view = RankView(ev.node, ev.state, ev.load_done, ev.load_total)
    ranks = tuple(view if r.node == ev.node else r for r in state.ranks)
    busy = any(r.state == RankState.BUSY for r in ranks)
    new = replace(state, ranks=ranks, idle_since=None if busy else now if state.idle_since is None else state.idle_since)
    if not all(r.state in LOADED for r in new.ranks):
        return Result(new, [])
    # The last rank loaded. Rank 0 may have answered its readiness probe before this report arrived:
    # then the step goes into the timeline of the incident that just closed, where it belongs.
    incident = new.incident if new.phase == Phase.STARTING else new.closing
    if incident is None or Moment.LOADED in [step for step, _ in incident.timeline[_last_start(incident):]]:
        return Result(new, [])
    incident = replace(incident, timeline=tuple(sorted(incident.timeline + ((Moment.LOADED, ev.at or now),),
                                                       key=lambda entry: entry[1])))
    new = replace(new, incident=incident) if new.phase == Phase.STARTING else replace(new, closing=incident)
    return Result(new, [IncidentUpdated(incident)])


def _last_start(incident: Incident) -> int:
    starts = [i for i, (step, _) in enumerate(incident.timeline) if step == Moment.STARTED]
    return starts[-1] if starts else len(incident.timeline)


def _on_steps_counted(state: FleetState, ev: StepsCounted, now: float, policy: Policy) -> Result:
    if ev.generation != state.generation or state.phase != Phase.READY:
        return Result(state, [])
    return Result(replace(state, steps=ev.steps), [])


def _on_rank_died(state: FleetState, ev: RankDied, now: float, policy: Policy) -> Result:
    if ev.generation == state.generation and state.phase in (Phase.STARTING, Phase.READY):
        return _fail(state, now, policy, ev)
    if ev.reboot and ev.generation == state.generation and state.phase == Phase.RECOVERING:
        state = _mark_reboot(state, (ev.node,), policy)
    return _attribute(state, now, policy, ev)


def _on_start_refused(state: FleetState, ev: StartRefused, now: float, policy: Policy) -> Result:
    if ev.generation != state.generation or state.phase != Phase.STARTING:
        return Result(state, [])
    return _fail(state, now, policy, RankDied("-", -1, ev.generation, Cause.PREFLIGHT, ev.reason, deterministic=True))


def _on_generation_stopped(state: FleetState, ev: GenerationStopped, now: float, policy: Policy) -> Result:
    if ev.generation != state.generation:
        return Result(state, [])
    if state.phase == Phase.DRAINING:
        return Result(replace(state, phase=Phase.STOPPED, ranks=(), reason=""),
                      [NoteGeneration(ev.generation, GenerationNote.ENDED, "down")])
    if state.phase != Phase.RECOVERING:
        return Result(state, [])
    state, actions = _mark(state, Moment.STOPPED, ev.stopped_at if ev.stopped_at is not None else now)
    state, swept = _mark(state, Moment.SWEPT, now)
    state = _mark_reboot(state, ev.survivors, policy)
    new, more = _start_next(state, now, policy) if state.restart_requested else _climb(state, now, policy)
    return Result(new, actions + swept + more)


def _on_step_done(state: FleetState, ev: StepDone, now: float, policy: Policy) -> Result:
    if state.phase != Phase.RECOVERING:
        return Result(state, [])
    if not ev.ok:
        failed = replace(state, ladder_step=state.ladder_step + 1, reason=f"{ev.step} failed: {ev.detail}")
        if failed.ladder_step >= len(policy.ladder):
            return _give_up(failed, f"recovery ladder exhausted; {ev.step} failed: {ev.detail}. "
                                    "Fix the nodes, then `meshctl up`")
        return _climb(failed, now, policy)
    nxt = replace(state, ladder_step=state.ladder_step + 1,
                  reboot_nodes=() if ev.step == LadderStep.REBOOT else state.reboot_nodes)
    if ev.step == LadderStep.REBOOT and LadderStep.REPROVISION in policy.ladder:
        nxt, actions = _with_step(nxt, LadderStep.REPROVISION)
        return Result(nxt, actions + [RunStep(LadderStep.REPROVISION, policy.nodes)])
    return _start_next(nxt, now, policy)


# --- the clock's rules, tried in order; each returns a result or None ------------
def _backoff_over(state: FleetState, now: float, policy: Policy) -> Result | None:
    if state.phase == Phase.RECOVERING and state.backoff_until is not None and now >= state.backoff_until:
        return _start_next(state, now, policy)
    return None


def _healthy_long_enough(state: FleetState, now: float, policy: Policy) -> Result | None:
    if state.phase == Phase.READY and state.ready_since is not None and state.failures \
            and now - state.ready_since >= policy.healthy_reset:
        return Result(replace(state, failures=(), ladder_step=0, reboot_nodes=()), [])
    return None


def _start_overdue(state: FleetState, now: float, policy: Policy) -> Result | None:
    if state.phase == Phase.STARTING and state.started_at is not None \
            and now - state.started_at > policy.start_deadline:
        return _fail(state, now, policy, RankDied("-", -1, state.generation, Cause.START_TIMEOUT,
                                                  f"not ready after {policy.start_deadline:.0f}s"))
    return None


def _recycle_due(state: FleetState, now: float, policy: Policy) -> Result | None:
    due = recycle_due(state, now, policy.recycle)
    if due is not None:
        return _planned(state, now, policy, *due)
    waiting = worn(state, now, policy.recycle) is not None
    if waiting == (state.due_since is not None):
        return None
    return Result(replace(state, due_since=now if waiting else None), [])


def _steps_due(state: FleetState, now: float, policy: Policy) -> Result | None:
    """Rank 0's steps counted every `STEPS_EVERY` while a generation serves and [recycle] steps asks for them."""
    if not policy.recycle.steps or state.phase != Phase.READY \
            or (state.steps_asked_at is not None and now - state.steps_asked_at < STEPS_EVERY):
        return None
    return Result(replace(state, steps_asked_at=now), [CountSteps(state.generation)])


TICK_RULES = (_backoff_over, _healthy_long_enough, _start_overdue, _recycle_due, _steps_due)


def _on_tick(state: FleetState, ev: Tick, now: float, policy: Policy) -> Result:
    for rule in TICK_RULES:
        result = rule(state, now, policy)
        if result is not None:
            return result
    return Result(state, [])


HANDLERS = {UpRequested: _on_up, DownRequested: _on_down, RestartRequested: _on_restart, Adopted: _on_adopted,
            GenerationsFound: _on_generations_found, LeftoversFound: _on_leftovers, DiedUnwatched: _on_died_unwatched,
            MeshReady: _on_mesh_ready, RankReported: _on_rank_reported, StepsCounted: _on_steps_counted,
            RankDied: _on_rank_died, StartRefused: _on_start_refused, LaunchesSent: _on_launches_sent,
            NotReadyYet: _on_not_ready_yet, StopsEnded: _on_stops_ended, GenerationStopped: _on_generation_stopped,
            StepDone: _on_step_done, RequestServed: _on_request_served, RequestMigrated: _on_request_migrated,
            Tick: _on_tick}


def step(state: FleetState, event: FleetEvent, now: float, policy: Policy) -> Result:
    """One transition. Unknown or stale events leave the state as it is."""
    handler = HANDLERS.get(type(event))
    return handler(state, event, now, policy) if handler else Result(state, [])
