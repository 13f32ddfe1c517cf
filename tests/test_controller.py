"""The controller on a mesh.toml of its own (two agents on loopback): giving
up after repeated deaths, API keys, admission, keep-alives, cancellation."""

import json
import os
import threading
import time

import pytest
import requests

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import meshctl, stop_controller
from kit.openai import sse_events, validate
from kit.waiting import wait_for


@pytest.fixture
def two_agents(tmp_path):
    agents = make_agents(tmp_path, 2, stall={"base": 10})
    for a in agents:
        a.start()
    yield agents
    for a in agents:
        a.kill()


@pytest.fixture
def guarded_mesh(two_agents, tmp_path, demo_model):
    keys = tmp_path / "keys"
    keys.write_text("# proxy keys\nsk-test-1\n")
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


def test_api_keys_are_required_when_configured(guarded_mesh):
    proxy, _ = guarded_mesh
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = requests.post(f"{proxy}/chat/completions", json=body, timeout=30)
    assert r.status_code == 401
    validate(r.json(), "ErrorResponse")
    assert requests.post(f"{proxy}/chat/completions", json=body, timeout=30,
                         headers={"Authorization": "Bearer nope"}).status_code == 401
    assert requests.post(f"{proxy}/chat/completions", json=body, timeout=30, headers=KEY).status_code == 200
    assert requests.get(f"{proxy}/models", timeout=30).status_code == 401


def test_a_full_queue_is_429_and_the_fifo_serves_the_rest(guarded_mesh):
    proxy, _ = guarded_mesh
    results = {}

    def send(name, tokens):
        r = requests.post(f"{proxy}/chat/completions", headers=KEY, timeout=120,
                          json={"messages": [{"role": "user", "content": name}], "max_tokens": tokens,
                                "temperature": 1.0, "seed": 1})
        results[name] = r

    first = threading.Thread(target=send, args=("first", 1500))
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=send, args=("second", 2))
    second.start()
    time.sleep(0.3)
    send("third", 2)
    first.join()
    second.join()
    assert results["third"].status_code == 429 and results["third"].headers["Retry-After"]
    validate(results["third"].json(), "ErrorResponse")
    assert results["first"].status_code == 200 and results["second"].status_code == 200


def test_keepalive_comments_flow_while_a_long_prefill_runs(guarded_mesh):
    proxy, _ = guarded_mesh
    r = requests.post(f"{proxy}/completions", headers=KEY, stream=True, timeout=120,
                      json={"prompt": "The ranks step in lockstep. " * 1000, "max_tokens": 2, "stream": True})
    lines = list(r.iter_lines(decode_unicode=True))
    data_at = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert any(line.startswith(": keep-alive") for line in lines[:data_at]), lines[:5]
    assert sse_events(lines)[-1] == "[DONE]"


def test_a_client_that_goes_away_cancels_the_upstream_work(guarded_mesh):
    proxy, agents = guarded_mesh

    def in_flight():
        return [((a.ranks()[-1]["status"] or {}).get("requests_in_flight")) for a in agents]

    r = requests.post(f"{proxy}/chat/completions", headers=KEY, stream=True, timeout=120,
                      json={"messages": [{"role": "user", "content": "long"}], "max_tokens": 4000, "stream": True,
                            "temperature": 1.0, "seed": 9})
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


def test_a_hung_stock_server_is_caught_by_the_idle_probe(two_agents, tmp_path, demo_model):
    mesh = write_mesh(tmp_path, two_agents, demo_model, runtime={"profile": "mlx-lm-server"},
                      proxy={"probe_idle": 1.0, "probe_timeout": 3.0})
    try:
        assert meshctl(mesh, "up").returncode == 0
        victim = two_agents[1].ranks()[-1]["pid"]
        os.kill(victim, 19)  # SIGSTOP: no status file, no exit; only a request can tell
        try:
            wait_for(lambda: (s := json.loads(meshctl(mesh, "status", "--json").stdout))["generation"] == 2
                     and s["phase"] == "ready", 120, "the probe to catch the hang and recover")
        finally:
            try:
                os.kill(victim, 18)
            except ProcessLookupError:
                pass
        incidents = json.loads(meshctl(mesh, "events", "--json").stdout)["incidents"]
        assert incidents[0]["cause"] == "probe" and "probe failed" in incidents[0]["detail"]
    finally:
        stop_controller(mesh)
