"""agent.toml and mesh.toml for tests, written with the same TOML writer as
the demo (common.tomlcheck.write_toml)."""

from __future__ import annotations

import secrets
from pathlib import Path

from common.tomlcheck import write_toml
from meshd.meshctl.ports import free_ports, free_run

STANDIN_PROFILES = {
    # Prints what a JACCL rank prints when ibv_post_recv returns ENOMEM, then blocks.
    "jaccl-standin": {"command": ["{python}", "-c",
                                  "import time; print('[jaccl] Recv failed with errno=12 (-12)', flush=True); "
                                  "time.sleep(3600)", "--meshd-generation", "{generation}"]},
    "ignores-sigterm": {"command": ["{python}", "-c",
                                    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                    "print('ignoring SIGTERM', flush=True); time.sleep(3600)",
                                    "--meshd-generation", "{generation}"]},
    # A rank that dies the way a transport's or a backend's error kills a real one: the line on
    # stderr, then exit 1.
    "prints-line": {"command": ["{python}", "-c", "import sys; print(sys.argv[-1], file=sys.stderr, flush=True); "
                                "sys.exit(1)", "--meshd-generation", "{generation}"],
                    "args": {"line": "--line"}},
}


def write_agent_config(path: Path, node: str, port: int, *, stall: dict | None = None,
                       extra: dict | None = None) -> str:
    """An agent.toml (and its 0600 token) in `path`; returns the token. Without a standby rank unless `extra`
    asks for one: after each generation serves, a standby costs every agent a rank's imports and device init,
    which only the tests of the standby need."""
    token = secrets.token_hex(16)
    (path / "token").write_text(token + "\n")
    (path / "token").chmod(0o600)
    extra = dict(extra or {})
    profiles = {name: {**profile, "status_file": False} for name, profile in STANDIN_PROFILES.items()}
    profiles.update(extra.pop("profiles", {}))
    write_toml(path / "agent.toml", {"node": node, "listen": f"127.0.0.1:{port}", "token_file": "token",
                                     "state_dir": "state", "standby": False, **extra, "stall": stall or {},
                                     "profiles": profiles})
    return token


def write_mesh(path: Path, agents, model: Path, *, backend: str = "ring", ssh_of: dict[str, str] | None = None,
               **sections) -> Path:
    """A mesh.toml for these agents; `sections` add keys to [runtime], [proxy], [recovery], or add [ssh];
    `ssh_of` gives nodes their ssh address."""
    proxy_port, control_port, rank_port = free_ports(3)
    nodes = [{"name": a.node, "agent": a.url, "token_file": str(a.dir / "token"),
              **({"ssh": ssh_of[a.node]} if ssh_of else {})} for a in agents]
    tables = {"runtime": {"model": str(model), "port": rank_port, "ring_port": free_run(len(agents))},
              "proxy": {"listen": f"127.0.0.1:{proxy_port}"},
              "recovery": {"backoff_base": 0.2, "stop_grace": 2.0, "drain_grace": 10.0},
              "control": {"listen": f"127.0.0.1:{control_port}"}}
    for name, extra in sections.items():
        tables.setdefault(name, {}).update(extra)
    return write_toml(path / "mesh.toml", {"name": "test", "backend": backend, "state_dir": "state",
                                           "nodes": nodes, **tables})
