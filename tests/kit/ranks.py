"""Real `meshd-rank` processes as a ring mesh on loopback, started the way
mlx.launch would (MLX_RANK, MLX_HOSTFILE), and a recorder of a rank's status file.

Ranks on the ring backend are forked from a process that has done their imports (kit/forkserver.py); ranks
on NCCL are spawned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from kit.forkserver import SERVERS, Forked
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports




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
            procs.append(SERVERS.fork("runtime.rank", rank_args, env, log))
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
