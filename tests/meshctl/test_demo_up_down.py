"""The demo mesh's own life, each test on a demo of its own: `meshctl up` with the default four nodes,
`meshctl down` leaving no process behind, up again on the same ports; a demo of one node that serves and
recovers; an `up` that fails because another process took the control port meanwhile. (tests/meshctl/test_demo_mesh.py
drives one demo through deaths and restarts.)"""

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading

import psutil

from kit.meshctl import Demo, demo_home, demo_meshctl
from kit.waiting import wait_for
from meshd.meshctl import background
from meshd.meshctl.demo import WORLD


def test_down_drains_and_leaves_no_process_and_up_again_keeps_every_port(tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home-down", built=False)  # its first up builds the demo model
    ports = (home / "demo" / "ports.json").read_text()
    demo_meshctl(home, "up")
    status = Demo(home).status()
    assert len(status["nodes"]) == WORLD and Demo(home).chat().status_code == 200
    pids = [n["rank"]["pid"] for n in status["nodes"]]
    assert set(pids) < set(background.pids_below(home))  # its ranks (titled, no path in ps) and daemons
    out = demo_meshctl(home, "down").stdout
    assert "no process of the mesh remains" in out
    assert not [p for p in pids if psutil.pid_exists(p)]
    assert background.pids_below(home) == []
    r = demo_meshctl(home, "status", check=False)
    assert r.returncode == 1 and "meshctl up" in r.stderr
    # Up again at once, the connections of the mesh that just stopped still in TIME_WAIT: the same ports,
    # so the URL the README shows (and a client's configuration) goes on working.
    again = demo_meshctl(home, "up")
    assert f"OpenAI URL: {status['urls']['proxy']}" in again.stdout, again.stdout
    assert (home / "demo" / "ports.json").read_text() == ports
    assert Demo(home).chat().status_code == 200
    assert "no process of the mesh remains" in demo_meshctl(home, "down").stdout


def test_a_demo_of_one_node_is_a_mesh_of_one_that_serves_and_recovers(tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home-one")
    up = demo_meshctl(home, "up", "--nodes", "1")
    assert "demo: starting 1 agent and the controller" in up.stdout and "on 1 rank\n" in up.stdout, up.stdout
    one = Demo(home)
    s = one.status()
    assert [(n["node"], n["rank"]["rank"]) for n in s["nodes"]] == [("node0", 0)]
    assert one.chat().status_code == 200
    other = demo_meshctl(home, "up", "--nodes", "2", check=False)
    assert other.returncode == 1 and "the demo mesh runs with 1 node: `meshctl down`" in other.stderr
    os.kill(one.rank_pid(0), signal.SIGKILL)
    one.wait_ready(after=s["generation"])
    assert one.incidents()[0]["node"] == "node0" and one.chat().status_code == 200
    assert "no process of the mesh remains" in demo_meshctl(home, "down").stdout


class Answers(http.server.BaseHTTPRequestHandler):
    """Any other HTTP server: 200 to every GET, an empty body."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_up_whose_control_port_another_process_took_meanwhile_stops_what_it_started(tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home-taken")
    control = json.loads((home / "demo" / "ports.json").read_text())["control"]
    env = {**{k: v for k, v in os.environ.items() if k != "MESHD_CONFIG"}, "MESHD_HOME": str(home)}
    up = subprocess.Popen([sys.executable, "-m", "meshd.meshctl.cli", "up", "--nodes", "2"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The port was free when `up` picked it; another server takes it once the agents are spawned (the controller
    # starts only when every agent answers, seconds later).
    wait_for(lambda: (home / "demo" / "run" / "agent-node0.pid").exists() or up.poll() is not None, 120,
             "`meshctl up` to spawn the agents")
    other = http.server.ThreadingHTTPServer(("127.0.0.1", control), Answers)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        out, err = up.communicate(timeout=300)
        assert up.returncode == 1, out + err
        assert f"127.0.0.1:{control}" in err and "stopped what it had started (agent-node0, agent-node1" in err, err
        assert background.pids_below(home) == []
        down = demo_meshctl(home, "down")  # while the other server still holds the port
        assert "no process of the mesh remains" in down.stdout, down.stdout
    finally:
        other.shutdown()
        other.server_close()
    demo_meshctl(home, "up", "--nodes", "2")  # the port free again: the demo comes up on it
    assert Demo(home).chat().status_code == 200
    assert "no process of the mesh remains" in demo_meshctl(home, "down").stdout


def pidfile(home, name: str) -> int:
    return background.pid_of(home / "demo" / "run" / f"{name}.pid")


def test_up_starts_a_dead_agent_again_and_down_after_the_controller_and_an_agent_died_leaves_nothing(
        tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home-dead")
    demo_meshctl(home, "up", "--nodes", "2")
    mesh = Demo(home)
    agent = pidfile(home, "agent-node1")
    os.kill(agent, signal.SIGKILL)
    up = demo_meshctl(home, "up").stdout
    assert f"node1's agent (pid {agent}) had exited; started it again" in up and "ready: generation" in up, up
    assert all(n["agent_ok"] for n in mesh.status()["nodes"]) and mesh.chat().status_code == 200
    ranks = [n["rank"]["pid"] for n in mesh.status()["nodes"]]
    for name in ("controller", "agent-node1"):
        os.kill(pidfile(home, name), signal.SIGKILL)
    down = demo_meshctl(home, "down").stdout
    left = re.search(r"that agents left running \(pid ([\d, ]+)\)", down)
    assert left and set(ranks) <= {int(p) for p in left[1].split(", ")}, down
    assert "no process of the mesh remains" in down and background.pids_below(home) == []
    demo_meshctl(home, "up")  # the rank port free again
    assert mesh.chat().status_code == 200
    assert "no process of the mesh remains" in demo_meshctl(home, "down").stdout
