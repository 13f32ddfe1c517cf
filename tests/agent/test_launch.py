"""The agent's launch, built before anything is spawned (agents/launch.py, pure), and the supervisor's start
around it with a fake spawner: what a start writes, spawns and emits, and what it refuses without touching
the node. The spawn itself, the standby's hand-over and the stop ladder run on real processes elsewhere
(test_agent_mesh.py, test_standby.py, test_rank_lifecycle.py)."""

import asyncio
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from agents.config import DEFAULT_PROFILES, AgentConfig, Profile
from agents.launch import BadSpec, launch_plan
from agents.manifest import Manifest
from agents.supervisor import Conflict, Supervisor
from common.modelref import ModelNotFound
from common.protocol import RankSpec
from common.states import RankState

STATE = Path("/state/n0")
RING = {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]}
NCCL = {"backend": "nccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]}


def config(state_dir: Path = STATE, **kw) -> AgentConfig:
    return AgentConfig(node="n0", host="127.0.0.1", port=7701, token_file=state_dir / "token", state_dir=state_dir,
                       profiles={name: Profile(name, tuple(p["command"]), p["args"], p["status_file"])
                                 for name, p in DEFAULT_PROFILES.items()},
                       python="/py", standby=False, **kw)


def found(model: str, node: str) -> Path:
    if model == "missing":
        raise ModelNotFound(f"no model {model!r} on {node}")
    return Path("/models") / model


def spec(**kw) -> RankSpec:
    return RankSpec(**{"generation": 3, "rank": 1, "world": 2, "profile": "meshd-rank", "model": "m",
                       "hostfile": RING, **kw})


def test_a_plan_holds_the_whole_launch():
    plan = launch_plan(spec(args={"max_tokens": 64}, env={"NCCL_DEBUG": "INFO"}, secret="s" * 32), config(),
                       {"PATH": "/bin", "MESHD_RANK_SECRET": "the agent's own"}, found)
    rundir = STATE / "gen-3" / "rank-1"
    assert plan.argv == ("/py", "-m", "runtime.rank", "--model", "/models/m", "--host", "127.0.0.1", "--port",
                         "8100", "--seed", "0", "--meshd-generation", "3", "--status-file",
                         str(rundir / "status.json"), "--max-tokens", "64")
    assert (plan.cwd, plan.log_path, plan.status_path) == (rundir, rundir / "rank.log", rundir / "status.json")
    assert json.loads(plan.files[rundir / "mlx_hostfile.json"]) == [["10.0.0.1:32323"], ["10.0.0.2:32324"]]
    assert {k: v for k, v in plan.env.items() if k != "PATH"} == {
        "MLX_RANK": "1", "MLX_HOSTFILE": str(rundir / "mlx_hostfile.json"), "NCCL_DEBUG": "INFO",
        "MESHD_BACKEND": "ring", "MESHD_GENERATION": "3", "MESHD_NODE": "n0", "MESHD_AGENT": str(STATE),
        "MESHD_STATUS_FILE": str(rundir / "status.json"), "MESHD_RANK_SECRET": "s" * 32}
    assert plan.early == {"MESHD_NODE": "n0", "NCCL_DEBUG": "INFO"}
    assert plan.watch_status


@pytest.mark.parametrize("name,changes,gpus", [
    ("a mesh of one on nccl: its own GPU, as mlx.launch gives it", {"world": 1, "rank": 0, "hostfile": {
        "backend": "nccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}]}}, "0"),
    ("nccl: the rank's place on its host", {"hostfile": NCCL}, "0"),
    ("nccl: the GPUs the controller chose for it", {"hostfile": NCCL, "devices": "2,3"}, "2,3"),
    ("ring: devices are not the ring's to set", {"devices": "2,3"}, None),
])
def test_a_plan_gives_the_rank_its_gpus(name, changes, gpus):
    plan = launch_plan(spec(**changes), config(), {}, found)
    assert plan.env.get("CUDA_VISIBLE_DEVICES") == gpus


@pytest.mark.parametrize("mesh,environ,expected", [
    ("left", {}, "left"),
    (None, {}, None),  # a caller that names no mesh
    ("left", {"MESHD_MESH": "the agent's own"}, "left"),
    (None, {"MESHD_MESH": "the agent's own"}, None),
])
def test_a_plan_names_the_controllers_mesh_for_the_ranks_title(mesh, environ, expected):
    plan = launch_plan(spec(), config(), environ, found, mesh=mesh)
    assert plan.env.get("MESHD_MESH") == expected
    assert plan.early.get("MESHD_MESH") == expected  # a standby started for another mesh does not take it


def test_a_ring_rank_that_shares_its_host_preloads_the_ring_wait_and_a_standby_must_have_been_started_with_it():
    lib = Path("/venv/ringwait.so")
    one_host = {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]}
    plan = launch_plan(spec(hostfile=one_host), config(), {"PATH": "/bin"}, found, lib)
    assert plan.env["LD_PRELOAD"] == plan.early["LD_PRELOAD"] == str(lib)
    assert "LD_PRELOAD" not in launch_plan(spec(), config(), {}, found, lib).env  # RING: a host each


@pytest.mark.parametrize("name,changes,param,says", [
    ("a profile this node does not allow", {"profile": "bash"}, "profile", "allowed: meshd-canary"),
    ("an environment variable off the allowlist", {"env": {"LD_PRELOAD": "x"}}, "env", "env_allowlist"),
    ("a model this node does not have", {"model": "missing"}, "model", "no model 'missing'"),
    ("a hostfile without hosts", {"hostfile": {"backend": "ring"}}, "hostfile", '"hosts" list'),
    ("a world the hostfile does not list", {"world": 3}, "world", "lists 2 hosts"),
    ("a parameter the profile does not take", {"args": {"rm": "-rf"}}, "args.rm", "takes no parameter 'rm'"),
    ("a parameter that is no string or number", {"args": {"max_tokens": True}}, "args.max_tokens", "a number"),
])
def test_a_plan_refuses_what_this_agent_does_not_run(name, changes, param, says):
    with pytest.raises(BadSpec, match=says) as e:
        launch_plan(spec(**changes), config(), {}, found)
    assert e.value.param == param


class FakeProc:
    """A spawned rank that exits when the test says: a real process (a `sleep`) while it runs, so that the
    supervisor sees a live rank, not one already gone."""

    def __init__(self):
        self._sleep = subprocess.Popen(["sleep", "300"])
        self.pid = self._sleep.pid
        self.code = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        code = await self.code
        self.gone()
        return code

    def gone(self) -> None:
        self._sleep.kill()
        self._sleep.wait()


class FakeSpawner:
    def __init__(self, warm: bool = False):
        self.plans, self.procs, self.warm = [], [], warm

    async def __call__(self, plan):
        self.plans.append(plan)
        self.procs.append(FakeProc())
        return self.procs[-1], self.warm


def kinds(sup: Supervisor) -> list[tuple[str, int, int]]:
    return [(e["kind"], e["generation"], e["rank"]) for e in sup.events.since(0)]


async def ended(sup: Supervisor, spawner: FakeSpawner) -> None:
    for p in spawner.procs:
        if not p.code.done():
            p.code.set_result(0)
    while sup.live():
        await asyncio.sleep(0.01)


# (scenario, specs started in turn, warm, what each start gives: created or the refusal, ranks spawned)
STARTS = [
    ("a start spawns its plan", [spec()], False, [True], 1),
    ("a warm start says so", [spec()], True, [True], 1),
    ("the same rank again answers the running one", [spec(), spec()], False, [True, False], 1),
    ("one rank a node: another of the same generation is refused", [spec(), spec(rank=0)], False,
     [True, Conflict], 1),
    ("another generation running: refused, nothing spawned", [spec(), spec(generation=4)], False,
     [True, Conflict], 1),
    ("a bad request: refused before the disk or a spawn", [spec(profile="bash")], False, [BadSpec], 0),
]


@pytest.mark.parametrize("name,specs,warm,answers,spawned", STARTS, ids=[s[0] for s in STARTS])
def test_a_start(tmp_path, name, specs, warm, answers, spawned):
    spawner = FakeSpawner(warm)

    async def scenario():
        sup = Supervisor(config(tmp_path), spawn=spawner)
        got = []
        for s in specs:
            try:
                rec, created = await sup.start(replace(s, model=str(tmp_path)))
                got.append(created)
                assert rec.state == RankState.SPAWNED and rec.pid == spawner.procs[-1].pid
            except (Conflict, BadSpec) as e:
                got.append(type(e))
                assert not isinstance(e, Conflict) or "is running here" in str(e), e  # at once, not after a wait
        assert got == answers
        assert len(spawner.plans) == spawned
        started = [e for e in sup.events.since(0) if e["kind"] == "RankStarted"]
        assert [e["warm"] for e in started] == [warm] * spawned
        # written before the start answered: an agent killed now adopts what it started
        assert [(e.generation, e.rank, e.pid) for e in Manifest(tmp_path / "manifest.json").read()] == [
            (r.generation, r.rank, r.pid) for r in sup.records.values()]
        for plan in spawner.plans:
            assert plan.cwd.is_dir() and (plan.cwd / "mlx_hostfile.json").exists()
        if not spawned:
            assert not list(tmp_path.glob("gen-*"))
        await ended(sup, spawner)
        assert [k for k in kinds(sup) if k[0] == "RankExited"] == [
            ("RankExited", r.generation, r.rank) for r in sup.records.values()]

    try:
        asyncio.run(scenario())
    finally:
        for p in spawner.procs:
            p.gone()
