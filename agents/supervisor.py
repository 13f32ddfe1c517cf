"""What an agent does to its node's ranks: start, stop, adopt, sweep.

One live generation at a time: a start waits for a stopping (or already exiting) generation's processes to be
gone (their memory released) before its rank starts, and that rank is the agent's standby (agents/standby.py)
when one can take it, else a cold spawn. The launch manifest (generation, rank, pid,
create time) is written before a start returns, so an agent that is killed
and started again adopts the ranks that are still running instead of killing
them, and can tell retired generations' leftovers from the live one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from agents import node as node_facts
from agents import orphans, ringwait
from agents.config import AgentConfig
from agents.events import EventLog
from agents.launch import LaunchPlan, launch_plan, rank_dir
from agents.manifest import Manifest
from agents.standby import Keeper, early_env, trigger
from agents.stall import blocked_on_peer
from agents.watch import RankRecord, RankWatcher
from common import procs
from common.modelref import resolve
from common.protocol import OrphansSwept, RankExited, RankSignature, RankSpec, RankStarted, RebootRequired, StopResult
from common.states import RankState, StopMode

# In a kill, a rank blocked in a collective on a dead peer (it runs no signal
# handler) gets this long after SIGTERM before its SIGKILL.
BLOCKED_GRACE = 0.5
# A start waits this long for a stopping generation's processes to be gone before it is refused (409):
# below the controller's timeout for a start.
RELEASE_WAIT = 20.0


def generations_to_prune(existing: list[int], keep: int, live: set[int]) -> list[int]:
    """The generations past the newest `keep`, less any that still runs."""
    return sorted(g for g in sorted(existing, reverse=True)[keep:] if g not in live)


async def _until(done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


class Conflict(Exception):
    """Another generation is running here (HTTP 409)."""


@dataclass
class Counters:
    exits: dict
    signatures: dict
    orphans_killed: int = 0
    survivors: int = 0


# How a planned rank is started: its process, and whether it was warm (the standby's, now this rank).
Spawn = Callable[[LaunchPlan], Awaitable[tuple[asyncio.subprocess.Process, bool]]]


class Supervisor:
    def __init__(self, config: AgentConfig, spawn: Spawn | None = None):
        """`spawn`: how a planned rank starts; by default the standby takes it, else a cold spawn."""
        self.config = config
        self.state_dir = config.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.state_dir / "events.jsonl")
        self.records: dict[tuple[int, int], RankRecord] = {}
        self.reboot_required: str | None = None
        self.wired_limit: dict | None = None  # what applying agent.toml's wired_limit_mb did
        self.counters = Counters(exits={}, signatures={})
        self._lock = asyncio.Lock()
        self.manifest = Manifest(self.state_dir / "manifest.json")
        self.standby = Keeper(self.state_dir, config.python, config.standby)
        self._spawn = spawn or self._warm_or_cold
        self._early = early_env(dict(os.environ), config.env_allowlist)  # the last rank's, for its standby
        self.events.subscribe(trigger(self.standby, lambda: self._early, self.serving))

    async def apply_wired_limit(self) -> None:
        """agent.toml's `wired_limit_mb` set on this node (GET /v1/node says what that did)."""
        if self.config.wired_limit_mb:
            self.wired_limit = await node_facts.apply_wired_limit(self.config.wired_limit_mb)

    # --- events -----------------------------------------------------------------
    async def emit(self, event) -> None:
        if isinstance(event, RankExited):
            kind = "expected" if event.expected else ("signal" if event.signal else f"code_{event.code}")
            self.counters.exits[kind] = self.counters.exits.get(kind, 0) + 1
        if isinstance(event, RankSignature):
            key = (event.signature, event.severity)
            self.counters.signatures[key] = self.counters.signatures.get(key, 0) + 1
            if event.severity == "reboot":
                self.reboot_required = f"{event.signature}: {event.line[-200:]}"
        if isinstance(event, RebootRequired):
            self.reboot_required = event.reason
        await self.events.emit(event)

    def _watch(self, rec: RankRecord) -> None:
        RankWatcher(rec, self.emit, self.config.node, self.config.stall, self.config.log_max_bytes).start()

    # --- queries ----------------------------------------------------------------
    def serving(self) -> bool:
        """A rank of this node is ready or busy (a standby may start beside it)."""
        return any(r.state in (RankState.READY, RankState.BUSY) for r in self.live())

    def live(self) -> list[RankRecord]:
        return [r for r in self.records.values() if not r.done]

    def current_generation(self) -> int | None:
        gens = {r.generation for r in self.live()}
        return max(gens) if gens else None

    def ranks(self) -> dict:
        """GET /v1/ranks: every rank this agent knows of and its standby."""
        return {"node": self.config.node, "generation": self.current_generation(),
                "ranks": [r.view() for r in self.records.values()], "standby": self.standby.pid,
                "standby_ready": self.standby.ready}

    # --- adopt ------------------------------------------------------------------
    async def adopt(self) -> None:
        """On agent start: watch again the manifest's ranks that still run."""
        keep = []
        for e in self.manifest.read():
            if not procs.alive(procs.Target(e.pid, e.create_time)):
                await self.emit(RankExited(node=self.config.node, generation=e.generation, rank=e.rank,
                                           at=time.time(), pid=e.pid, code=None, signal=None, expected=False))
                continue
            rec = RankRecord.adopted(e)
            self.records[(rec.generation, rec.rank)] = rec
            keep.append(e)
            await self.emit(RankStarted(node=self.config.node, generation=rec.generation, rank=rec.rank,
                                        at=time.time(), pid=rec.pid, adopted=True))
            self._watch(rec)
        self.manifest.write(keep)

    # --- start ------------------------------------------------------------------
    async def start(self, spec: RankSpec, mesh: str | None = None) -> tuple[RankRecord, bool]:
        """Start rank G/r of `mesh` (the commanding controller's); returns (record, created). Idempotent for the
        same G/r."""
        async with self._lock:
            existing = self.records.get((spec.generation, spec.rank))
            if existing is not None and not existing.done:
                return existing, False
            others = [r for r in self.live() if (r.generation, r.rank) != (spec.generation, spec.rank)]
            waited = bool(others) and all(o.stopping or procs.ending(o.target) for o in others)  # gone once reaped
            if waited:
                await self._gone(others, RELEASE_WAIT)
                others = [o for o in others if not o.done]
            if others:
                o = others[0]
                if waited:
                    raise Conflict(f"generation {o.generation} rank {o.rank} (pid {o.pid}) is still here "
                                   f"{RELEASE_WAIT:.0f} s after its stop (alive: {procs.alive(o.target)}); "
                                   f"start again once it is gone (GET /v1/ranks)")
                raise Conflict(f"generation {o.generation} rank {o.rank} is running here (pid {o.pid}); "
                               f"stop it first (POST /v1/generations/{o.generation}/stop)")
            plan = launch_plan(spec, self.config, dict(os.environ), resolve, ringwait.built(), mesh)
            plan.cwd.mkdir(parents=True, exist_ok=True)
            for path, content in plan.files.items():
                path.write_text(content)
            plan.status_path.unlink(missing_ok=True)
            proc, warm = await self._spawn(plan)
            self._early = plan.early
            target = procs.identify(proc.pid)
            rec = RankRecord(spec.generation, spec.rank, proc.pid, target.create_time if target else time.time(),
                             time.time(), plan.log_path, plan.status_path if plan.watch_status else None, spec.port,
                             spec.host, spec.profile, proc=proc)
            self.records[(rec.generation, rec.rank)] = rec
            self.manifest.record(rec.manifest_entry())
            await self.emit(RankStarted(node=self.config.node, generation=rec.generation, rank=rec.rank,
                                        at=time.time(), pid=rec.pid, warm=warm))
            self._watch(rec)
            self.prune()
            return rec, True

    async def _warm_or_cold(self, plan: LaunchPlan) -> tuple[asyncio.subprocess.Process, bool]:
        """The standby's process, handed this rank; else a cold spawn."""
        proc = await self.standby.take(list(plan.argv), plan.env, plan.cwd, plan.log_path, plan.early)
        if proc is not None:
            return proc, True
        return await procs.spawn(list(plan.argv), plan.log_path, env=plan.env, cwd=plan.cwd), False

    # --- stop -------------------------------------------------------------------
    async def stop(self, generation: int, mode: StopMode, grace: float) -> StopResult:
        recs = [r for r in self.records.values() if r.generation == generation and not r.done]
        for r in recs:  # one already ending (slow to reap, or its exit not yet seen) died by itself
            r.stopping = not procs.ending(r.target)
        drain = None
        rank0 = next((r for r in recs if r.rank == 0), None)
        if mode == StopMode.DRAIN and rank0 is not None:
            async def drain():  # SIGTERM is rank 0's finishing drain; it reaches the others through the mesh
                procs.send(rank0.target, signal.SIGTERM)
        elif mode == StopMode.DRAIN:
            async def drain():  # rank 0's drain reaches this rank through the mesh
                return None
        by_pid = {r.pid: r for r in recs}

        def blocked(t: procs.Target) -> bool:  # read live: the watchers go on reading logs and status files
            rec = by_pid[t.pid]
            return blocked_on_peer(rec.status, rec.peer_lost, time.time())

        result = await procs.stop_ladder([r.target for r in recs], grace=grace, drain=drain,
                                         escalate=blocked if mode == StopMode.KILL else None,
                                         escalate_grace=BLOCKED_GRACE)
        await self._settle(recs)
        survivors = result.survivors
        if survivors:
            self.counters.survivors += len(survivors)
            reason = f"pid(s) {list(survivors)} survived SIGKILL; reboot this node"
            await self.emit(RebootRequired(node=self.config.node, generation=generation, rank=-1, at=time.time(),
                                           reason=reason))
        self.manifest.keep(lambda e: e.generation != generation)
        stopped = tuple(r.pid for r in recs if r.stopping and r.pid in result.stopped)
        return StopResult(generation, stopped, survivors, result.steps)

    async def _settle(self, recs: list[RankRecord], timeout: float = 5.0) -> None:
        """Wait until the watchers have reported the exits (so events precede the answer)."""
        await _until(lambda: not any(not r.done and not procs.alive(r.target) for r in recs), timeout)

    @staticmethod
    async def _gone(recs: list[RankRecord], timeout: float) -> None:
        """Wait until these ranks' processes are gone and reaped, their memory released."""
        await _until(lambda: all(r.done for r in recs), timeout)

    # --- sweep ------------------------------------------------------------------
    async def sweep(self, grace: float = 5.0, current: int | None | str = "live") -> dict:
        """Stop debris. `current` is the generation that may keep running: by
        default the live one; the controller passes None between generations,
        which also stops this agent's own ranks of any generation."""
        if current == "live":
            current = self.current_generation()
        for g in sorted({r.generation for r in self.live() if r.generation != current}):
            await self.stop(g, StopMode.KILL, grace)
        keep = {r.pid for r in self.live()} | {os.getpid(), self.standby.pid}
        debris = orphans.select_orphans(orphans.scan(), agent=str(self.state_dir.resolve()), current=current,
                                        keep_pids=keep, manifest=self.manifest.read(), now=time.time(),
                                        ibv_limit=self.config.ibv_hang_seconds)
        result = await procs.stop_ladder([procs.Target(o.pid, o.create_time) for o in debris], grace=grace)
        killed = [{"pid": o.pid, "reason": o.reason, "what": o.what} for o in debris if o.pid in result.stopped]
        survived = [{"pid": o.pid, "reason": o.reason, "what": o.what} for o in debris
                    if o.pid in result.survivors]
        self.counters.orphans_killed += len(killed)
        self.counters.survivors += len(survived)
        self.manifest.keep(lambda e: e.generation == current)
        if debris:
            await self.emit(OrphansSwept(node=self.config.node, generation=current if current is not None else -1,
                                         rank=-1, at=time.time(), killed=tuple(o["pid"] for o in killed),
                                         survived=tuple(o["pid"] for o in survived)))
        if survived:
            await self.emit(RebootRequired(node=self.config.node, generation=-1, rank=-1, at=time.time(),
                                           reason=f"{len(survived)} process(es) survived SIGKILL in the sweep"))
        return {"killed": killed, "survived": survived, "steps": list(result.steps)}

    def _generation_dirs(self) -> list[int]:
        """The generations whose directories (rank logs, status files) this node keeps."""
        return [int(d.name.removeprefix("gen-")) for d in self.state_dir.glob("gen-*")
                if d.name.removeprefix("gen-").isdigit()]

    def highest_generation(self) -> int:
        """The highest generation this node has run or recorded (its ranks, its generation directories),
        whichever controller numbered it; 0 when none. A starting controller numbers its generations above it."""
        return max([0, *self._generation_dirs(), *(g for g, _ in self.records)])

    def prune(self) -> list[int]:
        """Remove the generation directories retention no longer keeps (never one a live rank uses)."""
        gone = generations_to_prune(self._generation_dirs(), self.config.keep_generations,
                                    {r.generation for r in self.live()})
        for g in gone:
            shutil.rmtree(self.state_dir / f"gen-{g}", ignore_errors=True)
        return gone

    def log_path(self, generation: int, rank: int) -> Path:
        rec = self.records.get((generation, rank))
        return rec.log_path if rec else rank_dir(self.state_dir, generation, rank) / "rank.log"
