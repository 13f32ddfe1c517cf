"""The agent's standby rank (runtime/standby.py): one process per agent whose imports and device init
are done, started once this node's rank serves, and handed the next generation's rank instead of a
cold spawn. One that exited, is not ready, is stale (the code it imported changed on disk since it
started) or was started for another environment is replaced, never used. It belongs to no generation
until it takes a spec: its exit is no rank's death, and a sweep ends it only once its agent is gone.

The decisions are pure (`rank_args`, `early_env`, `refusal`, `respawn_in`); `Keeper` carries them out.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

from agents.orphans import STANDBY_MARKER
from common import procs
from common.buildinfo import newest_change

log = structlog.get_logger("meshd.agent")

RANK_MODULE = "runtime.rank"
RESPAWN_AFTER = 30.0  # seconds after a standby died before it was ready: one that keeps dying costs no more


def rank_args(argv: list[str], python: str) -> list[str] | None:
    """The rank's own arguments when `argv` runs meshd-rank under `python` (what a standby can become),
    else None."""
    return argv[3:] if argv[:3] == [python, "-m", RANK_MODULE] else None


def early_env(env: dict[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """What of a rank's environment a standby reads before it takes one: what its imports and device init
    read (`names`: the variables a start may set, and the GPUs it sees) and its node (its process title);
    a standby started in another one cannot take it."""
    return {k: env[k] for k in sorted({*names, "CUDA_VISIBLE_DEVICES", "MESHD_NODE"}) if k in env}


@dataclass(frozen=True)
class Standby:
    target: procs.Target
    early: dict
    report: Path
    started: float  # its create time, by this host's clock


def refusal(standby: Standby | None, *, alive: bool, report: dict | None, changed_at: float,
            early: dict) -> str | None:
    """Why `standby` must not take a rank whose early environment is `early` (None: it may).
    `changed_at`: when the code under its report's roots last changed on disk."""
    if standby is None:
        return "no standby"
    if not alive:
        return "the standby exited"
    if not reported(standby, report):
        return "the standby is not ready yet"
    if changed_at > standby.started:
        return "the standby is stale: the code it imported changed on disk after it started"
    if early != standby.early:
        return "the standby was started for another environment"
    return None


def reported(standby: Standby, report: dict | None) -> bool:
    """The standby wrote its report: its imports and device init are done."""
    return report is not None and report.get("pid") == standby.target.pid


def respawn_in(*, enabled: bool, held: bool, failed_at: float | None, now: float,
               after: float = RESPAWN_AFTER) -> float | None:
    """When to start a standby (this node's rank serves): None when none is wanted (disabled, or one is
    held), else in how many seconds: 0 now, or the rest of `after` since the last one died before it was
    ready (`failed_at`)."""
    if not enabled or held:
        return None
    return 0.0 if failed_at is None else max(0.0, after - (now - failed_at))


def read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Keeper:
    """Holds this agent's standby: starts it, hands it a rank, ends it."""

    def __init__(self, state_dir: Path, python: str, enabled: bool, respawn_after: float = RESPAWN_AFTER):
        self.dir = state_dir / "standby"
        self.python = python
        self.enabled = enabled
        self.respawn_after = respawn_after
        self._again: asyncio.Task | None = None  # a later look, after one died before it was ready
        self.standby: Standby | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.failed_at: float | None = None  # when a standby was found dead before it was ready
        self._lock = asyncio.Lock()  # one start or hand-over at a time

    @property
    def pid(self) -> int | None:
        return self.standby.target.pid if self.standby else None

    async def ensure(self, early: dict, serving: Callable[[], bool]) -> None:
        """Start a standby for ranks with environment `early`, when one is wanted: now, or once the wait
        after an unready death is over if this node's rank still serves then (`serving`). Called while
        this node's rank serves, never beside a loading one, whose CPU and memory it would take."""
        async with self._lock:
            await self._ensure(early, serving)

    async def _ensure(self, early: dict, serving: Callable[[], bool]) -> None:
        held = self.standby is not None and procs.alive(self.standby.target)
        if self.standby is not None and not held:
            self._lost(self.standby)
        delay = respawn_in(enabled=self.enabled, held=held, failed_at=self.failed_at, now=time.monotonic(),
                           after=self.respawn_after)
        if delay is None:
            return
        if delay > 0:
            if self._again is None or self._again.done():
                self._again = asyncio.create_task(self._look_again(delay, early, serving))
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        report = self.dir / "report.json"
        report.unlink(missing_ok=True)
        env = {**os.environ, **early, "MESHD_AGENT": str(self.dir.parent.resolve())}
        self.proc = await procs.spawn([self.python, "-m", "runtime.standby", "--report", str(report), STANDBY_MARKER],
                                      self.dir / "standby.log", env=env, cwd=self.dir, stdin=True)
        target = procs.identify(self.proc.pid) or procs.Target(self.proc.pid, time.time())
        self.standby = Standby(target, early, report, target.create_time)
        log.info("standby started", pid=target.pid)

    async def take(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path,
                   early: dict) -> asyncio.subprocess.Process | None:
        """Hand the rank (`argv` as its profile runs it) to the standby: its process, now that rank; or
        None (the standby, if any, ended) when the rank must be spawned cold."""
        async with self._lock:
            return await self._take(argv, env, cwd, log_path, early)

    async def _take(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path,
                    early: dict) -> asyncio.subprocess.Process | None:
        args = rank_args(argv, self.python)
        standby, proc = self.standby, self.proc
        if args is None or standby is None:
            return None
        report = read_report(standby.report)
        alive = procs.alive(standby.target)
        changed_at = await asyncio.to_thread(newest_change, report["roots"]) if report else 0.0
        why = refusal(standby, alive=alive, report=report, changed_at=changed_at, early=early)
        self.standby, self.proc = None, None
        if why is not None:
            log.info("standby not used", pid=standby.target.pid, why=why)
            if not alive:
                self._lost(standby)
            await self._end(standby)
            return None
        proc.stdin.write(json.dumps({"argv": args, "env": env, "cwd": str(cwd), "log": str(log_path)}).encode()
                         + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def _look_again(self, delay: float, early: dict, serving: Callable[[], bool]) -> None:
        await asyncio.sleep(delay)
        if serving():
            await self.ensure(early, serving)

    def _lost(self, standby: Standby) -> None:
        """`standby` died by itself; before it was ready, its next start waits RESPAWN_AFTER."""
        ready = reported(standby, read_report(standby.report))
        log.warning("standby exited", pid=standby.target.pid, ready=ready)
        if not ready:
            self.failed_at = time.monotonic()
        self.standby, self.proc = None, None

    async def close(self) -> None:
        """End the standby (the agent stops; its ranks stay, a standby does not)."""
        if self._again is not None:
            self._again.cancel()
        if self.standby is not None:
            await self._end(self.standby)
            self.standby, self.proc = None, None

    @staticmethod
    async def _end(standby: Standby) -> None:
        await procs.stop_ladder([standby.target], grace=2.0)
