"""Render the service definitions in systemd/ and launchd/ for this machine:
paths, user and config filled in. `meshctl service install` writes them and
prints what to run to enable them."""

from __future__ import annotations

import getpass
import platform
import sys
from pathlib import Path
from string import Template

from agents import config as agent_config
from meshd import config as mesh_config

ROOT = Path(__file__).resolve().parents[1]

UNITS = {("controller", "linux"): "systemd/meshd.service", ("agent", "linux"): "systemd/meshd-agent.service",
         ("controller", "macos"): "launchd/com.meshd.controller.plist",
         ("agent", "macos"): "launchd/com.meshd.agent.plist"}
WIRED_LIMIT = "launchd/com.meshd.wired-limit.plist"


def state_dir_of(kind: str, config: Path) -> Path:
    return (mesh_config if kind == "controller" else agent_config).load(config).state_dir


def render(kind: str, config: Path, *, user: str | None = None, system: str | None = None,
           wired_limit_mb: int | None = None) -> dict[str, str]:
    """{file name: text} for `kind` (controller | agent) on `system` (linux | macos), for this machine."""
    system = system or ("macos" if platform.system() == "Darwin" else "linux")
    config = config.resolve()
    state = state_dir_of(kind, config)
    return render_with(kind, system, {"python": sys.executable, "config": str(config),
                                      "user": user or getpass.getuser(), "workdir": str(config.parent),
                                      "state_dir": str(state), "log_dir": str(state / "log")}, wired_limit_mb)


def render_with(kind: str, system: str, values: dict[str, str], wired_limit_mb: int | None = None) -> dict[str, str]:
    """The same with every path given (another machine's, for `meshctl agents install`)."""
    values = {**values, "docs": str(ROOT / "docs"), "wired_limit_mb": str(wired_limit_mb or "")}
    out = {}
    path = ROOT / UNITS[(kind, system)]
    out[path.name] = Template(path.read_text()).substitute(values)
    if system == "macos" and kind == "agent" and wired_limit_mb:
        path = ROOT / WIRED_LIMIT
        out[path.name] = Template(path.read_text()).substitute(values)
    return out


def enable_commands(files: dict[str, str], dest: Path, system: str) -> list[str]:
    cmds = []
    for name in files:
        if name.endswith(".service"):
            cmds += [f"sudo cp {dest / name} /etc/systemd/system/{name}", "sudo systemctl daemon-reload",
                     f"sudo systemctl enable --now {name.removesuffix('.service')}"]
        elif name == Path(WIRED_LIMIT).name:
            cmds += [f"sudo cp {dest / name} /Library/LaunchDaemons/{name}",
                     f"sudo launchctl load -w /Library/LaunchDaemons/{name}"]
        else:
            cmds += [f"cp {dest / name} ~/Library/LaunchAgents/{name}",
                     f"launchctl load -w ~/Library/LaunchAgents/{name}"]
    return cmds
