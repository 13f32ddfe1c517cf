"""A request is quarantined only on evidence against it: two `meshctl restart --wait` one after the other under
two long streams, each drain outlasted (drain_grace shorter than the answers) and so each cutting both,
quarantine neither stream nor the same request sent again: each answer goes on on the next generation,
whole. A cut restart's streams, resumed exactly, are tests/test_recycle.py's; that only one mesh's deaths
count, never two meshes' together, is table-tested in tests/test_meshes.py."""

import threading

import pytest
import requests

from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.openai import sse_events
from kit.waiting import wait_for
from meshd.config import load
from meshd.control.controllerd import urls
from runtime.demo_model import DemoModelSpec, build_demo_model

TOKENS = 1500
SLOWER = DemoModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, seed=3)  # outlasts 2 restarts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("models") / "slower", SLOWER)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, model):
    with mesh_up(tmp_path_factory.mktemp("planned"), model, agent={"standby": True}, recovery={"drain_grace": 2.0},
                 runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096}}) as (config, _):
        yield config


def stream(proxy: str, body: dict, out: dict) -> None:
    r = requests.post(f"{proxy}/chat/completions", json={**body, "stream": True}, stream=True, timeout=600)
    out["status"] = r.status_code
    for line in r.iter_lines(decode_unicode=True):
        if line:
            out["lines"].append(line)


def test_two_planned_restarts_under_long_streams_quarantine_nothing(mesh, model):
    proxy = urls(load(mesh))["proxy"]
    bodies = [{"messages": [{"role": "user", "content": f"a long story {i}"}], "max_tokens": TOKENS,
               "temperature": 0, **endless(model)} for i in range(2)]
    outs = [{"lines": []} for _ in bodies]
    clients = [threading.Thread(target=stream, args=(proxy, body, out)) for body, out in zip(bodies, outs)]
    for c in clients:
        c.start()
    wait_for(lambda: all(len(out["lines"]) >= 20 for out in outs), 120, "both streams under way")
    for _ in range(2):
        r = meshctl(mesh, "restart", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
    for c in clients:
        c.join(600)
    for out in outs:
        resumed = [line for line in out["lines"] if line.startswith(": resuming on mesh ")]
        assert len(resumed) == 2, f"each restart moved the stream to the next generation: {resumed}"
        assert out["status"] == 200 and out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
        assert not any('"error"' in line for line in out["lines"]), out["lines"][-3:]
        last = [e for e in sse_events(out["lines"]) if isinstance(e, dict)][-1]
        assert last["choices"][0]["finish_reason"] == "length", "the whole answer, to max_tokens"
    again = requests.post(f"{proxy}/chat/completions", json={**bodies[0], "max_tokens": 8}, timeout=120)
    assert again.status_code == 200, again.text
