"""`meshctl doctor`: each check's judgement (table tests), then the whole
gate on real agents and real sshd nodes playing Macs: a healthy mesh passes,
and a version mismatch, a model too large for the wired limit, a hung
ibv_devinfo and a missing model each fail with their fix. The canary runs
all_sum across a real 4-rank ring mesh."""

import json
import subprocess
import sys
import time
from importlib import metadata

import pytest

from common.protocol import EPOCH_MAX, Ballot, RankReport
from common.states import RankState
from kit.agents import make_agents
from kit.configs import write_agent_config, write_mesh
from kit.meshctl import meshctl, stop_controller
from kit.sshd import STANDINS, start_fleet
from meshd.epochs import Held, Reach
from meshd.nodes import doctor
from meshd.config import Runtime, parse

GiB = 2**30
MAC = {"python": "3.12.4", "mlx": "0.29.1", "mlx_lm": "0.28.2", "memory_total_bytes": 192 * GiB,
       "memory_available_bytes": 150 * GiB, "wired_limit_mb": 0}


def model(fp="a1", size=100 * GiB):
    return {"present": True, "fingerprint": fp, "bytes": size, "weight_files": 10}


@pytest.mark.parametrize("facts,bad,fix", [
    ({"a": MAC, "b": MAC, "c": MAC}, [], None),
    ({"a": MAC, "b": {**MAC, "mlx": "0.30.0"}, "c": MAC}, ["b"], "pip install 'mlx==0.29.1' 'mlx-lm==0.28.2'"),
    ({"a": MAC, "b": MAC, "c": {**MAC, "python": "3.11.9"}}, ["c"], "(and Python 3.12.4)"),
])
def test_versions_name_the_odd_node_and_the_versions_to_install(facts, bad, fix):
    checks = doctor.judge_versions(facts)
    assert sorted(c.node for c in checks if not c.ok) == bad
    assert all(fix in c.fix for c in checks if not c.ok)


@pytest.mark.parametrize("models,bad,needle", [
    ({"a": model(), "b": model()}, [], None),
    ({"a": model(), "b": {"present": False}}, ["b"], "rsync -a /m/ b:/m/"),
    ({"a": model(), "b": model(), "c": model("zz")}, ["c"], "rsync -a --delete GOOD:/m/ c:/m/"),
])
def test_the_model_must_be_everywhere_and_the_same(models, bad, needle):
    checks = doctor.judge_model({n: {**MAC, "model": m} for n, m in models.items()}, "/m")
    assert sorted(c.node for c in checks if not c.ok) == bad
    assert all(needle in c.fix for c in checks if not c.ok)


@pytest.mark.parametrize("models,bad,needle", [
    ({"a": {"present": False, "error": "org/m is not in node a's Hugging Face cache"}, "b": model()}, ["a"],
     "meshctl model pull org/m"),
    ({"a": model(), "b": model("zz"), "c": model()}, ["b"], "meshctl model pull org/m --force"),
])
def test_a_model_by_repo_id_is_fixed_by_model_pull(models, bad, needle):
    checks = doctor.judge_model({n: {**MAC, "model": m} for n, m in models.items()}, "org/m")
    assert sorted(c.node for c in checks if not c.ok) == bad
    assert all(c.fix == needle for c in checks if not c.ok)


PKG = {"name": "dsv4_overlay", "present": True, "version": "1.2.0"}


@pytest.mark.parametrize("packages,bad,needle", [
    ({"a": PKG, "b": PKG}, [], None),
    ({"a": PKG, "b": {"name": "dsv4_overlay", "present": False, "error": "ModuleNotFoundError"}}, ["b"],
     "does not import on b"),
    ({"a": PKG, "b": PKG, "c": {**PKG, "version": "1.1.0"}}, ["c"], "the other nodes have 1.2.0"),
    ({"a": {}, "b": PKG}, ["a"], "not reported"),
])
def test_the_model_overlay_must_import_everywhere_in_one_version(packages, bad, needle):
    checks = doctor.judge_package({n: {**MAC, "model_package": p} for n, p in packages.items()}, "dsv4_overlay")
    assert sorted(c.node for c in checks if not c.ok) == bad
    assert all(needle in c.detail for c in checks if not c.ok)
    assert doctor.judge_package({"a": MAC}, "") == []  # no overlay configured, nothing to check


@pytest.mark.parametrize("size,world,wired,ok,fix", [
    (400 * GiB, 4, 150_000, True, None),  # 100 GiB a rank, 131.8 GiB usable
    (600 * GiB, 4, 150_000, False, "sudo sysctl iogpu.wired_limit_mb=170667"),  # 150 GiB a rank
    (600 * GiB, 4, 0, False, "sudo sysctl iogpu.wired_limit_mb=170667"),  # unset: 90% of available (135 GiB)
    (2000 * GiB, 4, 150_000, False, "use more nodes"),  # 500 GiB a rank: no sysctl makes that fit 192 GiB
])
def test_each_rank_must_fit_90_percent_of_the_wired_limit(size, world, wired, ok, fix):
    (check,) = doctor.judge_memory({"a": {**MAC, "wired_limit_mb": wired, "model": model(size=size)}}, world)
    assert check.ok is ok
    assert ok or fix in check.fix


@pytest.mark.parametrize("output,ok", [
    ("bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500", False),
    ("bridge0: flags=8822<BROADCAST,SMART,SIMPLEX,MULTICAST> mtu 1500", True),
])
def test_bridge0_must_be_down(output, ok):
    assert doctor.judge_bridge("a", output).ok is ok


DEVICES = "    device   node GUID\n    ------   ----\n    rdma_en2   0\n    rdma_en3   0\n"


@pytest.mark.parametrize("devices,devinfo,hung,ok,fix", [
    (DEVICES, "state: PORT_ACTIVE (4)\nstate: PORT_ACTIVE (4)", False, True, None),
    (DEVICES, "state: PORT_ACTIVE (4)\nstate: PORT_DOWN (1)", False, False, "check the Thunderbolt cables"),
    ("    device   node GUID\n    ------   ----\n", "", False, False, "rdma_ctl enable"),
    (DEVICES, None, True, False, "meshctl reboot a"),
])
def test_rdma_devices_must_be_present_and_active(devices, devinfo, hung, ok, fix):
    check = doctor.judge_rdma("a", devices, devinfo, hung)
    assert check.ok is ok and (ok or fix in check.fix)


def test_ranks_of_another_generation_are_stale():
    ranks = [RankReport(3, 0, pid=10, state=RankState.SPAWNED), RankReport(2, 0, pid=9, state=RankState.EXITED)]
    assert doctor.judge_stale("a", ranks, 3).ok
    stale = doctor.judge_stale("a", ranks, 4)
    assert not stale.ok and "generation 3 rank 0 pid 10" in stale.detail


RUNS = Ballot(19, "abc123")


@pytest.mark.parametrize("held,ours,running,warn,words", [
    (Ballot(0), None, False, False, "no controller has taken this node yet"),
    (RUNS, RUNS, True, False, "the running controller's"),
    (Ballot(19, "other"), Ballot(19), False, False, "this mesh's last controller's"),
    (Ballot(12, "old"), Ballot(19), False, False, "next controller takes an epoch above it"),
    (Ballot(18, "old"), RUNS, True, True, "away during the controller's round"),
    (Ballot(25, "zz"), RUNS, True, True, "has taken the node over"),
    (Ballot(19, "zzzzzz"), RUNS, True, True, "has taken the node over"),
    (Ballot(25, "zz"), Ballot(19), False, True, "above this mesh's last controller's (epoch 19)"),
    (Ballot(18, "zz"), None, False, True, "this mesh's controller has taken no epoch yet"),
], ids=["fresh", "promised", "last-controller", "behind-stopped", "behind-running", "taken-over",
        "same-epoch-other-controller", "taken-over-while-stopped", "fresh-state-dir"])
def test_each_agents_epoch_is_judged_against_the_controllers(held, ours, running, warn, words):
    check = doctor.judge_epoch("n1", held, ours, running)
    assert check.ok and check.warn == warn and words in check.detail
    assert held.epoch == 0 or str(held) in check.detail
    assert not warn or check.fix


@pytest.mark.parametrize("held,words,fix", [
    (Held(RUNS, 4, "auth"), None, None),
    (Held(RUNS, 4), None, None),
    (Held(Ballot(5, "abc"), 4, "other"), "it serves mesh 'other' (it promised epoch 5 (abc)), not 'auth'",
     "curl -X DELETE -H \"Authorization: Bearer $(cat /m/n1.token)\" 'http://n1:7701/v1/epoch?mesh=other'"),
    (Held(Ballot(EPOCH_MAX, "abc"), 4, "auth"), f"the highest epoch there is ({EPOCH_MAX})", "delete controller_epoch"),
    ("n1: GET /v1/epoch -> 503: the promise file /s/controller_epoch cannot be trusted: it is not JSON",
     "the promise file /s/controller_epoch cannot be trusted", "delete the promise file"),
], ids=["its-mesh", "no-mesh-yet", "another-mesh", "the-highest-epoch", "unreadable"])
def test_a_promise_that_blocks_every_start_fails_with_its_fix(held, words, fix):
    check = doctor.judge_promise("n1", held, "auth", Reach("http://n1:7701", "/m/n1.token"))
    assert check is None if words is None else (not check.ok and words in check.detail and fix in check.fix)


# --- the whole gate ---------------------------------------------------------------------


def mesh_file(path, agents, model, backend="ring", fleet=None):
    if fleet is None:
        return write_mesh(path, agents, model, backend=backend)
    return write_mesh(path, agents, model, backend=backend, ssh_of=fleet.ssh_of(agents),
                      ssh=fleet.ssh_settings(path, command_timeout=3))


@pytest.fixture(scope="module")
def macs(tmp_path_factory):
    """Four sshd nodes playing Macs and four agents whose tools are the same stand-ins."""
    tmp = tmp_path_factory.mktemp("macs")
    fleet = start_fleet(tmp, 4)
    agents = make_agents(tmp, 4)
    for a, n in zip(agents, fleet.nodes):
        a.start(env={"PATH": f"{STANDINS / 'bin'}:{__import__('os').environ['PATH']}",
                     "MESHD_STANDIN_NODE": n.name, "MESHD_STANDIN_STATE": str(n.state.parent)})
    yield fleet, agents
    for a in agents:
        a.kill()
    fleet.stop()


def doctor_run(mesh, *args) -> tuple[int, dict, list]:
    """(exit code, {(check, node): fix} of the failures, all checks)."""
    r = meshctl(mesh, "doctor", "--json", *args)
    checks = json.loads(r.stdout)
    return r.returncode, {(c["name"], c["node"]): c["fix"] for c in checks if not c["ok"]}, checks


def test_a_healthy_mesh_passes_and_each_fault_fails_with_its_fix(macs, tmp_path, deep_model):
    fleet, agents = macs
    mesh = mesh_file(tmp_path, agents, deep_model, "jaccl", fleet)
    code, failed, _ = doctor_run(mesh)
    # Not provisioned yet: no hostfile, and bridge0 still up on every node (auto-setup takes it down).
    assert code == 1 and set(failed) == {("hostfile", "mesh")} | {("bridge0", f"node{i}") for i in range(4)}
    assert failed[("hostfile", "mesh")] == "meshctl provision"
    provisioned = meshctl(mesh, "provision")
    assert provisioned.returncode == 0, provisioned.stdout + provisioned.stderr
    r = meshctl(mesh, "doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "50 of 50 checks pass: ready to start" in r.stdout and "FAIL" not in r.stdout
    code, failed, checks = doctor_run(mesh)
    assert {c["name"] for c in checks} == {"ssh", "sudo", "bridge0", "rdma", "agent", "stale ranks", "epoch",
                                          "versions", "model", "launch", "memory", "space", "hostfile"}
    assert len(checks) == 12 * 4 + 2 and code == 0  # free space on each node and in the controller's state dir

    (fleet.nodes[1].state / "iogpu.wired_limit_mb").write_text("1\n")  # 0.9 MiB usable: the model cannot fit
    fleet.nodes[3].fault("ibv_hang")
    try:
        code, failed, checks = doctor_run(mesh)
    finally:
        (fleet.nodes[1].state / "iogpu.wired_limit_mb").unlink()
        fleet.nodes[3].fault("ibv_hang", on=False)
    assert code == 1 and set(failed) == {("memory", "node1"), ("rdma", "node3")}, checks
    assert "sudo sysctl iogpu.wired_limit_mb=" in failed[("memory", "node1")]
    assert "meshctl reboot node3" in failed[("rdma", "node3")]
    assert next(c for c in checks if (c["name"], c["node"]) == ("rdma", "node3"))["detail"].startswith(
        "ibv_devinfo hung")

    code, failed, _ = doctor_run(mesh_file(tmp_path, agents, tmp_path / "no-such-model", "jaccl", fleet))
    assert code == 1 and set(failed) == {("model", f"node{i}") for i in range(4)}, failed
    assert f"rsync -a {tmp_path / 'no-such-model'}/ node0:" in failed[("model", "node0")]


def test_a_node_with_another_mlx_lm_fails_the_version_check(tmp_path, demo_model):
    """One agent sees a different mlx-lm release (a real one from PyPI) ahead of this one on its path."""
    installed = metadata.version("mlx-lm")
    other = "0.28.0" if installed != "0.28.0" else "0.28.1"
    site = tmp_path / "other-mlx-lm"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                          f"mlx-lm=={other}"], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    agents = make_agents(tmp_path, 2)
    agents[0].start()
    agents[1].start(env={"PYTHONPATH": str(site)})
    try:
        agents[1].wait_healthy()
        code, failed, checks = doctor_run(mesh_file(tmp_path, agents, demo_model))
    finally:
        for a in agents:
            a.kill()
    assert code == 1 and set(failed) == {("versions", "node1")}, checks
    assert f"pip install 'mlx=={metadata.version('mlx')}' 'mlx-lm=={installed}'" in failed[("versions", "node1")]


def test_the_canary_runs_all_sum_across_a_real_4_rank_ring(tmp_path, demo_model):
    agents = make_agents(tmp_path, 4)
    for a in agents:
        a.start()
    try:
        mesh = mesh_file(tmp_path, agents, demo_model)
        r = meshctl(mesh, "doctor", "--canary", "--json")
    finally:
        for a in agents:
            a.kill()
    checks = json.loads(r.stdout)
    canary = [c for c in checks if c["name"] == "canary"]
    assert [c["node"] for c in canary] == ["node0", "node1", "node2", "node3"], r.stdout + r.stderr
    for c in canary:
        assert c["ok"] and c["detail"].startswith("canary ok "), c
        result = json.loads(c["detail"].removeprefix("canary ok "))
        assert result["world"] == 4 and result["collectives"] >= 7 and result["bytes"] > 0
    assert r.returncode == 0


BROKEN_CANARY = {"command": ["{python}", "-c", "import sys; print('[ring] Couldn\\'t connect (error: 111)', "
                            "file=sys.stderr); sys.exit(1)", "--meshd-generation", "{generation}"],
                 "args": {"seconds": "--seconds"}, "status_file": False}


def test_a_canary_rank_that_dies_ends_the_canary_at_once_each_node_saying_what_its_rank_did(tmp_path, demo_model):
    """node1's transport fails as a ring's does: rank 0 would wait for it until the canary's 120 s timeout; the
    canary ends once node1's rank exited, and says per node what each rank did."""
    agents = make_agents(tmp_path, 2)
    agents[1].token = write_agent_config(agents[1].dir, "node1", agents[1].port,
                                         extra={"profiles": {"meshd-canary": BROKEN_CANARY}})
    for a in agents:
        a.start()
    try:
        began = time.monotonic()
        r = meshctl(mesh_file(tmp_path, agents, demo_model), "doctor", "--canary", "--json", timeout=110)
        took = time.monotonic() - began
    finally:
        for a in agents:
            a.kill()
    canary = {c["node"]: c for c in json.loads(r.stdout) if c["name"] == "canary"}
    assert r.returncode == 1 and set(canary) == {"node0", "node1"}, r.stdout + r.stderr
    assert not canary["node1"]["ok"]
    assert canary["node1"]["detail"] == ("rank 1 exited 1 without a canary line; its last log line: "
                                         "[ring] Couldn't connect (error: 111)")
    assert not canary["node0"]["ok"] and canary["node0"]["detail"].startswith("rank 0 "), canary["node0"]
    assert took < 100, "the canary waited out its timeout for a rank that was gone"


def test_meshctl_up_refuses_to_start_when_the_preflight_fails(tmp_path, demo_model):
    agents = make_agents(tmp_path, 2)
    for a in agents:
        a.start()
    mesh = mesh_file(tmp_path, agents, tmp_path / "not-copied-yet")
    try:
        r = meshctl(mesh, "up", timeout=120)
        assert r.returncode == 1
        assert "FAIL model        node0" in r.stdout and "preflight: 2 of" in r.stderr
        assert "nothing was started" in r.stderr
        assert all(a.ranks() == [] for a in agents)  # no rank was spawned anywhere
    finally:

        stop_controller(mesh)
        for a in agents:
            a.kill()


def test_the_agent_applies_its_wired_limit_at_start_and_reports_it(tmp_path):
    (agent,) = make_agents(tmp_path, 1, extra={"wired_limit_mb": 180000})
    state = tmp_path / "standin-state"
    agent.start(env={"PATH": f"{STANDINS / 'bin'}:{__import__('os').environ['PATH']}",
                     "MESHD_STANDIN_NODE": "node0", "MESHD_STANDIN_STATE": str(state)})
    try:
        facts = agent.get("/v1/node").json()
    finally:
        agent.kill()
    assert facts["wired_limit_mb"] == 180000
    assert facts["wired_limit_applied"] == {"wanted": 180000, "ok": True, "was": 0}
    assert (state / "node0" / "iogpu.wired_limit_mb").read_text().strip() == "180000"


@pytest.mark.parametrize("content,needle", [
    ("{not json", "cannot read"),
    (json.dumps({"backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en2"]},
                                               {"ssh": "x", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None]}]}),
     "the hostfile lists hosts ['a', 'x'], the mesh has nodes ['a', 'b']"),
    (json.dumps({"backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": ["rdma_en2", "rdma_en2"]},
                                               {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None]}]}),
     "hosts[0].rdma[0] must be null"),
    (json.dumps({"backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, None]},
                                               {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None]}]}),
     "no RDMA device is listed for a to b"),
])
def test_a_malformed_or_mismatched_hostfile_fails_with_provision_as_the_fix(tmp_path, content, needle):

    (tmp_path / "hostfile.json").write_text(content)
    cfg = parse({"backend": "jaccl", "hostfile": "hostfile.json", "runtime": {"model": "/m"},
                 "nodes": [{"name": n, "agent": "http://127.0.0.1:9", "token_file": "t"} for n in "ab"]}, tmp_path)
    check = doctor.judge_hostfile(cfg)
    assert not check.ok and needle in check.detail and check.fix == "meshctl provision"


LAUNCH = {"launch": {"profiles": {"meshd-rank": ["max_tokens", "draft_model"], "mlx-lm-server": ["max_tokens"]},
                     "env_allowlist": ["NCCL_DEBUG"]}}


@pytest.mark.parametrize("runtime,ok,words", [
    (Runtime(profile="meshd-rank", args={"max_tokens": 8}, draft_model="/d"), True, "profile meshd-rank"),
    (Runtime(profile="vllm"), False, "profile 'vllm' is not allowed"),
    (Runtime(args={"max_tokens": 8, "temprature": 0.5}), False, "['temprature'] are not parameters"),
    (Runtime(profile="mlx-lm-server", draft_model="/d"), False, "['draft_model'] are not parameters"),
    (Runtime(env={"NCCL_DEBUG": "INFO", "LD_PRELOAD": "x"}), False, "env ['LD_PRELOAD'] is not in"),
], ids=["allowed", "profile", "arg", "draft-on-stock", "env"])
def test_launch_judgement_names_what_an_agent_would_refuse(runtime, ok, words):
    (check,) = doctor.judge_launch({"n1": LAUNCH}, runtime)
    assert (check.ok, check.node) == (ok, "n1") and words in check.detail
    assert ok or "agent.toml" in check.fix
