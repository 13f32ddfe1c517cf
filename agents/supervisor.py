"""What an agent does to its node's ranks: start, stop, adopt, sweep.

One live generation at a time: a start waits for a stopping generation's processes to be gone (their
memory released) before its rank starts, and that rank is the agent's standby (agents/standby.py)
when one can take it, else a cold spawn. The launch manifest (generation, rank, pid,
create time) is written before a start returns, so an agent that is killed
and started again adopts the ranks that are still running instead of killing
them, and can tell retired generations' leftovers from the live one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from agents import orphans
from agents.config import AgentConfig, Profile
from agents.events import EventLog
from agents.standby import Keeper, early_env
from agents.stall import blocked_on_peer
from agents.watch import RankRecord, RankWatcher
from common import procs
from common.hostfile import MLX_BACKEND, HostfileError, launch_env
from common.modelref import ModelNotFound, resolve
from common.protocol import (OrphansSwept, RankExited, RankSignature, RankSpec, RankStarted, RankStateChanged,
                             RebootRequired, StopResult)
from common.states import RankState, StopMode
from common.statusfile import write_atomic


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


class BadSpec(ValueError):
    """A start request this agent cannot run (HTTP 400); names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class Counters:
    exits: dict
    signatures: dict
    orphans_killed: int = 0
    survivors: int = 0


class Supervisor:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.state_dir = config.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.state_dir / "events.jsonl")
        self.records: dict[tuple[int, int], RankRecord] = {}
        self.reboot_required: str | None = None
        self.wired_limit: dict | None = None  # what applying agent.toml's wired_limit_mb did
        self.counters = Counters(exits={}, signatures={})
        self._lock = asyncio.Lock()
        self._manifest_path = self.state_dir / "manifest.json"
        self.standby = Keeper(self.state_dir, config.python, config.standby)
        self._early = early_env(dict(os.environ), config.env_allowlist)  # the last rank's, for its standby

    # --- manifest ---------------------------------------------------------------
    def _read_manifest(self) -> list[dict]:
        try:
            return json.loads(self._manifest_path.read_text())
        except (OSError, ValueError):
            return []

    def _write_manifest(self, entries: list[dict]) -> None:
        write_atomic(self._manifest_path, entries)

    def _record_in_manifest(self, rec: RankRecord) -> None:
        entries = [e for e in self._read_manifest()
                   if (e["generation"], e["rank"]) != (rec.generation, rec.rank)]
        self._write_manifest(entries + [rec.manifest_entry()])

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
        if isinstance(event, RankStateChanged) and event.state == RankState.READY:
            await self.standby.ensure(self._early, self.serving)  # while this rank serves, for the next generation

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

    # --- adopt ------------------------------------------------------------------
    async def adopt(self) -> None:
        """On agent start: watch again the manifest's ranks that still run."""
        keep = []
        for e in self._read_manifest():
            target = procs.Target(e["pid"], e["create_time"])
            if not procs.alive(target):
                await self.emit(RankExited(node=self.config.node, generation=e["generation"], rank=e["rank"],
                                           at=time.time(), pid=e["pid"], code=None, signal=None, expected=False))
                continue
            rec = RankRecord(e["generation"], e["rank"], e["pid"], e["create_time"], e["spawned_at"],
                             Path(e["log_path"]), Path(e["status_path"]) if e["status_path"] else None,
                             e["port"], e["host"], e["profile"], proc=None)
            self.records[(rec.generation, rec.rank)] = rec
            keep.append(e)
            await self.emit(RankStarted(node=self.config.node, generation=rec.generation, rank=rec.rank,
                                        at=time.time(), pid=rec.pid, adopted=True))
            self._watch(rec)
        self._write_manifest(keep)

    # --- start ------------------------------------------------------------------
    def _argv(self, profile: Profile, spec: RankSpec, model: Path, status_file: Path) -> list[str]:
        values = {"python": self.config.python, "model": model, "port": spec.port, "host": spec.host,
                  "seed": spec.seed, "generation": spec.generation, "rank": spec.rank, "world": spec.world,
                  "status_file": status_file}
        argv = [part.format(**values) for part in profile.command]
        for name, value in spec.args.items():
            if name not in profile.args:
                raise BadSpec(f"args.{name}", f"profile {profile.name!r} takes no parameter {name!r}; "
                                              f"it takes: {', '.join(sorted(profile.args)) or 'none'}")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise BadSpec(f"args.{name}", f"args.{name} must be a string or a number")
            argv += [profile.args[name], str(value)]
        return argv

    async def start(self, spec: RankSpec) -> tuple[RankRecord, bool]:
        """Start rank G/r; returns (record, created). Idempotent for the same G/r."""
        async with self._lock:
            existing = self.records.get((spec.generation, spec.rank))
            if existing is not None and not existing.done:
                return existing, False
            others = [r for r in self.live() if (r.generation, r.rank) != (spec.generation, spec.rank)]
            if others and all(o.stopping for o in others):
                await self._gone(others, RELEASE_WAIT)
                others = [o for o in others if not o.done]
            if others:
                o = others[0]
                raise Conflict(f"generation {o.generation} rank {o.rank} is running here (pid {o.pid}); "
                               f"stop it first (POST /v1/generations/{o.generation}/stop)")
            profile = self.config.profiles.get(spec.profile)
            if profile is None:
                raise BadSpec("profile", f"profile {spec.profile!r} is not allowed on this node; "
                                         f"allowed: {', '.join(sorted(self.config.profiles))}")
            bad_env = sorted(set(spec.env) - set(self.config.env_allowlist))
            if bad_env:
                raise BadSpec("env", f"env {bad_env} not in this agent's env_allowlist "
                                     f"({', '.join(self.config.env_allowlist)})")
            try:
                model = resolve(spec.model, self.config.node)
            except ModelNotFound as e:
                raise BadSpec("model", str(e))
            try:
                launch = launch_env(spec.hostfile, spec.rank, starting_port=spec.ring_port, nccl_port=spec.ring_port)
            except HostfileError as e:
                raise BadSpec("hostfile", str(e))
            if len(spec.hostfile["hosts"]) != spec.world:
                raise BadSpec("world", f"world is {spec.world} but the hostfile lists "
                                       f"{len(spec.hostfile['hosts'])} hosts")
            rundir = self.state_dir / f"gen-{spec.generation}" / f"rank-{spec.rank}"
            rundir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **launch.env, **{k: str(v) for k, v in spec.env.items()}}
            for var, content in launch.files.items():
                path = rundir / f"{var.lower()}.json"
                path.write_text(content + "\n")
                env[var] = str(path)
            status_path = rundir / "status.json"
            status_path.unlink(missing_ok=True)
            if spec.devices and "CUDA_VISIBLE_DEVICES" in launch.env:
                env["CUDA_VISIBLE_DEVICES"] = spec.devices
            env["MESHD_BACKEND"] = MLX_BACKEND[spec.hostfile.get("backend", "ring")]
            env["MESHD_GENERATION"] = str(spec.generation)
            env["MESHD_NODE"] = self.config.node
            env["MESHD_AGENT"] = str(self.state_dir.resolve())
            env["MESHD_STATUS_FILE"] = str(status_path)
            env.pop("MESHD_RANK_SECRET", None)
            if spec.secret:
                env["MESHD_RANK_SECRET"] = spec.secret
            argv = self._argv(profile, spec, model, status_path)
            log_path = rundir / "rank.log"
            early = early_env(env, self.config.env_allowlist)
            proc = await self.standby.take(argv, env, rundir, log_path, early)
            warm = proc is not None
            if proc is None:
                proc = await procs.spawn(argv, log_path, env=env, cwd=rundir)
            self._early = early
            target = procs.identify(proc.pid)
            rec = RankRecord(spec.generation, spec.rank, proc.pid, target.create_time if target else time.time(),
                             time.time(), log_path, status_path if profile.status_file else None, spec.port,
                             spec.host, spec.profile, proc=proc)
            self.records[(rec.generation, rec.rank)] = rec
            self._record_in_manifest(rec)
            await self.emit(RankStarted(node=self.config.node, generation=rec.generation, rank=rec.rank,
                                        at=time.time(), pid=rec.pid, warm=warm))
            self._watch(rec)
            self.prune()
            return rec, True

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
        self._write_manifest([e for e in self._read_manifest() if e["generation"] != generation])
        return StopResult(generation, result.stopped, survivors, result.steps)

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
                                        keep_pids=keep, manifest=self._read_manifest(), now=time.time(),
                                        ibv_limit=self.config.ibv_hang_seconds)
        result = await procs.stop_ladder([procs.Target(o.pid, o.create_time) for o in debris], grace=grace)
        killed = [{"pid": o.pid, "reason": o.reason, "what": o.what} for o in debris if o.pid in result.stopped]
        survived = [{"pid": o.pid, "reason": o.reason, "what": o.what} for o in debris
                    if o.pid in result.survivors]
        self.counters.orphans_killed += len(killed)
        self.counters.survivors += len(survived)
        self._write_manifest([e for e in self._read_manifest() if e["generation"] == current])
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
        return rec.log_path if rec else self.state_dir / f"gen-{generation}" / f"rank-{rank}" / "rank.log"
