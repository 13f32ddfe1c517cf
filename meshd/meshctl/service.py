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
from common.tomlcheck import split_listen
from meshd.share import shared

UNITS = {("controller", "linux"): ("systemd", ("meshd.service",)),
         ("proxy", "linux"): ("systemd", ("meshd-proxy.socket", "meshd-proxy.service")),
         ("agent", "linux"): ("systemd", ("meshd-agent.service",)),
         ("controller", "macos"): ("launchd", ("com.meshd.controller.plist",)),
         ("proxy", "macos"): ("launchd", ("com.meshd.proxy.plist",)),
         ("agent", "macos"): ("launchd", ("com.meshd.agent.plist",))}
WIRED_LIMIT = ("launchd", ("com.meshd.wired-limit.plist",))


def _values_of(kind: str, config: Path) -> dict[str, str]:
    """What the kind's templates take from its config: the state directory, and the proxy's address."""
    if kind == "agent":
        return {"state_dir": str(agent_config.load(config).state_dir)}
    cfg = mesh_config.load(config)
    host, port = split_listen("proxy.listen", cfg.proxy.listen)
    return {"state_dir": str(cfg.state_dir), "listen": cfg.proxy.listen, "listen_host": host.strip("[]"),
            "listen_port": str(port)}


def state_dir_of(kind: str, config: Path) -> Path:
    return Path(_values_of(kind, config)["state_dir"])


def render(kind: str, config: Path, *, user: str | None = None, system: str | None = None,
           wired_limit_mb: int | None = None) -> dict[str, str]:
    """{file name: text} for `kind` (controller | proxy | agent) on `system` (linux | macos), for this machine."""
    system = system or ("macos" if platform.system() == "Darwin" else "linux")
    config = config.resolve()
    values = _values_of(kind, config)
    return render_with(kind, system, {**values, "python": sys.executable, "config": str(config),
                                      "user": user or getpass.getuser(), "workdir": str(config.parent),
                                      "log_dir": str(Path(values["state_dir"]) / "log")}, wired_limit_mb)


def render_with(kind: str, system: str, values: dict[str, str], wired_limit_mb: int | None = None) -> dict[str, str]:
    """The same with every path given (another machine's, for `meshctl agents install`)."""
    values = {**values, "docs": str(shared("docs")), "wired_limit_mb": str(wired_limit_mb or "")}
    wanted = [UNITS[(kind, system)]] + ([WIRED_LIMIT] if system == "macos" and kind == "agent" and wired_limit_mb
                                        else [])
    return {name: Template((shared(where) / name).read_text()).substitute(values)
            for where, names in wanted for name in names}


def enable_commands(files: dict[str, str], dest: Path, system: str) -> list[str]:
    units = [name for name in files if name.endswith((".service", ".socket"))]
    cmds = [f"sudo cp {dest / name} /etc/systemd/system/{name}" for name in units]
    if units:  # the socket first: its service takes the listener from it
        cmds += ["sudo systemctl daemon-reload",
                 f"sudo systemctl enable --now {' '.join(u.removesuffix('.service') for u in units)}"]
    for name in (n for n in files if n not in units):
        # LaunchDaemons, bootstrapped into the system domain: they run with no one logged in
        label = name.removesuffix(".plist")
        cmds += [f"sudo cp {dest / name} /Library/LaunchDaemons/{name}",
                 f"sudo chown root:wheel /Library/LaunchDaemons/{name}",
                 f"sudo launchctl bootout system/{label} 2>/dev/null; "
                 f"sudo launchctl bootstrap system /Library/LaunchDaemons/{name}"]
    return cmds
