"""The demo mesh, as a user drives it: `meshctl up`, chat through the proxy,
deaths of every kind and the recovery after them, a controller restart, and
`meshctl down` leaving nothing behind. The module's mesh is a demo of two nodes, which recovers sooner
than the default four on a small machine (tests/meshctl/test_demo_up_down.py serves the default)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import tomllib

import psutil
import pytest
import requests
from mlx_lm.utils import load_tokenizer
from openai import OpenAI

from kit.demo_answers import endless
from kit.meshctl import Demo, demo_home, demo_meshctl
from kit.openai import sse_events, validate
from kit.ps import shown
from kit.snapshots import answer_in_flight
from kit.waiting import wait_for
from meshd.meshctl import background
from meshd.meshctl.demo import run_dir

STALL = 6.0
NODES = 2
ANSWER = 200  # tokens: the stream is still answering when its rank is killed


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home")
    r = demo_meshctl(home, "up", "--nodes", str(NODES), "--stall-window", str(STALL))
    assert "OpenAI URL: http://127.0.0.1:" in r.stdout and "meshctl down" in r.stdout
    d = Demo(home)
    yield d
    demo_meshctl(home, "down", "--force", check=False)


def test_up_serves_chat_through_the_proxy_streamed_and_whole(demo):
    client = OpenAI(base_url=demo.proxy, api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    validate(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    pieces = []
    for chunk in client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True):
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
        pieces += [c.delta.content or "" for c in chunk.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    status = demo.status()
    assert status["urls"]["metrics"].endswith("/metrics") and len(status["urls"]["agents"]) == NODES
    assert all(n["agent_ok"] and n["rank"]["state"] == "ready" for n in status["nodes"])


def test_ps_says_what_each_process_of_the_mesh_is(demo):
    s = demo.wait_ready()
    root = demo.home / "demo"
    for i, node in enumerate(s["nodes"]):
        assert shown(node["rank"]["pid"]) == (f"meshd-rank gen={s['generation']} rank={i}/{NODES} node=node{i} "
                                              "mesh=demo")
        agent = background.pid_of(run_dir(root) / f"agent-node{i}.pid")
        assert shown(agent) == f"meshd-agent node=node{i} config={root / 'agents' / f'node{i}' / 'agent.toml'}"
    assert shown(background.pid_of(run_dir(root) / "controller.pid")) == f"meshd mesh=demo config={root / 'mesh.toml'}"
    assert shown(background.pid_of(run_dir(root) / "proxy.pid")).startswith("meshd-proxy meshes=demo config=")


PROXY_BAD = [
    ("malformed json", "/chat/completions", b"{oops", 400),
    ("wrong type", "/chat/completions", json.dumps({"messages": [{"role": "user", "content": 1}]}).encode(), 400),
    ("empty messages", "/chat/completions", json.dumps({"messages": []}).encode(), 400),
    ("oversized body", "/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}',
     413),
    ("unknown model", "/completions", json.dumps({"model": "gpt-x", "prompt": "a"}).encode(), 404),
    ("unknown route", "/embeddings", b"{}", 404),
]


@pytest.mark.parametrize("name,path,data,status", PROXY_BAD, ids=[b[0] for b in PROXY_BAD])
def test_proxy_answers_bad_input_with_4xx_json(demo, name, path, data, status):
    r = requests.post(f"{demo.proxy}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    validate(r.json(), "ErrorResponse")
    assert demo.chat().status_code == 200


def test_sigkill_mid_stream_resumes_that_stream_and_the_mesh_recovers(demo):
    before = demo.wait_ready()
    g = before["generation"]
    victim = demo.rank_pid(1)
    model = demo.home / "demo" / "model"
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": ANSWER, "temperature": 1.0, "seed": 4,
            **endless(model)}
    # The same answer once whole, its tape snapshotted on every node: the next generation restores it, so the
    # resumed prompt (the conversation and the answer so far) comes from cache past the conversation.
    prompt = load_tokenizer(model).apply_chat_template(body["messages"], add_generation_prompt=True)
    assert requests.post(f"{demo.proxy}/chat/completions", json=body, timeout=180).status_code == 200
    folders = [demo.home / "demo" / "agents" / f"node{i}" / "state" / "snapshots" for i in range(NODES)]
    wait_for(lambda: all(any(answer_in_flight(d, prompt, ANSWER // 2, ANSWER) for d in f.glob("*-r*"))
                         for f in folders), 60,
             "the whole answer to be snapshotted on every node")
    r = requests.post(f"{demo.proxy}/chat/completions", stream=True, timeout=180,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
    lines = r.iter_lines(decode_unicode=True)
    data = (line for line in lines if line.startswith("data: "))
    first = [next(data) for _ in range(8)]  # the answer's first chunks; then its rank dies
    os.kill(victim, signal.SIGKILL)
    rest = sse_events(lines)
    assert rest[-1] == "[DONE]", rest[-3:]  # the stream resumed on the next generation: no error reached it
    assert rest[-3]["choices"][0]["finish_reason"] == "length" and not [e for e in rest if "error" in e]
    assert {e["id"] for e in rest[:-1]} == {json.loads(first[0][6:])["id"]}
    # The client's usage counts the conversation as its prompt (all of it restored) and the whole answer once,
    # as completion, though the next generation was given both as its prompt.
    usage = rest[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), ANSWER), usage
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt), usage

    during = demo.chat()  # sent while the mesh recovers: waits, then succeeds
    assert during.status_code == 200, during.text
    after = demo.wait_ready(after=g)
    assert after["generation"] == g + 1
    incident = demo.incidents()[0]
    # The killed rank is the cause, whatever reached the controller first; the peers that only lost
    # their socket to it are consequences.
    assert (incident["cause"], incident["node"], incident["generation"]) == ("exit", "node1", g)
    assert "signal 9" in incident["detail"] and incident["serving_back_at"] is not None
    assert incident["consequences"] and not any(c.startswith("node1 ") for c in incident["consequences"])
    steps = [t["step"] for t in incident["timeline"]]
    assert steps == ["detected", "stopped", "swept", "started", "loaded", "ready", "served"], incident["timeline"]
    assert [t["at"] for t in incident["timeline"]] == sorted(t["at"] for t in incident["timeline"])
    events = demo_meshctl(demo.home, "events").stdout
    assert "exit" in events and "served +" in events and "then node" in events
    # After the crash `meshctl logs` shows the log of the rank that died; -g and --incident pick others.
    crashed = demo_meshctl(demo.home, "logs", "node1")
    assert f"generation {g} (the last incident's, exit on node1 rank 1" in crashed.stderr
    assert f"[meshd-rank g{g} r1]" in crashed.stdout and f"g{g + 1} " not in crashed.stdout
    assert demo_meshctl(demo.home, "logs", "node1", "--incident", "1").stdout == crashed.stdout
    serving = demo_meshctl(demo.home, "logs", "node1", "-g", str(g + 1)).stdout
    assert f"[meshd-rank g{g + 1} r1]" in serving and f"g{g} " not in serving
    missing = demo_meshctl(demo.home, "logs", "node1", "--incident", "99", check=False)
    assert missing.returncode == 1 and "1 is the newest" in missing.stderr
    metrics = requests.get(demo.status()["urls"]["metrics"], timeout=5).text
    assert 'meshd_recovery_step_seconds_count{step="served"}' in metrics


def test_sigstop_of_a_busy_rank_is_a_stall_and_the_mesh_recovers(demo):
    g = demo.wait_ready()["generation"]
    victim = demo.rank_pid(1)

    def long_request():
        try:
            demo.chat(max_tokens=100, temperature=1.0, seed=2, **endless(demo.home / "demo" / "model"))
        except requests.RequestException:
            pass

    status_file = demo.home / "demo" / "agents" / "node1" / "state" / f"gen-{g}" / "rank-1" / "status.json"

    def busy() -> bool:  # the file rank 1's agent reads: a decode of 100 tokens is over between two meshctl polls
        try:
            return json.loads(status_file.read_text()).get("state") == "busy"
        except (OSError, ValueError):
            return False

    threading.Thread(target=long_request, daemon=True).start()
    wait_for(busy, 30, "rank 1 to be busy")
    os.kill(victim, signal.SIGSTOP)
    try:
        demo.wait_ready(after=g, timeout=STALL + 60)
    finally:
        if psutil.pid_exists(victim):
            os.kill(victim, signal.SIGCONT)
    incident = demo.incidents()[0]
    assert (incident["cause"], incident["node"]) == ("stall", "node1") and "heartbeat alive" not in incident["detail"]
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


def test_a_rank_that_exits_0_is_a_death_and_the_mesh_recovers(demo):
    s = demo.wait_ready()
    rank0, auth = demo.rank0(s["generation"])
    assert requests.post(f"{rank0}/internal/drain", json={"mode": "cancel"}, headers=auth, timeout=10).status_code == 202
    demo.wait_ready(after=s["generation"])
    incident = demo.incidents()[0]
    assert incident["cause"] == "exit" and "exit code 0" in incident["detail"]


def test_a_killed_controller_comes_back_and_adopts_the_running_generation(demo):
    s = demo.wait_ready()
    pids = [demo.rank_pid(i) for i in range(NODES)]
    incidents = len(demo.incidents())
    controller = int((demo.home / "demo" / "run" / "controller.pid").read_text().split()[0])
    os.kill(controller, signal.SIGKILL)
    psutil.Process(controller).wait(10) if psutil.pid_exists(controller) else None
    up = demo_meshctl(demo.home, "up")
    assert f"ready: generation {s['generation']}" in up.stdout
    after = demo.status()
    assert after["generation"] == s["generation"] and after["phase"] == "ready"
    assert [demo.rank_pid(i) for i in range(NODES)] == pids
    assert len(demo.incidents()) == incidents
    assert demo.chat().status_code == 200
    metrics = requests.get(after["urls"]["metrics"], timeout=5).text
    assert "meshd_restarts_total" not in metrics.replace("# HELP meshd_restarts_total", "").replace(
        "# TYPE meshd_restarts_total", "")


def controller_pid(demo) -> int:
    return int((demo.home / "demo" / "run" / "controller.pid").read_text().split()[0])


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_stopped_controller_is_named_stopped_with_the_fix_and_up_starts_no_second_one(demo):
    demo.wait_ready()
    pid = controller_pid(demo)
    os.kill(pid, signal.SIGSTOP)  # its port still accepts connections (the kernel's backlog); nothing answers
    try:
        status, up = demo_meshctl(demo.home, "status", check=False), demo_meshctl(demo.home, "up", check=False)
    finally:
        os.kill(pid, signal.SIGCONT)
    for r in (status, up):
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"accepts connections but does not answer: pid {pid} is stopped" in r.stderr, r.stderr
        assert f"kill -CONT {pid}" in r.stderr and "is it running" not in r.stderr
    assert controller_pid(demo) == pid and demo.status()["phase"] == "ready"


def test_up_while_the_controller_exits_waits_for_it_and_starts_the_next_which_adopts(demo):
    s = demo.wait_ready()
    pids = [demo.rank_pid(i) for i in range(NODES)]
    old = controller_pid(demo)
    control = demo.status()["urls"]["control"]
    os.kill(old, signal.SIGTERM)

    def closed_but_exiting():  # its API closed, its process not gone yet: held there until up is waiting
        if background.http_status(f"{control}/healthz") is None and not gone(old):
            os.kill(old, signal.SIGSTOP)
            return True
    wait_for(closed_but_exiting, 30, "the controller's API to close as it exits")
    up = subprocess.Popen([sys.executable, "-m", "meshd.meshctl.cli", "up"], stdout=subprocess.PIPE, text=True,
                          stderr=subprocess.STDOUT, env={**{k: v for k, v in os.environ.items() if k != "MESHD_CONFIG"},
                                                         "MESHD_HOME": str(demo.home)})
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(up.stdout), daemon=True).start()
    try:
        wait_for(lambda: any(f"(pid {old}) does not answer" in line for line in said), 60, "up to wait for it")
        os.kill(old, signal.SIGCONT)
        assert up.wait(300) == 0, "".join(said)
    finally:
        if not gone(old):
            os.kill(old, signal.SIGCONT)
        up.kill()
    assert f"ready: generation {s['generation']}" in "".join(said)
    assert controller_pid(demo) != old and gone(old)
    assert [demo.rank_pid(i) for i in range(NODES)] == pids and demo.chat().status_code == 200


class Knocks:
    """A down agent's port held by a listener that closes each connection at once: the controller's looks for
    an agent that does not answer, counted."""

    def __init__(self, host: str, port: int):
        self.server = socket.create_server((host, port))
        self.server.settimeout(0.2)
        self.count, self.done = 0, threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            conn.close()
            self.count += 1

    def __enter__(self) -> "Knocks":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(10)
        self.server.close()


def test_adoption_waits_for_an_agent_that_is_late_and_a_reset_agent_log_is_read_again(demo):
    s = demo.wait_ready()
    pids = [demo.rank_pid(i) for i in range(NODES)]
    incidents = len(demo.incidents())
    run = demo.home / "demo" / "run"
    agent1 = demo.home / "demo" / "agents" / "node1"

    def kill(name):
        pid = int((run / f"{name}.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(10) if psutil.pid_exists(pid) else None

    def start(name, module, config):
        background.start(background.python_module(module, "--config", str(config)), run / f"{name}.pid", run / f"{name}.log")

    # The controller comes back while node1's agent is still down: it waits, and adopts once the agent answers.
    kill("controller")
    kill("agent-node1")
    host, port = tomllib.loads((agent1 / "agent.toml").read_text())["listen"].rsplit(":", 1)
    with Knocks(host, int(port)) as knocks:
        start("controller", "meshd.control.controllerd", demo.home / "demo" / "mesh.toml")
        wait_for(lambda: knocks.count >= 2, 60, "the controller to look for node1's agent, and look again")
    start("agent-node1", "agents.server", agent1 / "agent.toml")
    wait_for(lambda: demo_meshctl(demo.home, "status", "--json", check=False).returncode == 0, 60, "the controller")
    after = demo.status()
    assert (after["generation"], after["phase"]) == (s["generation"], "ready")
    assert [demo.rank_pid(i) for i in range(NODES)] == pids and len(demo.incidents()) == incidents

    # node1's agent loses its event log (reinstalled, state wiped): a new epoch, numbered from 1 again.
    kill("agent-node1")
    for name in ("events.jsonl", "events.jsonl.epoch"):
        (agent1 / "state" / name).unlink()
    start("agent-node1", "agents.server", agent1 / "agent.toml")
    wait_for(lambda: demo.status()["nodes"][1]["agent_ok"], 60, "node1's agent back")
    os.kill(pids[1], signal.SIGKILL)
    demo.wait_ready(after=s["generation"])
    incident = demo.incidents()[0]
    assert (incident["node"], incident["cause"], incident["generation"]) == ("node1", "exit", s["generation"])


def test_restart_drains_into_the_next_generation_as_a_planned_incident_and_logs_f_follows_it(demo):
    """`meshctl restart` is a planned recycle: its one incident is the recycle's, with no failure's step."""
    s = demo.wait_ready()
    incidents = len(demo.incidents())
    follow = subprocess.Popen([sys.executable, "-m", "meshd.meshctl.cli", "logs", "node1", "-g", str(s["generation"]), "-f"],
                              env={**{k: v for k, v in os.environ.items() if k != "MESHD_CONFIG"},
                                   "MESHD_HOME": str(demo.home)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(follow.stdout), daemon=True).start()
    try:
        wait_for(lambda: any("ready" in line for line in seen), 30, "the log so far")
        assert "restarting" in demo_meshctl(demo.home, "restart").stdout
        demo.wait_ready(after=s["generation"])
        wait_for(lambda: any("drained, exiting 0" in line for line in seen), 30, "the drain as it is written")
        follow.send_signal(signal.SIGINT)
        assert follow.wait(30) == 0 and "Traceback" not in follow.stderr.read()
    finally:
        follow.kill()
    planned = demo.incidents()[:-incidents or None]  # newest first
    assert [(i["cause"], i["generation"], i["steps"]) for i in planned] == [("recycle", s["generation"], ["recycle"])]


def test_logs_show_a_nodes_rank_log(demo):
    demo.wait_ready()
    out = demo_meshctl(demo.home, "logs", "node0", "--lines", "50").stdout
    assert "[meshd-rank" in out and "ready on 127.0.0.1:" in out
    r = demo_meshctl(demo.home, "logs", "nodeX", check=False)
    assert r.returncode == 1 and "no node 'nodeX'" in r.stderr
    as_json = json.loads(demo_meshctl(demo.home, "logs", "node0", "--lines", "5", "--json").stdout)
    assert len(as_json["lines"]) == 5 and as_json["rank"] == 0 and as_json["offset"] > 0


def test_logs_show_an_agents_and_the_controllers_own_log(demo):
    demo.wait_ready()
    agent = demo_meshctl(demo.home, "logs", "node1", "--agent")
    assert "agent listening" in agent.stdout and "node=node1" in agent.stdout
    assert "'s agent log" in agent.stderr
    controller = demo_meshctl(demo.home, "logs", "--controller", "--lines", "500").stdout
    assert "meshd running" in controller and "mesh=demo" in controller
    r = demo_meshctl(demo.home, "logs", check=False)
    assert r.returncode == 1 and "name the node" in r.stderr
    r = demo_meshctl(demo.home, "logs", "node0", "--agent", "-g", "1", check=False)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_status_watch_redraws_live_on_a_terminal_while_restart_waits_for_the_next_generation(demo):
    s = demo.wait_ready()
    master, slave = os.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "meshd.meshctl.cli", "status", "--watch"], stdin=slave, stdout=slave,
                             stderr=slave, env={**{k: v for k, v in os.environ.items() if k != "MESHD_CONFIG"},
                                                "MESHD_HOME": str(demo.home)})
    os.close(slave)
    seen = bytearray()

    def read():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_for(lambda: b"generation" in seen, 30, "the first frame")
        restart = demo_meshctl(demo.home, "restart", "--wait")
        assert f"ready: generation {s['generation'] + 1}" in restart.stdout
        assert "\x1b[" not in restart.stdout  # not a terminal: plain lines
        wait_for(lambda: f"generation {s['generation'] + 1} ready".encode() in seen, 30, "the new generation live")
        watch.send_signal(signal.SIGINT)
        assert watch.wait(30) == 0
    finally:
        watch.kill()
        os.close(master)
    text = seen.decode(errors="replace")
    assert "\x1b[2K" in text and "\x1b[" in text.split("generation", 2)[-1]  # redrawn in place, not scrolled
    # Redrawn from one generation to the next; the frames between are the 0.5 s poll's luck (a restart onto
    # standby ranks can take less).
    assert text.index(f"generation {s['generation']} ready") < text.index(f"generation {s['generation'] + 1} ready")
    assert "Traceback" not in text
