"""The users' own driver under meshd's supervision: a tensor-parallel OpenAI server of their own over
mlx-lm's BatchGenerator and omlx (tests/standins/own_driver.py, on the DSpark-layout checkpoint, which only
omlx's loader reads), run on every node by a real agent from an agent.toml profile with `status_file =
false`: the controller's probe of /v1/models and one token says when it serves, meshd-proxy serves it,
and a rank killed with SIGKILL ends that generation (its survivor stopped by the ladder) and the next one
serves the same answers."""

import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import requests

from kit.dspark import build_dspark_model, omlx_mesh
from kit.meshctl import meshctl
from kit.waiting import wait_for

DRIVER = Path(__file__).parents[1] / "standins" / "own_driver.py"
PROFILE = {"command": ["{python}", str(DRIVER), "--model", "{model}", "--host", "{host}", "--port", "{port}",
                       "--meshd-generation", "{generation}"],
           "args": {"max_tokens": "--max-tokens"}, "status_file": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_dspark_model(tmp_path_factory.mktemp("models") / "dspark", markov_steps=0)


def chat(proxy: str) -> str:
    r = requests.post(f"{proxy}/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Which rank serves?"}], "max_tokens": 12})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    return r.json()["choices"][0]["message"]["content"]


def test_the_users_own_driver_serves_through_meshd_and_comes_back_after_a_rank_dies(model, tmp_path):
    with omlx_mesh(tmp_path, model, 2, agent={"profiles": {"own-driver": PROFILE}},
                   runtime={"profile": "own-driver"}) as (mesh, agents):
        def status():
            return json.loads(meshctl(mesh, "status", "--json").stdout)

        proxy = status()["urls"]["proxy"]
        first = chat(proxy)
        ranks = [a.ranks()[-1] for a in agents]
        assert [r["status"] for r in ranks] == [None, None]  # the driver keeps no status file
        for r in ranks:
            assert psutil.Process(r["pid"]).cmdline()[:2] == [sys.executable, str(DRIVER)]
            assert "--meshd-generation 1" in " ".join(psutil.Process(r["pid"]).cmdline())  # the sweep's marker
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        wait_for(lambda: (s := status())["generation"] == 2 and s["phase"] == "ready", 180,
                 "generation 2 of the driver serving")
        assert not psutil.pid_exists(ranks[0]["pid"])  # rank 0 of generation 1 was stopped, not left behind
        incident = json.loads(meshctl(mesh, "events", "--json").stdout)["incidents"][0]
        assert incident["generation"] == 1 and incident["node"] == agents[1].node, incident
        assert chat(proxy) == first
