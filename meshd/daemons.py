"""Background daemons that meshctl starts itself (the demo mesh's agents and
controller): pidfiles and logs in a run directory, start, stop with a ladder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil


def _read_pid(pidfile: Path) -> psutil.Process | None:
    try:
        pid, created = pidfile.read_text().split()
        p = psutil.Process(int(pid))
        if abs(p.create_time() - float(created)) < 1.0 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def running(pidfile: Path) -> bool:
    return _read_pid(pidfile) is not None


def start(argv: list[str], pidfile: Path, logfile: Path) -> int:
    """Start a detached daemon unless its pidfile names a live one."""
    if (p := _read_pid(pidfile)) is not None:
        return p.pid
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pidfile.write_text(f"{proc.pid} {psutil.Process(proc.pid).create_time()}\n")
    return proc.pid


def stop(pidfiles: list[Path], grace: float = 10.0) -> None:
    """SIGTERM every daemon at once, wait up to `grace`, SIGKILL what is left."""
    procs = [p for p in map(_read_pid, pidfiles) if p is not None]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    for f in pidfiles:
        f.unlink(missing_ok=True)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def pids_below(root: Path) -> list[int]:
    """Live processes whose command line mentions `root` (what a demo left behind)."""
    needle = str(root)
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] != os.getpid() and any(needle in part for part in (p.info["cmdline"] or [])):
            out.append(p.info["pid"])
    return out
