"""What the kit's processes start of meshd, forked warm from themselves instead of exec'd cold.

Every process the kit forks from its fork server (kit/forkserver.py) has imported what meshd's processes import
and done no device init. Installed in one before its module runs (`install`), the processes it starts as
`python -m M` for M in `WARM`, in its own start-time environment, fork it instead of paying those imports
again: the ranks an agent starts (`common.procs.spawn`), the agents, controller and proxy meshctl starts
(`common.procs.spawn_detached`), unless a thread not Python's runs in it (`threads_all_pythons`). The child
becomes its process as the fork server's children become theirs (`standby.become`, then the module as
`python -m` runs it), and is its starter's own child, as an exec'd one is: the agent waits for its exit
(`Child`) and signals its group, the sweep finds it by its environment (`show_environment`) and title.
Everything else, and a process that reads its stdin (a standby), is exec'd as before; so is every process where
MLX is its CUDA build (`CUDA`): a child forked from a process that loaded the CUDA driver hangs at its first
evaluation (on an H200, a rank sat in `mx.random.seed` until it was killed; bench/rank_start.py started the
same rank exec'd in 30 s).

A starter's threads and event loop do not follow a fork: the child leaves the loop and its signal handlers,
closes every descriptor but its standard ones (as exec does) and freezes the starter's objects, which its
garbage collector must never close under it. It ends as the interpreter would have (non-daemon threads joined,
its output flushed, SystemExit's code, 1 after a traceback) without returning into its starter.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from common import procs, proctitle
from runtime import standby

WARM = ("runtime.rank", "agents.server", "meshd.control.controllerd", "meshd.dataplane.proxyd")


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


CUDA = any(_installed(f"mlx-cuda-{v}") for v in (12, 13))


def install(starts_as_this: Callable[[dict[str, str]], bool]) -> None:
    """`starts_as_this(env)`: would a process exec'd in `env` read at its start what this one read at its own
    (kit/forkserver.py `at_exec`)? Only such a process is forked."""
    cold, cold_detached = procs.spawn, procs.spawn_detached

    def warm(argv: list[str], env: dict[str, str]) -> bool:
        return (not CUDA and argv[:2] == [sys.executable, "-m"] and argv[2:3] and argv[2] in WARM
                and starts_as_this(env) and threads_all_pythons())

    async def spawn(argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                    cwd: Path | None = None, stdin: bool = False):
        env = dict(os.environ) if env is None else env
        if stdin or not warm(argv, env):
            return await cold(argv, log_path, env=env, cwd=cwd, stdin=stdin)
        return Child(fork(argv, log_path, env, cwd or Path.cwd()))

    def spawn_detached(argv: list[str], log_path: Path) -> procs.Target:
        if not warm(argv, dict(os.environ)):
            return cold_detached(argv, log_path)
        pid = fork(argv, log_path, dict(os.environ), Path.cwd())
        return procs.identify(pid) or procs.Target(pid, time.time())

    procs.spawn, procs.spawn_detached = spawn, spawn_detached


def threads_all_pythons() -> bool:
    """Whether every thread of this process is one of Python's: a thread of its own that MLX started at its
    first evaluation (meshctl building the demo model, say) would be missing from a fork, and the child would
    wait for it forever at its own first evaluation."""
    return len(os.listdir("/proc/self/task")) <= threading.active_count()


def fork(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> int:
    for stream in (sys.stdout, sys.stderr):  # what the starter wrote stays the starter's
        stream.flush()
    pid = os.fork()
    if pid == 0:
        become(argv, log_path, env, cwd)
    return pid


def become(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> None:
    code = 1
    try:
        leave_the_starter()
        args = standby.become({"argv": argv[3:], "cwd": str(cwd), "env": env, "log": str(log_path)})
        show_environment(env)
        marker = argv.index("--meshd-generation") if "--meshd-generation" in argv else None
        first = argv[marker:marker + 2] if marker else []  # the sweep's marker, before the title's room runs out
        proctitle.set_title(" ".join([*argv[:3], *first, *(a for i, a in enumerate(argv[3:], 3)
                                                          if marker is None or i not in (marker, marker + 1))]))
        sys.path[0] = str(cwd)
        sys.argv = [argv[2], *args]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            for t in threading.enumerate():
                if t is not threading.current_thread() and not t.daemon:
                    t.join()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def leave_the_starter() -> None:
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    gc.collect()
    gc.freeze()
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))


def show_environment(env: dict[str, str]) -> None:
    """Write `env` where /proc/PID/environ reads it, the environment block this process started with (its
    starter's; exec would have laid the child's there): MESHD_'s variables first, then what else fits."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])
    block = b""
    for k, v in sorted(env.items(), key=lambda kv: not kv[0].startswith("MESHD_")):
        entry = f"{k}={v}".encode() + b"\0"
        if len(block) + len(entry) < end - start:
            block += entry
    ctypes.memmove(start, block.ljust(end - start, b"\0"), end - start)


class Child:
    """A forked child as asyncio.subprocess.Process shows an exec'd one to the agent."""

    stdin = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd = os.pidfd_open(pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
