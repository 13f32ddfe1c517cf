"""Preparing nodes and bringing them back: `meshctl provision`, `meshctl
reboot`, and the reprovision / reboot steps of the recovery ladder.

Provision, JACCL: run the real `mlx.distributed_config --auto-setup` with
meshd's SSH settings (host keys verified), stream its output, validate the
hostfile it writes and record it with every node's boot id. Auto-setup twice
in one boot of the same nodes corrupts the Thunderbolt mapping, so a second
run in the same boot is refused unless forced. Ring over Ethernet: the
hostfile comes from the nodes' addresses.

Reboot: through the node's agent when it answers (and its config allows it),
over SSH otherwise; then wait for a new boot id and re-provision.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import structlog

from common import procs
from common.hostfile import HostfileError, validate
from common.tomlcheck import ConfigError
from meshd.nodes import ssh
from meshd.nodes.agentclient import AgentClient, AgentError
from meshd.config import MeshConfig, address_hostfile, hostfile_for

REBOOT_WAIT = 900.0
SETUP_TIMEOUT = 600.0
BOOT_ID = "sysctl -n kern.bootsessionuuid 2>/dev/null || cat /proc/sys/kernel/random/boot_id"
REBOOT = "sudo -n shutdown -r now"
# What the `mlx.distributed_config` console script runs, with this interpreter.
DISTRIBUTED_CONFIG = ("import sys; from mlx._distributed_utils.config import main; "
                      "sys.argv[0] = 'mlx.distributed_config'; main()")
log = structlog.get_logger()


class ProvisionError(Exception):
    """Names the node or step, what failed and the fix."""


def hostfile_path(cfg: MeshConfig) -> Path:
    return cfg.hostfile or cfg.state_dir / "hostfile.json"


def record_path(cfg: MeshConfig) -> Path:
    return cfg.state_dir / "provisioned.json"


def targets(cfg: MeshConfig) -> list[ssh.Target]:
    config = ssh.read_config(cfg.ssh.config)
    return [ssh.parse_target(n.name, n.ssh or n.address, cfg.ssh.user, config) for n in cfg.nodes]


def target_of(cfg: MeshConfig, name: str) -> ssh.Target:
    return next(t for t in targets(cfg) if t.node == name)


def read_boot_id(session) -> str:
    return session.run(BOOT_ID, timeout=30).stdout.strip()


def sudo_fix(node: str, user: str) -> str:
    return (f"on {node}: run `sudo visudo` and add `{user} ALL=(ALL) NOPASSWD: /sbin/ifconfig, /sbin/route, "
            f"/sbin/shutdown, /usr/sbin/sysctl`")


def already_provisioned(record: dict | None, nodes: list[str], boots: dict[str, str]) -> bool:
    """Did auto-setup already run on exactly these nodes in their current boot?"""
    return bool(record) and record.get("nodes") == nodes and record.get("boot_ids") == boots


def check_hostfile(hostfile: dict, cfg: MeshConfig) -> list[dict]:
    """The hostfile fits this mesh: valid for its backend, one host per node, ips present."""
    backend, hosts = validate(hostfile, cfg.backend)
    names = sorted(h["ssh"] for h in hosts)
    nodes = sorted(n.name for n in cfg.nodes)
    if names != nodes:
        raise HostfileError(f"the hostfile lists hosts {names}, the mesh has nodes {nodes}; re-run meshctl provision")
    missing = [h["ssh"] for h in hosts if not h.get("ips")]
    if missing:
        raise HostfileError(f"no ip for {', '.join(missing)} in the hostfile; check `ipconfig getifaddr en0` there")
    return hosts


def provision(cfg: MeshConfig, *, force: bool = False, trust_new: bool = False,
              say: Callable[[str], None] = print) -> Path:
    out = hostfile_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    nodes = [n.name for n in cfg.nodes]
    if cfg.backend == "ring":
        hostfile = address_hostfile(cfg)
        check_hostfile(hostfile, cfg)
        out.write_text(json.dumps(hostfile, indent=2) + "\n")
        say(f"ring over Ethernet: wrote {out} from the nodes' addresses")
        return out
    say(f"checking SSH and passwordless sudo on {', '.join(nodes)}")
    boots = {}
    for t in targets(cfg):
        with ssh.Session(t, cfg.ssh, trust_new=trust_new) as s:
            sudo = s.run("sudo -n true", timeout=30)
            if not sudo.ok:
                raise ProvisionError(f"{t.node}: auto-setup needs passwordless sudo "
                                     f"({sudo.stderr.strip() or 'sudo -n failed'}); {sudo_fix(t.node, t.user)}")
            boots[t.node] = read_boot_id(s)
    record_file = record_path(cfg)
    record = json.loads(record_file.read_text()) if record_file.exists() else None
    if already_provisioned(record, nodes, boots) and not force:
        raise ProvisionError(
            f"auto-setup already ran on {', '.join(nodes)} in this boot ({time.ctime(record['at'])}); running it "
            f"twice in one boot corrupts the Thunderbolt mapping. {record['hostfile']} still holds. For a fresh "
            f"setup reboot the nodes (meshctl reboot --all), or pass --force")
    config = cfg.state_dir / "ssh_config"
    config.write_text(ssh.ssh_config(targets(cfg), cfg.ssh))
    shim = ssh.openssh_shim(cfg.state_dir / "ssh-shim", config)
    fresh = out.with_suffix(".new.json")
    fresh.unlink(missing_ok=True)
    argv = [sys.executable, "-c", DISTRIBUTED_CONFIG, "--hosts", ",".join(nodes), "--over",
            "thunderbolt", "--backend", cfg.backend, "--auto-setup", "--output-hostfile", str(fresh)]
    say(f"running mlx.distributed_config --hosts {','.join(nodes)} --over thunderbolt --backend {cfg.backend} "
        f"--auto-setup --output-hostfile {fresh}")
    code = stream("mlx.distributed_config", argv,
                  {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"}, say, SETUP_TIMEOUT)
    if code != 0 or not fresh.exists():
        raise ProvisionError(f"mlx.distributed_config failed (exit {code}); its output is above")
    try:
        hostfile = json.loads(fresh.read_text())
        check_hostfile(hostfile, cfg)
    except (ValueError, HostfileError) as e:
        raise ProvisionError(f"the hostfile mlx.distributed_config wrote ({fresh}) does not fit the mesh: {e}")
    fresh.replace(out)
    record_file.write_text(json.dumps({"nodes": nodes, "boot_ids": boots, "backend": cfg.backend, "at": time.time(),
                                       "hostfile": str(out)}, indent=2) + "\n")
    say(f"provisioned: {out} ({cfg.backend}, {len(nodes)} hosts), recorded with each node's boot id")
    return out


def stream(name: str, argv: list[str], env: dict, say: Callable[[str], None], timeout: float) -> int:
    """Run a child, passing each output line to `say`; kill it (and its children) after `timeout` seconds."""
    r = procs.run(argv, timeout, env=env, on_line=lambda line: say(f"  | {line}"))
    if r.hung:
        raise ProvisionError(f"{name} did not finish within "
                             f"{timeout:.0f}s; a hung ibv_devices on a node (it has no timeout) means that node "
                             f"needs a reboot: meshctl reboot NODE")
    return r.code


# --- the ladder's steps (run by the controller) ---------------------------------------

async def reprovision(cfg: MeshConfig) -> tuple[bool, str]:
    if cfg.backend in ("jaccl", "jaccl-ring"):
        try:
            path = await asyncio.to_thread(provision, cfg, say=lambda line: None)
        except (ssh.SshError, ProvisionError, OSError) as e:  # the step failed: the ladder climbs
            return False, str(e)
        return True, f"re-provisioned {path}"
    try:
        backend, hosts = validate(hostfile_for(cfg), cfg.backend)
    except (ConfigError, HostfileError) as e:
        return False, str(e)
    return True, f"{backend} hostfile for {len(hosts)} hosts"


async def reboot_nodes(cfg: MeshConfig, agents: dict[str, AgentClient], nodes: tuple[str, ...], say: Callable[[str], None],
                       wait: float = REBOOT_WAIT) -> tuple[bool, str]:
    """Reboot `nodes` (agent first, SSH when the agent cannot) and wait until each has a new boot id."""
    before, how = {}, {}
    for name in nodes:
        client = agents[name]
        try:
            before[name] = (await client.node_facts(timeout=15))["boot_id"]
            await client.reboot()
            how[name] = "agent"
        except AgentError as e:
            say(f"{name}: the agent cannot reboot it ({e}); rebooting over SSH")
            try:
                before[name], how[name] = await asyncio.to_thread(_reboot_over_ssh, cfg, name), "ssh"
            except (ssh.SshError, OSError) as e2:  # nothing more to try for this node
                return False, f"cannot reboot {name}: agent: {e}; ssh: {e2}"
        say(f"{name}: reboot requested through the {how[name]} (boot id was {before[name][:8]})")
    deadline = time.monotonic() + wait
    waiting = set(nodes)
    while waiting and time.monotonic() < deadline:
        for name in sorted(waiting):
            now = await _boot_id_now(cfg, agents[name], name)
            if now and now != before[name]:
                waiting.discard(name)
                say(f"{name}: back (boot id {now[:8]})")
        if waiting:
            await asyncio.sleep(1)
    if waiting:
        return False, f"{', '.join(sorted(waiting))} did not come back within {wait:.0f}s"
    return True, f"rebooted {', '.join(nodes)} ({', '.join(f'{n} via {how[n]}' for n in nodes)})"


def _reboot_over_ssh(cfg: MeshConfig, name: str) -> str:
    with ssh.Session(target_of(cfg, name), cfg.ssh) as s:
        boot = read_boot_id(s)
        r = s.run(REBOOT, timeout=30)
        if not r.ok:
            raise ssh.SshError(f"{name}: `{REBOOT}` failed ({r.stderr.strip()}); allow it with passwordless sudo "
                           f"for shutdown")
    return boot


async def _boot_id_now(cfg: MeshConfig, client: AgentClient, name: str) -> str | None:
    try:
        return (await client.node_facts(timeout=5))["boot_id"]
    except AgentError:
        pass
    try:
        return await asyncio.to_thread(_ssh_boot_id, cfg, name)
    except (ssh.SshError, OSError):  # the node is still down: SSH refuses or times out
        return None


def _ssh_boot_id(cfg: MeshConfig, name: str) -> str:
    with ssh.Session(target_of(cfg, name), cfg.ssh) as s:
        return read_boot_id(s)


async def run_ladder_step(cfg: MeshConfig, agents: dict[str, AgentClient], step: str,
                          nodes: tuple[str, ...]) -> tuple[bool, str]:
    if step == "reprovision":
        return await reprovision(cfg)
    if step == "reboot":
        return await reboot_nodes(cfg, agents, nodes, say=lambda line: log.info("reboot", progress=line))
    return False, f"unknown ladder step {step!r}"
