"""A request is quarantined only on evidence against it: two `meshctl restart --wait` one after the other under
two long streams, each drain outlasted (drain_grace shorter than the answers) and so each cutting both,
quarantine neither stream nor the same request sent again: each answer goes on on the next generation,
whole. Nor do two meshes' deaths together: both meshes behind one proxy, their ranks SIGKILLed at once under
a stream, quarantine neither it nor the same request sent again. A cut restart's streams, resumed exactly, are
tests/control/test_recycle.py's; the rule (only one mesh's repeated deaths count) is table-tested in
tests/dataplane/test_meshes.py."""

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
import requests

from common.tomlcheck import write_toml
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.openai import sse_events
from kit.waiting import wait_for
from meshd.config import load
from meshd.control.controllerd import urls
from meshd.meshctl.ports import free_ports
from runtime.models.demo_model import DemoModelSpec, build_demo_model

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
    out["status"], out["mesh"] = r.status_code, r.headers.get("X-Meshd-Mesh")
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


# --- two meshes behind one proxy, both killed at once --------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory, model):
    """Meshes a and b of one rank each on the same weights, each its own agent and controller, and one
    meshd-proxy in front of both."""
    tmp = tmp_path_factory.mktemp("pair")
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        ups = {n: mesh_up(tmp / n, model, 1, runtime={"args": {"model_name": "demo", "max_tokens_limit": 4096}})
               for n in "ab"}
        entered = {n: pool.submit(up.__enter__) for n, up in ups.items()}
        for up in ups.values():
            stack.push(up.__exit__)
        meshes = {n: f.result() for n, f in entered.items()}
        (port,) = free_ports(1)
        path = write_toml(tmp / "proxy.toml", {"name": "pair", "proxy": {"listen": f"127.0.0.1:{port}"},
                                               "meshes": [{"name": n, "config": str(m)} for n, (m, _) in
                                                          meshes.items()]})
        proc = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(path)],
                                stdout=(tmp / "proxy.log").open("w"), stderr=subprocess.STDOUT)
        stack.callback(proc.wait, 30)
        stack.callback(proc.terminate)
        url = f"http://127.0.0.1:{port}/v1"

        def serving() -> bool:
            assert proc.poll() is None, (tmp / "proxy.log").read_text()
            try:
                return [m["healthy"] for m in requests.get(f"{url}/meshes", timeout=10).json()["meshes"]] == [True] * 2
            except requests.ConnectionError:  # not listening yet
                return False
        wait_for(serving, 120, "the proxy to see both meshes serve")
        yield url, meshes, tmp / "proxy.log"


def test_two_meshes_killed_together_under_a_stream_are_no_evidence_against_it(pair, model):
    url, meshes, log = pair
    body = {"messages": [{"role": "user", "content": "a story of two meshes"}], "max_tokens": 600,
            "temperature": 0, **endless(model)}
    out = {"lines": []}
    client = threading.Thread(target=stream, args=(url, body, out))
    client.start()
    wait_for(lambda: len(out["lines"]) >= 20, 120, "the stream under way")
    # the mesh that streams it dies, the stream goes on on the other, which dies too: the request was in flight
    # at both meshes' deaths, each mesh's first (two deaths: poison_after's count, of two meshes)
    for n in sorted(meshes, key=lambda n: n != out["mesh"]):
        _, agents = meshes[n]
        resumed = sum(line.startswith(": resuming on mesh ") for line in out["lines"])
        os.kill(agents[0].ranks()[-1]["pid"], signal.SIGKILL)
        wait_for(lambda: sum(line.startswith(": resuming on mesh ") for line in out["lines"]) > resumed, 120,
                 f"the stream resumed after mesh {n}'s death")
    client.join(600)
    assert out["status"] == 200 and out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
    assert not any('"error"' in line for line in out["lines"]), out["lines"][-3:]
    last = [e for e in sse_events(out["lines"]) if isinstance(e, dict)][-1]
    assert last["choices"][0]["finish_reason"] == "length", "the whole answer, to max_tokens"
    again = requests.post(f"{url}/chat/completions", json={**body, "max_tokens": 8}, timeout=120)
    assert again.status_code == 200, again.text  # not quarantined
    said = log.read_text()
    assert said.count("upstream failed") == 2 and "request quarantined" not in said, said
