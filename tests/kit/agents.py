"""Real `meshd-agent` processes on loopback, each with its own port, state
directory and token, and the calls a controller makes to them. Agents are forked from a process that has
done their imports (kit/forkserver.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import requests

from kit.configs import write_agent_config
from kit.forkserver import SERVERS, Forked
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports, free_run


@dataclass
class Agent:
    node: str
    port: int
    dir: Path
    token: str
    proc: subprocess.Popen | Forked | None = None  # forked; a test may start it otherwise
    ca: Path | None = None  # set: the agent speaks TLS with a certificate from this CA

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> str | bool:
        return str(self.ca) if self.ca else True

    def start(self, env: dict | None = None, *, warm: bool = True) -> "Agent":
        return self.spawn(env, warm=warm).wait_healthy()

    def spawn(self, env: dict | None = None, *, warm: bool = True) -> "Agent":
        """`warm`: the ranks it starts are forked from it (kit/warmstart.py), not exec'd."""
        self.proc = SERVERS.fork("agents.server", ["--config", str(self.dir / "agent.toml")],
                                 {**os.environ, **(env or {})}, self.dir / "agent.log", warm=warm)
        return self

    def wait_healthy(self, timeout: float = 60) -> "Agent":
        wait_for(self._healthy, timeout, f"agent {self.node} to answer /healthz", interval=0.05)
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent {self.node} exited {self.proc.returncode}: "
                                 f"{(self.dir / 'agent.log').read_text()[-2000:]}")
        try:
            return requests.get(f"{self.url}/healthz", timeout=1, verify=self.verify).ok
        except requests.RequestException:
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(f"{self.url}{path}", headers=self.headers(), timeout=kw.pop("timeout", 30),
                            verify=self.verify, **kw)

    def post(self, path: str, body=None, **kw) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, headers=self.headers(),
                             timeout=kw.pop("timeout", 120), verify=self.verify, **kw)

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
        return wait_for(find, timeout, f"{what} on {self.node}")

    def ranks(self) -> list[dict]:
        return self.get("/v1/ranks").json()["ranks"]


def make_agents(tmp: Path, n: int, **kw) -> list[Agent]:
    agents = []
    for i, port in enumerate(free_ports(n)):
        d = tmp / f"agent{i}"
        d.mkdir(parents=True)
        token = write_agent_config(d, f"node{i}", port, **kw)
        agents.append(Agent(f"node{i}", port, d, token))
    return agents


def ring_hostfile(n: int) -> dict:
    return {"backend": "ring", "hosts": [{"ssh": f"node{i}", "ips": ["127.0.0.1"], "rdma": []} for i in range(n)]}


def start_generation(agents: list[Agent], generation: int, model: Path, *, http_port: int | None = None,
                     args: dict | None = None, profile: str = "meshd-rank") -> int:
    """Ask each agent to start its rank of `generation`; returns rank 0's HTTP port."""
    http_port = http_port or free_ports(1)[0]
    ring_port = free_run(len(agents))
    for rank, a in enumerate(agents):
        r = a.post("/v1/ranks", {"generation": generation, "rank": rank, "world": len(agents), "profile": profile,
                                 "model": str(model), "hostfile": ring_hostfile(len(agents)), "port": http_port,
                                 "ring_port": ring_port, "args": args or {}})
        assert r.status_code == 201, r.text
    return http_port


def wait_mesh_ready(port: int, timeout: float = 120, agents: list[Agent] = (), generation: int | None = None) -> None:
    """Until rank 0 of the mesh at `port` says it is ready; with the `agents` that started `generation`, a rank of
    it that exited first fails the wait at once, saying how (a rank that died is not one still loading)."""
    def ready():
        for a in agents:
            r = next((r for r in a.ranks() if r["generation"] == generation and r["state"] == "exited"), None)
            if r:
                raise AssertionError(f"rank {r['rank']} of generation {generation} exited (code {r['exit_code']}, "
                                     f"signal {r['exit_signal']}) before the mesh was ready; its log: {r['log_path']}")
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
