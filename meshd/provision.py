"""Ladder steps beyond restart: re-provision and reboot.

`run_ladder_step(controller, step, nodes) -> (ok, detail)` is what the
reconciler runs for a `RunStep` action. Re-provisioning a ring mesh rebuilds
its hostfile from the nodes' addresses; a JACCL mesh needs
`mlx.distributed_config --auto-setup` (see `meshctl provision`). Reboot goes
through each node's agent (only where its config allows it) and waits for a
new boot id.
"""

from __future__ import annotations

import asyncio
import time

from meshd.agentclient import AgentError
from meshd.config import ConfigError, hostfile_for
from meshd.hostfile import HostfileError, validate

REBOOT_WAIT = 900.0


async def reprovision(ctl) -> tuple[bool, str]:
    try:
        backend, hosts = validate(hostfile_for(ctl.cfg), ctl.cfg.backend)
    except (ConfigError, HostfileError) as e:
        return False, str(e)
    if backend in ("jaccl", "jaccl-ring"):
        return False, ("re-provisioning a JACCL mesh (mlx.distributed_config --auto-setup over SSH) is not "
                       "automated yet; run it by hand on the nodes, then `meshctl up`")
    return True, f"{backend} hostfile for {len(hosts)} hosts"


async def reboot(ctl, nodes: tuple[str, ...]) -> tuple[bool, str]:
    before = {}
    for name in nodes:
        client = ctl.agents[name]
        try:
            before[name] = (await client.call("GET", "/v1/node", timeout=15))["boot_id"]
            await client.call("POST", "/v1/reboot", timeout=40)
        except AgentError as e:
            return False, f"cannot reboot {name} through its agent: {e}"
    deadline = time.monotonic() + REBOOT_WAIT
    waiting = set(nodes)
    while waiting and time.monotonic() < deadline:
        for name in list(waiting):
            try:
                if (await ctl.agents[name].call("GET", "/v1/node", timeout=5))["boot_id"] != before[name]:
                    waiting.discard(name)
            except AgentError:
                pass
        await asyncio.sleep(2)
    if waiting:
        return False, f"{', '.join(sorted(waiting))} did not come back within {REBOOT_WAIT:.0f}s"
    return True, f"rebooted {', '.join(nodes)}"


async def run_ladder_step(ctl, step: str, nodes: tuple[str, ...]) -> tuple[bool, str]:
    if step == "reprovision":
        return await reprovision(ctl)
    if step == "reboot":
        return await reboot(ctl, nodes)
    return False, f"unknown ladder step {step!r}"
