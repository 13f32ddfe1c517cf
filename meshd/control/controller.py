"""The reconciler: feeds the fleet state machine and carries out its actions.

It takes its epoch first (`epochround`) and adopts what runs (`adopting`).
Inputs: what the agents' events mean (`intake.Intake`), what the proxy observes
(through `FleetView.report`), a clock tick, and the answers to what the fleet
asks of the world: rank 0's readiness while a generation starts (probed by
`upstream.probe_ready`, judged by `evidence`), rank 0's step count (`survey`),
the end of a stop and of the sweep after it. Outputs: start and stop
generations, sweeps and ladder steps through the agents, incidents in the store,
metrics. The fleet's state changes in `feed` and nowhere else; what to do next
is the fleet's to say.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Callable

import aiohttp
import structlog

from common.protocol import RankSpec, StopResult
from common.states import LadderStep, StopMode
from common.tomlcheck import ConfigError
from meshd.nodes import doctor, provision
from meshd.control import adopting, epochround, evidence, fleet, survey
from meshd.control.intake import Intake
from meshd.nodes.agentclient import AgentClient, AgentError, agent_session
from meshd import configdiff
from meshd.config import MeshConfig, hostfile_for
from meshd.metrics import Metrics
from meshd.seam import FleetRecord, Observation, Serving, WeightsRecord, rank_key, rank_secret, wait_until
from meshd.store import Store
from meshd.upstream import Upstream, probe_ready

log = structlog.get_logger("meshd.controller")


def policy_for(cfg: MeshConfig) -> fleet.Policy:
    return fleet.Policy(nodes=tuple(n.name for n in cfg.nodes), recycle=cfg.recycle, **asdict(cfg.recovery))


class Controller:
    def __init__(self, cfg: MeshConfig, store: Store, metrics: Metrics):
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.policy = policy_for(cfg)
        self.rank_key = rank_key(cfg.state_dir, create=True)
        metrics.desired_up.set(store.get("desired") == "up")
        saved = FleetRecord.from_wire(store.get(FleetRecord.KEY))
        carried = store.open_incident_row()
        self.state = fleet.FleetState(generation=saved.generation if saved else 0,
                                      incident=fleet.Incident(**carried) if carried else None)
        self.changed = asyncio.Condition()
        self.session: aiohttp.ClientSession | None = None
        self.agents: dict[str, AgentClient] = {}
        self.rank0 = Upstream()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.agent_errors: dict[str, str] = {}
        self._steps_observed: dict[float, int] = {}  # incident -> timeline entries already in /metrics
        self._counted: float | None = None  # the last incident counted in meshd_restarts_total
        # The weights' fingerprint of the generation that runs, as its rank 0 loaded them (the store keeps it
        # for a restarted controller that adopts that generation).
        self.weights = WeightsRecord.from_wire(store.get(WeightsRecord.KEY)) or WeightsRecord(-1, "")

    # --- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        """Take the epoch (EpochRefused when the agents do not grant it), then adopt, then follow the agents."""
        self.session = agent_session(self.cfg)
        self.agents = {n.name: AgentClient(n, self.session) for n in self.cfg.nodes}
        await self.feed(fleet.GenerationsFound(await epochround.take_epoch(self.cfg, self.store, self.agents,
                                                                          self.agent_errors, self.policy.adopt_wait)))
        intake = Intake(self.agents, self.store, self.metrics, self.agent_errors, lambda: self.state, self.feed)
        if not await adopting.adopt(self):
            self._spawn(adopting.adopt_when_whole(self))
        for loop in intake.loops():
            self._spawn(loop)
        self._spawn(self._tick_loop())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.rank0.close()
        if self.session:
            await self.session.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the one place state changes ------------------------------------------
    async def feed(self, event: fleet.FleetEvent) -> None:
        async with self._lock:
            before = self.state
            self.state, actions = fleet.step(self.state, event, time.time(), self.policy)
            if (before.phase, before.generation) != (self.state.phase, self.state.generation):
                log.info("fleet", phase=self.state.phase, generation=self.state.generation, reason=self.state.reason)
                self.store.put(FleetRecord.KEY, FleetRecord(self.state.phase, self.state.generation).wire())
                self.metrics.set_phase(self.state.phase)
                self.metrics.generation.set(self.state.generation)
            for action in actions:
                self._execute(action)
        async with self.changed:
            self.changed.notify_all()

    def _execute(self, action: fleet.Action) -> None:
        match action:
            case fleet.StartGeneration(generation=g):
                self._spawn(self._start_generation(g))
            case fleet.StopGeneration(generation=g, mode=mode, grace=grace):
                self._spawn(self._stop_generation(g, mode, grace))
            case fleet.Sweep(generation=g, survivors=survivors, stopped_at=stopped_at):
                self._spawn(self._sweep(g, survivors, stopped_at))
            case fleet.ProbeReadiness(generation=g, after=after):
                self._spawn(self._probe_readiness(g, after))
            case fleet.CountSteps(generation=g):
                self._spawn(self._count_steps(g))
            case fleet.RunStep(step=step, nodes=nodes):
                self._spawn(self._run_step(step, nodes))
            case fleet.OpenIncident(incident=i, planned=trigger):
                self.store.open_incident(i)
                if trigger:
                    log.info("planned recycle", generation=i.generation, trigger=trigger, detail=i.detail)
                    self.metrics.recycles.labels(reason=trigger).inc()
                else:
                    log.warning("incident", cause=i.cause, node=i.node, rank=i.rank, generation=i.generation,
                                detail=i.detail)
                    self._count_restart(i, closing=False)
            case fleet.IncidentUpdated(incident=i):
                self.store.update_incident(i)
                self._observe_steps(i)
                self._count_restart(i, closing=False)
            case fleet.CloseIncident(incident=i, serving_back_at=back):
                self._count_restart(i, closing=True)
                log.info("serving again", cause=i.cause, node=i.node, rank=i.rank,
                         recovery_seconds=round(back - i.opened_at, 3),
                         timeline=" ".join(f"{step}+{at - i.opened_at:.2f}" for step, at in i.timeline))
                self.store.update_incident(i, serving_back_at=back)
                self.metrics.recovery.observe(back - i.opened_at)
                self._observe_steps(i)
            case fleet.NoteGeneration(generation=g, what=what, detail=detail):
                self.store.note_generation(g, what, time.time(), detail)
                if what == fleet.GenerationNote.STARTED:
                    self.store.prune(self.cfg.retention.generations, self.cfg.retention.incidents)

    def _count_restart(self, incident: fleet.Incident, closing: bool) -> None:
        """A failure's restart into meshd_restarts_total once, under its root cause: as soon as the rank that
        failed by itself is named (it may report after a peer that only lost it), else when the incident
        closes under what is known then."""
        if fleet.counts_restart(incident, self._counted == incident.opened_at, closing):
            self._counted = incident.opened_at
            self.metrics.restarts.labels(reason=incident.cause).inc()

    def _observe_steps(self, incident: fleet.Incident) -> None:
        """Each timeline step's duration (from the step before it) into /metrics, once."""
        seen = self._steps_observed.get(incident.opened_at, 1)
        for (_, before), (step, at) in list(zip(incident.timeline, incident.timeline[1:]))[seen - 1:]:
            self.metrics.recovery_steps.labels(step=step).observe(max(0.0, at - before))
        self._steps_observed = {incident.opened_at: max(seen, len(incident.timeline))}

    # --- desired state from the operator ----------------------------------------
    async def up(self) -> None:
        self.store.put("desired", "up")
        self.metrics.desired_up.set(1)
        await self.feed(fleet.UpRequested())

    async def down(self, force: bool) -> None:
        self.store.put("desired", "down")
        self.metrics.desired_up.set(0)
        await self.feed(fleet.DownRequested(force))

    async def apply(self, cfg: MeshConfig) -> None:
        """Start the next generation with `cfg`, which differs from the running config only where a new generation
        applies it (`configdiff.changes`)."""
        self.cfg = cfg
        await self.restart()

    async def restart(self) -> None:
        await self.feed(fleet.RestartRequested())

    # --- actions ----------------------------------------------------------------
    def rank_secret(self, generation: int) -> str:
        return rank_secret(self.rank_key, generation)

    def _spec(self, generation: int, rank: int, hostfile: dict) -> RankSpec:
        rt = self.cfg.runtime
        return RankSpec(generation=generation, rank=rank, world=len(self.cfg.nodes), profile=rt.profile,
                        model=rt.model, hostfile=hostfile, port=rt.port, host=rt.host, ring_port=rt.ring_port,
                        seed=rt.seed, env=dict(rt.env), args=rt.launch_args(), devices=self.cfg.nodes[rank].devices,
                        secret=self.rank_secret(generation))

    async def _preflight(self) -> list[str]:
        """The doctor's cheap checks (hostfile, versions, model, launch) as every start passes them:
        the failures no restart can fix. An agent that does not answer is not one of them."""
        async def facts(node: str) -> tuple[str, dict | None]:
            try:
                return node, await doctor.node_facts(self.cfg, self.agents[node])
            except AgentError:
                return node, None

        answers = dict(await asyncio.gather(*(facts(n) for n in self.agents)))
        known = {node: f for node, f in answers.items() if f is not None}
        refused = [f"{c.name} on {c.node}: {c.detail} (fix: {c.fix})"
                   for c in doctor.judge_start(self.cfg, known) if not c.ok]
        return refused

    def _remember_weights(self, generation: int, fingerprint: str) -> None:
        self.weights = WeightsRecord(generation, fingerprint)
        self.store.put(WeightsRecord.KEY, self.weights.wire())

    def learn_weights(self, generation: int, said: str | None) -> None:
        """The fingerprint rank 0 of an adopted `generation` said it serves (None: it did not answer ready),
        unless the store knows it already."""
        if said is not None and (self.weights.generation != generation or not self.weights.fingerprint):
            self._remember_weights(generation, said)

    def desired_up(self) -> bool:
        return self.store.get("desired") == "up"

    async def _start_generation(self, g: int) -> None:
        try:
            hostfile = hostfile_for(self.cfg)
        except ConfigError as e:
            await self.feed(fleet.StartRefused(g, str(e)))
            return
        refused = await self._preflight()
        self._remember_weights(g, "")  # unknown until rank 0 says what it loaded
        if refused:
            await self.feed(fleet.StartRefused(g, "; ".join(refused)))
            return
        log.info("starting generation", generation=g, nodes=len(self.cfg.nodes), config=configdiff.digest(self.cfg))
        self.store.put(configdiff.KEY, configdiff.remember(self.store.get(configdiff.KEY, {}), g,
                                                           configdiff.digest(self.cfg)))

        async def one(rank: int, node: str):
            try:
                await self.agents[node].start_rank(self._spec(g, rank, hostfile), timeout=30)
            except AgentError as e:
                await self.feed(evidence.launch_refused(node, rank, g, e.status, str(e)))

        await asyncio.gather(*(one(i, n.name) for i, n in enumerate(self.cfg.nodes)))
        await self.feed(fleet.LaunchesSent(g))

    async def readiness(self) -> tuple[bool, fleet.RankDied | None, str | None]:
        """Does rank 0 serve, is its answer evidence against it, and the weights it says it serves (None: not
        said)."""
        seen = await probe_ready(self.rank0, self.cfg.rank0_url, self.serving().rank0_auth, self.cfg.runtime.profile,
                                 self.cfg.proxy.probe_timeout)
        return *evidence.readiness(seen, self.cfg.nodes[0].name, self.state.generation), seen.weights

    async def _probe_readiness(self, g: int, after: float) -> None:
        """Rank 0 of `g` asked whether it serves, unless its generation stopped starting meanwhile; the weights
        it loaded remembered before the fleet hears it serves."""
        await asyncio.sleep(after)
        if not fleet.awaiting_ready(self.state, g):
            return
        ready, died, said = await self.readiness()
        if ready:  # as the answer says it: no second call, which could fail under load and leave it unknown
            self._remember_weights(g, said or "")
        await self.feed(fleet.MeshReady(g) if ready else died or fleet.NotReadyYet(g))

    async def _stop_generation(self, g: int, mode: StopMode, grace: float) -> None:
        log.info("stopping generation", generation=g, mode=mode, grace=grace)

        async def one(node: str) -> StopResult:
            try:
                return await self.agents[node].stop_generation(g, mode, grace, timeout=3 * grace + 15)
            except AgentError as e:
                log.warning("stop failed", node=node, error=str(e))
                return StopResult(g)

        results = await asyncio.gather(*(one(n) for n in self.agents))
        stopped_at = time.time()
        await self.feed(fleet.StopsEnded(g, tuple(n for n, r in zip(self.agents, results) if r.survivors),
                                         stopped_at))

    async def _sweep(self, g: int, survivors: tuple[str, ...], stopped_at: float | None) -> None:
        async def one(node: str) -> None:
            try:
                await self.agents[node].sweep(2, None, timeout=60)  # between generations: none of its ranks
            except AgentError as e:
                log.warning("sweep failed", node=node, error=str(e))

        await asyncio.gather(*(one(n) for n in self.agents))
        await self.feed(fleet.GenerationStopped(g, survivors, stopped_at))

    async def _run_step(self, step: LadderStep, nodes: tuple[str, ...]) -> None:
        ok, detail = await provision.run_ladder_step(self.cfg, self.agents, step, nodes)
        await self.feed(fleet.StepDone(step, ok, detail))

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self.feed(fleet.Tick())

    async def _count_steps(self, g: int) -> None:
        steps = await survey.rank0_steps(self.agents[self.cfg.nodes[0].name], g)
        if steps is not None:
            await self.feed(fleet.StepsCounted(g, steps))

    # --- the proxy's view (seam.FleetView) ------------------------------------------
    def serving(self) -> Serving:
        s = self.state
        w = self.weights
        return Serving(s.phase, s.generation, s.reason, self.cfg.rank0_url, self.rank_secret(s.generation),
                       s.planned, w.fingerprint if w.generation == s.generation else "")

    async def wait_serving(self, predicate: Callable[[Serving], bool], timeout: float) -> Serving:
        return await wait_until(self.changed, self.serving, predicate, timeout)

    async def report(self, obs: Observation) -> None:
        await self.feed(evidence.observed(obs, self.cfg.nodes[0].name))
