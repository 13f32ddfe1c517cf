"""The agent's standby rank on a real agent (a mesh of one, real meshd-rank processes): the next
generation starts on it, no sooner than the generation before is gone, and it holds no weights; one
that crashed, went stale (a file it imported replaced, its distribution upgraded) or does not answer
(stopped) is replaced, never used; it ends with its agent. What the snapshots take
on each node, as the agent reports it and doctor judges it, and rank 0's step count as the controller
surveys it ([recycle] steps). And the pure decisions, as tables."""

import asyncio
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import aiohttp
import psutil
import pytest

from agents.events import EventLog
from agents.orphans import ProcInfo, marker_generation, scan, select_orphans
from agents.standby import (RESPAWN_AFTER, SILENT, Keeper, Standby, answered, changed_code, early_env, rank_args,
                            refusal, respawn_in, trigger)
from common.buildinfo import identities
from common.protocol import RankExited, RankStarted, RankStateChanged
from common.procs import Target
from common.states import RankState
from kit.agents import make_agents, start_generation, stop_generation, wait_mesh_ready
from kit.ps import shown
from kit.waiting import wait_for
from meshd.config import Node
from meshd.control.survey import rank0_steps
from meshd.meshctl.background import pids_below
from meshd.nodes.agentclient import AgentClient
from meshd.nodes.doctor import judge_snapshots

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """One agent whose ranks import runtime/ and common/ from a copy of their own, installed as a
    distribution of its own (its dist-info beside them): the stale tests change that copy, never the
    checkout or .venv."""
    tmp = tmp_path_factory.mktemp("standby")
    for package in ("runtime", "common"):
        shutil.copytree(ROOT / package, tmp / "code" / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist_info = tmp / "code" / "meshd_copy-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: meshd-copy\nVersion: 0.1\n")
    (dist_info / "top_level.txt").write_text("common\nruntime\n")
    (a,) = make_agents(tmp, 1, extra={"standby": True})
    # its ranks exec'd, as the standby they are measured against is
    a.start(env={"PYTHONPATH": f"{tmp / 'code'}{os.pathsep}{ROOT}"}, warm=False)
    a.code = tmp / "code"
    a.generation = 0
    yield a
    a.kill()
    for pid in pids_below(tmp):  # a rank outlives its agent
        os.kill(pid, signal.SIGKILL)


def started(a, generation: int) -> dict:
    return next(e for e in a.events() if e["kind"] == "RankStarted" and e["generation"] == generation)


def serve_next(a, model, within: float = 120) -> dict:
    """Stop the generation that runs (if any), start the next and wait (up to `within` seconds) until it
    serves; returns the next one's RankStarted."""
    if a.generation:
        stop_generation([a], a.generation, mode="drain", grace=10)
    a.generation += 1
    wait_mesh_ready(start_generation([a], a.generation, model), timeout=within)
    return started(a, a.generation)


def standby_report(a) -> dict:
    """The standby the agent holds, once it reported ready."""
    def ready():
        ranks = a.get("/v1/ranks").json()
        path = a.dir / "state" / "standby" / "report.json"
        return json.loads(path.read_text()) if ranks["standby_ready"] else None
    report = wait_for(ready, 120, "the agent's standby to be ready")
    assert report["pid"] == a.get("/v1/ranks").json()["standby"]
    return report


def test_the_next_generation_starts_on_the_standby_once_the_last_is_gone(agent, demo_model):
    assert serve_next(agent, demo_model)["warm"] is False, "an agent's first rank has no standby to take"
    standby = standby_report(agent)
    rank = next(r for r in agent.ranks() if r["generation"] == agent.generation)
    assert standby["mlx_active_bytes"] * 1000 < rank["status"]["mlx_active_bytes"], "the standby holds no weights"
    assert psutil.Process(standby["pid"]).memory_info().rss < rank["rss_bytes"]
    g = agent.generation
    assert shown(standby["pid"]) == f"meshd-standby node={agent.node}"  # ps tells the waiting one from the rank
    assert shown(rank["pid"]) == f"meshd-rank gen={g} rank=0/1 node={agent.node}"

    stopping = threading.Thread(target=stop_generation, args=([agent], g), kwargs={"mode": "drain", "grace": 10})
    stopping.start()
    wait_for(lambda: next(r for r in agent.ranks() if r["generation"] == g)["expected"], 30, "the stop to begin")
    port = start_generation([agent], g + 1, demo_model)  # while generation g still drains: it waits, then starts
    stopping.join()
    agent.generation = g + 1
    wait_mesh_ready(port)
    exited = next(e for e in agent.events() if e["kind"] == "RankExited" and e["generation"] == g)
    took = started(agent, g + 1)
    assert (took["warm"], took["pid"]) == (True, standby["pid"])
    assert took["at"] >= exited["at"], "the next rank starts once the last one's process is gone"
    assert shown(took["pid"]) == f"meshd-rank gen={g + 1} rank=0/1 node={agent.node}"  # it retitled itself
    beside = standby_report(agent)["pid"]
    assert shown(beside) == f"meshd-standby node={agent.node}"
    top = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in (took["pid"], beside)}  # top's short name
    assert top == {took["pid"]: "meshd-rank gen=", beside: "meshd-standby n"}
    seen = {p.pid: p for p in scan()}  # what the sweep reads of them: the title, and the environment kept
    assert marker_generation(seen[took["pid"]]) == g + 1 and seen[beside].standby
    assert seen[took["pid"]].agent == seen[beside].agent == str((agent.dir / "state").resolve())


def test_a_standby_that_died_is_replaced_and_never_blamed(agent, demo_model):
    dead = standby_report(agent)["pid"]
    os.kill(dead, signal.SIGKILL)
    took = serve_next(agent, demo_model)
    assert took["warm"] is False and took["pid"] != dead
    assert not [e for e in agent.events() if e.get("pid") == dead], "a standby's death is no rank's"
    assert standby_report(agent)["pid"] not in (dead, took["pid"]), "a new standby once the rank serves"


def replace_with_a_copy(path: Path) -> Path:
    """What an installer does to a file: a new one (here the same bytes and mtime) renamed over it."""
    shutil.copy2(path, path.with_name(path.name + ".new"))
    os.replace(path.with_name(path.name + ".new"), path)
    return path


def upgrade(dist_info: Path) -> Path:
    """What `pip install -U` does to a distribution's metadata: the old version's directory is gone."""
    dist_info.rename(dist_info.with_name("meshd_copy-0.2.dist-info"))
    return dist_info


@pytest.mark.parametrize("change", [
    lambda code: replace_with_a_copy(code / "runtime" / "engine" / "rowwise.py"),  # a module it imported
    lambda code: upgrade(code / "meshd_copy-0.1.dist-info"),  # the distribution its modules come from
], ids=["a module replaced", "its distribution upgraded"])
def test_a_stale_standby_is_replaced(agent, demo_model, change):
    standby = standby_report(agent)
    changed = change(agent.code)
    assert str(changed) in standby["code"], "the standby reported the identity of what changed"
    took = serve_next(agent, demo_model)
    assert took["warm"] is False and not psutil.pid_exists(standby["pid"])
    assert f"the standby is stale: {changed} changed" in (agent.dir / "agent.log").read_text()
    standby_report(agent)
    assert serve_next(agent, demo_model)["warm"] is True, "its replacement, started after the change, is used"


def test_a_stopped_standby_is_ended_and_the_rank_starts_cold_at_once(agent, demo_model):
    stopped = standby_report(agent)["pid"]
    os.kill(stopped, signal.SIGSTOP)  # it cannot answer the agent's question
    took = serve_next(agent, demo_model, within=60)  # far below a controller's start_timeout (120 s)
    assert took["warm"] is False and not psutil.pid_exists(stopped), "ended (SIGKILL) and reaped, never handed a rank"
    said = [line for line in (agent.dir / "agent.log").read_text().splitlines() if str(stopped) in line]
    assert any(SILENT in line for line in said), said


def test_the_agent_reports_what_the_snapshots_take(agent):
    before = agent.get("/v1/node").json()["snapshots_bytes"]  # what its ranks wrote
    extra = agent.dir / "state" / "snapshots" / "test"
    extra.mkdir(parents=True)
    (extra / "a.safetensors").write_bytes(b"x" * 3000)
    (extra / "index.json").write_bytes(b"{}")
    assert agent.get("/v1/node").json()["snapshots_bytes"] == before + 3002


def test_rank_0s_step_count_reaches_the_controller_through_its_agent(agent):
    async def count(generation: int) -> int | None:
        async with aiohttp.ClientSession() as session:
            return await rank0_steps(AgentClient(Node(agent.node, agent.url, agent.dir / "token"), session), generation)

    first = asyncio.run(count(agent.generation))
    assert first > 0 and asyncio.run(count(agent.generation + 1)) is None
    wait_for(lambda: asyncio.run(count(agent.generation)) > first, 30, "rank 0's idle exchanges to count")


def test_a_waiting_standby_ends_with_its_agent(agent):
    standby = standby_report(agent)["pid"]
    agent.kill()
    wait_for(lambda: not psutil.pid_exists(standby) or psutil.Process(standby).status() == psutil.STATUS_ZOMBIE,
             30, "the standby to end with its agent")


# --- the pure decisions ---------------------------------------------------------------------------------
STANDBY = Standby(Target(40, 1000.0), {"OMP_NUM_THREADS": "2"}, Path("report.json"), Path("answer.json"))
READY = {"pid": 40, "code": {"/venv/mlx/core.so": [1, 2, 3, 4]}}
REFUSALS = [
    ("current", STANDBY, True, READY, [], {"OMP_NUM_THREADS": "2"}, None),
    ("none held", None, False, None, [], {}, "no standby"),
    ("crashed", STANDBY, False, READY, [], {"OMP_NUM_THREADS": "2"}, "exited"),
    ("still importing", STANDBY, True, None, [], {"OMP_NUM_THREADS": "2"}, "not ready"),
    ("a report of an earlier standby", STANDBY, True, {**READY, "pid": 39}, [], {"OMP_NUM_THREADS": "2"},
     "not ready"),
    ("a file of its code changed", STANDBY, True, READY, ["/venv/mlx/core.so"], {"OMP_NUM_THREADS": "2"},
     "stale: /venv/mlx/core.so changed"),
    ("several", STANDBY, True, READY, ["/a.py", "/b.py", "/c.py"], {"OMP_NUM_THREADS": "2"}, "/a.py and 2 more"),
    ("another environment", STANDBY, True, READY, [], {"OMP_NUM_THREADS": "4"}, "another environment"),
    ("other GPUs", STANDBY, True, READY, [], {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "1"},
     "another environment"),
]


@pytest.mark.parametrize("name, standby, alive, report, changed, early, why", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_when_a_standby_may_take_a_rank(name, standby, alive, report, changed, early, why):
    said = refusal(standby, alive=alive, report=report, changed=changed, early=early)
    assert said is None if why is None else why in said


REPORTED = {"/venv/numpy/__init__.py": [1, 10, 500, 80], "/venv/numpy-2.1.dist-info": [1, 11, 400, 4096]}
CHANGES = [
    ("nothing changed", REPORTED, []),
    ("edited in place", {**REPORTED, "/venv/numpy/__init__.py": [1, 10, 501, 80]}, ["/venv/numpy/__init__.py"]),
    ("replaced by an equal copy", {**REPORTED, "/venv/numpy/__init__.py": [1, 12, 500, 80]},
     ["/venv/numpy/__init__.py"]),
    ("the same inode on another device", {**REPORTED, "/venv/numpy/__init__.py": [2, 10, 500, 80]},
     ["/venv/numpy/__init__.py"]),
    ("its dist-info renamed by an upgrade", {**REPORTED, "/venv/numpy-2.1.dist-info": None},
     ["/venv/numpy-2.1.dist-info"]),
    ("not asked about", {"/venv/numpy/__init__.py": [1, 10, 500, 80]}, ["/venv/numpy-2.1.dist-info"]),
    ("files it never imported", {**REPORTED, "/venv/numpy/linalg.py": [1, 13, 900, 10]}, []),
]


@pytest.mark.parametrize("name, now, changed", CHANGES, ids=[c[0] for c in CHANGES])
def test_which_files_of_a_standbys_code_changed(name, now, changed):
    assert changed_code(REPORTED, now) == changed


@pytest.mark.parametrize("asked, answer, yes", [
    ("b7", {"answered": "b7"}, True),
    ("b7", {"answered": "a1"}, False),  # the answer to an earlier question: it may have stopped since
    ("b7", None, False),  # no answer yet
    ("b7", {}, False),
])
def test_whether_a_standby_answered(asked, answer, yes):
    assert answered(asked, answer) is yes


@pytest.mark.parametrize("enabled, held, failed_at, now, delay", [
    (True, False, None, 0.0, 0.0),
    (False, False, None, 0.0, None),  # standby = false in agent.toml
    (True, True, None, 0.0, None),
    (True, False, 100.0, 101.0, RESPAWN_AFTER - 1),  # the last one died before it was ready: look again then
    (True, False, 100.0, 100.0 + RESPAWN_AFTER, 0.0),
    (True, False, 100.0, 100.0 + 2 * RESPAWN_AFTER, 0.0),
])
def test_when_a_standby_is_started(enabled, held, failed_at, now, delay):
    assert respawn_in(enabled=enabled, held=held, failed_at=failed_at, now=now) == delay


def test_a_standby_that_died_unready_is_started_again_later_while_the_rank_serves(tmp_path):
    """The keeper looks again once the wait is over, with no new generation to prompt it; not while the
    node's rank does not serve."""
    async def scenario():
        keeper = Keeper(tmp_path, sys.executable, True, respawn_after=1.0)
        serving, looks = [True], []

        def rank_serves() -> bool:
            looks.append(serving[0])
            return serving[0]

        await keeper.ensure({}, rank_serves)
        first = keeper.standby.target.pid
        os.kill(first, signal.SIGKILL)  # before it reported ready
        await keeper.proc.wait()
        await keeper.ensure({}, rank_serves)
        assert keeper.standby is None and keeper.failed_at is not None, "an unready death waits"
        await asyncio.to_thread(wait_for, lambda: keeper.standby is not None, 60, "the keeper's look again")
        assert looks == [True]
        second = keeper.standby.target.pid
        os.kill(second, signal.SIGKILL)
        await keeper.proc.wait()
        serving[0] = False
        await keeper.ensure({}, rank_serves)
        await asyncio.to_thread(wait_for, lambda: len(looks) == 2, 60, "the keeper's look again, the rank not serving")
        assert looks == [True, False] and keeper.standby is None, "no standby while the node's rank does not serve"
        await keeper.close()
        return first, second
    first, second = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert first != second


@pytest.mark.parametrize("argv, args", [
    (["/venv/python", "-m", "runtime.rank", "--model", "/m"], ["--model", "/m"]),
    (["/other/python", "-m", "runtime.rank", "--model", "/m"], None),  # another interpreter than the standby's
    (["/venv/python", "-m", "mlx_lm.server", "--model", "/m"], None),
    (["/venv/python", "-X", "x", "-m", "runtime.rank"], None),
])
def test_which_launches_a_standby_can_become(argv, args):
    assert rank_args(argv, "/venv/python") == args


def test_the_early_environment_is_what_imports_device_init_and_the_title_read():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0", "MLX_RANK": "1", "MESHD_NODE": "n1"}
    assert early_env(env, ("OMP_NUM_THREADS", "NCCL_DEBUG")) == {"CUDA_VISIBLE_DEVICES": "0", "MESHD_NODE": "n1",
                                                                 "OMP_NUM_THREADS": "2"}


def test_files_rewritten_replaced_or_removed_have_another_identity(tmp_path):
    for name in ("kept.py", "edited.py", "replaced.py", "removed.py"):
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "pkg-1.0.dist-info").mkdir()
    paths = sorted(str(p) for p in tmp_path.iterdir())
    before = identities(paths)
    (tmp_path / "edited.py").write_text("x = 22\n")  # another size: the same clock tick may give the same mtime
    replace_with_a_copy(tmp_path / "replaced.py")
    (tmp_path / "removed.py").unlink()
    (tmp_path / "pkg-1.0.dist-info").rename(tmp_path / "pkg-1.1.dist-info")
    assert changed_code(before, identities(paths)) == [str(tmp_path / n) for n in
                                                       ("edited.py", "pkg-1.0.dist-info", "removed.py", "replaced.py")]


@pytest.mark.parametrize("event, asked", [
    (RankStateChanged("n0", 3, 0, 1.0, RankState.READY), True),
    (RankStateChanged("n0", 3, 0, 1.0, RankState.LOADING), False),
    (RankStateChanged("n0", 3, 0, 1.0, RankState.BUSY), False),
    (RankStarted("n0", 3, 0, 1.0, pid=7), False),
    (RankExited("n0", 3, 0, 1.0), False),
], ids=["ready: a standby beside it", "loading: none beside it", "busy: asked at ready already", "started",
        "exited"])
def test_a_standby_is_asked_for_when_the_agent_logs_its_rank_ready(tmp_path, event, asked):
    class Keeping:
        def __init__(self):
            self.asked = []

        async def ensure(self, early, serving):
            self.asked.append((early, serving()))

    keeper, log = Keeping(), EventLog(tmp_path / "events.jsonl")
    log.subscribe(trigger(keeper, lambda: {"MESHD_NODE": "n0"}, lambda: True))
    record = asyncio.run(log.emit(event))
    assert record["seq"] == 1 and log.since(0) == [record]
    assert keeper.asked == ([({"MESHD_NODE": "n0"}, True)] if asked else [])


def test_a_sweep_ends_a_standby_only_when_its_agent_does_not_hold_it():
    standby = "python -m runtime.standby --report /s/standby/report.json --meshd-standby"
    procs = [ProcInfo(30, "python", tuple(standby.split()), 1.0, agent="/s"),
             ProcInfo(31, "python", tuple(standby.split()), 1.0, agent="/s", standby=True),
             ProcInfo(32, "python", tuple(standby.split()), 1.0, agent="/s", standby=True),
             ProcInfo(33, "python", tuple(standby.split()), 1.0, agent="/other", standby=True)]
    orphans = select_orphans(procs, agent="/s", current=None, keep_pids={31}, manifest=[], now=10.0, ibv_limit=30)
    assert [(o.pid, o.reason) for o in orphans] == [(32, "a standby rank this agent does not hold")]


@pytest.mark.parametrize("used, free, line", [
    (0, 10 << 30, None),
    (None, 10 << 30, None),
    (3 << 30, 10 << 30, "ok   snapshots    node0      3072 MiB in /srv/agent/snapshots, 10240 MiB free"),
    (3 << 30, 5 << 30, "WARN snapshots    node0      3072 MiB in /srv/agent/snapshots, only 5120 MiB free beside them"),
])
def test_doctor_says_what_the_snapshots_take_and_warns_near_the_free_space(used, free, line):
    checks = judge_snapshots("node0", "/srv/agent/snapshots", used, free)
    assert [c.line().splitlines()[0] for c in checks] == ([line] if line else []) and all(c.ok for c in checks)
    assert all("snapshot_budget_mb" in c.fix for c in checks if c.warn)
