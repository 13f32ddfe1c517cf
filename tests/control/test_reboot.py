"""Reboot: the recovery ladder escalates to reboot on reboot-severity
evidence, reboots the node through its agent, waits for the new boot id,
re-provisions and serves again; `meshctl reboot` goes over SSH when the
agent cannot. The nodes' `sudo`, `shutdown` and `sysctl` are the stand-ins
(shutdown -r gives the node a new boot id, as a reboot does)."""

import json
import os
import subprocess
import sys

import pytest
import requests

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import meshctl, stop_controller
from kit.sshd import STANDINS, start_fleet
from kit.waiting import wait_for

REBOOT_LINE = "[jaccl] Couldn't allocate protection domain\n"


def standin_env(state_root, node: str) -> dict:
    return {"PATH": f"{STANDINS / 'bin'}:{os.environ['PATH']}", "MESHD_STANDIN_NODE": node,
            "MESHD_STANDIN_STATE": str(state_root)}


@pytest.fixture
def macs(tmp_path):
    fleet = start_fleet(tmp_path, 2)
    agents = make_agents(tmp_path, 2, stall={"base": 10}, extra={"allow_reboot": True})
    for a, n in zip(agents, fleet.nodes):
        a.start(env=standin_env(n.state.parent, n.name))
    yield fleet, agents
    for a in agents:
        a.kill()
    fleet.stop()


def boot_id(node) -> str:
    return (node.state / "boot_id").read_text().strip()


def test_reboot_severity_evidence_climbs_the_ladder_to_reboot_and_back_to_ready(macs, tmp_path, demo_model):
    fleet, agents = macs
    mesh = write_mesh(tmp_path, agents, demo_model, recovery={"ladder": ["restart", "reprovision", "reboot"]})
    up = meshctl(mesh, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    status = json.loads(meshctl(mesh, "status", "--json").stdout)
    before = [agents[i].get("/v1/node").json()["boot_id"] for i in range(2)]
    assert before == [boot_id(n) for n in fleet.nodes]  # the agents read the boot id the macOS way
    try:
        g = status["generation"]
        log = next((agents[1].dir / "state").glob(f"gen-{g}/rank-1/rank.log"))
        with log.open("a") as f:
            f.write(REBOOT_LINE)

        def recovered():
            s = json.loads(meshctl(mesh, "status", "--json").stdout)
            return s["phase"] == "ready" and s["generation"] > g and s
        wait_for(recovered, 300, "the mesh to reboot node1 and serve again", interval=0.5)
        incident = json.loads(meshctl(mesh, "events", "--json").stdout)["incidents"][0]
        assert incident["cause"] == "signature" and incident["node"] == "node1"
        assert incident["steps"][:2] == ["reboot", "reprovision"] and incident["serving_back_at"]
        assert boot_id(fleet.nodes[1]) != before[1]  # node1 rebooted
        assert boot_id(fleet.nodes[0]) == before[0]  # node0 did not
        assert agents[1].get("/v1/node").json()["boot_id"] == boot_id(fleet.nodes[1])
        r = requests.post(f"{status['urls']['proxy']}/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "back?"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        stop_controller(mesh)


def test_meshctl_reboot_goes_over_ssh_when_the_agent_is_gone(macs, tmp_path, demo_model):
    fleet, agents = macs
    mesh = write_mesh(tmp_path, agents, demo_model, ssh_of=fleet.ssh_of(agents), ssh=fleet.ssh_settings(tmp_path))
    before = [a.get("/v1/node").json()["boot_id"] for a in agents]
    agents[0].kill()
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "--config", str(mesh), "reboot", "node0", "--wait", "60"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "node0: the agent cannot reboot it" in r.stdout and "rebooting over SSH" in r.stdout
    assert "node0: reboot requested through the ssh" in r.stdout and "node0: back (boot id" in r.stdout
    assert boot_id(fleet.nodes[0]) != before[0] and boot_id(fleet.nodes[1]) == before[1]

    agents[1].get("/v1/node")  # node1's agent answers, and its config allows reboot
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "--config", str(mesh), "reboot", "node1", "--wait", "60"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "node1: reboot requested through the agent" in r.stdout, r.stdout + r.stderr
    assert boot_id(fleet.nodes[1]) != before[1]


def test_reboot_refused_by_the_agent_and_unreachable_over_ssh_names_both(tmp_path, demo_model):
    agents = make_agents(tmp_path, 1)
    agents[0].start()
    try:
        mesh = write_mesh(tmp_path, agents, demo_model)
        r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "--config", str(mesh), "reboot", "node0", "--wait",
                            "5"], capture_output=True, text=True, timeout=120)
    finally:
        agents[0].kill()
    assert r.returncode == 1
    assert "cannot reboot node0: agent:" in r.stderr and "reboot is not allowed on node0" in r.stderr
    assert "ssh: node0 (" in r.stderr
