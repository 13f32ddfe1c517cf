"""Background daemons that meshctl starts itself (the demo mesh's agents and
controller): pidfiles and logs in a run directory, start, stop with the ladder."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from common import procs
from common.tomlcheck import loopback, wildcard
from meshd.meshctl.ports import tcp_sockets


class NotStarted(Exception):
    """A daemon meshctl started did not come up (the message says where its log is)."""


def _read_pid(pidfile: Path) -> procs.Target | None:
    """The live daemon a pidfile (pid and create time) names, or None."""
    try:
        pid, created = pidfile.read_text().split()
        target = procs.Target(int(pid), float(created))
    except (OSError, ValueError):
        return None
    return target if procs.alive(target) else None


def exited(pidfile: Path) -> int | None:
    """The pid of the daemon a pidfile names when that daemon has exited (None: no pidfile, or it runs)."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if running(pidfile) else pid


def running(pidfile: Path) -> bool:
    return _read_pid(pidfile) is not None


def pid_of(pidfile: Path) -> int | None:
    t = _read_pid(pidfile)
    return t.pid if t else None


def start(argv: list[str], pidfile: Path, logfile: Path) -> int:
    """Start a detached daemon unless its pidfile names a live one. It writes its log to `logfile` itself
    (--log-file: rotated, and readable through its API), where its stderr goes too."""
    if (t := _read_pid(pidfile)) is not None:
        return t.pid
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    t = procs.spawn_detached([*argv, "--log-file", str(logfile)], logfile)
    try:
        pidfile.write_text(f"{t.pid} {t.create_time}\n")
    except OSError as e:  # a full disk, say
        stop_targets([t], grace=5.0)
        pidfile.unlink(missing_ok=True)
        raise NotStarted(f"cannot write {pidfile} ({e.strerror}): {pidfile.stem} was stopped again, as nothing could "
                         f"stop it later; free space in {pidfile.parent}")
    return t.pid


def running_in(run: Path) -> dict[Path, int]:
    """The daemons of a run directory that run now: pidfile -> pid."""
    return {f: pid for f in sorted(run.glob("*.pid")) if (pid := pid_of(f)) is not None}


def stop(pidfiles: list[Path], grace: float = 10.0) -> dict[str, int]:
    """SIGTERM every daemon at once, wait up to `grace`, SIGKILL what is left. Returns what ran, by its
    pidfile's name (`controller`, `proxy`, `agent-node0`): the pids it stopped."""
    running = {f.stem: t for f in pidfiles if (t := _read_pid(f)) is not None}
    stop_targets(list(running.values()), grace)
    for f in pidfiles:
        f.unlink(missing_ok=True)
    return {name: t.pid for name, t in running.items()}


def stop_targets(targets: list[procs.Target], grace: float) -> None:
    asyncio.run(procs.stop_ladder(targets, grace=grace, kill_grace=5.0))


STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)  # SIGSTOP, or a debugger holds it


def process_state(pid: int) -> str | None:
    """psutil's word for what the process is doing (running, sleeping, stopped, ...); None when it is gone."""
    try:
        return psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def listener(host: str, port: int) -> int | None:
    """The pid of the process listening on host:port (or on every address) here, where the OS shows it."""
    def serves(ip: str) -> bool:
        return ip == host or wildcard(ip) or (loopback(ip) and loopback(host))
    return next((c.pid for c in tcp_sockets() if c.status == psutil.CONN_LISTEN and c.laddr.port == port
                 and serves(c.laddr.ip)), None)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def http_status(url: str) -> int | None:
    """The status `url` answers with, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def answers(url: str) -> bool:
    return http_status(url) == 200


def pids_below(root: Path) -> list[int]:
    """Live processes whose command line mentions `root`, or whose agent's state directory (MESHD_AGENT, as
    ranks and standbys carry it: their titles name no path) is below it: what a demo left behind."""
    needle = str(root)
    return [p.info["pid"] for p in _others() if any(needle in part for part in (p.info["cmdline"] or []))
            or _agent_below(p, root)]


def agents_children(root: Path) -> list[procs.Target]:
    """The live ranks and standbys that agents whose state directories are below `root` started (MESHD_AGENT in
    their environment): a rank outlives its agent, and an agent that died leaves it to whoever stops the mesh."""
    return [t for p in _others() if _agent_below(p, root) and (t := procs.identify(p.info["pid"])) and procs.alive(t)]


def _others():
    return (p for p in psutil.process_iter(["pid", "cmdline", "environ"]) if p.info["pid"] != os.getpid())


def _agent_below(p: psutil.Process, root: Path) -> bool:
    return (p.info["environ"] or {}).get("MESHD_AGENT", "").startswith(str(root.resolve()) + os.sep)
