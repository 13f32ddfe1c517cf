"""Planned recycling on a real 2-rank mesh: a generation past its [recycle] age is
not drained while streams are in flight; once the mesh is idle it is, and the
next generation serves the request that waited for it. It is a planned incident
in `meshctl events` and meshd_recycles_total, never a failure. `meshctl restart`
under 4 streaming clients takes the same path onto the agents' standby ranks and
costs no client an error or a refusal: each stream in flight finishes on the
generation it began on (planned_restart "drain", the default). With "cut", a
mesh kept busy by clients streaming back to back is recycled once it waited
idle_deadline, and like `meshctl restart` it cuts the streams, which resume on
the next generation, each answer equal to the one no restart cut. And the keys
that `meshctl config check` refuses, each named."""

import json
import threading
import time
from pathlib import Path

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


def streams_until(proxy: str, body: dict, until, out: list, on_answer=lambda: None) -> None:
    """Streamed answers back to back until `until()`; into `out` each one's status, events, the generation
    it began on, where it resumed (the proxy's comments), when it was sent, when its headers (naming the
    generation chosen) came and when it ended. `on_answer()` as each one's headers come."""
    while not until():
        began = time.time()
        r = requests.post(f"{proxy}/chat/completions", json={**body, "stream": True}, stream=True, timeout=300)
        answered = time.time()
        on_answer()
        lines = list(r.iter_lines(decode_unicode=True))
        out.append({"status": r.status_code, "events": sse_events(lines), "began": began, "answered": answered,
                    "ended": time.time(),
                    "generation": int(r.headers.get("X-Meshd-Generation", -1)),
                    "resumed": [line for line in lines if line.startswith(": resuming on mesh ")]})


def at_each_cut(cuts: list[dict], answers: list[dict], logs: Path) -> str:
    """What each cut found, for a failure's message: the answers the client had open at it (when each was sent,
    answered and ended, relative to the cut; the generation it began on; where it resumed); the controller's
    log lines of the fleet's phases and stops and the proxy's of the streams it cut (in `logs`)."""
    lines = []
    for cut in cuts:
        t = cut["opened_at"]
        lines.append(f"cut of generation {cut['generation']}:")
        lines += [f"  began {a['began'] - t:+.2f}s answered {a['answered'] - t:+.2f}s ended {a['ended'] - t:+.2f}s "
                  f"on {a['generation']} {a['resumed']}" for a in answers if a["began"] - 1 < t < a["ended"] + 1]
    said = [line for name, says in (("controller", ("] fleet ", "stopping generation")), ("proxy", ("upstream failed",)))
            for line in (logs / f"{name}.log").read_text().splitlines() if any(s in line for s in says)]
    return "\n".join(lines + sorted(said))


def text(answer: dict) -> str:
    return "".join(c["delta"].get("content") or "" for e in answer["events"] if isinstance(e, dict)
                   for c in e.get("choices", []))


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, demo_model):
    with mesh_up(tmp_path_factory.mktemp("recycle"), demo_model, agent={"standby": True},
                 recycle={"after": AFTER, "idle_for": IDLE_FOR}, recovery={"drain_grace": 60.0},
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
    wait_for(lambda: all(a.get("/v1/ranks").json()["standby_ready"] for a in agents), 120,
             "a ready standby rank on every agent", interval=0.2)
    before = status(mesh)["generation"]  # read under load: an idle mesh could recycle by age before the restart
    # the back-to-back answers start and end together, so at an instant all may be waiting for their headers:
    # a long one surely in flight when the restart begins
    long, answering = [], threading.Event()
    longest = threading.Thread(target=streams_until, args=(where["proxy"], {**body, "max_tokens": 2000},
                                                           lambda: bool(long), long, answering.set))
    longest.start()
    assert answering.wait(120), "the long answer to begin"
    restart = meshctl(mesh, "restart", "--wait")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    served = [len(out) for out in answers]  # the next generation serves: each client's next answers are its
    wait_for(lambda: all(len(out) >= n + 2 for out, n in zip(answers, served)), 120, "answers of the next generation")
    done.set()
    for c in (*clients, longest):
        c.join(timeout=300)
    answers = [a for out in answers for a in out]
    assert_whole(answers + long)
    assert len({text(a) for a in answers}) == 1

    assert status(mesh)["failures_in_window"] == 0
    planned = next(i for i in recycles(mesh) if i["generation"] == before)
    assert planned["steps"] == ["recycle"] and "meshctl restart" in planned["detail"] and planned["serving_back_at"]
    # in flight: its generation chosen before the restart began (one sent just before waits for the next)
    in_flight = [a for a in answers + long if a["answered"] < planned["opened_at"] < a["ended"]]
    assert long[0] in in_flight and all((a["generation"], a["resumed"]) == (before, []) for a in in_flight), \
        ("each stream in flight at the restart finished on the generation it began on, none cut",
         [{k: a[k] for k in ("generation", "resumed", "began", "answered", "ended")} for a in in_flight])
    assert planned["migrated"] == 0
    assert {s.labels["reason"] for s in samples(where["metrics"], "meshd_recycles_total")} >= {"restart"}
    assert samples(where["metrics"], "meshd_restarts_total") == [], "a restart is no failure"
    for a in agents:
        assert [e["warm"] for e in a.events() if e["kind"] == "RankStarted" and e["generation"] == before + 1] \
            == [True], "the next generation's ranks are the standbys"


CUT_AFTER, IDLE_DEADLINE = 15.0, 3.0


@pytest.fixture(scope="module")
def cut_mesh(tmp_path_factory, demo_model):
    with mesh_up(tmp_path_factory.mktemp("cut"), demo_model, agent={"standby": True},
                 recovery={"planned_restart": "cut"},
                 recycle={"after": CUT_AFTER, "idle_for": 600, "idle_deadline": IDLE_DEADLINE},
                 runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096}}) as (config, _):
        yield config


def test_cut_a_busy_generation_is_recycled_past_idle_deadline_and_restarts_resume_every_answer_equal(cut_mesh,
                                                                                                      demo_model):
    where = urls(load(cut_mesh))
    body = {"messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 48,
            "temperature": 0, **endless(demo_model)}
    uncut = []
    streams_until(where["proxy"], body, lambda: uncut, uncut)
    answers = [[] for _ in range(3)]
    long_body, long_answers = {**body, "max_tokens": 1024}, []  # its stream runs across each cut, but for a gap
    done = threading.Event()
    clients = [threading.Thread(target=streams_until, args=(where["proxy"], b, done.is_set, out))
               for b, out in [*((body, out) for out in answers), (long_body, long_answers)]]
    for c in clients:
        c.start()
    busy = wait_for(lambda: recycles(cut_mesh), 120, "a recycle of the busy generation", interval=0.2)[0]
    served = [len(out) for out in answers]  # the restart comes while every client streams from the next generation
    wait_for(lambda: all(len(out) >= n + 2 for out, n in zip(answers, served)), 120, "answers of the next generation")
    restart = meshctl(cut_mesh, "restart", "--wait")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    served = [len(out) for out in answers]
    wait_for(lambda: all(len(out) >= n + 2 for out, n in zip(answers, served)), 120, "answers of the next generation")
    done.set()
    for c in clients:
        c.join(timeout=300)
    answers = [a for out in answers for a in out]
    long_uncut = []
    streams_until(where["proxy"], long_body, lambda: long_uncut, long_uncut)
    assert_whole(uncut + answers + long_uncut + long_answers)
    assert {text(a) for a in answers} == {text(uncut[0])}, "every answer, cut and resumed or not, the uncut one"
    assert {text(a) for a in long_answers} == {text(long_uncut[0])}

    assert busy["generation"] == uncut[0]["generation"]
    assert any(a["began"] < busy["opened_at"] < a["ended"] for a in answers), "recycled while streams ran"
    assert f"recycle.idle_deadline {IDLE_DEADLINE:g}s" in busy["detail"], "recycled under load, not once idle"
    planned = [i for i in recycles(cut_mesh) if i["generation"] <= busy["generation"] + 1]
    assert len(planned) == 2 and "meshctl restart" in planned[1]["detail"]
    # a short answer can be in its prefill or between two requests when a cut comes (it begins again on the
    # next generation, with nothing to resume); the long one is mid-answer
    resumed_on = {int(line.rpartition(" ")[2]) for a in answers + long_answers for line in a["resumed"]}
    assert resumed_on == {i["generation"] + 1 for i in planned}, "each restart cut streams that resumed on the " \
        "next\n" + at_each_cut(planned, answers + long_answers, load(cut_mesh).state_dir / "run")
    assert status(cut_mesh)["failures_in_window"] == 0


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
