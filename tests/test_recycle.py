"""Planned recycling on a real 2-rank mesh: a generation past its [recycle] age is
not drained while streams are in flight; once the mesh is idle it is, and the
next generation serves the request that waited for it. It is a planned incident
in `meshctl events` and meshd_recycles_total, never a failure. `meshctl restart`
under 4 streaming clients takes the same path onto the agents' standby ranks and
costs no client an error or a refusal. And the [recycle] keys that `meshctl
config check` refuses, each named."""

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


def streams_until(proxy: str, body: dict, until, out: list) -> None:
    """Streamed answers back to back until `until()`; each one's status, events and end into `out`."""
    while not until():
        r = requests.post(f"{proxy}/chat/completions", json={**body, "stream": True}, stream=True, timeout=300)
        out.append({"status": r.status_code, "events": sse_events(r.iter_lines(decode_unicode=True)),
                    "ended": time.time()})


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, demo_model):
    with mesh_up(tmp_path_factory.mktemp("recycle"), demo_model, agent={"standby": True}, recycle={"after": AFTER, "idle_for": IDLE_FOR},
                 runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096}}) as (config, agents):
        yield config, agents


@pytest.fixture(scope="module")
def mesh(meshes):
    return meshes[0]


def test_an_idle_generation_past_its_age_is_recycled_without_cutting_a_stream(mesh, demo_model):
    ready = time.time()  # at the latest
    where = urls(load(mesh))
    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 48,
            "temperature": 0, **endless(demo_model)}
    answers = [[] for _ in range(4)]
    clients = [threading.Thread(target=streams_until,
                                args=(where["proxy"], body, lambda: time.time() >= ready + AFTER + IDLE_FOR, out))
               for out in answers]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=300)
    answers = [a for out in answers for a in out]
    assert_whole(answers)
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


def assert_whole(answers: list[dict]) -> None:
    """Every answer streamed to its max_tokens: no error, no refusal, no cut."""
    for a in answers:
        assert a["status"] == 200 and a["events"][-1] == "[DONE]"
        assert not [e for e in a["events"] if isinstance(e, dict) and "error" in e]
        finish = [c["finish_reason"] for e in a["events"] if isinstance(e, dict) for c in e.get("choices", [])
                  if c.get("finish_reason")]
        assert finish == ["length"], "each stream ran to its max_tokens"


def test_meshctl_restart_under_streaming_clients_is_planned_warm_and_costs_no_answer(meshes, demo_model):
    mesh, agents = meshes
    where = urls(load(mesh))
    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 48,
            "temperature": 0, **endless(demo_model)}
    answers = [[] for _ in range(4)]
    done = threading.Event()
    clients = [threading.Thread(target=streams_until, args=(where["proxy"], body, done.is_set, out))
               for out in answers]
    for c in clients:
        c.start()
    wait_for(lambda: all(answers), 120, "every client to have had an answer", interval=0.1)
    wait_for(lambda: all(a.get("/v1/ranks").json()["standby"] for a in agents), 120, "a standby rank on every agent",
             interval=0.2)
    before = status(mesh)["generation"]  # read under load: an idle mesh could recycle by age before the restart
    restart = meshctl(mesh, "restart", "--wait")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    served = [len(out) for out in answers]  # the next generation serves: each client's next answers are its
    wait_for(lambda: all(len(out) >= n + 2 for out, n in zip(answers, served)), 120, "answers of the next generation")
    done.set()
    for c in clients:
        c.join(timeout=300)
    assert_whole([a for out in answers for a in out])

    assert status(mesh)["failures_in_window"] == 0
    planned = next(i for i in recycles(mesh) if i["generation"] == before)
    assert planned["steps"] == ["recycle"] and "meshctl restart" in planned["detail"] and planned["serving_back_at"]
    assert {s.labels["reason"] for s in samples(where["metrics"], "meshd_recycles_total")} >= {"restart"}
    assert samples(where["metrics"], "meshd_restarts_total") == [], "a restart is no failure"
    for a in agents:
        assert [e["warm"] for e in a.events() if e["kind"] == "RankStarted" and e["generation"] == before + 1] \
            == [True], "the next generation's ranks are the standbys"


@pytest.mark.parametrize("profile, sections, named", [
    ("meshd-rank", {"recycle": {"window": "3-4"}}, ("recycle.window",)),
    ("meshd-rank", {"recycle": {"after": -1, "idle": 60, "idle_deadline": "1h"}},
     ("recycle.after", "recycle.idle", "recycle.idle_deadline")),
    ("mlx-lm-server", {"recycle": {"after": 3600}}, ("recycle: the mlx-lm-server profile", 'profile = "meshd-rank"')),
    ("meshd-rank", {"recovery": {"planned_restart": "finish"}}, ("recovery.planned_restart", '"drain"', '"cut"')),
])
def test_config_check_names_the_planned_restart_key_that_is_wrong(tmp_path, demo_model, profile, sections, named):
    agents = make_agents(tmp_path, 2)  # never started: the check reads the file
    mesh = write_mesh(tmp_path, agents, demo_model, runtime={"profile": profile}, **sections)
    check = meshctl(mesh, "config", "check")
    said = check.stdout + check.stderr
    assert check.returncode != 0 and all(key in said for key in named), said
