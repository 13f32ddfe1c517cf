"""Test helpers: real `meshd-agent` processes on loopback, each with its own
port, state directory and token."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from meshkit import free_ports, wait_for

STANDIN_PROFILES = {
    # Prints what a JACCL rank prints when ibv_post_recv returns ENOMEM, then blocks.
    "jaccl-standin": ["{python}", "-c",
                      "import time; print('[jaccl] Recv failed with errno=12 (-12)', flush=True); time.sleep(3600)",
                      "--meshd-generation", "{generation}"],
    "ignores-sigterm": ["{python}", "-c",
                        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "print('ignoring SIGTERM', flush=True); time.sleep(3600)",
                        "--meshd-generation", "{generation}"],
}


def toml_value(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def write_config(path: Path, node: str, port: int, *, stall: dict | None = None, extra: dict | None = None) -> str:
    token = secrets.token_hex(16)
    (path / "token").write_text(token + "\n")
    (path / "token").chmod(0o600)
    lines = [f"node = {json.dumps(node)}", f'listen = "127.0.0.1:{port}"', 'token_file = "token"',
             'state_dir = "state"']
    extra = dict(extra or {})
    profiles = {name: {"command": command, "status_file": False} for name, command in STANDIN_PROFILES.items()}
    profiles.update(extra.pop("profiles", {}))
    for k, v in extra.items():
        lines.append(f"{k} = {toml_value(v)}")
    lines.append("[stall]")
    for k, v in (stall or {}).items():
        lines.append(f"{k} = {v}")
    for name, profile in profiles.items():
        lines.append(f"[profiles.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in profile.items()]
    (path / "agent.toml").write_text("\n".join(lines) + "\n")
    return token


@dataclass
class Agent:
    node: str
    port: int
    dir: Path
    token: str
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict | None = None) -> "Agent":
        return self.spawn(env).wait_healthy()

    def spawn(self, env: dict | None = None) -> "Agent":
        log = open(self.dir / "agent.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "agents.server", "--config", str(self.dir / "agent.toml")],
                                     stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        return self

    def wait_healthy(self, timeout: float = 60) -> "Agent":
        wait_for(self._healthy, timeout, f"agent {self.node} to answer /healthz", interval=0.05)
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent {self.node} exited {self.proc.returncode}: "
                                 f"{(self.dir / 'agent.log').read_text()[-2000:]}")
        try:
            return requests.get(f"{self.url}/healthz", timeout=1).ok
        except requests.RequestException:
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(f"{self.url}{path}", headers=self.headers(), timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, body=None, **kw) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, headers=self.headers(),
                             timeout=kw.pop("timeout", 120), **kw)

    def events(self, since: int = 0) -> list[dict]:
        return self.get(f"/v1/events?stream=0&since={since}").json()["events"]

    def seq(self) -> int:
        return self.get("/v1/events?stream=0&since=0").json()["seq"]

    def wait_event(self, since: int, timeout: float, what: str, **match) -> dict:
        def find():
            for e in self.events(since):
                if all(e.get(k) == v for k, v in match.items()):
                    return e
            return None
        return wait_for(find, timeout, f"{what} on {self.node}", interval=0.02)

    def ranks(self) -> list[dict]:
        return self.get("/v1/ranks").json()["ranks"]


def make_agents(tmp: Path, n: int, **kw) -> list[Agent]:
    agents = []
    for i, port in enumerate(free_ports(n)):
        d = tmp / f"agent{i}"
        d.mkdir(parents=True)
        token = write_config(d, f"node{i}", port, **kw)
        agents.append(Agent(f"node{i}", port, d, token))
    return agents


def free_port_run(n: int) -> int:
    """A base port with n consecutive free ports (the ring backend's ports)."""
    for _ in range(200):
        base = 20000 + secrets.randbelow(30000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def ring_hostfile(n: int) -> dict:
    return {"backend": "ring", "hosts": [{"ssh": f"node{i}", "ips": ["127.0.0.1"], "rdma": []} for i in range(n)]}


def start_generation(agents: list[Agent], generation: int, model: Path, *, http_port: int | None = None,
                     args: dict | None = None, profile: str = "meshd-rank") -> int:
    """Ask each agent to start its rank of `generation`; returns rank 0's HTTP port."""
    http_port = http_port or free_ports(1)[0]
    ring_port = free_port_run(len(agents))
    for rank, a in enumerate(agents):
        r = a.post("/v1/ranks", {"generation": generation, "rank": rank, "world": len(agents), "profile": profile,
                                 "model": str(model), "hostfile": ring_hostfile(len(agents)), "port": http_port,
                                 "ring_port": ring_port, "args": args or {}})
        assert r.status_code == 201, r.text
    return http_port


def wait_mesh_ready(port: int, timeout: float = 120) -> None:
    def ready():
        try:
            return requests.get(f"http://127.0.0.1:{port}/internal/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False
    wait_for(ready, timeout, "the mesh to be ready", interval=0.1)


def stop_generation(agents: list[Agent], generation: int, mode: str = "kill", grace: float = 2) -> list[dict]:
    """Stop on every agent at once, as the controller does."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(lambda a: a.post(f"/v1/generations/{generation}/stop",
                                              {"mode": mode, "grace": grace}).json(), agents))


def pid_of(agent: Agent, generation: int) -> int:
    return next(r["pid"] for r in agent.ranks() if r["generation"] == generation)


def now() -> float:
    return time.time()


def write_mesh(path: Path, agents: list[Agent], model: Path, *, backend: str = "ring",
               ssh_of: dict[str, str] | None = None, **sections) -> Path:
    """A mesh.toml for these agents; `sections` add keys to [runtime], [proxy], [recovery], or add [ssh];
    `ssh_of` gives nodes their ssh address."""
    proxy_port, control_port, rank_port = free_ports(3)
    ring = free_port_run(len(agents))
    lines = ['name = "test"', f'backend = "{backend}"', 'state_dir = "state"', ""]
    for a in agents:
        lines += ["[[nodes]]", f'name = "{a.node}"', f'agent = "{a.url}"', f'token_file = "{a.dir / "token"}"']
        lines += [f'ssh = "{ssh_of[a.node]}"', ""] if ssh_of else [""]
    tables = {"runtime": {"model": str(model), "port": rank_port, "ring_port": ring},
              "proxy": {"listen": f"127.0.0.1:{proxy_port}"},
              "recovery": {"backoff_base": 0.2, "stop_grace": 2.0, "drain_grace": 10.0},
              "control": {"listen": f"127.0.0.1:{control_port}"}}
    for name, extra in sections.items():
        tables.setdefault(name, {}).update(extra)
    for name, values in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    mesh = path / "mesh.toml"
    mesh.write_text("\n".join(lines))
    return mesh
