"""Four real agents on loopback, each the parent of one real rank of a ring
mesh: exits, deaths, stalls, signatures, adoption after an agent restart,
sweeps, auth and bad input."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from common import procs
from kit.agents import (
    make_agents,
    pid_of,
    ring_hostfile,
    start_generation,
    stop_generation,
    wait_mesh_ready,
)
from kit.demo_answers import endless
from kit.fatal_lines import LINES
from kit.openai import validate
from kit.waiting import wait_for

STALL_BASE = 3.0
MIN_PREFILL_RATE = 10.0  # prompt tokens a second: the short prompts' allowance stays under a second
IBV_HANG_SECONDS = 1.0


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    agents = make_agents(tmp_path_factory.mktemp("agents"), 4,
                         stall={"base": STALL_BASE, "min_prefill_rate": MIN_PREFILL_RATE},
                         extra={"ibv_hang_seconds": IBV_HANG_SECONDS, "grace_seconds": 5.0})
    for a in agents:
        a.start()
    yield agents
    for a in agents:
        try:
            a.post("/v1/sweep", {"grace": 1})
        finally:
            a.kill()


_generation = iter(range(1, 1000))


@pytest.fixture
def generation(agents):
    g = next(_generation)
    yield g
    stop_generation(agents, g)


def chat(port, **kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}
    return requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)


def chat_until_cut(port, **kw):
    """A long request on a thread whose mesh will be stopped under it."""
    try:
        chat(port, **kw)
    except requests.RequestException:
        pass


def test_four_agents_start_a_real_mesh_idempotently(agents, demo_model, generation):
    port = start_generation(agents, generation, demo_model)
    wait_mesh_ready(port)
    assert chat(port).status_code == 200
    views = [a.ranks()[-1] for a in agents]
    assert [v["rank"] for v in views] == [0, 1, 2, 3]
    assert all(v["generation"] == generation and v["rss_bytes"] > 0 for v in views)
    wait_for(lambda: all(a.ranks()[-1]["state"] == "ready" for a in agents), 10, "ready state on every agent")
    for a, v in zip(agents, views):  # forked warm by its agent (kit/warmranks.py), seen as an exec'd one
        rank = psutil.Process(v["pid"])
        assert rank.ppid() == a.proc.pid and rank.cmdline()[0].startswith(f"meshd-rank gen={generation} ")
        assert {k: rank.environ().get(k) for k in ("MESHD_AGENT", "MESHD_GENERATION")} == {
            "MESHD_AGENT": str((a.dir / "state").resolve()), "MESHD_GENERATION": str(generation)}

    again = agents[2].post("/v1/ranks", {"generation": generation, "rank": 2, "world": 4, "profile": "meshd-rank",
                                         "model": str(demo_model), "hostfile": ring_hostfile(4)})
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["pid"] == views[2]["pid"]

    other = agents[2].post("/v1/ranks", {"generation": generation + 100, "rank": 2, "world": 4,
                                         "profile": "meshd-rank", "model": str(demo_model),
                                         "hostfile": ring_hostfile(4)})
    assert other.status_code == 409
    validate(other.json(), "ErrorResponse")

    since = [a.seq() for a in agents]
    results = stop_generation(agents, generation, mode="drain", grace=30)
    # the first drain reaches every rank through rank 0: an agent asked after its rank ended has nothing to stop
    assert all(r["survivors"] == [] and r["steps"] in (["drain"], []) for r in results), results
    stopped = {pid for r in results for pid in r["stopped"]}
    assert stopped and stopped <= {v["pid"] for v in views}
    for a, s, v in zip(agents, since, views):
        e = a.wait_event(s, 10, "the drained exit", kind="RankExited", generation=generation)
        assert e["code"] == 0 and e["expected"] is (v["pid"] in stopped)


def test_sigkill_of_a_rank_is_an_exit_event_within_half_a_second(agents, demo_model, generation):
    port = start_generation(agents, generation, demo_model)
    wait_mesh_ready(port)
    since = [a.seq() for a in agents]
    victim = pid_of(agents[2], generation)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    event = agents[2].wait_event(since[2], 10, "the exit event", kind="RankExited", generation=generation)
    assert event["signal"] == signal.SIGKILL and event["expected"] is False and event["pid"] == victim
    assert event["at"] - killed_at < 0.5
    # The neighbours lose their peer: a signature and an exit of their own.
    for i in (1, 3):
        agents[i].wait_event(since[i], 30, "the survivors' exit", kind="RankExited", generation=generation)
    assert any(e["kind"] == "RankSignature" and e["signature"] == "ring_peer_lost"
               for i in (1, 3) for e in agents[i].events(since[i]))


def test_a_rank_that_exits_0_is_a_death_event(agents, demo_model, generation):
    port = start_generation(agents, generation, demo_model)
    wait_mesh_ready(port)
    since = [a.seq() for a in agents]
    requests.post(f"http://127.0.0.1:{port}/internal/drain", json={"mode": "cancel"}, timeout=10)
    for a, s in zip(agents, since):
        e = a.wait_event(s, 30, "the exit event", kind="RankExited", generation=generation)
        assert e["code"] == 0 and e["expected"] is False


def test_sigstop_of_a_busy_rank_is_a_stall_after_the_window(agents, demo_model, generation):
    port = start_generation(agents, generation, demo_model)
    wait_mesh_ready(port)
    threading.Thread(target=chat_until_cut, args=(port,),
                     kwargs={"max_tokens": 4000, "temperature": 1.0, "seed": 1, **endless(demo_model)},
                     daemon=True).start()
    wait_for(lambda: all((a.ranks()[-1]["status"] or {}).get("state") == "busy" for a in agents), 30,
             "the request to reach every rank")
    since = [a.seq() for a in agents]
    victim = pid_of(agents[1], generation)
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        stalls = [a.wait_event(s, STALL_BASE + 10, "a stall event", kind="RankStalled", generation=generation)
                  for a, s in zip(agents, since)]
        # Every rank is stuck (the stopped one, and its peers in the collective): a kill does not wait
        # out the grace on any of them.
        t0 = time.monotonic()
        results = stop_generation(agents, generation, mode="kill", grace=30)
        took = time.monotonic() - t0
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for e in stalls:
        assert e["window"] == pytest.approx(STALL_BASE, abs=1.0)  # plus the short prompt at MIN_PREFILL_RATE
        assert e["idle_for"] > e["window"]
        assert e["at"] - stopped_at <= e["window"] + 1.5
    assert [e["frozen"] for e in stalls] == [False, True, False, False]
    # The stopped rank is killed as blocked; a peer is blocked in the collective too, or (when its transport
    # already gave up on the stopped one) leaves at the SIGTERM.
    blocked = [r["steps"][:2] == ["SIGTERM", f"SIGKILL {r['stopped'][0]} (blocked)"] for r in results]
    assert blocked[1] and all(b or r["steps"] == ["SIGTERM"] for b, r in zip(blocked, results)), results
    assert all(r["survivors"] == [] for r in results), results
    assert took < 15, f"stopping blocked ranks took {took:.1f}s of a 30 s grace"


def test_a_long_prefill_under_its_window_is_not_a_stall(deep_model, tmp_path):
    """A prefill that outlasts the base window (1 s here: with an optimized BLAS the prefill takes a few
    seconds), on agents that allow a prompt token a second: whatever the machine's load, the prompt's
    allowance (its 1700-odd tokens at that rate) is past the request's timeout, so any stall said is the
    allowance ignored."""
    base = 1.0
    pair = make_agents(tmp_path, 2, stall={"base": base, "min_prefill_rate": 1.0})
    for a in pair:
        a.start()
    try:
        port = start_generation(pair, 1, deep_model, args={"prefill_step_size": 8192, "max_context": 16384})
        wait_mesh_ready(port)
        since = [a.seq() for a in pair]
        t0 = time.time()
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                          json={"prompt": "The ranks step in lockstep. " * 250, "max_tokens": 1})
        took = time.time() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 1500
        assert took > base, f"the prefill ({took:.1f}s) must outlast the base window to prove anything"
        assert not [e for a, s in zip(pair, since) for e in a.events(s) if e["kind"] == "RankStalled"]
    finally:
        stop_generation(pair, 1)
        for a in pair:
            a.kill()


def test_every_fatal_line_a_dying_rank_prints_is_its_signature(agents):
    """A real process, started by the agent as a rank, prints the real line on stderr and exits 1."""
    a = agents[3]
    for line, name, severity, role in LINES:
        g = next(_generation)
        since = a.seq()
        r = a.post("/v1/ranks", {"generation": g, "rank": 0, "world": 1, "profile": "prints-line",
                                 "model": str(a.dir), "hostfile": ring_hostfile(1), "args": {"line": line}})
        assert r.status_code == 201, r.text
        exited = a.wait_event(since, 10, f"the exit after {line!r}", kind="RankExited", generation=g)
        assert exited["code"] == 1 and exited["last_line"] == line
        sigs = [e for e in a.events(since) if e["kind"] == "RankSignature" and e["generation"] == g]
        if name is None:
            assert sigs == [] and exited["peer_lost"] is False
            continue
        assert [(e["signature"], e["severity"], e["role"], e["line"]) for e in sigs] == [(name, severity, role, line)]
        assert exited["peer_lost"] == (role == "consequence")


def test_agent_restart_adopts_running_ranks_and_resumes_events(agents, demo_model, generation):
    port = start_generation(agents, generation, demo_model)
    wait_mesh_ready(port)
    a = agents[1]
    pid = pid_of(a, generation)
    seen = a.seq()
    a.kill()
    assert chat(port).status_code == 200  # the mesh does not notice its agent is gone
    a.start()
    assert pid_of(a, generation) == pid
    resumed = a.events(seen)
    assert resumed[0]["seq"] == seen + 1  # the log goes on where it was
    # The old agent may have said a last state change (the rank's warm-up ending) after `seen` was read.
    adopted = next(e for e in resumed if e["kind"] == "RankStarted")
    assert adopted["adopted"] is True and adopted["pid"] == pid
    assert chat(port).status_code == 200
    since = a.seq()
    os.kill(pid, signal.SIGKILL)
    e = a.wait_event(since, 5, "the adopted rank's exit", kind="RankExited", generation=generation)
    assert e["pid"] == pid


def test_sweep_kills_stale_ranks_hung_ibv_tools_and_sigterm_ignorers(agents, generation, tmp_path):
    a = agents[0]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ibv = bindir / "ibv_devinfo"
    ibv.write_text("#!/bin/sh\n# stand-in for an ibv_devinfo hung in the RDMA driver\nsleep 3600\n")
    ibv.chmod(0o755)
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "--meshd-generation", "0"],
                             start_new_session=True, env={**os.environ, "MESHD_AGENT": str((a.dir / "state").resolve())})
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "--meshd-generation", "0"],
                                 start_new_session=True, env={**os.environ, "MESHD_AGENT": "/elsewhere/state"})
    hung = subprocess.Popen([str(ibv)], start_new_session=True)
    r = a.post("/v1/ranks", {"generation": generation, "rank": 0, "world": 1, "profile": "ignores-sigterm",
                             "model": str(tmp_path), "hostfile": ring_hostfile(1)})
    stubborn = r.json()["pid"]
    a.wait_event(0, 10, "the stubborn rank to start", kind="RankStarted", pid=stubborn)
    born = psutil.Process(hung.pid).create_time()  # the age the sweep judges, by the clock it reads
    wait_for(lambda: time.time() - born > IBV_HANG_SECONDS, 30, "the ibv stand-in to be older than ibv_hang_seconds")

    swept = a.post("/v1/sweep", {"grace": 1}).json()
    killed = {k["pid"]: k["reason"] for k in swept["killed"]}
    assert stale.pid in killed and "generation 0" in killed[stale.pid]
    assert hung.pid in killed and "hung" in killed[hung.pid]
    assert stale.wait(5) == -signal.SIGTERM and hung.wait(5) == -signal.SIGTERM
    assert neighbour.pid not in killed and neighbour.poll() is None  # another agent's rank on this host
    neighbour.kill()

    stop = a.post(f"/v1/generations/{generation}/stop", {"mode": "kill", "grace": 1}).json()
    assert stop["stopped"] == [stubborn] and stop["survivors"] == []
    assert stop["steps"] == ["SIGTERM", "SIGKILL"]
    e = a.wait_event(0, 5, "the stubborn rank's exit", kind="RankExited", pid=stubborn)
    assert e["signal"] == signal.SIGKILL and e["expected"] is True


def test_a_rank_already_ending_when_its_stop_begins_is_not_the_stops():
    """The stop marks a rank's exit expected only when the rank was not already ending: a live or stopped
    (SIGSTOP) process is the stop's to end; one exiting or exited and not yet reaped (its agent starved, or
    a CUDA process's teardown) died by itself."""
    proc = subprocess.Popen(["sleep", "60"])
    target = procs.identify(proc.pid)
    assert not procs.ending(target)
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 5, "the stopped process")
    assert not procs.ending(target)
    proc.kill()
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 5, "the unreaped process")
    assert procs.ending(target)
    proc.wait()
    assert procs.ending(target)


def test_token_is_required_except_on_health_and_metrics(agents):
    a = agents[0]
    for path in ("/v1/ranks", "/v1/node", "/v1/events?stream=0"):
        r = requests.get(f"{a.url}{path}", timeout=5)
        assert r.status_code == 401
        validate(r.json(), "ErrorResponse")
        r = requests.get(f"{a.url}{path}", headers={"Authorization": "Bearer wrong"}, timeout=5)
        assert r.status_code == 401
    assert requests.post(f"{a.url}/v1/sweep", timeout=5).status_code == 401
    assert requests.get(f"{a.url}/healthz", timeout=5).status_code == 200
    metrics = requests.get(f"{a.url}/metrics", timeout=5).text
    assert "meshd_agent_rank_exits_total" in metrics and "meshd_agent_node_memory_bytes" in metrics


BAD = [
    ("not json", b"{", 400, None),
    ("not an object", [], 400, None),
    ("missing model", {"generation": 1, "rank": 0, "world": 1, "profile": "meshd-rank", "hostfile": {}}, 400, "model"),
    ("wrong type", {"generation": "1", "rank": 0, "world": 1, "profile": "p", "model": "m", "hostfile": {}}, 400,
     "generation"),
    ("unknown field", {"command": ["rm", "-rf", "/"]}, 400, "command"),
    ("rank outside world", {"generation": 1, "rank": 2, "world": 2, "profile": "meshd-rank", "model": "/",
                            "hostfile": {}}, 400, "rank"),
    ("unknown profile", {"generation": 1, "rank": 0, "world": 1, "profile": "bash", "model": "/",
                         "hostfile": {"hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}]}}, 400, "profile"),
    ("env not allowed", {"generation": 1, "rank": 0, "world": 1, "profile": "meshd-rank", "model": "/",
                         "env": {"LD_PRELOAD": "/evil.so"}, "hostfile": {"hosts": [{"ssh": "a"}]}}, 400, "env"),
    ("arg not in profile", {"generation": 1, "rank": 0, "world": 1, "profile": "meshd-rank", "model": "/",
                            "args": {"exec": "x"}, "hostfile": {"hosts": [{"ssh": "a", "ips": ["1.1.1.1"]}]}},
     400, "args.exec"),
    ("missing model path", {"generation": 1, "rank": 0, "world": 1, "profile": "meshd-rank", "model": "/nope",
                            "hostfile": {"hosts": [{"ssh": "a"}]}}, 400, "model"),
    ("rdma diagonal not null", {"generation": 1, "rank": 0, "world": 2, "profile": "meshd-rank", "model": "/",
                                "hostfile": {"backend": "jaccl", "hosts": [
                                    {"ssh": "a", "ips": ["1.1.1.1"], "rdma": ["x", "y"]},
                                    {"ssh": "b", "ips": ["1.1.1.2"], "rdma": ["x", None]}]}}, 400, "hostfile"),
    ("world differs from hostfile", {"generation": 1, "rank": 0, "world": 3, "profile": "meshd-rank", "model": "/",
                                     "hostfile": ring_hostfile(2)}, 400, "world"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_start_requests_are_400_naming_the_field(agents, name, body, status, param):
    a = agents[0]
    data = body if isinstance(body, bytes) else __import__("json").dumps(body).encode()
    r = requests.post(f"{a.url}/v1/ranks", data=data, timeout=10,
                      headers={**a.headers(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    validate(r.json(), "ErrorResponse")
    if param:
        assert r.json()["error"]["param"] == param
    assert not [x for x in a.ranks() if x["state"] not in ("exited", "lost")], "a bad request left a process"


def test_bad_stop_and_sweep_requests(agents):
    a = agents[0]
    assert a.post("/v1/generations/x/stop", {}).status_code == 400
    assert a.post("/v1/generations/1/stop", {"mode": "explode"}).json()["error"]["param"] == "mode"
    assert a.post("/v1/generations/1/stop", {"grace": -1}).json()["error"]["param"] == "grace"
    assert a.post("/v1/sweep", {"grace": "soon"}).status_code == 400
    assert a.post("/v1/reboot").status_code == 403
    assert a.get("/v1/events?since=abc&stream=0").status_code == 400


def test_node_facts_report_versions_and_a_missing_rdma_tool(agents):
    facts = agents[0].get("/v1/node").json()
    assert facts["node"] == "node0" and facts["mlx"] and facts["mlx_lm"] and facts["python"]
    assert facts["memory_total_bytes"] > 0 and facts["boot_id"]
    assert facts["rdma_devices"] == {"error": "ibv_devices not found", "hung": False}


def test_node_facts_report_rdma_devices_and_a_hung_tool(tmp_path):

    bindir = tmp_path / "bin"
    bindir.mkdir()
    flag = tmp_path / "hang"
    tool = bindir / "ibv_devices"
    # Stand-in for macOS's ibv_devices: prints what the real one prints, or hangs.
    tool.write_text(f"""#!/bin/sh
if [ -e {flag} ]; then sleep 3600; fi
printf '    device          \t   node GUID\n'
printf '    ------          \t----------------\n'
printf '    rdma_en2        \t0000000000000000\n'
printf '    rdma_en3        \t0000000000000000\n'
""")
    tool.chmod(0o755)
    (agent,) = make_agents(tmp_path, 1)
    agent.start(env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    try:
        assert agent.get("/v1/node").json()["rdma_devices"] == ["rdma_en2", "rdma_en3"]
        flag.write_text("")
        t0 = time.time()
        facts = agent.get("/v1/node").json()
        assert facts["rdma_devices"]["hung"] is True and "hung" in facts["rdma_devices"]["error"]
        assert time.time() - t0 < 15
    finally:
        agent.kill()


def test_rank_logs_are_capped(tmp_path):
    """A burst then quiet: rotated without losing a line. A rank that never pauses is capped all the same."""
    (agent,) = make_agents(tmp_path, 1, extra={"log_max_bytes": 20000, "profiles": {
        "chatty": {"command": ["{python}", "-c", "import time\nfor i in range(4000): print('line', i, flush=True)\n"
                               "time.sleep(3600)", "--meshd-generation", "{generation}"], "status_file": False},
        "steady": {"command": ["{python}", "-c", "import time\nwhile True: print('x' * 99, flush=True); "
                               "time.sleep(0.004)", "--meshd-generation", "{generation}"], "status_file": False}}})
    agent.start()

    def run(generation: int, profile: str) -> Path:
        r = agent.post("/v1/ranks", {"generation": generation, "rank": 0, "world": 1, "profile": profile,
                                     "model": str(tmp_path), "hostfile": ring_hostfile(1)})
        assert r.status_code == 201, r.text
        return agent.dir / "state" / f"gen-{generation}" / "rank-0" / "rank.log"

    try:
        log = run(1, "chatty")
        wait_for(lambda: "line 3999" in agent.get("/v1/ranks/1/0/log?lines=3").text, 20, "the last line")
        # the rotation done: LOG.1 in place and the quiet rank's log emptied
        wait_for(lambda: log.with_suffix(".log.1").exists() and not log.stat().st_size, 20, "a rotation")
        kept = (log.with_suffix(".log.1").read_text() + log.read_text()).splitlines()
        assert kept == [f"line {i}" for i in range(4000)]
        agent.post("/v1/generations/1/stop", {"mode": "kill", "grace": 1})
        steady = run(2, "steady")
        wait_for(lambda: steady.with_suffix(".log.1").exists(), 20, "a busy log's rotation")
        rotations = set()

        def capped_through_rotations():
            assert steady.stat().st_size <= 4 * 20000  # twice the cap, and what a slow poll lets it add
            rotations.add(steady.with_suffix(".log.1").stat().st_mtime_ns)
            return len(rotations) > 3

        wait_for(capped_through_rotations, 60, "three more rotations of a busy log, each look at it capped")
    finally:  # a failed wait leaves no rank behind: its ranks outlive the agent by design
        with contextlib.suppress(requests.RequestException):  # an agent that died sweeps nothing
            agent.post("/v1/sweep", {"grace": 1, "generation": None})
        agent.kill()


def test_sweep_with_no_current_generation_stops_the_agents_own_ranks(agents, generation, tmp_path):
    a = agents[3]
    r = a.post("/v1/ranks", {"generation": generation, "rank": 0, "world": 1, "profile": "jaccl-standin",
                             "model": str(tmp_path), "hostfile": ring_hostfile(1)})
    pid = r.json()["pid"]
    since = a.seq()
    assert a.post("/v1/sweep", {"grace": 1, "generation": None}).status_code == 200
    e = a.wait_event(since, 10, "the swept rank's exit", kind="RankExited", pid=pid)
    assert e["expected"] is True
    assert a.get("/healthz").json()["generation"] is None
    assert a.post("/v1/sweep", {"generation": "all"}).json()["error"]["param"] == "generation"
