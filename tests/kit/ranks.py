"""Real `meshd-rank` processes as a ring mesh on loopback, started the way
mlx.launch would (MLX_RANK, MLX_HOSTFILE), and a recorder of a rank's status file.

Ranks on the ring backend are forked from a process that has done their imports (kit/forkserver.py), one
per environment read at exec (`AT_EXEC`: the loader's preloads, the interpreter's path, the imports'
settings), which a fork cannot change; `Forked` shows a forked rank as `subprocess.Popen` shows a child
(pid, poll, wait, send_signal, returncode: the server reports its exit). Ranks on NCCL are spawned."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports


AT_EXEC = ("LD_", "PYTHON", "HF_", "TRANSFORMERS_")  # what is read once, at the start of the process


def at_exec(env: dict[str, str]) -> tuple:
    """What of `env` a rank reads only as its process starts: a fork server started in it serves it."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(AT_EXEC)))


class Forked:
    """A rank the server forked: its pid, and its exit as the server reports it on `conn`."""

    def __init__(self, conn: socket.socket, pid: int):
        self.pid, self.returncode, self._conn = pid, None, conn

    def poll(self) -> int | None:
        return self.wait(0, raising=False)

    def wait(self, timeout: float | None = None, *, raising: bool = True) -> int | None:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                if raising:
                    raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
                return None
            line = self._conn.makefile().readline()
            self._conn.close()
            if not line:
                raise AssertionError(f"the fork server ended before rank {self.pid}, whose exit it alone can see")
            self.returncode = os.waitstatus_to_exitcode(json.loads(line)["status"])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Servers:
    """The fork servers of this process, one per environment read at exec; each ends with this process
    (its stdin is a pipe from here)."""

    def __init__(self):
        self._dir = Path(tempfile.mkdtemp(prefix="meshd-forkserver-"))
        self._servers: dict[tuple, tuple[subprocess.Popen, Path]] = {}

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> Forked:
        """A rank with arguments `argv` (meshd-rank's), environment `env`, output to `log`."""
        path = self._socket(env)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(path))
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise AssertionError(f"the fork server at {path} closed before it forked the rank")
            reply += chunk
        return Forked(conn, json.loads(reply)["pid"])

    def _socket(self, env: dict[str, str]) -> Path:
        key = at_exec(env)
        if key in self._servers and self._servers[key][0].poll() is None:
            return self._servers[key][1]
        home = Path(tempfile.mkdtemp(dir=self._dir))
        path, ready = home / "sock", home / "ready"
        proc = subprocess.Popen([sys.executable, "-m", "kit.forkserver", str(path), str(ready)], env=env,
                                cwd=Path(__file__).parent.parent, stdin=subprocess.PIPE, start_new_session=True)
        self._servers[key] = (proc, path)
        wait_for(lambda: ready.exists() or proc.poll() is not None, 120, "the fork server to import meshd-rank")
        if proc.poll() is not None:
            raise AssertionError(f"the fork server exited {proc.returncode} before it was ready")
        return path


SERVERS = Servers()


@dataclass
class Mesh:
    procs: list[subprocess.Popen | Forked]
    port: int
    status_files: list[Path]
    logs: list[Path]
    hostfile: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self, rank: int) -> dict | None:
        try:
            return json.loads(self.status_files[rank].read_text())
        except (OSError, ValueError):
            return None

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/internal/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = 120) -> None:
        def check():
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise AssertionError(f"rank {i} exited {p.returncode}:\n{self.log(i)}")
            return self.ready()
        wait_for(check, timeout, "the mesh to be ready", interval=0.1)

    def first_token(self) -> float:
        """Seconds from asking rank 0 a short streamed question to its first token."""
        t0 = time.perf_counter()
        r = requests.post(f"{self.url}/v1/chat/completions", stream=True, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                return time.perf_counter() - t0
        raise AssertionError("no token")

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def wait_exit(self, timeout: float = 60) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)


def start_mesh(model: Path, world: int, tmp: Path, *args: str, generation: int = 1, env: dict | None = None,
               backend: str = "ring") -> Mesh:
    """Spawn `world` ranks with the env mlx.launch would give a ring hostfile
    (MLX_RANK, MLX_HOSTFILE) on loopback, or with backend "nccl" the NCCL
    rendezvous and a GPU each (CUDA_VISIBLE_DEVICES), plus `env`."""
    tmp.mkdir(parents=True, exist_ok=True)
    *ring_ports, http_port = free_ports(world + 1)
    hostfile = None
    env_base = dict(os.environ, MESHD_GENERATION=str(generation), PYTHONUNBUFFERED="1", **(env or {}))
    if backend == "nccl":
        env_base.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(ring_ports[0]), MLX_WORLD_SIZE=str(world))
        args = (*args, "--backend", "nccl")
    elif world > 1:
        hostfile = tmp / "ring.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring_ports]))
        env_base["MLX_HOSTFILE"] = str(hostfile)
    procs, status_files, logs = [], [], []
    for rank in range(world):
        status = tmp / f"status-{rank}.json"
        log = tmp / f"rank-{rank}.log"
        env = dict(env_base, MLX_RANK=str(rank), MESHD_STATUS_FILE=str(status),
                   **({"CUDA_VISIBLE_DEVICES": str(rank)} if backend == "nccl" else {}))
        rank_args = ["--model", str(model), "--port", str(http_port), "--meshd-generation", str(generation), *args]
        if backend == "nccl":
            with open(log, "wb") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "runtime.rank", *rank_args], env=env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        else:
            procs.append(SERVERS.fork(rank_args, env, log))
        status_files.append(status)
        logs.append(log)
    return Mesh(procs, http_port, status_files, logs, hostfile)


class StatusTrace:
    """Records every distinct status file content of one rank, from a thread."""

    def __init__(self, path: Path, interval: float = 0.002):
        self.path, self.interval = path, interval
        self.snapshots: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        last = None
        while not self._stop.is_set():
            try:
                raw = self.path.read_text()
            except OSError:
                raw = None
            if raw and raw != last:
                last = raw
                try:
                    self.snapshots.append(json.loads(raw))
                except ValueError:
                    raise AssertionError(f"status file was read half-written: {raw!r}")
            time.sleep(self.interval)
