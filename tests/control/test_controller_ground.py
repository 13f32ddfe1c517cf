"""The controller's own ground, on a two-rank mesh whose state directory (the
store, the controller's and the proxy's logs) is a real 8 MB tmpfs.

A full disk: filled to the last byte while the mesh serves, a rank killed
meanwhile is recovered, /healthz and /metrics say the store fails, `meshctl
doctor` warns of the space, `meshctl down` and `down --force` stop the mesh,
a controller restarted on the full disk adopts and acts; once there is room
the record of it all is written, stamped when it happened.

One controller per mesh: a second controller started under a stopped first
does nothing; a stopped one resumed after another took the mesh over (its
lock lost) acts on nothing. Either way one death is one incident."""

import json
import os
import signal
import re
import subprocess
import sys
import time
import tomllib

import psutil
import pytest
import requests

from common.protocol import CONTROLLER_EPOCH
from common.tomlcheck import write_toml
from kit.agents import pid_of
from kit.meshctl import meshctl, mesh_up
from kit.smallfs import fill, free, small_filesystem
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports
from meshd.nodes.doctor import judge_space


@pytest.fixture(scope="module")
def full_mesh(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("full-disk")
    with small_filesystem(tmp / "state", "8m") as state, \
            mesh_up(tmp, demo_model, runtime={"args": {"max_tokens": 4, "max_context": 512, "model_name": "demo"}}) \
            as (mesh, agents):
        urls = status(mesh)["urls"]
        yield {"mesh": mesh, "agents": agents, "state": state, "control": urls["control"], "metrics": urls["metrics"],
               "proxy": urls["proxy"]}


def status(mesh) -> dict:
    return json.loads(meshctl(mesh, "status", "--json").stdout)


def health(m) -> dict:
    """/healthz's body; its status says the same to a monitor that reads only that (503 while not ok)."""
    r = requests.get(f"{m['control']}/healthz", timeout=10)
    assert r.status_code == (200 if r.json()["ok"] else 503), r.text
    return r.json()


def metric(m, name: str) -> float:
    text = requests.get(m["metrics"], timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def serving(m) -> dict:
    up = meshctl(m["mesh"], "up")  # starts a controller when none runs, and the mesh when it is stopped
    assert up.returncode == 0, up.stdout + up.stderr
    return status(m["mesh"])


def answers(m) -> bool:
    try:
        return requests.get(f"{m['control']}/healthz", timeout=2).status_code in (200, 503)
    except requests.ConnectionError:
        return False


def controller_pid(m) -> int:
    return int((m["state"] / "run" / "controller.pid").read_text().split()[0])


def incidents_of(generation: int, incidents: list[dict]) -> list[dict]:
    return [i for i in incidents if i["generation"] == generation]


def test_a_rank_killed_on_a_full_disk_is_recovered_and_health_and_metrics_say_the_store_fails(full_mesh):
    m = full_mesh
    before = status(m["mesh"])
    assert health(m)["ok"] and metric(m, "meshd_store_errors_total") == 0
    fill(m["state"])
    wait_for(lambda: not health(m)["ok"], 60, "/healthz to say the store fails")
    assert "database or disk is full" in health(m)["problems"][0]
    assert metric(m, "meshd_store_errors_total") > 0 and metric(m, "meshd_store_pending_writes") > 0

    killed_at = time.time()
    os.kill(pid_of(m["agents"][1], before["generation"]), signal.SIGKILL)
    wait_for(lambda: (s := status(m["mesh"]))["phase"] == "ready" and s["generation"] > before["generation"], 180,
             "the mesh to serve a new generation with its state directory full")
    r = requests.post(f"{m['proxy']}/chat/completions", timeout=180,
                      json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert not health(m)["ok"] and 'meshd_fleet_state{phase="ready"} 1.0' in requests.get(m["metrics"]).text

    doctor = meshctl(m["mesh"], "doctor")
    assert re.search(r"^WARN space +mesh +only 0 MiB free in \S+state \(the controller's state directory\)$",
                     doctor.stdout, re.M), doctor.stdout
    assert doctor.returncode == 0, "a warning, not a failure: the mesh serves"

    freed_at = time.time()
    free(m["state"])
    wait_for(lambda: health(m)["ok"], 60, "/healthz to say the store writes again")
    events = json.loads(meshctl(m["mesh"], "events", "--json").stdout)
    (incident,) = incidents_of(before["generation"], events["incidents"])
    assert incident["cause"] == "exit" and incident["node"] == "node1"
    assert killed_at <= incident["opened_at"] < incident["serving_back_at"] < freed_at, \
        "stamped when it happened, not when it was written"
    log = (m["state"] / "run" / "controller.log").read_text()
    assert "store write failed" in log and "store writes again" in log and "Traceback" not in log


@pytest.mark.parametrize("free_bytes, lines", [
    (5 << 30, ["ok   space        node0      5120 MiB free in /srv/agent (the agent's state directory)"]),
    (40 << 20, ["WARN space        node0      only 40 MiB free in /srv/agent (the agent's state directory)\n"
                "     fix: free space in /srv/agent, or move it to a larger disk (a full one loses records and logs; "
                "the mesh is still recovered)"]),
    (None, []),
], ids=["room", "low", "not reported"])
def test_doctor_warns_of_a_state_directory_low_on_space(free_bytes, lines):
    checks = judge_space("node0", "the agent's state directory", "/srv/agent", free_bytes)
    assert [c.line() for c in checks] == lines and all(c.ok for c in checks)


def test_down_down_force_and_a_restarted_controller_work_on_a_full_disk(full_mesh, tmp_path):
    m = full_mesh
    serving(m)
    fill(m["state"])
    restarted = None
    try:
        down = meshctl(m["mesh"], "down", timeout=120)
        assert down.returncode == 0 and "the mesh is stopped" in down.stdout, down.stdout + down.stderr
        assert all(r["state"] == "exited" for a in m["agents"] for r in a.ranks())
        assert not (m["state"] / "run" / "controller.pid").exists()  # down stopped the controller meshctl started
        # A controller again, as its service manager starts one, on the full disk:
        restarted = subprocess.Popen([sys.executable, "-m", "meshd.control.controllerd", "--config", str(m["mesh"]),
                                      "--log-file", str(tmp_path / "controller.log")])
        wait_for(lambda: answers(m), 60, "the restarted controller to answer")
        assert not health(m)["ok"]
        up = meshctl(m["mesh"], "up")  # its meshd-proxy, stopped by down, has no room for its pidfile
        assert up.returncode == 1 and "proxy.pid (No space left on device): proxy was stopped again" in up.stderr, \
            up.stdout + up.stderr
        wait_for(lambda: status(m["mesh"])["phase"] == "ready", 120, "the restarted controller to start the mesh")
        down = meshctl(m["mesh"], "down", "--force", timeout=120)
        assert down.returncode == 0 and "the mesh is stopped" in down.stdout, down.stdout + down.stderr
        assert all(r["state"] == "exited" for a in m["agents"] for r in a.ranks())
    finally:
        free(m["state"])
    wait_for(lambda: health(m)["ok"], 60, "/healthz to say the store writes again")
    audit = json.loads(meshctl(m["mesh"], "events", "--json").stdout)["audit"]
    assert [a["action"] for a in audit[:2]] == ["down --force", "up"], audit[:2]  # the restarted controller's
    restarted.terminate()
    assert restarted.wait(30) == 0


def test_a_second_controller_started_under_a_stopped_first_does_nothing(full_mesh):
    m = full_mesh
    before = serving(m)
    g, first = before["generation"], controller_pid(m)
    os.kill(first, signal.SIGSTOP)
    try:
        seqs = [a.seq() for a in m["agents"]]
        os.kill(pid_of(m["agents"][1], g), signal.SIGKILL)
        m["agents"][1].wait_event(seqs[1], 30, "the rank's exit", kind="RankExited", generation=g)
        second = subprocess.run([sys.executable, "-m", "meshd.control.controllerd", "--config", str(m["mesh"])],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and f"another controller of mesh test (pid {first}) holds" in second.stderr \
            and "this one did nothing" in second.stderr and f"kill -CONT {first}" in second.stderr, second.stderr
        seen = [e for a, seq in zip(m["agents"], seqs) for e in a.events(seq)]
        assert not [e for e in seen if e.get("expected") or e["kind"] == "RankStarted"], "a command reached an agent"
    finally:
        os.kill(first, signal.SIGCONT)
    wait_for(lambda: (s := status(m["mesh"]))["phase"] == "ready" and s["generation"] > g, 120,
             "the resumed controller to recover the mesh")
    (incident,) = incidents_of(g, json.loads(meshctl(m["mesh"], "events", "--json").stdout)["incidents"])
    assert incident["node"] == "node1" and incident["serving_back_at"]


def test_a_stopped_controller_resumed_after_another_took_the_mesh_over_acts_on_nothing(full_mesh, tmp_path):
    m = full_mesh
    g = serving(m)["generation"]
    stale = controller_pid(m)
    os.kill(stale, signal.SIGSTOP)
    (m["state"] / "controller.lock").unlink()  # the lock is lost (a state directory restored, say)
    raw = tomllib.loads(m["mesh"].read_text())
    (port,) = free_ports(1)
    other = write_toml(tmp_path / "mesh.toml", {**raw, "state_dir": str(m["state"]),
                                                "control": {"listen": f"127.0.0.1:{port}"}})
    token = (m["state"] / "control.token").read_text().strip()
    api = f"http://127.0.0.1:{port}"
    takeover = subprocess.Popen([sys.executable, "-m", "meshd.control.controllerd", "--config", str(other),
                                 "--log-file", str(tmp_path / "takeover.log")])

    def call(path: str) -> dict:
        return requests.get(f"{api}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()

    def takeover_serves_after(generation: int) -> bool:
        try:
            s = call("/v1/status")
        except requests.ConnectionError:
            return False
        return s["phase"] == "ready" and s["generation"] > generation

    try:
        wait_for(lambda: takeover_serves_after(g - 1), 60, "the new controller to adopt the mesh")
        os.kill(pid_of(m["agents"][1], g), signal.SIGKILL)
        wait_for(lambda: takeover_serves_after(g), 120, "the new controller to recover the mesh")
        os.kill(stale, signal.SIGCONT)
        wait_for(lambda: not psutil.pid_exists(stale) or psutil.Process(stale).status() == psutil.STATUS_ZOMBIE,
                 60, "the stale controller to stop")
        log = (m["state"] / "run" / "controller.log").read_text()
        assert "a newer controller has taken this mesh over; this one stops" in log, log[-3000:]
        (incident,) = incidents_of(g, call("/v1/incidents")["incidents"])
        assert incident["node"] == "node1" and incident["serving_back_at"]
        a = m["agents"][0]
        refused = requests.post(f"{a.url}/v1/sweep", json={"grace": 1},
                                headers={**a.headers(), CONTROLLER_EPOCH: "1"}, timeout=30)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "stale_controller"
        newer = int(refused.headers[CONTROLLER_EPOCH])
        assert newer > 1 and f"controller epoch 1 is older than epoch {newer}" in refused.json()["error"]["message"]
        assert call("/v1/status")["phase"] == "ready"
    finally:
        takeover.terminate()
        takeover.wait(30)
    up = meshctl(m["mesh"], "up")  # this mesh's own controller again, which adopts what runs
    assert up.returncode == 0 and status(m["mesh"])["generation"] > g, up.stdout + up.stderr
