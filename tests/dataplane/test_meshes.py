"""One endpoint over several meshes: meshd-proxy with a proxy config in front of two 2-rank meshes of
the demo model (each its own controller and agents) and a 1-rank mesh of another model, the fallback.
Routing's decisions table-tested; on the real meshes: follow-ups land on the mesh that served their
prefix, the streams a SIGKILL cuts on one mesh go on from the other before the first is back, exactly
as uncut, and the fallback answers while no mesh of the model is up, and stops when one is back. Once one
mesh comes back on weights changed in place, the proxies (the running one, and one started then) serve
both and name the conflict, and the other mesh's cut streams wait for their own weights, never taking
its. A request is quarantined only for one mesh's repeated deaths (table-tested)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import requests

from common.tomlcheck import ConfigError, write_toml
from kit.configs import write_mesh
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.openai import sse_events
from kit.waiting import wait_for
from kit.weights import nudge
from meshd.dataplane.exchange import poisoning
from meshd.dataplane.proxyconfig import check_twins, load_front
from meshd.dataplane.routing import Failed, MeshSeen, PrefixMemory, Route, conflicts, prefix_keys, route
from meshd.meshctl.ports import free_ports


def seen(name, ready=True, load=0, *, fp="w1", names=("demo",), gone=False, generation=1, full=False):
    return MeshSeen(name, names, fp, ready, gone, generation, load, full)


A, B = seen("a"), seen("b")
SMALL = seen("f", names=("small",), fp="w2")


@pytest.mark.parametrize("meshes,kw,want", [
    ([A], {}, Route("send", "a", "model")),  # the one mesh of the model
    ([A, B], {}, Route("send", "a", "queue")),  # a tie: the first named
    ([seen("a", load=2), seen("b", load=1)], {}, Route("send", "b", "queue")),
    ([seen("a", load=2), seen("b", load=1)], {"affinity": ("a", 1)}, Route("send", "a", "affinity")),
    ([seen("a", load=2), seen("b", load=1)], {"affinity": ("a", 0)}, Route("send", "b", "queue")),  # a new tape
    ([seen("a", ready=False), B], {"affinity": ("a", 1)}, Route("send", "b", "queue")),  # not waiting for it
    ([seen("a", full=True), B], {"affinity": ("a", 1)}, Route("send", "b", "queue")),
    ([seen("a", ready=False), B], {}, Route("send", "b", "queue")),  # a mesh recovers: the healthy one
    ([seen("a", ready=False), seen("b", ready=False, load=1)], {}, Route("wait", "a")),
    ([seen("a", gone=True, ready=False), seen("b", ready=False)], {}, Route("wait", "b")),
    ([seen("a", gone=True, ready=False)], {}, Route("gone")),
    ([seen("a", full=True), seen("b", full=True)], {}, Route("full")),
    ([seen("a", full=True), seen("b", ready=False)], {}, Route("full")),  # 429, not a wait for b
    # failover: the same weights, never the generation that failed
    ([A, B], {"failed": Failed("a", 1, "w1")}, Route("send", "b", "failover")),
    ([seen("a", generation=2), seen("b", load=3)], {"failed": Failed("a", 1, "w1")}, Route("send", "a", "failover")),
    ([A, seen("b", names=("other",))], {"failed": Failed("a", 1, "w1")}, Route("send", "b", "failover")),  # by weights
    ([A, seen("b", fp="w9")], {"failed": Failed("a", 1, "w1")}, Route("wait", "a")),  # other weights: not its twin
    ([seen("a", fp=""), seen("b", fp="")], {"failed": Failed("a", 1, "")}, Route("wait", "a")),  # unknown: alone
    ([A, SMALL], {"failed": Failed("a", 1, "w1"), "fallback": "small"}, Route("wait", "a")),  # no resume elsewhere
    # the failed mesh's next generation: waited for while its weights are not known, never sent other weights
    ([seen("a", ready=False, generation=2, fp="")], {"failed": Failed("a", 1, "w1")}, Route("wait", "a")),
    ([seen("a", generation=2, fp="w9")], {"failed": Failed("a", 1, "w1")}, Route("gone")),
    ([seen("a", generation=2, fp="w9"), B], {"failed": Failed("a", 1, "w1")}, Route("send", "b", "failover")),
    ([seen("a", generation=2, fp="")], {"failed": Failed("a", 1, "w1")}, Route("gone")),  # serves, weights unread
    # the fallback: only while no mesh of the model serves, only when asked for
    ([seen("a", ready=False), SMALL], {"fallback": "small"}, Route("send", "f", "fallback")),
    ([seen("a", ready=False, gone=True), SMALL], {"fallback": "small"}, Route("send", "f", "fallback")),
    ([A, SMALL], {"fallback": "small"}, Route("send", "a", "model")),
    ([seen("a", ready=False), SMALL], {}, Route("wait", "a")),
    ([seen("a", ready=False), seen("f", ready=False, names=("small",))], {"fallback": "small"}, Route("wait", "a")),
])
def test_routing(meshes, kw, want):
    assert route(meshes, "demo", **kw) == want


@pytest.mark.parametrize("killed,after,want", [
    ([], 2, None),
    ([("a", 2)], 2, None),
    ([("a", 2), ("a", 3)], 2, ("a", [2, 3])),  # the same mesh died twice under it
    ([("a", 2), ("b", 4)], 2, None),  # two meshes' unrelated deaths
    ([("a", 2), ("b", 4), ("b", 5)], 2, ("b", [4, 5])),
    ([("a", 2), ("b", 4), ("a", 3), ("b", 5)], 2, ("a", [2, 3])),  # the first mesh to reach it
    ([("a", 2), ("b", 4), ("c", 1)], 3, None),
    ([("a", 2)], 1, ("a", [2])),
])
def test_a_request_is_quarantined_only_for_one_mesh_s_repeated_deaths(killed, after, want):
    assert poisoning(killed, after) == want


def test_meshes_of_one_name_with_other_weights_are_named_as_a_conflict():
    assert conflicts([A, B, SMALL]) == [] and conflicts([A, seen("b", fp="")]) == []
    (said,) = conflicts([A, seen("b", fp="w9"), SMALL])
    assert "meshes a and b both serve 'demo' with different weights (fingerprints w1 and w9)" in said
    assert conflicts([A, seen("b", fp="w9", names=("other",))]) == []


def test_a_request_for_a_model_no_mesh_serves_goes_nowhere():
    assert route([A, B], "nobody") == Route("gone")


def test_a_follow_up_finds_the_mesh_of_its_longest_known_prefix_and_the_memory_is_bounded():
    u1, a1, u2 = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "more"})
    memory = PrefixMemory(2)
    memory.remember(prefix_keys([u1])[0], "a", 3)
    assert memory.find(prefix_keys([u1, a1, u2])) == ("a", 3)
    memory.remember(prefix_keys([u1, a1, u2])[0], "b", 1)  # where the conversation went on
    assert memory.find(prefix_keys([u1, a1, u2, a1, u2])) == ("b", 1)
    assert memory.find(prefix_keys([u2])) is None
    memory.remember(prefix_keys([u2])[0], "a", 3)
    memory.find(prefix_keys([u1, a1, u2]))  # used: the most recent now
    memory.remember(prefix_keys([a1])[0], "a", 3)  # the least recently used goes
    assert memory.find(prefix_keys([u2])) is None and memory.find(prefix_keys([u1])) is None
    assert memory.find(prefix_keys([u1, a1, u2])) == ("b", 1)


# --- the proxy config ---------------------------------------------------------------------------

def two_mesh_tomls(tmp_path, model_a, model_b, **args_b):
    agent = SimpleNamespace(node="node0", url="http://127.0.0.1:7701", dir=tmp_path)
    paths = []
    for name, model, args in (("a", model_a, {}), ("b", model_b, args_b)):
        (tmp_path / name).mkdir()
        paths.append(write_mesh(tmp_path / name, [agent], model, runtime={"args": {"model_name": "demo", **args}}))
    return paths


def proxy_toml(tmp_path, meshes, **top) -> str:
    write_toml(tmp_path / "proxy.toml", {**top, "proxy": {"listen": "127.0.0.1:8123"},
                                        "meshes": [{"name": n, "config": str(p)} for n, p in meshes]})
    return str(tmp_path / "proxy.toml")


def test_a_proxy_config_lists_its_meshes_and_a_mesh_toml_is_a_proxy_of_one(tmp_path, demo_model):
    a, b = two_mesh_tomls(tmp_path, demo_model, demo_model)
    front = load_front(proxy_toml(tmp_path, [("left", a), ("right", b)], fallback="demo"))
    assert [m.name for m in front.meshes] == ["left", "right"] and front.fallback == "demo" and front.several
    assert front.proxy.listen == "127.0.0.1:8123"
    check_twins(front)
    one = load_front(a)
    assert [m.name for m in one.meshes] == ["test"] and one.proxy == one.meshes[0].cfg.proxy and not one.several


@pytest.mark.parametrize("top,meshes,says", [
    ({"fallback": "nobody"}, "ab", "fallback: no mesh serves 'nobody'"),
    ({"affinity_entries": 0}, "ab", "affinity_entries: expected a whole number of at least 1"),
    ({"extra": 1}, "ab", "extra: unknown key"),
    ({}, "aa", "the name 'a' is used twice"),
    ({}, "", "meshes: at least one [[meshes]] table is needed"),
])
def test_a_proxy_config_mistake_names_its_key_and_the_fix(tmp_path, demo_model, top, meshes, says):
    paths = dict(zip("ab", two_mesh_tomls(tmp_path, demo_model, demo_model)))
    with pytest.raises(ConfigError) as e:
        load_front(proxy_toml(tmp_path, [(n, paths[n]) for n in meshes], **top))
    assert says in str(e.value)


def test_a_mesh_that_is_not_there_is_named_with_its_own_mistake(tmp_path, demo_model):
    a, _ = two_mesh_tomls(tmp_path, demo_model, demo_model)
    with pytest.raises(ConfigError) as e:
        load_front(proxy_toml(tmp_path, [("a", a), ("b", tmp_path / "nowhere.toml")]))
    assert "meshes[1].config" in str(e.value) and "cannot read" in str(e.value)


def test_two_meshes_that_give_other_weights_one_name_are_refused(tmp_path, demo_model, draft_model):
    a, b = two_mesh_tomls(tmp_path, demo_model, draft_model)
    with pytest.raises(ConfigError) as e:
        check_twins(load_front(proxy_toml(tmp_path, [("a", a), ("b", b)])))
    assert "both serve 'demo' with different weights" in str(e.value) and "model_name" in str(e.value)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    a, b = two_mesh_tomls(renamed, demo_model, draft_model, model_name="small")
    check_twins(load_front(proxy_toml(renamed, [("a", a), ("b", b)])))


# --- two meshes of the demo model and one of the fallback model, one proxy in front -----------------

LIMITS = {"max_tokens_limit": 4096}


@pytest.fixture(scope="module")
def front(tmp_path_factory, demo_model, draft_model):
    """Meshes a and b (two ranks each, the demo model) and f (one rank, another model, the fallback),
    each with its own agents and controller, and a meshd-proxy fronting all three."""
    tmp = tmp_path_factory.mktemp("meshes")
    weights = {name: shutil.copytree(demo_model, tmp / f"weights-{name}") for name in "ab"}  # b's change later
    plans = {"a": (weights["a"], 2, "demo"), "b": (weights["b"], 2, "demo"), "f": (draft_model, 1, "small")}
    with ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        ups = {name: mesh_up(tmp / name, model, n, runtime={"args": {"model_name": served, **LIMITS}})
               for name, (model, n, served) in plans.items()}
        entered = {name: pool.submit(up.__enter__) for name, up in ups.items()}
        for name, up in ups.items():
            stack.push(up.__exit__)
        meshes = {name: f.result() for name, f in entered.items()}
        (port,) = free_ports(1)
        path = write_toml(tmp / "proxy.toml", {
            "name": "front", "fallback": "small", "proxy": {"listen": f"127.0.0.1:{port}", "keepalive_interval": 0.5},
            "meshes": [{"name": name, "config": str(mesh)} for name, (mesh, _) in meshes.items()]})
        log = open(tmp / "proxy.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT)
        stack.callback(drained, proc, tmp / "proxy.log")
        url = f"http://127.0.0.1:{port}"
        def serving() -> bool:
            assert proc.poll() is None, (tmp / "proxy.log").read_text()
            return [m["healthy"] for m in view(url)] == [True] * 3
        wait_for(serving, 120, "the proxy to see all three meshes serve")
        yield SimpleNamespace(url=url, config=path, meshes=meshes, weights=weights, log=tmp / "proxy.log")


def drained(proc: subprocess.Popen, log) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # meshd-proxy writes where each of its tasks waits
        time.sleep(2)
        proc.kill()
        proc.wait(30)
        pytest.fail(f"meshd-proxy did not drain within 60 s of its SIGTERM; its log ends:\n{log.read_text()[-12000:]}")


def view(url) -> list[dict]:
    try:
        return requests.get(f"{url}/v1/meshes", timeout=10).json()["meshes"]
    except requests.ConnectionError:
        return []


def mesh(url, name) -> dict:
    return next(m for m in view(url) if m["name"] == name)


def chat(url, messages, **kw) -> requests.Response:
    r = requests.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def user(text) -> dict:
    return {"role": "user", "content": text}


def test_follow_ups_land_on_the_mesh_that_served_their_prefix(front, demo_model):
    before = {m["name"]: m["routed"] for m in view(front.url)}
    x1 = chat(front.url, [user("tell me about x")])
    assert x1.headers["X-Meshd-Mesh"] == "a"  # both idle: the first named
    # A long answer keeps a busy: a new conversation goes to b by queue, the follow-ups where they began.
    with requests.post(f"{front.url}/v1/chat/completions", stream=True, timeout=120,
                       json={"messages": [user("go on and on")], "max_tokens": 4000, "stream": True,
                             **endless(demo_model)}) as long:
        lines = long.iter_lines()
        wait_for(lambda: next(lines).startswith(b"data: "), 60, "the long answer's first chunk")
        assert long.headers["X-Meshd-Mesh"] == "a"
        y1 = chat(front.url, [user("and about y")])
        assert y1.headers["X-Meshd-Mesh"] == "b"
        for first, mesh_name in ((x1, "a"), (y1, "b")):
            asked = [user("tell me about x") if mesh_name == "a" else user("and about y")]
            answer = first.json()["choices"][0]["message"]
            follow_up = chat(front.url, [*asked, {"role": "assistant", "content": answer["content"]},
                                         user("and then?")])
            assert follow_up.headers["X-Meshd-Mesh"] == mesh_name
    after = {m["name"]: m["routed"] for m in view(front.url)}
    assert {n: after[n]["affinity"] - before[n]["affinity"] for n in "ab"} == {"a": 1, "b": 1}
    assert sum(after[n]["queue"] - before[n]["queue"] for n in "ab") == 3
    metrics = requests.get(f"{front.url}/metrics", timeout=10).text
    assert 'meshd_proxy_routed_total{mesh="b",reason="affinity"}' in metrics
    assert 'meshd_proxy_mesh_ready{mesh="f"} 1.0' in metrics


def test_meshctl_status_shows_every_mesh_and_where_requests_went(front):
    r = meshctl(front.config, "status", "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert [m["name"] for m in status["meshes"]] == ["a", "b", "f"] and status["fallback"] == "small"
    assert all(m["controller"]["phase"] == "ready" and m["healthy"] for m in status["meshes"])
    assert status["meshes"][0]["routed"]["affinity"] >= 1
    text = meshctl(front.config, "status").stdout
    assert all(line in text for line in ("a ", "b ", "f ", "affinity 1", "fallback: small"))
    refused = meshctl(front.config, "restart")
    assert refused.returncode == 1 and "is a proxy config" in refused.stderr
    checked = json.loads(meshctl(front.config, "config", "check", "--json").stdout)
    assert (checked["ok"], checked["meshes"], checked["fallback"]) == (True, ["a", "b", "f"], "small")


class Stream(threading.Thread):
    """One streamed request, every line kept with the time it came."""

    def __init__(self, url, body):
        super().__init__()
        self.url, self.body = url, body
        self.lines: list[tuple[float, str]] = []
        self.mesh = ""
        self.start()

    def run(self):
        with requests.post(f"{self.url}/v1/chat/completions", json={**self.body, "stream": True}, stream=True,
                           timeout=300) as r:
            self.mesh = r.headers.get("X-Meshd-Mesh", "")
            for line in r.iter_lines(decode_unicode=True):
                if line:
                    self.lines.append((time.monotonic(), line))

    @property
    def chunks(self) -> int:
        return sum(line.startswith("data: ") for _, line in self.lines)

    def text(self) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in sse_events(line for _, line in self.lines) if isinstance(e, dict) and e.get("choices"))

    def resumed(self) -> tuple[str, float] | None:
        """The comment naming where the stream resumed, and when its next chunk came."""
        for i, (_, line) in enumerate(self.lines):
            if line.startswith(": resuming on mesh "):
                return line, next(t for t, later in self.lines[i:] if later.startswith("data: "))
        return None


def test_a_killed_rank_s_streams_go_on_from_the_other_mesh_before_it_is_back(front, demo_model):
    bodies = [{"messages": [user(f"story {i}")], "max_tokens": 120, **endless(demo_model),
               **({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": 40 + i})} for i in range(4)]
    uncut = [Stream(front.url, body) for body in bodies]
    for s in uncut:
        s.join()
    g = mesh(front.url, "a")["generation"]
    before = mesh(front.url, "b")["routed"]["failover"]
    streams = [Stream(front.url, body) for body in bodies]  # each where its uncut run went (affinity)
    wait_for(lambda: all(s.chunks >= 4 for s in streams), 60, "every stream's first chunks")
    cut = [s for s in streams if s.mesh == "a"]
    assert cut and [s.mesh for s in streams] == [s.mesh for s in uncut]
    _, agents = front.meshes["a"]
    os.kill(agents[-1].ranks()[-1]["pid"], signal.SIGKILL)
    meanwhile = chat(front.url, [user("while a recovers")])
    answered = time.monotonic()
    back = wait_for(lambda: (m := mesh(front.url, "a"))["healthy"] and m["generation"] > g and time.monotonic(),
                    120, "mesh a's next generation", interval=0.05)
    for s in streams:
        s.join(300)
    assert [s.text() for s in streams] == [s.text() for s in uncut]  # exact, greedy and seeded, cut or not
    assert all(s.lines[-1][1] == "data: [DONE]" and not any('"error"' in line for _, line in s.lines)
               for s in streams)
    for s in cut:
        where, next_chunk = s.resumed()
        assert where.startswith(": resuming on mesh b") and next_chunk < back
    assert meanwhile.headers["X-Meshd-Mesh"] == "b" and answered < back  # no waiting for a
    # the cut streams, and the request sent meanwhile when the proxy sent it to a before it knew
    assert len(cut) <= mesh(front.url, "b")["routed"]["failover"] - before <= len(cut) + 1


def start_proxy(config, log):
    """Another meshd-proxy on the same proxy config, on a port of its own."""
    (port,) = free_ports(1)
    raw = tomllib.loads(config.read_text())
    again = write_toml(config.with_name("proxy-again.toml"), {**raw, "proxy": {**raw["proxy"],
                                                                               "listen": f"127.0.0.1:{port}"}})
    proc = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(again)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def test_the_fallback_answers_while_no_mesh_of_the_model_is_up_and_stops_when_one_is_back(front):
    for name in "ab":
        r = meshctl(front.meshes[name][0], "down")
        assert r.returncode == 0, r.stderr
    wait_for(lambda: not any(mesh(front.url, n)["healthy"] for n in "ab"), 60, "a and b down at the proxy")
    r = chat(front.url, [user("anyone there?")], model="demo")
    assert (r.json()["model"], r.headers["X-Meshd-Model"], r.headers["X-Meshd-Mesh"]) == ("small", "small", "f")
    assert mesh(front.url, "f")["routed"]["fallback"] >= 1
    up = meshctl(front.meshes["a"][0], "up")
    assert up.returncode == 0, up.stderr
    wait_for(lambda: mesh(front.url, "a")["healthy"], 60, "a back at the proxy")
    r = chat(front.url, [user("anyone there?")], model="demo")
    assert (r.json()["model"], r.headers["X-Meshd-Mesh"]) == ("demo", "a")


def test_a_mesh_back_on_other_weights_is_named_a_conflict_takes_none_of_the_other_s_streams_and_a_new_proxy_serves(
        front, demo_model):
    """After the fallback's test: a serves, b is down. b comes up on weights changed in place (a tensor +0.05)."""
    nudge(front.weights["b"])
    up = meshctl(front.meshes["b"][0], "up")
    assert up.returncode == 0, up.stderr
    wait_for(lambda: mesh(front.url, "b")["healthy"], 120, "b back at the proxy")
    a, b = mesh(front.url, "a"), mesh(front.url, "b")
    assert a["fingerprint"] and b["fingerprint"] and a["fingerprint"] != b["fingerprint"]
    (conflict,) = requests.get(f"{front.url}/v1/meshes", timeout=10).json()["conflicts"]
    assert "meshes a and b both serve 'demo' with different weights" in conflict
    wait_for(lambda: "meshes disagree" in front.log.read_text(), 10, "the conflict in the proxy's log")

    proc, url = start_proxy(front.config, front.log.with_name("proxy-again.log"))
    try:  # a proxy started now serves both, naming the conflict, where it once refused to start at all
        wait_for(lambda: proc.poll() is None and [m["healthy"] for m in view(url)] == [True] * 3, 60,
                 "the new proxy to serve all three meshes")
        assert requests.get(f"{url}/v1/meshes", timeout=10).json()["conflicts"] == [conflict]
    finally:
        drained(proc, front.log.with_name("proxy-again.log"))

    bodies = [{"messages": [user(f"weights {i}")], "max_tokens": 120, "temperature": 0.0, **endless(demo_model)}
              for i in range(4)]
    uncut = []
    for body in bodies:  # one at a time: each on a (named first), with its own weights
        uncut.append(Stream(front.url, body))
        uncut[-1].join()
    assert [s.mesh for s in uncut] == ["a"] * 4
    g = a["generation"]
    streams = [Stream(front.url, body) for body in bodies]
    wait_for(lambda: all(s.chunks >= 4 for s in streams), 60, "every stream's first chunks")
    cut = [s for s in streams if s.mesh == "a"]
    assert cut
    os.kill(front.meshes["a"][1][-1].ranks()[-1]["pid"], signal.SIGKILL)
    for s in streams:
        s.join(300)
    assert mesh(front.url, "a")["generation"] > g
    for s in cut:  # never on b: each waited for a's next generation, the same weights, and went on there
        assert s.resumed()[0].startswith(": resuming on mesh a"), s.resumed()
        assert s.text() == next(u.text() for u in uncut if u.body == s.body)

