"""The reconciler: feeds the fleet state machine and carries out its actions.

Inputs: every agent's event stream (resumed by sequence number), a 1 s poll of
the same events as a backstop, rank 0's readiness while starting, the proxy's
observations, an idle probe, and a clock tick. Outputs: start and stop
generations through the agents, sweeps, incidents in the store, metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, replace

import aiohttp
import structlog

from meshd import fleet
from meshd.agentclient import AgentClient, AgentError
from meshd.config import ConfigError, MeshConfig, hostfile_for
from meshd.metrics import Metrics
from meshd.protocol import RankSpec
from meshd.store import Store

log = structlog.get_logger("meshd.controller")


def policy_for(cfg: MeshConfig) -> fleet.Policy:
    return fleet.Policy(nodes=tuple(n.name for n in cfg.nodes), **asdict(cfg.recovery))


def death_from_record(rec: dict) -> fleet.RankDied | None:
    """An agent event that is death evidence, as the fleet sees it."""
    kind, node, rank, g = rec["kind"], rec["node"], rec.get("rank", -1), rec.get("generation", -1)
    if kind == "RankExited" and not rec.get("expected"):
        how = f"signal {rec['signal']}" if rec.get("signal") else (
            f"exit code {rec['code']}" if rec.get("code") is not None else "gone (not the agent's child)")
        return fleet.RankDied(node, rank, g, "exit", how)
    if kind == "RankSignature":
        return fleet.RankDied(node, rank, g, "signature", f"{rec['signature']}: {rec['line'][-200:]}",
                              reboot=rec.get("severity") == "reboot")
    if kind == "RankStalled":
        return fleet.RankDied(node, rank, g, "stall",
                              f"no progress for {rec['idle_for']:.1f}s (window {rec['window']:.1f}s) "
                              f"while {rec['phase']}")
    if kind == "RebootRequired":
        return fleet.RankDied(node, rank, g, "reboot_required", rec.get("reason", ""), reboot=True)
    return None


class Controller:
    def __init__(self, cfg: MeshConfig, store: Store, metrics: Metrics):
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.policy = policy_for(cfg)
        saved = store.get("fleet", {})
        carried = store.open_incident_row()
        self.state = fleet.FleetState(generation=saved.get("generation", 0),
                                      incident=fleet.Incident(**carried) if carried else None)
        self.seen: dict[str, int] = store.get("agent_seq", {})
        self.changed = asyncio.Condition()
        self.session: aiohttp.ClientSession | None = None
        self.agents: dict[str, AgentClient] = {}
        self.last_request_at = time.time()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.agent_errors: dict[str, str] = {}

    # --- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        self.agents = {n.name: AgentClient(n, self.session) for n in self.cfg.nodes}
        await self._adopt()
        for node in self.agents:
            self._spawn(self._follow(node))
        self._spawn(self._poll_loop())
        self._spawn(self._tick_loop())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session:
            await self.session.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the one place state changes ------------------------------------------
    async def feed(self, event) -> None:
        async with self._lock:
            before = self.state
            self.state, actions = fleet.step(self.state, event, time.time(), self.policy)
            if (before.phase, before.generation) != (self.state.phase, self.state.generation):
                log.info("fleet", phase=self.state.phase, generation=self.state.generation, reason=self.state.reason)
                self.store.put("fleet", {"phase": self.state.phase, "generation": self.state.generation})
                self.metrics.set_phase(self.state.phase)
                self.metrics.generation.set(self.state.generation)
            for action in actions:
                self._execute(action)
        async with self.changed:
            self.changed.notify_all()

    def _execute(self, action) -> None:
        match action:
            case fleet.StartGeneration(generation=g):
                self._spawn(self._start_generation(g))
            case fleet.StopGeneration(generation=g, mode=mode, grace=grace):
                self._spawn(self._stop_generation(g, mode, grace))
            case fleet.RunStep(step=step, nodes=nodes):
                self._spawn(self._run_step(step, nodes))
            case fleet.OpenIncident(incident=i):
                log.warning("incident", cause=i.cause, node=i.node, rank=i.rank, generation=i.generation,
                            detail=i.detail)
                self.store.open_incident(i.opened_at, i.cause, i.node, i.rank, i.generation, i.detail)
                self.metrics.restarts.labels(reason=i.cause).inc()
            case fleet.IncidentUpdated(incident=i):
                self.store.update_incident(i.opened_at, i.steps)
            case fleet.CloseIncident(incident=i, serving_back_at=back, steps=steps):
                log.info("serving again", cause=i.cause, recovery_seconds=round(back - i.opened_at, 3))
                self.store.close_incident(i.opened_at, back, steps)
                self.metrics.recovery.observe(back - i.opened_at)
            case fleet.NoteGeneration(generation=g, what=what, detail=detail):
                self.store.note_generation(g, what, time.time(), detail)

    # --- desired state from the operator ----------------------------------------
    async def up(self) -> None:
        self.store.put("desired", "up")
        await self.feed(fleet.UpRequested())

    async def down(self, force: bool) -> None:
        self.store.put("desired", "down")
        await self.feed(fleet.DownRequested(force))

    async def restart(self) -> None:
        await self.feed(fleet.RestartRequested())

    async def wait_for(self, predicate, timeout: float) -> bool:
        """Wait until predicate(state) holds; False on timeout."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: predicate(self.state)), timeout)
                return True
            except asyncio.TimeoutError:
                return False

    # --- actions ----------------------------------------------------------------
    def rank0_url(self) -> str:
        host = self.cfg.runtime.host
        if host in ("0.0.0.0", "::", ""):
            host = self.cfg.nodes[0].address
        return f"http://{host}:{self.cfg.runtime.port}"

    def _spec(self, generation: int, rank: int, hostfile: dict) -> dict:
        rt = self.cfg.runtime
        args = dict(rt.args)
        if rt.draft_model:
            args["draft_model"] = rt.draft_model
        return asdict(RankSpec(generation=generation, rank=rank, world=len(self.cfg.nodes), profile=rt.profile,
                               model=rt.model, hostfile=hostfile, port=rt.port, host=rt.host,
                               ring_port=rt.ring_port, seed=rt.seed, env=dict(rt.env), args=args))

    async def _start_generation(self, g: int) -> None:
        try:
            hostfile = hostfile_for(self.cfg)
        except ConfigError as e:
            await self.feed(fleet.RankDied("-", -1, g, "launch", str(e)))
            return
        log.info("starting generation", generation=g, nodes=len(self.cfg.nodes))

        async def one(rank: int, node: str):
            try:
                await self.agents[node].call("POST", "/v1/ranks", self._spec(g, rank, hostfile), timeout=30)
            except AgentError as e:
                await self.feed(fleet.RankDied(node, rank, g, "launch", str(e)))

        await asyncio.gather(*(one(i, n.name) for i, n in enumerate(self.cfg.nodes)))
        self._spawn(self._await_ready(g))

    async def ready_probe(self) -> bool:
        path = "/internal/ready" if self.cfg.runtime.profile == "meshd-rank" else "/v1/models"
        try:
            async with self.session.get(self.rank0_url() + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _await_ready(self, g: int) -> None:
        while self.state.generation == g and self.state.phase == fleet.STARTING:
            if await self.ready_probe():
                await self.feed(fleet.MeshReady(g))
                return
            await asyncio.sleep(0.1)

    async def _stop_generation(self, g: int, mode: str, grace: float) -> None:
        log.info("stopping generation", generation=g, mode=mode, grace=grace)

        async def one(node: str) -> dict:
            try:
                return await self.agents[node].call("POST", f"/v1/generations/{g}/stop",
                                                    {"mode": mode, "grace": grace}, timeout=3 * grace + 15)
            except AgentError as e:
                log.warning("stop failed", node=node, error=str(e))
                return {"survivors": [], "error": str(e)}

        results = await asyncio.gather(*(one(n) for n in self.agents))
        survivors = tuple(n for n, r in zip(self.agents, results) if r.get("survivors"))
        await asyncio.gather(*(self._sweep(n) for n in self.agents))
        await self.feed(fleet.GenerationStopped(g, survivors))

    async def _sweep(self, node: str) -> None:
        try:
            # Between generations nothing of meshd should run on a node.
            await self.agents[node].call("POST", "/v1/sweep", {"grace": 2, "generation": None}, timeout=60)
        except AgentError as e:
            log.warning("sweep failed", node=node, error=str(e))

    async def _run_step(self, step: str, nodes: tuple[str, ...]) -> None:
        from meshd import provision

        ok, detail = await provision.run_ladder_step(self, step, nodes)
        await self.feed(fleet.StepDone(step, ok, detail))

    # --- observation ------------------------------------------------------------
    async def on_record(self, node: str, record: dict) -> None:
        if record["seq"] <= self.seen.get(node, 0):
            return  # the stream and the poll both deliver; keep the first
        self.seen[node] = record["seq"]
        self.store.put("agent_seq", self.seen)
        self.store.record_event(record)
        if record["kind"] == "RankStateChanged":
            await self.feed(fleet.RankReported(node, record["generation"], record["state"],
                                               record.get("load_done", 0), record.get("load_total", 0)))
            return
        death = death_from_record(record)
        if death is not None:
            if death.generation == self.state.generation and self.state.phase in (fleet.READY, fleet.STARTING):
                self.metrics.detection.observe(max(0.0, time.time() - record["at"]))
            await self.feed(death)

    async def _follow(self, node: str) -> None:
        delay = 0.2
        while True:
            try:
                await self.agents[node].follow(self.seen.get(node, 0), lambda r: self.on_record(node, r))
            except AgentError as e:
                self.agent_errors[node] = str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            else:
                delay = 0.2

    async def _poll_loop(self) -> None:
        """The backstop: events missed by a stream arrive here within a second.
        All agents at once, so one that does not answer delays no other."""
        async def poll(node: str, client: AgentClient) -> None:
            try:
                data = await client.call("GET", f"/v1/events?stream=0&since={self.seen.get(node, 0)}", timeout=5)
                self.agent_errors.pop(node, None)
            except AgentError as e:
                self.agent_errors[node] = str(e)
                return
            for record in data["events"]:
                await self.on_record(node, record)

        while True:
            await asyncio.sleep(1.0)
            await asyncio.gather(*(poll(node, client) for node, client in self.agents.items()))

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self.feed(fleet.Tick())
            await self._maybe_probe()

    async def _maybe_probe(self) -> None:
        """When the mesh has been idle a while, ask it for one token."""
        s = self.state
        if s.phase != fleet.READY or time.time() - self.last_request_at < self.cfg.proxy.probe_idle:
            return
        self.last_request_at = time.time()
        body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        try:
            async with self.session.post(self.rank0_url() + "/v1/chat/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.proxy.probe_timeout)) as r:
                if r.status == 200:
                    return
                detail = f"probe answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            detail = f"probe failed: {type(e).__name__}"
        if self.state.generation == s.generation:
            await self.feed(fleet.RankDied(self.cfg.nodes[0].name, 0, s.generation, "probe", detail))

    async def _adopt(self) -> None:
        """A restarted controller keeps a healthy running generation."""
        views = {}
        for node, client in self.agents.items():
            try:
                views[node] = await client.call("GET", "/v1/ranks", timeout=5)
            except AgentError as e:
                self.agent_errors[node] = str(e)
        live = {node: [r for r in v["ranks"] if r["state"] not in ("exited", "lost")] for node, v in views.items()}
        gens = {r["generation"] for rs in live.values() for r in rs}
        complete = (len(gens) == 1 and len(views) == len(self.agents)
                    and all(len(rs) == 1 and rs[0]["rank"] == i
                            for i, rs in enumerate(live[n.name] for n in self.cfg.nodes)))
        if complete:
            g = gens.pop()
            ready = await self.ready_probe() if self.session else False
            log.info("adopting running generation", generation=g, ready=ready)
            await self.feed(fleet.Adopted(g, ready))
            if not ready:
                self._spawn(self._await_ready(g))
            return
        # Leftovers of a broken generation: stop them before anything starts,
        # and never reuse their generation number.
        for g in sorted(gens):
            await asyncio.gather(*(c.call("POST", f"/v1/generations/{g}/stop", {"mode": "kill", "grace": 5},
                                          timeout=30) for c in self.agents.values()), return_exceptions=True)
        if gens and max(gens) > self.state.generation:
            self.state = replace(self.state, generation=max(gens))  # initial state, before any event
        if self.store.get("desired") == "up":
            await self.feed(fleet.UpRequested())

    async def status(self) -> dict:
        s = self.state

        async def one(n):
            try:
                v = await self.agents[n.name].call("GET", "/v1/ranks", timeout=3)
                rank = next((r for r in reversed(v["ranks"]) if r["generation"] == s.generation), None)
                return {"node": n.name, "agent": n.agent, "agent_ok": True, "rank": rank}
            except AgentError as e:
                return {"node": n.name, "agent": n.agent, "agent_ok": False, "error": str(e), "rank": None}

        nodes = await asyncio.gather(*(one(n) for n in self.cfg.nodes))
        incidents = self.store.incidents(1)
        return {"mesh": self.cfg.name, "phase": s.phase, "generation": s.generation, "reason": s.reason,
                "ready_since": s.ready_since, "failures_in_window": len(s.failures),
                "backoff_until": s.backoff_until, "nodes": list(nodes),
                "load": [{"node": n, "state": st, "load_done": d, "load_total": t} for n, st, d, t in s.ranks],
                "last_incident": incidents[0] if incidents else None}
