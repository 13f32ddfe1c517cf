"""Planned recycling on a real 2-rank mesh: a generation past its [recycle] age is
not drained while streams are in flight; once the mesh is idle it is, and the
next generation serves the request that waited for it. It is a planned incident
in `meshctl events` and meshd_recycles_total, never a failure. And the
[recycle] keys that `meshctl config check` refuses, each named."""

import json
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.openai import sse_events
from kit.waiting import wait_for
from meshd.config import load
from meshd.control.controllerd import urls

AFTER, IDLE_FOR = 8.0, 3.0


def status(config) -> dict:
    return json.loads(meshctl(config, "status", "--json").stdout)


def recycles(config) -> list[dict]:
    """The planned incidents, oldest first."""
    incidents = json.loads(meshctl(config, "events", "--json").stdout)["incidents"]
    return [i for i in reversed(incidents) if i["cause"] == "recycle"]


def samples(url: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(requests.get(url, timeout=30).text)
            for s in family.samples if s.name == name]


def streams_until(proxy: str, body: dict, until: float, out: list) -> None:
    """Streamed answers back to back until `until`; each one's status, events and end into `out`."""
    while time.time() < until:
        r = requests.post(f"{proxy}/chat/completions", json={**body, "stream": True}, stream=True, timeout=300)
        out.append({"status": r.status_code, "events": sse_events(r.iter_lines(decode_unicode=True)),
                    "ended": time.time()})


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, demo_model):
    with mesh_up(tmp_path_factory.mktemp("recycle"), demo_model, recycle={"after": AFTER, "idle_for": IDLE_FOR},
                 runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096}}) as (config, _):
        yield config


def test_an_idle_generation_past_its_age_is_recycled_without_cutting_a_stream(mesh, demo_model):
    ready = time.time()  # at the latest
    where = urls(load(mesh))
    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 48,
            "temperature": 0, **endless(demo_model)}
    answers = [[] for _ in range(4)]
    clients = [threading.Thread(target=streams_until, args=(where["proxy"], body, ready + AFTER + IDLE_FOR, out))
               for out in answers]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=300)
    answers = [a for out in answers for a in out]
    for a in answers:
        assert a["status"] == 200 and a["events"][-1] == "[DONE]"
        assert not [e for e in a["events"] if isinstance(e, dict) and "error" in e]
        finish = [c["finish_reason"] for e in a["events"] if isinstance(e, dict) for c in e.get("choices", [])
                  if c.get("finish_reason")]
        assert finish == ["length"], "each stream ran to its max_tokens"
    busy_until = max(a["ended"] for a in answers)

    planned = wait_for(lambda: recycles(mesh), 60, "a planned recycle once the mesh is idle", interval=0.2)[0]
    answer = requests.post(f"{where['proxy']}/chat/completions", timeout=180,
                           json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    assert answer.status_code == 200, "a request during the recycle waits for the next generation"
    assert (planned["generation"], planned["steps"]) == (1, ["recycle"])
    assert planned["opened_at"] - busy_until >= IDLE_FOR * 0.9, \
        "generation 1 was past its age while the streams ran, and recycled only once idle for idle_for"
    assert planned["detail"].startswith("planned: ") and "recycle.after" in planned["detail"]

    now = status(mesh)
    assert now["phase"] == "ready" and now["generation"] > 1 and now["failures_in_window"] == 0
    assert recycles(mesh)[0]["serving_back_at"], "its incident closed when generation 2 served"
    counted = samples(where["metrics"], "meshd_recycles_total")
    assert [s.labels for s in counted] == [{"reason": "age"}] and counted[0].value >= 1
    assert samples(where["metrics"], "meshd_restarts_total") == [], "a recycle is no failure"


@pytest.mark.parametrize("profile, recycle, named", [
    ("meshd-rank", {"window": "3-4"}, ("recycle.window",)),
    ("meshd-rank", {"after": -1, "idle": 60}, ("recycle.after", "recycle.idle")),
    ("mlx-lm-server", {"after": 3600}, ("recycle: the mlx-lm-server profile", 'profile = "meshd-rank"')),
])
def test_config_check_names_the_recycle_key_that_is_wrong(tmp_path, demo_model, profile, recycle, named):
    agents = make_agents(tmp_path, 2)  # never started: the check reads the file
    mesh = write_mesh(tmp_path, agents, demo_model, recycle=recycle, runtime={"profile": profile})
    check = meshctl(mesh, "config", "check")
    said = check.stdout + check.stderr
    assert check.returncode != 0 and all(key in said for key in named), said
