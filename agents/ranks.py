"""The only place that spawns, signals and kills rank processes.

Verbs: `spawn`, `alive`, `signal_group`, `stop_ladder` (the one kill ladder:
optional drain, SIGTERM to the process group, one shared grace deadline,
SIGKILL to survivors, a final check), and `list_processes` for the sweep.
Each rank is a session leader (its own process group), writes its output to
files rather than pipes, and so outlives an agent restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import psutil

from agents.orphans import IBV_TOOLS, MARKER, ProcInfo


@dataclass
class Target:
    """A process to stop: pid plus create time, so a recycled pid is never hit."""

    pid: int
    create_time: float


@dataclass(frozen=True)
class LadderResult:
    stopped: tuple[int, ...]
    survivors: tuple[int, ...]
    steps: tuple[str, ...]


async def spawn(argv: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> asyncio.subprocess.Process:
    with open(log_path, "ab") as log:
        return await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def alive(t: Target) -> bool:
    """Exists, is the same process (create time), and is not a zombie."""
    try:
        p = psutil.Process(t.pid)
        return abs(p.create_time() - t.create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _signal(t: Target, sig: int) -> None:
    """Signal the target's process group when it leads one, else the process."""
    if not alive(t):
        return
    try:
        if os.getpgid(t.pid) == t.pid:
            os.killpg(t.pid, sig)
        else:
            os.kill(t.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group(t: Target, sig: int) -> None:
    _signal(t, sig)


async def _wait_gone(targets: list[Target], deadline: float) -> None:
    while any(alive(t) for t in targets) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def stop_ladder(targets: list[Target], *, grace: float, drain: Callable[[], Awaitable[None]] | None = None,
                      kill_grace: float = 2.0, progress: Callable[[str], None] = lambda s: None) -> LadderResult:
    """Drain (when given), then SIGTERM, the grace period, SIGKILL, and a check.

    `grace` bounds the drain and the SIGTERM steps each; a process still
    present `kill_grace` seconds after SIGKILL is a survivor (on macOS that
    means a reboot)."""
    steps = []
    if drain is not None and any(alive(t) for t in targets):
        steps.append("drain")
        progress("drain")
        try:
            await asyncio.wait_for(drain(), timeout=grace)
        except (asyncio.TimeoutError, OSError) as e:
            steps.append(f"drain request failed: {type(e).__name__}")
        await _wait_gone(targets, time.monotonic() + grace)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_grace)):
        if not any(alive(t) for t in targets):
            break
        steps.append(sig.name)
        progress(sig.name)
        for t in targets:
            _signal(t, sig)
        await _wait_gone(targets, time.monotonic() + wait)
    survivors = tuple(t.pid for t in targets if alive(t))
    return LadderResult(tuple(t.pid for t in targets if t.pid not in survivors), survivors, tuple(steps))


def list_processes() -> list[ProcInfo]:
    """Processes that could be meshd debris: marked ranks and ibv tools. Only
    those get their environment read."""
    out = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "name", "cmdline", "create_time"]):
        info = p.info
        if info["pid"] == me or not info["cmdline"]:
            continue
        cmdline = tuple(info["cmdline"])
        joined = " ".join(cmdline)
        ibv = info["name"] in IBV_TOOLS or any(t in joined for t in IBV_TOOLS)
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            env = {}
        raw = env.get("MESHD_GENERATION")
        env_gen = int(raw) if raw and raw.isdigit() else None
        if not (MARKER.search(joined) or env_gen is not None or ibv):
            continue
        out.append(ProcInfo(info["pid"], info["name"] or "", cmdline, info["create_time"], env_gen,
                            env.get("MESHD_AGENT")))
    return out


def resources(t: Target) -> dict:
    """Resident memory (bytes) and CPU seconds of a rank's process tree."""
    try:
        p = psutil.Process(t.pid)
        procs = [p, *p.children(recursive=True)]
        rss = sum(q.memory_info().rss for q in procs)
        cpu = sum(sum(q.cpu_times()[:2]) for q in procs)
        return {"rss_bytes": rss, "cpu_seconds": cpu}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {"rss_bytes": 0, "cpu_seconds": 0.0}
