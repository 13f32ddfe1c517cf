"""The mesh's authority on real processes: epochs the agents grant, bound to
their mesh.

Two agents that served other controllers (their promise and their generations
far ahead of a fresh store) are served by a controller with a fresh state
directory from a generation above theirs; a controller of another mesh.toml
(another mesh's name) that lists one of them is refused there, naming both
meshes, and takes nothing down (doctor says why and how to release the node);
then they are taken over by another controller of the same mesh, which
serves from a generation above that one's and shows both older generations'
rank logs; the old controller, resumed from SIGSTOP, acts on nothing and exits
saying why, and meshctl tells its words; two controllers started at once on
two state directories end with one commanding. Three agents without ranks: a
controller that no majority answers refuses to start and `meshctl up` prints
its reason; an agent away during the round promises when it is back, before
its first command; an absurd epoch is refused on the wire and in a promise file
(which an operator deletes, no restart), and no later start is blocked by it.
The pure parts: tests/control/test_epochs.py."""

import json
import os
import re
import signal
import subprocess
import sys
import tomllib

import psutil
import pytest
import requests

from common.protocol import CONTROLLER_EPOCH, CONTROLLER_ID, CONTROLLER_MESH, EPOCH_MAX, Ballot
from common.tomlcheck import write_toml
from kit.agents import make_agents, stop_generation
from kit.configs import write_mesh
from kit.meshctl import meshctl, stop_controller
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports
from meshd.store import EPOCH, read_value

FAR_AHEAD = 17  # the agents' promise before this module: earlier controllers, another state directory's
EARLIER = 40  # the newest generation those controllers ran: its rank logs are in the agents' state directories


def status(mesh) -> dict:
    r = meshctl(mesh, "status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def promised(agent) -> Ballot:
    held = agent.get("/v1/epoch").json()
    return Ballot(held["epoch"], held["controller"])


def another_state_dir(mesh, where):
    """The same nodes, runtime and rank ports in a mesh.toml of its own: its own state directory, control API
    and proxy (another Mac's controller for these nodes, or a restored backup)."""
    where.mkdir()
    raw = tomllib.loads(mesh.read_text())
    control, proxy = free_ports(2)
    return write_toml(where / "mesh.toml", {**raw, "state_dir": str(where / "state"),
                                             "control": {"listen": f"127.0.0.1:{control}"},
                                             "proxy": {"listen": f"127.0.0.1:{proxy}"}})


def agent_log(agent) -> list[str]:
    return (agent.dir / "agent.log").read_text().splitlines()


def commands_of(agent, ballot: Ballot) -> int:
    """How many commands `agent` let through from the controller of `ballot` (its log says whose each was)."""
    return sum("] command " in line and f"controller='{ballot}'" in line for line in agent_log(agent))


def rank_log(mesh, node: str, generation: int) -> str:
    r = meshctl(mesh, "logs", node, "-g", str(generation), "--lines", "10000")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def run_pid(mesh, name: str) -> int | None:
    pidfile = mesh.parent / "state" / "run" / f"{name}.pid"
    return int(pidfile.read_text().split()[0]) if pidfile.exists() else None


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill(pid: int | None) -> None:
    if pid is not None and not gone(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_model):
    """Two agents whose promise is epoch 17 and whose newest generation is 40, and the mesh they serve by a
    controller of state directory `a`."""
    tmp = tmp_path_factory.mktemp("takeover")
    agents = make_agents(tmp, 2, stall={"base": 10})
    for rank, a in enumerate(agents):
        (a.dir / "state" / f"gen-{EARLIER}" / f"rank-{rank}").mkdir(parents=True)
        (a.dir / "state" / f"gen-{EARLIER}" / f"rank-{rank}" / "rank.log").write_text("an earlier controller's rank\n")
        (a.dir / "state" / "controller_epoch").write_text(f"{FAR_AHEAD}\n")  # kept before ballots had ids
        a.start()
    (tmp / "a").mkdir()
    mesh = write_mesh(tmp / "a", agents, demo_model,
                      runtime={"args": {"max_tokens": 4, "max_context": 512, "model_name": "demo"}})
    meshes, daemons = [mesh], []
    try:
        up = meshctl(mesh, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"tmp": tmp, "agents": agents, "a": mesh, "meshes": meshes, "daemons": daemons}
    finally:
        for p in daemons:
            p.kill()
        for m in meshes:
            for name in ("controller", "proxy"):
                kill(run_pid(m, name))
        generations = {r["generation"] for a in agents for r in a.ranks() if r["state"] != "exited"}
        for g in generations:
            stop_generation(agents, g)
        for a in agents:
            a.kill()


def ask_promise(agent, epoch: int, mesh: str) -> requests.Response:
    """POST /v1/epoch as a controller of `mesh` asking for `epoch` would."""
    return requests.post(f"{agent.url}/v1/epoch", timeout=30, headers={
        **agent.headers(), CONTROLLER_EPOCH: str(epoch), CONTROLLER_ID: "someone", CONTROLLER_MESH: mesh})


def test_a_controller_of_another_mesh_listing_a_serving_node_is_refused_there_and_takes_nothing_down(served):
    a_mesh, agents = served["a"], served["agents"]
    before, pid = status(a_mesh), run_pid(a_mesh, "controller")
    ruling = Ballot(before["epoch"], before["controller_id"])
    rank1 = next(r for r in agents[1].ranks() if r["generation"] == before["generation"])
    other = another_state_dir(a_mesh, served["tmp"] / "other")
    raw = tomllib.loads(other.read_text())
    write_toml(other, {**raw, "name": "other", "nodes": [n for n in raw["nodes"] if n["name"] == "node1"],
                       "recovery": {**raw["recovery"], "adopt_wait": 1.0}})
    served["meshes"].append(other)

    refused = ask_promise(agents[1], ruling.epoch + 5, "other")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "other_mesh", refused.text
    said = refused.json()["error"]["message"]
    assert "serves mesh 'test'" in said and "mesh 'other' is refused" in said and "DELETE /v1/epoch?mesh=test" in said
    doctor = json.loads(meshctl(other, "doctor", "--json").stdout)
    (epoch,) = [c for c in doctor if c["name"] == "epoch"]
    assert not epoch["ok"] and "it serves mesh 'test'" in epoch["detail"] and \
        f"'{agents[1].url}/v1/epoch?mesh=test'" in epoch["fix"], epoch

    up = meshctl(other, "up", "--skip-preflight", timeout=120)
    assert up.returncode == 1 and "meshd: mesh other: 0 of 1 agents answered" in up.stderr, up.stdout + up.stderr
    assert "node1: it serves mesh 'test'" in up.stderr and "free or remove the nodes of another mesh" in up.stderr
    assert "start those agents" not in up.stderr and "has taken" not in up.stderr
    assert promised(agents[1]) == ruling
    assert [line for line in agent_log(agents[1]) if "promise refused" in line and "mesh=other" in line]
    after = status(a_mesh)
    assert (after["phase"], after["generation"], after["epoch"]) == ("ready", before["generation"], ruling.epoch)
    assert run_pid(a_mesh, "controller") == pid and not gone(pid)
    assert next(r for r in agents[1].ranks() if r["generation"] == before["generation"])["pid"] == rank1["pid"]
    assert not gone(rank1["pid"]), "the other mesh's controller killed the serving mesh's rank"


def test_a_fresh_state_dir_takes_over_agents_far_ahead_and_serves_and_the_old_one_resumed_acts_on_nothing(served):
    a_mesh, agents = served["a"], served["agents"]
    before = status(a_mesh)
    old, old_ballot = run_pid(a_mesh, "controller"), Ballot(before["epoch"], before["controller_id"])
    assert old_ballot.epoch == FAR_AHEAD + 1 and all(promised(a) == old_ballot for a in agents)
    assert before["generation"] == EARLIER + 1, "a fresh store numbered its generation below the agents' logs"
    os.kill(old, signal.SIGSTOP)
    try:
        b_mesh = another_state_dir(a_mesh, served["tmp"] / "b")
        served["meshes"].append(b_mesh)
        up = meshctl(b_mesh, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        taken = status(b_mesh)
        ruling = Ballot(taken["epoch"], taken["controller_id"])
        assert taken["phase"] == "ready" and taken["generation"] > before["generation"]
        assert "an earlier controller's rank" in rank_log(b_mesh, "node0", EARLIER)
        assert f"[meshd-rank g{before['generation']} r0] loaded in" in rank_log(b_mesh, "node0", before["generation"])
        assert ruling.epoch == old_ballot.epoch + 1 and all(promised(a) == ruling for a in agents)
        r = requests.post(f"{taken['urls']['proxy']}/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "who serves?"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        seqs, commanded = [a.seq() for a in agents], [commands_of(a, old_ballot) for a in agents]
    finally:
        os.kill(old, signal.SIGCONT)
    wait_for(lambda: gone(old), 60, "the resumed controller to exit")
    told = meshctl(a_mesh, "status")
    assert told.returncode == 1, told.stdout
    assert f"the controller (pid {old}) exited: meshd: controller {ruling} has taken mesh test over" in told.stderr
    assert str(a_mesh.parent / "state" / "run" / "controller.log") in told.stderr and "is it running" not in told.stderr
    acted = [e for a, seq in zip(agents, seqs) for e in a.events(seq) if e["kind"] != "RankStateChanged"]
    assert acted == [] and [commands_of(a, old_ballot) for a in agents] == commanded, "the resumed controller acted"
    after = status(b_mesh)
    assert (after["phase"], after["generation"]) == ("ready", taken["generation"])

    doctor = json.loads(meshctl(a_mesh, "doctor", "--json").stdout)
    epochs = [c for c in doctor if c["name"] == "epoch"]
    assert len(epochs) == 2 and all(c["warn"] and f"above this mesh's last controller's (epoch {before['epoch']})"
                                    in c["detail"] for c in epochs), epochs


def test_two_controllers_started_at_once_on_two_state_dirs_end_with_one_commanding(served):
    """Each a restored backup of the serving controller's state directory (its rank key), so whichever wins
    adopts the generation that serves."""
    b_mesh, agents = served["meshes"][-1], served["agents"]
    serving = status(b_mesh)
    b_pid = run_pid(b_mesh, "controller")
    starting = []
    for name in ("c", "d"):
        mesh = another_state_dir(b_mesh, served["tmp"] / name)
        (mesh.parent / "state").mkdir()
        (mesh.parent / "state" / "rank.key").write_bytes((b_mesh.parent / "state" / "rank.key").read_bytes())
        (mesh.parent / "state" / "rank.key").chmod(0o600)
        starting.append((mesh, [sys.executable, "-m", "meshd.control.controllerd", "--config", str(mesh)]))
    procs = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _, argv in starting]
    served["daemons"].extend(procs)

    def settled():
        return [p for p in procs if p.poll() is None] if sum(p.poll() is None for p in procs) <= 1 and \
            gone(b_pid) else None

    (survivor,) = wait_for(settled, 90, "one controller of three to remain")
    loser = next(p for p in procs if p is not survivor)
    said = loser.stderr.read()
    assert loser.returncode == 1 and ("took this mesh over as this one" in said or "has taken mesh test over" in said)
    assert "has taken mesh test over" in (b_mesh.parent / "state" / "run" / "controller.log").read_text()
    mesh = starting[procs.index(survivor)][0]
    control = f"http://{tomllib.loads(mesh.read_text())['control']['listen']}"
    token = (mesh.parent / "state" / "control.token").read_text().strip()

    def now():
        try:
            return requests.get(f"{control}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        except requests.ConnectionError:
            return None

    ruling = wait_for(lambda: (s := now()) and s["phase"] == "ready" and s, 60, "the survivor to adopt the mesh")
    assert ruling["generation"] == serving["generation"] and ruling["epoch"] > serving["epoch"]
    assert all(promised(a) == Ballot(ruling["epoch"], ruling["controller_id"]) for a in agents)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three agents, none started, and a mesh.toml of them whose model is not there: no rank ever runs."""
    tmp = tmp_path_factory.mktemp("round")
    agents = make_agents(tmp, 3)
    mesh = write_mesh(tmp, agents, tmp / "no-such-model", recovery={"adopt_wait": 1.0})
    yield mesh, agents
    for name in ("controller", "proxy"):  # what each meshctl up started
        kill(run_pid(mesh, name))
    for a in agents:
        a.kill()


def test_meshctl_up_prints_the_reason_of_a_controller_that_refused_to_start(three):
    mesh, agents = three
    agents[0].start()
    up = meshctl(mesh, "up", "--skip-preflight", timeout=120)
    pid = run_pid(mesh, "controller")
    assert up.returncode == 1 and f"the controller (pid {pid}) exited: meshd: mesh test: 1 of 3 agents answered, " \
        "and a majority (2) must before a controller commands any (node1: GET /v1/epoch failed" in up.stderr, up.stderr
    assert str(mesh.parent / "state" / "run" / "controller.log") in up.stderr and "is it running" not in up.stderr
    assert promised(agents[0]) == Ballot(0), "nothing was asked to promise without a majority"


def test_an_agent_away_during_the_round_promises_when_back_before_its_first_command(three):
    mesh, agents = three
    agents[1].start()
    up = meshctl(mesh, "up", "--skip-preflight", timeout=120)
    assert up.returncode == 1 and "no model at" in up.stdout, up.stdout + up.stderr  # failed: nothing spawned
    ruling = status(mesh)
    ours = Ballot(ruling["epoch"], ruling["controller_id"])
    assert [promised(a) for a in agents[:2]] == [ours, ours]
    agents[2].start()
    down = meshctl(mesh, "down")  # from failed: the generation's stop and a sweep, on every agent
    assert down.returncode == 0, down.stdout + down.stderr
    assert promised(agents[2]) == ours
    log = agent_log(agents[2])
    commands = [i for i, line in enumerate(log) if "] command " in line]
    (promise,) = [i for i, line in enumerate(log) if "] promised " in line]
    assert commands and promise < commands[0] and all(str(ours) in log[i] for i in commands), log
    assert not [line for line in log if "controller refused" in line], log


def test_an_absurd_epoch_is_refused_on_the_wire_and_in_a_promise_file_and_blocks_no_start(three):
    mesh, agents = three  # all three promised the running controller's ballot (the tests above)
    held = promised(agents[0])
    absurd = ask_promise(agents[0], 2**63 - 1, "test")
    assert absurd.status_code == 400 and f"from 0 to {EPOCH_MAX}" in absurd.json()["error"]["message"], absurd.text
    assert promised(agents[0]) == held and [line for line in agent_log(agents[0]) if "ballot refused" in line]

    agents[1].kill()  # a promise file an older agent wrote
    (agents[1].dir / "state" / "controller_epoch").write_text(f"{2**63 - 1}\n")
    agents[1].start()
    unread = agents[1].get("/v1/epoch")
    assert unread.status_code == 503 and "cannot be trusted" in unread.json()["error"]["message"], unread.text
    assert [line for line in agent_log(agents[1]) if "promise file cannot be trusted" in line]
    doctor = json.loads(meshctl(mesh, "doctor", "--json").stdout)
    (epoch,) = [c for c in doctor if c["name"] == "epoch" and c["node"] == "node1"]
    assert not epoch["ok"] and f"{2**63 - 1}" in epoch["detail"] and "delete the promise file" in epoch["fix"], epoch

    stop_controller(mesh)
    up = meshctl(mesh, "up", "--skip-preflight", timeout=120)  # two of three promise: it starts
    assert up.returncode == 1 and "no model at" in up.stdout, up.stdout + up.stderr
    ours = Ballot(status(mesh)["epoch"], status(mesh)["controller_id"])
    assert ours.epoch == held.epoch + 1 == read_value(mesh.parent / "state" / "meshd.sqlite", EPOCH)
    assert promised(agents[0]) == promised(agents[2]) == ours
    assert (agents[1].dir / "state" / "controller_epoch").read_text() == f"{2**63 - 1}\n", "the file was rewritten"

    (agents[1].dir / "state" / "controller_epoch").unlink()  # the fix doctor names; the agent runs on
    wait_for(lambda: agents[1].get("/v1/epoch").ok and promised(agents[1]) == ours, 60,
             "node1 to promise the controller once its promise file is gone")
    assert re.search(r"promised .*mesh=test", "\n".join(agent_log(agents[1])))
