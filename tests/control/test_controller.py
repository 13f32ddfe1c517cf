"""The controller on a mesh.toml of its own (two agents on loopback): giving
up after repeated deaths, API keys, admission, keep-alives, cancellation; and
what its store keeps."""

import json
import os
import shutil
import signal
import threading
import time

import pytest
import requests

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.demo_answers import endless
from kit.meshctl import meshctl, stop_controller
from kit.openai import sse_events, validate
from kit.waiting import wait_for
from meshd.config import load
from meshd.control.fleet import Incident
from meshd.meshctl.cli import Control
from meshd.store import Store


@pytest.fixture
def two_agents(tmp_path):
    agents = make_agents(tmp_path, 2, stall={"base": 10})
    for a in agents:
        a.start()
    yield agents
    for a in agents:
        a.kill()


def test_a_model_no_restart_can_load_ends_failed_at_its_second_generation_and_the_proxy_says_503(
        two_agents, tmp_path, demo_model):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, broken / name)
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    mesh = write_mesh(tmp_path, two_agents, broken, recovery={"max_failures": 5, "backoff_base": 0.1})
    try:
        up = meshctl(mesh, "up", timeout=240)
        assert up.returncode == 1, up.stdout + up.stderr
        assert "no_such_architecture" in up.stdout and "the same failure at load" in up.stdout
        assert "meshctl up" in up.stdout
        status = json.loads(meshctl(mesh, "status", "--json").stdout)
        assert status["phase"] == "failed" and status["generation"] == 2
        r = requests.post(f"{status['urls']['proxy']}/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.headers["Retry-After"]
        validate(r.json(), "ErrorResponse")
        assert "failed" in r.json()["error"]["message"]
        events = json.loads(meshctl(mesh, "events", "--json").stdout)
        assert len(events["incidents"]) == 1, "one incident from the first death until serving is back (or given up)"
        incident = events["incidents"][0]
        assert (incident["cause"], incident["generation"], incident["serving_back_at"]) == ("exit", 1, None)
        assert "no_such_architecture" in incident["detail"] and incident["steps"] == ["restart", "failed"]
        assert [g["generation"] for g in events["generations"]] == [2, 1]
        assert all(g["ended_at"] for g in events["generations"])
    finally:
        stop_controller(mesh)


def test_a_missing_model_is_refused_before_any_rank_starts(two_agents, tmp_path):
    mesh = write_mesh(tmp_path, two_agents, tmp_path / "no-such-model")
    try:
        t0 = time.monotonic()
        up = meshctl(mesh, "up", "--skip-preflight", timeout=120)
        assert up.returncode == 1 and time.monotonic() - t0 < 15, up.stdout + up.stderr
        assert "no model at" in up.stdout and "no-such-model" in up.stdout
        assert all(a.ranks() == [] for a in two_agents), "nothing was spawned"
        incident = json.loads(meshctl(mesh, "events", "--json").stdout)["incidents"][0]
        assert incident["cause"] == "preflight" and incident["steps"] == ["failed"]
    finally:
        stop_controller(mesh)


@pytest.fixture
def guarded_mesh(two_agents, tmp_path, demo_model):
    keys = tmp_path / "keys"
    keys.write_text("# proxy keys\nsk-test-1\nsk-test-2\n")
    mesh = write_mesh(tmp_path, two_agents, demo_model,
                      proxy={"api_keys_file": str(keys), "concurrency": 1, "queue_limit": 1,
                             "keepalive_interval": 0.2, "queue_wait": 60},
                      runtime={"args": {"prefill_step_size": 8192, "max_context": 8192, "model_name": "demo"}})
    up = meshctl(mesh, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    status = json.loads(meshctl(mesh, "status", "--json").stdout)
    yield status["urls"]["proxy"], two_agents
    stop_controller(mesh)


KEY = {"Authorization": "Bearer sk-test-1"}


def test_api_keys_are_required_when_configured_and_no_key_reads_anothers_prefixes(guarded_mesh):
    proxy, _ = guarded_mesh
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = requests.post(f"{proxy}/chat/completions", json=body, timeout=30)
    assert r.status_code == 401
    validate(r.json(), "ErrorResponse")
    assert requests.post(f"{proxy}/chat/completions", json=body, timeout=30,
                         headers={"Authorization": "Bearer nope"}).status_code == 401
    assert requests.post(f"{proxy}/chat/completions", json=body, timeout=30, headers=KEY).status_code == 200
    assert requests.get(f"{proxy}/models", timeout=30).status_code == 401

    def cached(key: str) -> int:  # what a caller learns of the prefix cache: the count, and the speed it buys
        secret = {"messages": [{"role": "user", "content": "my password is hunter2, " * 8}], "max_tokens": 2}
        r = requests.post(f"{proxy}/chat/completions", json=secret, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = cached("sk-test-1")
    assert cached("sk-test-1") > first + 50  # its own second ask comes from its cache
    assert cached("sk-test-2") == 0  # another key's same prompt: nothing of the first key's tape


def test_a_full_queue_is_429_and_the_fifo_serves_the_rest(guarded_mesh, demo_model):
    proxy, _ = guarded_mesh
    results = {}

    def send(name, tokens, stream=False):
        results[name] = requests.post(
            f"{proxy}/chat/completions", headers=KEY, timeout=120, stream=stream,
            json={"messages": [{"role": "user", "content": name}], "max_tokens": tokens, "temperature": 1.0,
                  "seed": 1, **endless(demo_model), "stream": stream})
        return results[name]

    # The first holds the one slot until its client goes away: a long answer, not read past its first event.
    first = send("first", 6000, stream=True)
    assert first.status_code == 200
    lines = first.iter_lines()  # kept: a dropped iterator closes the connection
    while not next(lines).startswith(b"data: "):
        pass
    second = threading.Thread(target=send, args=("second", 2))
    second.start()
    wait_for(lambda: requests.get(f"{proxy}/meshes", timeout=10).json()["meshes"][0]["queue"] == 1, 30,
             "the second request to wait in the proxy's queue")
    send("third", 2)
    first.close()
    second.join()
    assert results["third"].status_code == 429 and results["third"].headers["Retry-After"]
    validate(results["third"].json(), "ErrorResponse")
    assert results["second"].status_code == 200, results["second"].text


def test_keepalive_comments_flow_while_a_long_prefill_runs(guarded_mesh):
    proxy, _ = guarded_mesh
    r = requests.post(f"{proxy}/completions", headers=KEY, stream=True, timeout=120,
                      json={"prompt": "The ranks step in lockstep. " * 600, "max_tokens": 2, "stream": True})
    lines = list(r.iter_lines(decode_unicode=True))
    data_at = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert any(line.startswith(": keep-alive") for line in lines[:data_at]), lines[:5]
    assert sse_events(lines)[-1] == "[DONE]"


def test_a_client_that_goes_away_cancels_the_upstream_work(guarded_mesh, demo_model):
    proxy, agents = guarded_mesh

    def in_flight():
        return [((a.ranks()[-1]["status"] or {}).get("requests_in_flight")) for a in agents]

    r = requests.post(f"{proxy}/chat/completions", headers=KEY, stream=True, timeout=120,
                      json={"messages": [{"role": "user", "content": "long"}], "max_tokens": 4000, "stream": True,
                            "temperature": 1.0, "seed": 9, **endless(demo_model)})
    lines = r.iter_lines(decode_unicode=True)
    next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: in_flight() == [1, 1], 30, "the request on both ranks")
    r.close()
    wait_for(lambda: in_flight() == [0, 0], 30, "the cancel to reach both ranks")
    tokens = [a.ranks()[-1]["status"]["tokens"] for a in agents]
    assert tokens[0] == tokens[1] < 4000


def test_the_stock_mlx_lm_server_profile_serves_and_recovers(two_agents, tmp_path, demo_model):
    mesh = write_mesh(tmp_path, two_agents, demo_model, runtime={"profile": "mlx-lm-server"})
    try:
        up = meshctl(mesh, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        status = json.loads(meshctl(mesh, "status", "--json").stdout)
        r = requests.post(f"{status['urls']['proxy']}/chat/completions", timeout=120,
                          json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        ranks = [a.ranks()[-1] for a in two_agents]
        assert all("meshd-generation=1" in " ".join(__import__("psutil").Process(x["pid"]).cmdline())
                   for x in ranks)
        os.kill(ranks[1]["pid"], 9)
        wait_for(lambda: json.loads(meshctl(mesh, "status", "--json").stdout)["generation"] == 2 and
                 json.loads(meshctl(mesh, "status", "--json").stdout)["phase"] == "ready", 120,
                 "generation 2 of the stock server")
    finally:
        stop_controller(mesh)


def test_a_hung_stock_server_is_caught_idle_by_the_probe_and_busy_by_its_silence(two_agents, tmp_path, demo_model):
    mesh = write_mesh(tmp_path, two_agents, demo_model, runtime={"profile": "mlx-lm-server"},
                      proxy={"probe_idle": 1.0, "probe_timeout": 3.0, "token_stall": 2.0, "min_decode_rate": 4.0})

    def status():
        return json.loads(meshctl(mesh, "status", "--json").stdout)

    def hang_rank1(what: str) -> tuple[dict, list[dict]]:
        """SIGSTOP rank 1 (no status file, no exit; only a request can tell) until a new generation
        serves; the incident that ended the hung one."""
        hung = status()["generation"]
        victim = two_agents[1].ranks()[-1]["pid"]
        os.kill(victim, 19)
        try:
            wait_for(lambda: (s := status())["generation"] > hung and s["phase"] == "ready", 120, what)
        finally:
            try:
                os.kill(victim, 18)
            except ProcessLookupError:
                pass
        incidents = json.loads(meshctl(mesh, "events", "--json").stdout)["incidents"]
        return next(i for i in incidents if i["generation"] == hung), incidents

    try:
        assert meshctl(mesh, "up").returncode == 0
        incident, incidents = hang_rank1("the idle probe to catch the hang and recover")
        assert incident["cause"] == "probe" and "probe failed" in incident["detail"], incidents

        # Under whole (non-streamed) requests back to back the probe never runs; rank 0's silence past
        # each request's window is the evidence, and the request that waited is retried.
        proxy, answers, done = status()["urls"]["proxy"], [], threading.Event()

        def client():
            while not done.is_set():
                answers.append(requests.post(f"{proxy}/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code)

        worker = threading.Thread(target=client)
        worker.start()
        try:
            wait_for(lambda: len(answers) >= 3, 60, "traffic")
            incident, incidents = hang_rank1("the silence of rank 0 to be caught under traffic")
            n = len(answers)
            wait_for(lambda: len(answers) > n + 2, 60, "traffic on the new generation")
        finally:
            done.set()
            worker.join(120)
        assert set(answers) == {200}, answers
        assert incident["cause"] == "proxy" and "no answer within" in incident["detail"], incidents
    finally:
        stop_controller(mesh)


def test_no_probe_while_a_request_runs_and_a_request_in_flight_at_two_deaths_is_quarantined(
        two_agents, tmp_path, demo_model):
    """Each death is blamed on the killed rank's exit, the second too though its agent, stopped as a starved
    one is (or as a CUDA process is slow to reap), reports it after node0's closed socket and the proxy's cut
    stream opened the incident, and past the death window."""
    probe_idle, probe_timeout, death_window = 1.0, 2.0, 2.0
    mesh = write_mesh(tmp_path, two_agents, demo_model, recovery={"death_window": death_window},
                      proxy={"probe_idle": probe_idle, "probe_timeout": probe_timeout})
    body = {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 4000, "temperature": 1.0,
            "seed": 23, **endless(demo_model)}
    try:
        assert meshctl(mesh, "up").returncode == 0
        proxy = json.loads(meshctl(mesh, "status", "--json").stdout)["urls"]["proxy"]
        answer = {}
        worker = threading.Thread(target=lambda: answer.update(
            r=requests.post(f"{proxy}/chat/completions", json=body, timeout=300)))
        worker.start()

        def busy(g):  # 4000 tokens: long enough to be killed twice
            wait_for(lambda: (r := two_agents[1].ranks()[-1])["generation"] == g
                     and (r["status"] or {}).get("state") == "busy", 60, f"the request on generation {g}")

        def logged_incidents():
            return json.loads(meshctl(mesh, "events", "--json").stdout)["incidents"]

        busy(1)
        began = two_agents[1].ranks()[-1]["status"]["progress_at"]
        wait_for(lambda: (r := two_agents[1].ranks()[-1])["generation"] == 1
                 and (r["status"] or {}).get("state") == "busy"
                 and r["status"]["progress_at"] - began > probe_idle + probe_timeout, 60,
                 "the request to run on past probe_idle + probe_timeout")
        metrics = requests.get(proxy.removesuffix("/v1") + "/metrics", timeout=10).text
        assert "meshd_proxy_requests_in_flight 1.0" in metrics and "meshd_proxy_probes_total{" not in metrics, metrics
        assert logged_incidents() == []
        os.kill(two_agents[1].ranks()[-1]["pid"], 9)
        busy(2)
        pid = two_agents[1].ranks()[-1]["pid"]
        two_agents[1].proc.send_signal(signal.SIGSTOP)
        try:
            os.kill(pid, 9)
            opened = wait_for(lambda: len(i := logged_incidents()) == 2 and max(x["opened_at"] for x in i), 30,
                              "the incident opened by what node0 and the proxy saw")
            wait_for(lambda: time.time() > opened + death_window, 30, "the controller's clock past the death window")
        finally:
            two_agents[1].proc.send_signal(signal.SIGCONT)
        worker.join(120)
        r = answer["r"]
        assert r.status_code == 502 and r.json()["error"]["code"] == "request_quarantined", r.text
        validate(r.json(), "ErrorResponse")
        again = requests.post(f"{proxy}/chat/completions", json=body, timeout=30)
        assert again.status_code == 502 and "quarantined" in again.json()["error"]["message"]
        other = requests.post(f"{proxy}/chat/completions", timeout=120,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert other.status_code == 200
        incidents = logged_incidents()
        assert [(i["cause"], i["node"], i["detail"]) for i in incidents] == [("exit", "node1", "signal 9")] * 2
        assert any(c.startswith("node0 rank 0") for c in incidents[0]["consequences"]), incidents[0]
    finally:
        stop_controller(mesh)


def test_the_proxy_answers_health_cors_every_name_of_its_model_and_tools(two_agents, tmp_path, demo_model):
    mesh = write_mesh(tmp_path, two_agents, demo_model, proxy={"cors_origins": ["https://chat.example"]},
                      runtime={"aliases": ["org/demo-1b"], "args": {"model_name": "demo"}})
    try:
        assert meshctl(mesh, "up").returncode == 0
        proxy = json.loads(meshctl(mesh, "status", "--json").stdout)["urls"]["proxy"]
        health = requests.get(proxy.removesuffix("/v1") + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"

        asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        pre = requests.options(f"{proxy}/chat/completions", headers={"Origin": "https://chat.example", **asks},
                               timeout=10)
        assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == "https://chat.example"
        assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
        stranger = requests.options(f"{proxy}/chat/completions", headers={"Origin": "https://else.example", **asks},
                                    timeout=10)
        assert "Access-Control-Allow-Origin" not in stranger.headers

        names = [m["id"] for m in requests.get(f"{proxy}/models", timeout=10).json()["data"]]
        assert names == ["demo", "org/demo-1b"]  # names, never the path (tests/dataplane/test_model_ids.py)
        for name in [*names, str(demo_model), demo_model.name]:  # the path and its directory's name still answer
            r = requests.post(f"{proxy}/chat/completions", headers={"Origin": "https://chat.example"}, timeout=60,
                              json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "demo", r.text
            assert r.headers["Access-Control-Allow-Origin"] == "https://chat.example"
        ask = {"messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 2}
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        plain, offered = (requests.post(f"{proxy}/chat/completions", json=body, timeout=60).json()
                          for body in (ask, {**ask, "tools": [tool]}))
        assert offered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the tools reached the prompt
        forced = requests.post(f"{proxy}/chat/completions", timeout=60,
                               json={**ask, "max_tokens": 64, "tools": [tool], "tool_choice": "required"})
        call = forced.json()["choices"][0]  # held to a call by its grammar (runtime/engine/grammar.py)
        assert forced.status_code == 200 and call["finish_reason"] == "tool_calls", forced.text
        assert call["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        unknown = requests.post(f"{proxy}/chat/completions", timeout=30,
                                json={"model": "org/other", "messages": [{"role": "user", "content": "hi"}]})
        assert unknown.status_code == 404 and "demo" in unknown.json()["error"]["message"]

        Control(load(mesh)).call("POST", "/v1/down", {"force": False})  # the mesh stops; its proxy stays up
        wait_for(lambda: requests.get(proxy.removesuffix("/v1") + "/health", timeout=10).status_code == 503, 60,
                 "the proxy to say the mesh is stopped")
        down = requests.get(proxy.removesuffix("/v1") + "/health", timeout=10)
        assert down.status_code == 503 and down.json()["error"]["message"]
        assert "meshd-proxy (pid" in meshctl(mesh, "down").stdout  # `meshctl down` stops the proxy it started too
        with pytest.raises(requests.ConnectionError):
            requests.get(proxy.removesuffix("/v1") + "/health", timeout=10)
    finally:
        stop_controller(mesh)


def test_the_store_keeps_the_newest_generations_events_and_incidents(tmp_path):
    store = Store(tmp_path / "meshd.sqlite")
    for g in range(1, 7):
        store.note_generation(g, "started", float(g))
        store.record_event({"node": "n", "seq": g, "kind": "RankStarted", "generation": g, "rank": 0, "at": float(g)})
        store.open_incident(Incident(float(g), "exit", "n", 0, g, "exit code 1"))
    store.prune(generations=2, incidents=3)
    assert [r["generation"] for r in store.generations()] == [6, 5]
    assert [r[0] for r in store.db.execute("SELECT generation FROM events ORDER BY generation")] == [5, 6]
    assert [i["generation"] for i in store.incidents()] == [6, 5, 4]
