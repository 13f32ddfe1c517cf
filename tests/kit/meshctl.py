"""`meshctl` as a user runs it: on a mesh.toml (`meshctl`), or on the embedded
demo mesh under its own $MESHD_HOME (`demo_meshctl`, `Demo`); forked from a process that has done its
imports (kit/forkserver.py)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import requests

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.forkserver import SERVERS
from kit.waiting import wait_for
from meshd import config as mesh_config
from meshd.seam import rank_key, rank_secret
from meshd.meshctl.demo import PREFERRED, WORLD
from meshd.meshctl.ports import free_run
from runtime.models.demo_model import build_demo_model


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MESHD_CONFIG"}
    return {**env, **extra}


def meshctl(config, *args, timeout=300):
    return SERVERS.run("meshd.meshctl.cli", ["--config", str(config), *args], _env(), timeout)


def stop_controller(mesh):
    """`meshctl down --force` (it stops the controller and the proxy too); when it fails (a test left the
    controller unable to stop the mesh), the controller and the proxy themselves."""
    if meshctl(mesh, "down", "--force").returncode == 0:
        return
    for name in ("controller", "proxy"):
        pidfile = mesh.parent / "state" / "run" / f"{name}.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().split()[0]), 15)
            except ProcessLookupError:
                pass


@contextmanager
def mesh_up(tmp, model, n: int = 2, agent: dict | None = None, **mesh):
    """`n` agents on loopback (`agent`: keys for their agent.toml) and `meshctl up` on a mesh.toml of them
    (`mesh`: write_mesh's tables); yields (mesh.toml, agents) and leaves no process behind."""
    agents = make_agents(tmp, n, stall={"base": 10}, extra=agent)
    for a in agents:
        a.start()
    path = write_mesh(tmp, agents, model, **mesh)
    try:
        up = meshctl(path, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        yield path, agents
    finally:
        stop_controller(path)
        for a in agents:
            a.kill()


@contextmanager
def another_controller():
    """A server answering /healthz as a controller does, on a free loopback port: another mesh's controller
    on an address this mesh shares. Yields its "host:port"."""
    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def demo_home(tmp_path_factory, name: str, *, built: bool = True):
    """A $MESHD_HOME whose demo mesh takes random free ports, not the preferred 8000/8001/...: tests run
    beside each other (pytest -n) and beside a user's own demo, and preferred ports would collide. `built`: its
    demo model is there already, as after a first `meshctl up` (the one this process built first, copied):
    meshctl then evaluates nothing with MLX, and the daemons it starts are forked warm (kit/warmstart.py)."""
    home = tmp_path_factory.mktemp(name)
    (home / "demo").mkdir()
    if built:
        shutil.copytree(_built_demo_model(tmp_path_factory), home / "demo" / "model")
    ports = {key: free_run(WORLD if key in ("agents", "ring") else 1) for key in PREFERRED}
    (home / "demo" / "ports.json").write_text(json.dumps(ports))
    return home


_BUILT: list[Path] = []


def _built_demo_model(tmp_path_factory) -> Path:
    if not _BUILT:
        _BUILT.append(build_demo_model(tmp_path_factory.mktemp("demo-model") / "model"))
    return _BUILT[0]


def demo_meshctl(home, *args, timeout=300, check=True):
    r = SERVERS.run("meshd.meshctl.cli", list(args), _env(MESHD_HOME=str(home)), timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"meshctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


class Demo:
    """The demo mesh of one $MESHD_HOME."""

    def __init__(self, home):
        self.home = home

    def status(self) -> dict:
        return json.loads(demo_meshctl(self.home, "status", "--json").stdout)

    @property
    def proxy(self) -> str:
        return self.status()["urls"]["proxy"]

    def rank0(self, generation: int) -> tuple[str, dict]:
        """Rank 0's address and the header that opens it in `generation` (what the proxy sends)."""
        cfg = mesh_config.load(self.home / "demo" / "mesh.toml")
        secret = rank_secret(rank_key(cfg.state_dir), generation)
        return f"http://127.0.0.1:{cfg.runtime.port}", {"Authorization": f"Bearer {secret}"}

    def rank_pid(self, i: int) -> int:
        return self.status()["nodes"][i]["rank"]["pid"]

    def wait_ready(self, after: int = 0, timeout: float = 120) -> dict:
        def ready():
            s = self.status()
            return s if s["phase"] == "ready" and s["generation"] > after else None
        return wait_for(ready, timeout, f"the mesh to serve a generation after {after}", interval=0.2)

    def incidents(self) -> list[dict]:
        return json.loads(demo_meshctl(self.home, "events", "--json").stdout)["incidents"]

    def chat(self, **kw):
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **kw}
        return requests.post(f"{self.proxy}/chat/completions", json=body, timeout=180)
