"""Table tests for the agent's pure decisions: log signatures, stall verdicts,
orphan selection, retention."""

from pathlib import Path

import pytest

from agents.manifest import ManifestEntry
from agents.orphans import ProcInfo, marked_standby, select_orphans
from agents.signatures import classify
from agents.stall import StallWindows, stall_verdict
from agents.supervisor import generations_to_prune
from common import proctitle
from common.statusfile import RankStatus, read_status
from kit.fatal_lines import LINES


@pytest.mark.parametrize("line,name,severity,role", LINES, ids=[l[0][:48] for l in LINES])
def test_signatures(line, name, severity, role):
    sig = classify(line)
    assert (sig.name, sig.severity, sig.role) == (name, severity, role) if sig else (name is None)


def status_file(fields: dict | None) -> RankStatus | None:
    """A status file as the agent reads it, with the table's fields."""
    return None if fields is None else RankStatus.from_dict({"generation": 1, "rank": 0, "world": 2, "pid": 1, **fields})


W = StallWindows(base=10, min_prefill_rate=100, load_deadline=600, warmup=120, start_deadline=60)
T0 = 1000.0
STALLS = [
    ("no status yet, young", None, T0 + 30, None),
    ("no status after the start deadline", None, T0 + 61, "starting"),
    ("loading slowly but under the load deadline", {"state": "loading", "progress_at": T0}, T0 + 500, None),
    ("loading past the load deadline", {"state": "loading", "progress_at": T0}, T0 + 601, "loading"),
    ("armed, compiling kernels in its warm-up, within the warm-up window",
     {"state": "armed", "progress_at": T0}, T0 + 100, None),
    ("armed past the warm-up window", {"state": "armed", "progress_at": T0}, T0 + 121, "armed"),
    ("ready and moving", {"state": "ready", "progress_at": T0}, T0 + 9, None),
    ("ready but the idle exchange stopped", {"state": "ready", "progress_at": T0}, T0 + 11, "ready"),
    ("decoding stuck", {"state": "busy", "progress_at": T0, "prompt_tokens_in_flight": 0}, T0 + 11, "busy"),
    ("100k-token prefill within its scaled window",
     {"state": "busy", "progress_at": T0, "prompt_tokens_in_flight": 100_000}, T0 + 900, None),
    ("100k-token prefill past its scaled window",
     {"state": "busy", "progress_at": T0, "prompt_tokens_in_flight": 100_000}, T0 + 1011, "busy"),
    ("exited is never a stall", {"state": "exited", "progress_at": T0}, T0 + 5000, None),
]


@pytest.mark.parametrize("name,status,now,phase", STALLS, ids=[s[0] for s in STALLS])
def test_stall_verdicts(name, status, now, phase):
    verdict = stall_verdict(status_file(status), now, T0, W)
    assert (verdict.phase if verdict else None) == phase
    if verdict:
        assert verdict.idle_for > verdict.window


@pytest.mark.parametrize("base,idle_for,heartbeat_age,frozen", [
    (3, 3.1, 2.7, True),     # a short window: stopped just after its last progress, judged at once
    (3, 3.1, 0.4, False),    # a short window, its heartbeat alive: blocked in a collective
    (30, 31, 3.5, True),     # the usual window: the heartbeat stopped long ago
    (30, 31, 2.0, False),    # the usual window: a late heartbeat write is no stopped process
])
def test_a_stall_says_whether_the_heartbeat_stopped_too(base, idle_for, heartbeat_age, frozen):
    status = {"state": "busy", "progress_at": T0, "updated_at": T0 + idle_for - heartbeat_age}
    verdict = stall_verdict(status_file(status), T0 + idle_for, T0, StallWindows(base=base))
    assert verdict.frozen is frozen


def proc(pid, cmd, created=0.0, env_gen=None, name=None, agent="/state/n0"):
    return ProcInfo(pid, name or cmd.split()[0].rsplit("/", 1)[-1], tuple(cmd.split()), created, env_gen, agent)


NOW = 10_000.0


def entry(generation: int, pid: int, create_time: float) -> ManifestEntry:
    return ManifestEntry(generation, 0, pid, create_time, create_time, Path("rank.log"), None, 8100, "127.0.0.1", "p")


PROCS = [
    proc(10, "python -m runtime.rank --model m --meshd-generation 3"),
    proc(11, "python -m runtime.rank --model m --meshd-generation 4"),
    proc(12, "python -X meshd-generation=2 -m mlx_lm.server --model m"),
    proc(13, "python serve.py", env_gen=1),
    proc(14, "ibv_devinfo", created=NOW - 100),
    proc(15, "/usr/bin/ibv_devices", created=NOW - 5),
    proc(16, "python -c pass --meshd-generation 4"),
    proc(17, "sleep 100", created=500.0),
    proc(18, "python -m runtime.rank --meshd-generation 1", agent="/state/n1"),  # another agent's rank on this host
    proc(19, "python -m runtime.rank --meshd-generation 1", agent=None),  # not started by an agent
]


def test_orphan_selection():
    manifest = [entry(generation=2, pid=17, create_time=500.0),
                entry(generation=4, pid=11, create_time=0.0)]
    orphans = select_orphans(PROCS, agent="/state/n0", current=4, keep_pids={11}, manifest=manifest, now=NOW, ibv_limit=30)
    reasons = {o.pid: o.reason for o in orphans}
    assert sorted(reasons) == [10, 12, 13, 14, 17]
    assert "generation 3" in reasons[10] and "generation 2" in reasons[12] and "generation 1" in reasons[13]
    assert "hung" in reasons[14]
    assert "retired generation 2" in reasons[17]


def test_orphan_selection_with_no_current_generation_takes_every_marked_process_of_this_node():
    orphans = select_orphans(PROCS, agent="/state/n0", current=None, keep_pids=set(), manifest=[], now=NOW, ibv_limit=30)
    assert {o.pid for o in orphans} == {10, 11, 12, 13, 14, 16}


def titled(pid, title, agent="/state/n0"):
    """A process as psutil lists it once it set its title: the title, then the old command line's room."""
    return ProcInfo(pid, title[:15], (title, "", ""), 0.0, None, agent)


def test_a_titled_rank_is_known_by_the_generation_in_its_title():
    procs = [titled(20, proctitle.rank(3, 1, 4, "node1")),  # came from a standby: no MESHD_GENERATION either
             titled(21, proctitle.rank(4, 1, 4, "node1")),
             titled(22, proctitle.rank(3, 1, None, "node1"), agent="/state/n1"),
             titled(23, proctitle.daemon("meshd-agent", "node=node1", "/etc/meshd/agent.toml"))]
    orphans = select_orphans(procs, agent="/state/n0", current=4, keep_pids=set(), manifest=[], now=NOW, ibv_limit=30)
    assert [(o.pid, o.reason) for o in orphans] == [(20, "generation 3 is not the current one (4)")]


@pytest.mark.parametrize("cmdline,standby", [
    (("python", "-m", "runtime.standby", "--report", "r.json", "--meshd-standby"), True),  # before its title
    ((proctitle.standby("node1"), "", ""), True),
    ((proctitle.standby(""), "", ""), True),
    ((proctitle.rank(3, 1, 4, "node1"), "", ""), False),  # the rank it became
    (("python", "-m", "runtime.rank", "--meshd-generation", "3"), False),
])
def test_a_standby_is_known_by_its_marker_or_its_title(cmdline, standby):
    assert marked_standby(cmdline) is standby


def test_recycled_pid_in_manifest_is_left_alone():
    manifest = [entry(generation=1, pid=17, create_time=499.0 - 100)]
    assert select_orphans([PROCS[7]], agent="/state/n0", current=2, keep_pids=set(), manifest=manifest, now=NOW, ibv_limit=30) == []


PRUNES = [
    ("fewer than kept", [1, 2], 3, set(), []),
    ("the oldest go", [1, 2, 3, 4, 5], 2, set(), [1, 2, 3]),
    ("a live old one stays", [1, 2, 3, 4], 2, {1}, [2]),
    ("unordered on disk", [10, 3, 7, 12], 2, set(), [3, 7]),
]


@pytest.mark.parametrize("existing,keep,live,pruned", [p[1:] for p in PRUNES], ids=[p[0] for p in PRUNES])
def test_retention_prunes_the_oldest_generations_but_never_a_live_one(existing, keep, live, pruned):
    assert generations_to_prune(existing, keep, live) == pruned


@pytest.mark.parametrize("text,state", [
    ('{"generation": 3, "rank": 1, "world": 2, "pid": 9, "state": "busy", "added_by_a_newer_rank": 1}', "busy"),
    ('{"generation": 3, "rank": 1, "world": 2, "pid": 9}', "loading"),
    ('{"generation": 3, "rank": 1, "world": 2, "pid": 9, "state": "a state this version does not know"}', None),
    ('{"state": "busy"}', None),  # no rank's identity: not a rank's status file
    ('{"generation": 3, "rank": 1, "wor', None),  # half a file
])
def test_a_status_file_is_read_as_any_version_wrote_it(tmp_path, text, state):
    path = tmp_path / "status.json"
    path.write_text(text)
    seen = read_status(path)
    assert (seen.state if seen else None) == state
