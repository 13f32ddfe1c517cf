"""The agent's standby rank (runtime/standby.py): one process per agent whose imports and device init
are done, started once this node's rank serves, and handed the next generation's rank instead of a
cold spawn. One that exited, is not ready, is stale (a file of the code it imported changed, vanished
or was replaced since it was ready), was started for another environment, or does not answer at the
moment of the hand-over (stopped, hung) is ended and replaced, never used. It belongs to no generation
until it takes a spec: its exit is no rank's death, and a sweep ends it only once its agent is gone.

The decisions are pure (`rank_args`, `early_env`, `refusal`, `changed_code`, `answered`, `respawn_in`);
`Keeper` carries them out.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

from agents.events import Listener
from agents.orphans import STANDBY_MARKER
from common import procs
from common.protocol import Event, RankStateChanged
from common.states import RankState
from common.buildinfo import identities

log = structlog.get_logger("meshd.agent")

RANK_MODULE = "runtime.rank"
RESPAWN_AFTER = 30.0  # seconds after a standby died before it was ready: one that keeps dying costs no more
ANSWER_WITHIN = 1.0  # seconds a standby has to answer before it is handed a rank
REAP_WITHIN = 5.0  # seconds for a SIGKILLed standby to be gone
SILENT = f"the standby did not answer within {ANSWER_WITHIN:g} s (stopped or hung)"


def rank_args(argv: list[str], python: str) -> list[str] | None:
    """The rank's own arguments when `argv` runs meshd-rank under `python` (what a standby can become),
    else None."""
    return argv[3:] if argv[:3] == [python, "-m", RANK_MODULE] else None


def early_env(env: dict[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """What of a rank's environment a standby reads before it takes one: what its imports and device init
    read (`names`: the variables a start may set, and the GPUs it sees), what is preloaded into it (at its
    exec: agents/ringwait.py) and its node and mesh (its process title); a standby started in another one cannot
    take it."""
    return {k: env[k] for k in sorted({*names, "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "MESHD_MESH", "MESHD_NODE"})
            if k in env}


@dataclass(frozen=True)
class Standby:
    target: procs.Target
    early: dict
    report: Path
    answer: Path  # where it answers the agent's questions


def refusal(standby: Standby | None, *, alive: bool, report: dict | None, changed: list[str],
            early: dict) -> str | None:
    """Why `standby` must not take a rank whose early environment is `early` (None: it may; it is then
    asked whether it answers). `changed`: the files of its code that are not those it reported."""
    if standby is None:
        return "no standby"
    if not alive:
        return "the standby exited"
    if not reported(standby, report):
        return "the standby is not ready yet"
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        return f"the standby is stale: {changed[0]}{more} changed, vanished or was replaced since it was ready"
    if early != standby.early:
        return "the standby was started for another environment"
    return None


def changed_code(reported_code: dict[str, list[int] | None], now: dict[str, list[int] | None]) -> list[str]:
    """The paths of a standby's code (its modules' files, their distributions' dist-info) whose identity
    now (`common.buildinfo.identities`) is not the one it reported when it was ready."""
    return sorted(path for path, identity in reported_code.items() if now.get(path) != identity)


def answered(asked: str, answer: dict | None) -> bool:
    """The standby's last answer is to the question `asked` (not to an earlier one)."""
    return answer is not None and answer.get("answered") == asked


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


def read_json(path: Path) -> dict | None:
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

    @property
    def ready(self) -> bool:
        """The standby held reported ready: its imports and device init are done."""
        return self.standby is not None and reported(self.standby, read_json(self.standby.report))

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
        report, answer = self.dir / "report.json", self.dir / "answer.json"
        report.unlink(missing_ok=True)
        env = {**os.environ, **early, "MESHD_AGENT": str(self.dir.parent.resolve())}
        self.proc = await procs.spawn([self.python, "-m", "runtime.standby", "--report", str(report),
                                       "--answer", str(answer), STANDBY_MARKER],
                                      self.dir / "standby.log", env=env, cwd=self.dir, stdin=True)
        target = procs.identify(self.proc.pid) or procs.Target(self.proc.pid, time.time())
        self.standby = Standby(target, early, report, answer)
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
        report = read_json(standby.report)
        alive = procs.alive(standby.target)
        code = report["code"] if reported(standby, report) else {}
        changed = changed_code(code, await asyncio.to_thread(identities, list(code)))
        why = refusal(standby, alive=alive, report=report, changed=changed, early=early)
        if why is None and not await self._answers(standby, proc):
            why = SILENT
        self.standby, self.proc = None, None
        if why is not None:
            log.warning("standby not used: ending it, the rank spawns cold", pid=standby.target.pid, why=why)
            if alive:
                await self._end(standby, proc)
            else:
                self._lost(standby)
            return None
        proc.stdin.write(json.dumps({"argv": args, "env": env, "cwd": str(cwd), "log": str(log_path)}).encode()
                         + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    @staticmethod
    async def _answers(standby: Standby, proc: asyncio.subprocess.Process) -> bool:
        """Ask the standby, on its pipe, whether it is there; whether it answered within ANSWER_WITHIN."""
        asked = secrets.token_hex(8)
        deadline = time.monotonic() + ANSWER_WITHIN
        try:
            proc.stdin.write(json.dumps({"ask": asked}).encode() + b"\n")
            await asyncio.wait_for(proc.stdin.drain(), ANSWER_WITHIN)
        except (OSError, asyncio.TimeoutError):
            return False
        while not answered(asked, read_json(standby.answer)):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _look_again(self, delay: float, early: dict, serving: Callable[[], bool]) -> None:
        await asyncio.sleep(delay)
        if serving():
            await self.ensure(early, serving)

    def _lost(self, standby: Standby) -> None:
        """`standby` died by itself; before it was ready, its next start waits RESPAWN_AFTER."""
        ready = reported(standby, read_json(standby.report))
        log.warning("standby exited", pid=standby.target.pid, ready=ready)
        if not ready:
            self.failed_at = time.monotonic()
        self.standby, self.proc = None, None

    async def close(self) -> None:
        """End the standby (the agent stops; its ranks stay, a standby does not)."""
        if self._again is not None:
            self._again.cancel()
        if self.standby is not None:
            await self._end(self.standby, self.proc)
            self.standby, self.proc = None, None

    @staticmethod
    async def _end(standby: Standby, proc: asyncio.subprocess.Process) -> None:
        """SIGKILL, and reaped before this returns: a standby holds nothing a SIGTERM would save, and a
        stopped one would not run it."""
        procs.send(standby.target, signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), REAP_WITHIN)
        except asyncio.TimeoutError:
            log.error("standby survived SIGKILL", pid=standby.target.pid, waited=REAP_WITHIN)
            return
        log.info("standby ended", pid=standby.target.pid, signal="SIGKILL")


def takes_its_turn(event: Event) -> bool:
    """Whether `event` calls for a standby: a rank of this node became ready, so one may start beside it
    (for the next generation) while it serves, never beside a loading one."""
    return isinstance(event, RankStateChanged) and event.state == RankState.READY


def trigger(keeper: Keeper, early: Callable[[], dict], serving: Callable[[], bool]) -> Listener:
    """The standby's listener on the agent's event log: `keeper` asked for a standby (with the last rank's
    environment, `early()`) when an event calls for one."""
    async def on_event(event: Event) -> None:
        if takes_its_turn(event):
            await keeper.ensure(early(), serving)
    return on_event
