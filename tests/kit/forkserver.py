"""The ranks, agents and meshctl runs the kit starts, forked from a process that has imported their code
instead of each paying its imports (a CPU-second and more for a rank: mlx-lm, transformers, aiohttp; a
third of one for an agent, a quarter for meshctl).

The server is the product's warm start (runtime/standby.py) turned into a fork server: it imports what a
standby imports, and each process it forks becomes what it was asked for as a standby becomes its rank
(`standby.become`: its directory, environment and log) and runs its module as `python -m` does, in a session
of its own. It does no device init before a fork: MLX starts its CPU stream's thread at the first
evaluation, and a fork carries over only the thread that forks; importing mlx, mlx-lm and transformers
starts no thread but numpy's OpenBLAS pool, which OpenBLAS shuts down and restarts across a fork.

What a process reads once, as it starts (`AT_EXEC`: the loader's preloads, the interpreter's path, the
imports' settings), a fork cannot change: a server serves one such environment, and `Servers` starts one
for each the kit asks for. `Forked` shows a forked process as `subprocess.Popen` shows a child (pid, poll,
wait, send_signal, returncode: the server reports its exit).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import agents.server  # noqa: F401  (imported to be forked warm)
import meshd.control.controllerd  # noqa: F401
import meshd.dataplane.proxyd  # noqa: F401
import meshd.meshctl.cli  # noqa: F401
import runtime.rank  # noqa: F401
from common import proctitle
from kit import warmstart
from kit.waiting import wait_for
from runtime import standby

# The server's command line is the memory each process it forks titles itself in (setproctitle): as long as an
# exec'd one's would be, so that a title naming a config's path (meshctl finds a demo's daemons by it) is whole.
TITLE_ROOM = " " * 2048
AT_EXEC = ("LD_", "PYTHON", "HF_", "TRANSFORMERS_")  # what is read once, at the start of the process


def at_exec(env: dict[str, str]) -> tuple:
    """What of `env` a process reads only as it starts: a fork server started in it serves it."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(AT_EXEC)))


class Forked:
    """A process the server forked: its pid, and its exit as the server reports it on `conn`."""

    def __init__(self, conn: socket.socket, pid: int):
        self.pid, self.returncode, self._conn = pid, None, conn

    def poll(self) -> int | None:
        return self.wait(0, raising=False)

    def wait(self, timeout: float | None = None, *, raising: bool = True) -> int | None:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                if raising:
                    raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
                return None
            line = self._conn.makefile().readline()
            self._conn.close()
            if not line:
                raise AssertionError(f"the fork server ended before process {self.pid}, whose exit only it sees")
            self.returncode = os.waitstatus_to_exitcode(json.loads(line)["status"])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended, and the server reaped it, after the poll: as Popen.send_signal
                pass


class Servers:
    """The fork servers of this process, one per environment read at exec; each ends with this process
    (its stdin is a pipe from here)."""

    def __init__(self):
        self._servers: dict[tuple, tuple[subprocess.Popen, Path]] = {}
        self._starting = threading.Lock()  # threads that ask at once (a fixture's meshes brought up together) share one

    def fork(self, module: str, argv: list[str], env: dict[str, str], log: Path, stderr: Path | None = None, *,
             warm: bool = True) -> Forked:
        """`python -m module` with arguments `argv` and environment `env`, its output to `log` (its stderr to
        `stderr` when given); `warm`: the meshd processes it starts are forked from it (kit/warmstart.py), not
        exec'd."""
        path = self._socket(env)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(path))
        spec = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log),
                "stderr": str(stderr) if stderr else None, "warm": warm}
        conn.sendall(json.dumps(spec).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise AssertionError(f"the fork server at {path} closed before it forked {module}")
            reply += chunk
        return Forked(conn, json.loads(reply)["pid"])

    def run(self, module: str, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """`python -m module` as `subprocess.run(..., capture_output=True, text=True, timeout=timeout)` runs it."""
        with tempfile.TemporaryDirectory(prefix="meshd-run-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            proc = self.fork(module, argv, env, out, err)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                raise subprocess.TimeoutExpired([module, *argv], timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess([module, *argv], code, out.read_text(), err.read_text())

    def _socket(self, env: dict[str, str]) -> Path:
        with self._starting:
            return self._started(at_exec(env))

    def _started(self, key: tuple) -> Path:
        if key in self._servers and self._servers[key][0].poll() is None:
            return self._servers[key][1]
        home = Path(tempfile.mkdtemp(prefix="meshd-forkserver-"))
        path, ready = home / "sock", home / "ready"
        # in this process's environment but for what is read at exec, which is the one asked for: what a forked
        # process's /proc/PID/environ shows, where a sweep looks for whose it is
        base = {k: v for k, v in os.environ.items() if not k.startswith(AT_EXEC)}
        proc = subprocess.Popen([sys.executable, "-m", "kit.forkserver", str(path), str(ready), TITLE_ROOM],
                                env={**base, **dict(key)}, cwd=Path(__file__).parent.parent, stdin=subprocess.PIPE,
                                start_new_session=True)
        self._servers[key] = (proc, path)
        wait_for(lambda: ready.exists() or proc.poll() is not None, 120, "the fork server to import its code")
        if proc.poll() is not None:
            raise AssertionError(f"the fork server exited {proc.returncode} before it was ready")
        return path


SERVERS = Servers()


def serve(path: Path, ready: Path) -> dict | None:
    """Fork a process for each spec asked on the socket at `path` and report its exit there; in a forked one,
    its spec. None once this server's stdin ends (the process that started it is gone)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    ready.touch()
    forked: dict[int, socket.socket] = {}
    while True:
        readable = select.select([listener, sys.stdin], [], [], 0.05)[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return None
        if listener in readable:
            conn, _ = listener.accept()
            spec = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                for held in (listener, conn, *forked.values()):
                    held.close()
                os.setsid()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                # `python -m runtime.rank` run in `cwd` has it first on its path; this server has tests/ there
                sys.path[0] = spec["cwd"]
                sys.argv = [spec["module"], *spec["argv"]]
                return spec
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            forked[pid] = conn
        while forked:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = forked.pop(pid)
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            conn.close()


def main() -> None:
    # setproctitle finds the command line's memory through the environment as the process started, which a
    # forked process has replaced (`become`) by the time it titles itself; the standby titles itself first too
    proctitle.set_title("meshd-forkserver")
    path = Path(sys.argv[1])
    spec = serve(path, Path(sys.argv[2]))
    if spec is None:
        shutil.rmtree(path.parent)  # its socket's folder, which the kit made for it
    else:
        standby.become(spec)
        if spec["warm"]:
            warmstart.install(lambda env: at_exec(env) == at_exec(spec["env"]))
        if spec["stderr"]:
            os.dup2(os.open(spec["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
