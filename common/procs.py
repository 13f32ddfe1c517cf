"""The process verbs, the one place that spawns, signals and kills.

A process is named by its pid *and* its create time (`Target`), so a recycled
pid is never signalled. Verbs: `spawn` (a detached child in its own session,
output to a file: it outlives its parent, and its group can be signalled),
`alive`, `ending`, `send`, `stop_ladder` (the one kill ladder: optional drain, SIGTERM
to each process group, one shared deadline, SIGKILL to what is left, a final
check), and `run` (a command under a timeout that kills its whole group: a hung
tool's children would otherwise hold the pipe open).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import psutil

from common.secretfile import open_appending


@dataclass(frozen=True)
class Target:
    pid: int
    create_time: float


@dataclass(frozen=True)
class LadderResult:
    stopped: tuple[int, ...]
    survivors: tuple[int, ...]
    steps: tuple[str, ...]


@dataclass(frozen=True)
class RunResult:
    code: int | None  # None when the command hung and was killed
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def hung(self) -> bool:
        return self.code is None


def identify(pid: int) -> Target | None:
    """The live process `pid`, as a Target; None when there is none."""
    try:
        return Target(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def alive(t: Target) -> bool:
    """Exists, is the same process (create time), and is not a zombie."""
    try:
        p = psutil.Process(t.pid)
        return abs(p.create_time() - t.create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def ending(t: Target) -> bool:
    """Gone, a zombie, or already exiting. Linux shows a process's exit status (field 52 of /proc/PID/stat)
    from the moment it starts to exit, through its teardown (a CUDA process's: 0.15-0.24 s on an H200), until
    it is reaped; a stopped process shows its stop signal there. Elsewhere: gone or a zombie."""
    if not alive(t):
        return True
    try:
        fields = Path(f"/proc/{t.pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3, the state
    except (OSError, IndexError):
        return False
    return fields[0] not in ("T", "t") and len(fields) > 49 and fields[49] != "0"


def send(t: Target, sig: int) -> None:
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


def _detached(log_path: Path, stdin: bool = False) -> dict:
    """Popen options of a child that outlives its parent: its own session
    (its group can be signalled as one), stdin closed (or a pipe from the parent), output appended to a
    file only its user reads."""
    return {"stdin": subprocess.PIPE if stdin else subprocess.DEVNULL, "stdout": open_appending(log_path),
            "stderr": subprocess.STDOUT, "start_new_session": True}


async def spawn(argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                cwd: Path | None = None, stdin: bool = False) -> asyncio.subprocess.Process:
    """A detached child whose exit the event loop learns of at once (SIGCHLD); `stdin`: it reads a
    pipe the caller writes (`proc.stdin`), whose end it sees when the caller is gone."""
    opts = _detached(log_path, stdin)
    try:
        return await asyncio.create_subprocess_exec(*argv, env=env, cwd=str(cwd) if cwd else None, **opts)
    finally:
        opts["stdout"].close()


def spawn_detached(argv: list[str], log_path: Path) -> Target:
    """A detached child for a caller that does not wait for it (a daemon)."""
    opts = _detached(log_path)
    try:
        proc = subprocess.Popen(argv, **opts)
    finally:
        opts["stdout"].close()
    return identify(proc.pid) or Target(proc.pid, time.time())


async def _wait_gone(targets: list[Target], deadline: float, escalate: Callable[[Target], bool] | None = None,
                     steps: list[str] | None = None) -> None:
    while any(alive(t) for t in targets) and time.monotonic() < deadline:
        if escalate is not None:
            for t in targets:
                if alive(t) and escalate(t):
                    steps.append(f"SIGKILL {t.pid} (blocked)")
                    send(t, signal.SIGKILL)
        await asyncio.sleep(0.02)


async def stop_ladder(targets: list[Target], *, grace: float, drain: Callable[[], Awaitable[None]] | None = None,
                      kill_grace: float = 2.0, progress: Callable[[str], None] = lambda s: None,
                      escalate: Callable[[Target], bool] | None = None,
                      escalate_grace: float = 0.5) -> LadderResult:
    """Drain (when given), then SIGTERM, the grace period, SIGKILL, and a check.

    `grace` bounds the drain and the SIGTERM steps each; a process still
    present `kill_grace` seconds after SIGKILL is a survivor (on macOS that
    means a reboot). A process for which `escalate` says yes once it has had
    `escalate_grace` seconds of its SIGTERM (one blocked where no signal
    handler runs) gets its SIGKILL then, not at the end of the grace."""
    steps: list[str] = []
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
            send(t, sig)
        if sig == signal.SIGTERM and escalate is not None:
            await _wait_gone(targets, time.monotonic() + min(escalate_grace, wait))
            await _wait_gone(targets, time.monotonic() + max(0.0, wait - escalate_grace), escalate, steps)
        else:
            await _wait_gone(targets, time.monotonic() + wait)
    survivors = tuple(t.pid for t in targets if alive(t))
    return LadderResult(tuple(t.pid for t in targets if t.pid not in survivors), survivors, tuple(steps))


def run(argv: list[str], timeout: float, *, env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None) -> RunResult:
    """Run a command to its end, its output read line by line (passed to
    `on_line` as it comes); after `timeout` seconds its whole session is
    killed and the result says it hung."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    hung = threading.Event()

    def kill() -> None:
        hung.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    lines = []
    try:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append(line)
            if on_line:
                on_line(line)
        code = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
    return RunResult(None if hung.is_set() else code, "\n".join(lines), time.monotonic() - t0)


def resources(t: Target) -> dict:
    """Resident memory (bytes) and CPU seconds of a process tree."""
    try:
        p = psutil.Process(t.pid)
        procs = [p, *p.children(recursive=True)]
        return {"rss_bytes": sum(q.memory_info().rss for q in procs),
                "cpu_seconds": sum(sum(q.cpu_times()[:2]) for q in procs)}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {"rss_bytes": 0, "cpu_seconds": 0.0}
