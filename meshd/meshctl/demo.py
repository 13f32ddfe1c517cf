"""The embedded demo mesh: a controller and four agents (`--nodes`: 1, 2, 4 or
8) on 127.0.0.1, each agent's rank on the ring backend over loopback, serving
the tiny demo model built locally on first use. Everything lives under
`$MESHD_HOME/demo` (default `~/.meshd/meshctl/demo`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from common.secretfile import ensure_secret
from common.tomlcheck import write_toml
from meshd.config import load
from meshd.meshctl import background
from meshd.meshctl.ports import free_run, run_free
from runtime.models.demo_model import build_demo_model

WORLD = 4  # nodes unless `meshctl up --nodes` says otherwise
NODES = (1, 2, 4, 8)  # the ways the demo model's heads and widths divide
PREFERRED = {"proxy": 8000, "control": 8001, "rank": 8100, "agents": 7701, "ring": 32323}


@dataclass(frozen=True)
class DemoOptions:
    stall_window: float = 10.0
    start_deadline: float = 120.0
    max_failures: int = 5
    backoff_max: float = 10.0
    poison_after: int = 2
    migration_limit: int = 2
    nodes: int = WORLD


def home() -> Path:
    return Path(os.environ.get("MESHD_HOME", Path.home() / ".meshd")) / "demo"


def _ports(root: Path, nodes: int) -> dict:
    """Ports stay what they were while they are free, so URLs do not move."""
    saved = root / "ports.json"
    counts = {k: nodes if k in ("agents", "ring") else 1 for k in PREFERRED}
    if saved.exists():
        ports = json.loads(saved.read_text())
        if all(run_free(ports[k], n) for k, n in counts.items()):
            return ports
    taken: set[int] = set()
    ports = {}
    for key, preferred in PREFERRED.items():
        ports[key] = free_run(counts[key], preferred, taken)
        taken.update(range(ports[key], ports[key] + counts[key]))
    saved.write_text(json.dumps(ports))
    return ports


def ensure_model(root: Path, say) -> Path:
    model = root / "model"
    if not (model / "model.safetensors").exists():
        say("building the demo model (tiny llama, random weights, byte-level BPE tokenizer; no download)")
        build_demo_model(model)
    return model


def agent_config(node: str, port: int, opts: DemoOptions) -> dict:
    return {"node": node, "listen": f"127.0.0.1:{port}", "token_file": "token", "state_dir": "state",
            "grace_seconds": 10, "ibv_hang_seconds": 30,
            "stall": {"base": opts.stall_window, "min_prefill_rate": 50, "load_deadline": 300,
                      "start_deadline": opts.start_deadline}}


def mesh_config(ports: dict, model: Path, opts: DemoOptions) -> dict:
    return {
        "name": "demo", "backend": "ring", "state_dir": "state",
        "nodes": [{"name": f"node{i}", "agent": f"http://127.0.0.1:{ports['agents'] + i}",
                   "token_file": f"agents/node{i}/token", "address": "127.0.0.1"} for i in range(opts.nodes)],
        "runtime": {"profile": "meshd-rank", "model": str(model), "port": ports["rank"], "ring_port": ports["ring"],
                    "args": {"max_tokens": 128, "model_name": "demo"}},
        "proxy": {"listen": f"127.0.0.1:{ports['proxy']}", "queue_wait": 120, "keepalive_interval": 5,
                  "poison_after": opts.poison_after, "migration_limit": opts.migration_limit},
        "recovery": {"backoff_base": 0.5, "backoff_max": opts.backoff_max, "max_failures": opts.max_failures,
                     "window": 300, "healthy_reset": 120, "stop_grace": 5, "drain_grace": 20,
                     "start_deadline": opts.start_deadline},
        "control": {"listen": f"127.0.0.1:{ports['control']}"},
    }


def write_configs(root: Path, opts: DemoOptions, say) -> Path:
    """Write (again) the agent configs and mesh.toml; returns mesh.toml's path."""
    root.mkdir(parents=True, exist_ok=True)
    model = ensure_model(root, say)
    ports = _ports(root, opts.nodes)
    for i in range(opts.nodes):
        d = root / "agents" / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        ensure_secret(d / "token")
        write_toml(d / "agent.toml", agent_config(f"node{i}", ports["agents"] + i, opts))
    return write_toml(root / "mesh.toml", mesh_config(ports, model, opts))


def run_dir(root: Path) -> Path:
    return root / "run"


def start_daemons(root: Path, mesh: Path) -> None:
    """The agents first, and the controller once every agent answers: a
    controller that starts a generation before its agents listen only
    records a launch failure."""
    run = run_dir(root)
    start_agents(root, mesh)
    background.start(background.python_module("meshd.control.controllerd", "--config", str(mesh)), run / "controller.pid",
                  run / "controller.log")


def start_agents(root: Path, mesh: Path) -> dict[str, int]:
    """Start the agents that do not run (all of them, or those that died under a running demo) and wait until
    every agent answers; returns the nodes whose agent had exited, with its pid. NotStarted when one does not
    come up."""
    run = run_dir(root)
    nodes = load(mesh).nodes
    exited = {n.name: pid for n in nodes if (pid := background.exited(run / f"agent-{n.name}.pid")) is not None}
    for n in nodes:
        cfg = root / "agents" / n.name / "agent.toml"
        background.start(background.python_module("agents.server", "--config", str(cfg)), run / f"agent-{n.name}.pid",
                      run / f"agent-{n.name}.log")
    for n in nodes:
        if not background.wait_until(lambda: background.answers(f"{n.agent}/healthz"), 60):
            raise background.NotStarted(f"agent {n.name} did not come up; see {run / f'agent-{n.name}.log'}")
    return exited


@dataclass(frozen=True)
class Stopped:
    daemons: dict[str, int]  # what meshctl started, by pidfile name: pid
    strays: list[int]  # ranks and standbys that agents left running (one that died, or the controller with it)
    left: list[int]  # any process of the demo still there


def stop_daemons(root: Path) -> Stopped:
    """Stop the proxy, the controller and the agents, then the ranks and standbys they leave (an agent's
    ranks outlive it: one that died, or one that stops, leaves them)."""
    daemons = background.stop(sorted(run_dir(root).glob("*.pid")))
    strays = background.agents_children(root)
    background.stop_targets(strays, grace=5.0)
    return Stopped(daemons, [t.pid for t in strays], background.pids_below(root))


def any_running(root: Path) -> bool:
    run = run_dir(root)
    return any(background.running(pid) for pid in run.glob("*.pid")) if run.exists() else False


def is_demo(mesh: Path) -> bool:
    return mesh.resolve() == (home() / "mesh.toml").resolve()
