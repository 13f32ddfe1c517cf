"""The embedded demo mesh: a controller and four agents on 127.0.0.1, each
agent's rank on the ring backend over loopback, serving the tiny demo model
built locally on first use. Everything lives under `$MESHD_HOME/demo`
(default `~/.meshd/demo`)."""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from meshd import daemons

WORLD = 4
PREFERRED = {"proxy": 8000, "control": 8001, "rank": 8100, "agents": 7701, "ring": 32323}


@dataclass(frozen=True)
class DemoOptions:
    stall_window: float = 10.0
    start_deadline: float = 120.0
    max_failures: int = 5
    backoff_max: float = 10.0


def home() -> Path:
    return Path(os.environ.get("MESHD_HOME", Path.home() / ".meshd")) / "demo"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pick(preferred: int, count: int, taken: set[int]) -> int:
    """`preferred` when it and the next count-1 ports are free, else a free run."""
    base = preferred
    while base < 65000:
        run = range(base, base + count)
        if not taken.intersection(run) and all(_free(p) for p in run):
            taken.update(run)
            return base
        base += 97 if base == preferred else count + 1
    raise RuntimeError("no free ports on 127.0.0.1")


def _ports(root: Path) -> dict:
    """Ports stay what they were while they are free, so URLs do not move."""
    saved = root / "ports.json"
    if saved.exists():
        ports = json.loads(saved.read_text())
        if all(_free(p) for key, p in ports.items() if key != "agents" and key != "ring") and \
                all(_free(ports["agents"] + i) and _free(ports["ring"] + i) for i in range(WORLD)):
            return ports
    taken: set[int] = set()
    ports = {k: _pick(v, WORLD if k in ("agents", "ring") else 1, taken) for k, v in PREFERRED.items()}
    saved.write_text(json.dumps(ports))
    return ports


def _write_secret(path: Path) -> None:
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(24) + "\n")


def ensure_model(root: Path, say) -> Path:
    from runtime.demo_model import build_demo_model

    model = root / "model"
    if not (model / "model.safetensors").exists():
        say("building the demo model (tiny llama, random weights, byte-level BPE tokenizer; no download)")
        build_demo_model(model)
    return model


def write_configs(root: Path, opts: DemoOptions, say) -> Path:
    """Write (again) the agent configs and mesh.toml; returns mesh.toml's path."""
    root.mkdir(parents=True, exist_ok=True)
    model = ensure_model(root, say)
    ports = _ports(root)
    nodes = []
    for i in range(WORLD):
        d = root / "agents" / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        _write_secret(d / "token")
        (d / "agent.toml").write_text(
            f'node = "node{i}"\nlisten = "127.0.0.1:{ports["agents"] + i}"\ntoken_file = "token"\n'
            f'state_dir = "state"\ngrace_seconds = 10\nibv_hang_seconds = 30\n'
            f"[stall]\nbase = {opts.stall_window}\nmin_prefill_rate = 50\nload_deadline = 300\n"
            f"start_deadline = {opts.start_deadline}\n")
        nodes.append(f'[[nodes]]\nname = "node{i}"\nagent = "http://127.0.0.1:{ports["agents"] + i}"\n'
                     f'token_file = "agents/node{i}/token"\naddress = "127.0.0.1"\n')
    mesh = root / "mesh.toml"
    mesh.write_text(
        'name = "demo"\nbackend = "ring"\nstate_dir = "state"\n\n' + "\n".join(nodes) +
        f'\n[runtime]\nprofile = "meshd-rank"\nmodel = "{model}"\nport = {ports["rank"]}\n'
        f'ring_port = {ports["ring"]}\nargs = {{max_tokens = 128, model_name = "demo"}}\n\n'
        f'[proxy]\nlisten = "127.0.0.1:{ports["proxy"]}"\nqueue_wait = 120\nkeepalive_interval = 5\n\n'
        f'[recovery]\nbackoff_base = 0.5\nbackoff_max = {opts.backoff_max}\nmax_failures = {opts.max_failures}\nwindow = 300\n'
        f"healthy_reset = 120\nstop_grace = 5\ndrain_grace = 20\nstart_deadline = {opts.start_deadline}\n\n"
        f'[control]\nlisten = "127.0.0.1:{ports["control"]}"\n')
    return mesh


def run_dir(root: Path) -> Path:
    return root / "run"


def start_daemons(root: Path, mesh: Path) -> None:
    """The agents first, and the controller once every agent answers: a
    controller that starts a generation before its agents listen only
    records a launch failure."""
    run = run_dir(root)
    ports = json.loads((root / "ports.json").read_text())
    for i in range(WORLD):
        cfg = root / "agents" / f"node{i}" / "agent.toml"
        daemons.start(daemons.python_module("agents.server", "--config", str(cfg)), run / f"agent-node{i}.pid",
                      run / f"agent-node{i}.log")
    for i in range(WORLD):
        url = f"http://127.0.0.1:{ports['agents'] + i}/healthz"
        if not daemons.wait_until(lambda: daemons.answers(url), 60):
            raise RuntimeError(f"agent node{i} did not come up; see {run / f'agent-node{i}.log'}")
    daemons.start(daemons.python_module("meshd.daemon", "--config", str(mesh)), run / "controller.pid",
                  run / "controller.log")


def stop_daemons(root: Path) -> list[int]:
    """Stop the controller and the agents; returns any process still there."""
    run = run_dir(root)
    daemons.stop([run / "controller.pid", *(run / f"agent-node{i}.pid" for i in range(WORLD))])
    return daemons.pids_below(root)


def any_running(root: Path) -> bool:
    run = run_dir(root)
    return any(daemons.running(pid) for pid in run.glob("*.pid")) if run.exists() else False


def is_demo(mesh: Path) -> bool:
    return mesh.resolve() == (home() / "mesh.toml").resolve()
