"""meshd-proxy, the OpenAI endpoint as its own process: it serves on while the
controller is killed and comes back, holds requests for a generation that dies
while the controller is away, hands its socket to a successor without refusing
a connection, and takes its listener from systemd's socket activation."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
import requests

from common.errors import ApiError
from common.states import Phase
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.waiting import wait_for
from meshd.dataplane.fleetlink import NOT_YET, local_view
from meshd.meshctl.ports import free_ports
from meshd.seam import Observation, Serving

READY = Serving(Phase.READY, 4, "", "http://127.0.0.1:9", "s")


@pytest.mark.parametrize("told,connected,suspect,phase,generation", [
    (None, False, None, NOT_YET.phase, 0),  # never reached the controller: requests wait, /health 503
    (READY, True, None, Phase.READY, 4),
    (READY, False, None, Phase.READY, 4),  # the controller is away: serve the generation it named
    (READY, False, 4, Phase.RECOVERING, 4),  # ... until the proxy sees that generation fail
    (READY, False, 3, Phase.READY, 4),  # evidence against an older generation changes nothing
    (READY, True, 4, Phase.READY, 4),  # with the controller there, the controller judges
    (Serving(Phase.RECOVERING, 5, "x", ""), False, 5, Phase.RECOVERING, 5),
])
def test_the_proxys_view_of_the_fleet(told, connected, suspect, phase, generation):
    s = local_view(told, connected, suspect)
    assert (s.phase, s.generation) == (phase, generation)


@pytest.mark.parametrize("body,param", [
    ({"source": "proxy"}, "generation"), ({"generation": -1, "source": "proxy"}, "generation"),
    ({"generation": True, "source": "proxy"}, "generation"), ({"generation": 1, "source": "rumour"}, "source"),
    ({"generation": 1, "source": "probe", "detail": 7}, "detail"),
    ({"generation": 1, "source": "probe", "detail": "x" * 5000}, "detail"),
    ({"generation": 1, "source": "probe", "status": 99}, "status"),
])
def test_an_observation_the_control_api_cannot_take_is_refused_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        Observation.from_wire(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_observations_and_the_fleet_cross_the_wire_unchanged():
    obs = Observation(3, "probe", "probe answered 404", 404)
    assert Observation.from_wire(json.loads(json.dumps(obs.wire()))) == obs
    assert Serving.from_wire(json.loads(json.dumps(READY.wire()))) == READY


@pytest.fixture
def mesh(tmp_path, demo_model):
    with mesh_up(tmp_path, demo_model) as running:
        yield running


def status(path) -> dict:
    return json.loads(meshctl(path, "status", "--json").stdout)


def pid(path, name: str) -> int:
    return int((path.parent / "state" / "run" / f"{name}.pid").read_text().split()[0])


def kill(p: int, sig=signal.SIGKILL) -> None:
    os.kill(p, sig)
    try:
        psutil.Process(p).wait(10)
    except psutil.NoSuchProcess:
        pass


class Clients:
    """Clients in a loop, each request on a new connection, streamed and whole; every outcome kept."""

    def __init__(self, proxy: str, n: int, body: dict):
        self.proxy, self.body, self.done = proxy, body, threading.Event()
        self.outcomes: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i % 2 == 0,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, stream: bool) -> None:
        while not self.done.is_set():
            self.outcomes.append(ask(self.proxy, {**self.body, "stream": stream}))

    def stop(self) -> list[str]:
        self.done.set()
        for t in self.threads:
            t.join(300)
        return self.outcomes


def ask(proxy: str, body: dict) -> str:
    """"ok", or what went wrong: refused (no connection), a status, a broken stream."""
    try:
        with requests.post(f"{proxy}/chat/completions", json=body, stream=True, timeout=300,
                           headers={"Connection": "close"}) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {r.text[:200]}"
            if not body.get("stream"):
                return "ok" if r.json()["usage"]["completion_tokens"] == body["max_tokens"] else "short"
            lines = [line for line in r.iter_lines() if line.startswith(b"data: ")]
            if lines[-1:] != [b"data: [DONE]"] or any(b'"error"' in line for line in lines):
                return f"broken stream: {lines[-2:]}"
            return "ok"
    except requests.ConnectionError as e:
        return f"refused: {e}"


def test_the_endpoint_serves_on_while_the_controller_is_killed_and_restarted(mesh, demo_model):
    path, _ = mesh
    s = status(path)
    assert s["proxies_following"] == 1
    proxy_pid = pid(path, "proxy")
    clients = Clients(s["urls"]["proxy"], 4, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                              **endless(demo_model)})
    try:
        wait_for(lambda: len(clients.outcomes) >= 8, 60, "traffic")
        kill(pid(path, "controller"))
        away = len(clients.outcomes)
        wait_for(lambda: len(clients.outcomes) > away + 4, 60, "requests served while the controller is away")
        assert meshctl(path, "up").returncode == 0  # the controller again, adopting the generation that serves
        back = len(clients.outcomes)
        wait_for(lambda: len(clients.outcomes) >= back + 8, 60, "traffic with the controller back")
    finally:
        outcomes = clients.stop()
    assert set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"]
    after = status(path)
    assert (after["generation"], after["phase"]) == (s["generation"], "ready")
    assert pid(path, "proxy") == proxy_pid  # the same proxy throughout
    wait_for(lambda: status(path)["proxies_following"] == 1, 30, "the proxy to follow the new controller")


def test_a_generation_that_dies_while_the_controller_is_away_holds_requests_until_it_is_back(mesh, demo_model):
    path, agents = mesh
    s = status(path)
    proxy, g = s["urls"]["proxy"], s["generation"]
    kill(pid(path, "controller"))
    kill(agents[1].ranks()[-1]["pid"])
    answer = {}
    body = {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4, **endless(demo_model)}
    worker = threading.Thread(target=lambda: answer.update(outcome=ask(proxy, body)))
    worker.start()
    base = proxy.removesuffix("/v1")
    health = wait_for(lambda: (r := requests.get(f"{base}/health", timeout=10)).status_code == 503 and r.json(),
                      60, "the proxy to hold the generation it saw fail")
    assert f"generation {g} failed while the controller is away" in health["error"]["message"]
    wait_for(lambda: "meshd_proxy_requests_in_flight 1.0" in requests.get(f"{base}/metrics", timeout=10).text, 60,
             "the proxy to hold the request")
    assert requests.get(f"{base}/health", timeout=10).status_code == 503
    assert worker.is_alive(), "the request waits (bounded by queue_wait) rather than failing"
    assert meshctl(path, "up").returncode == 0
    worker.join(120)
    assert answer["outcome"] == "ok"
    after = status(path)
    assert after["generation"] > g and after["phase"] == "ready"
    incident = json.loads(meshctl(path, "events", "--json").stdout)["incidents"][0]
    assert incident["generation"] == g and incident["serving_back_at"]


def test_a_proxy_restart_refuses_no_connection_and_finishes_the_streams_in_flight(mesh, demo_model):
    path, _ = mesh
    proxy = status(path)["urls"]["proxy"]
    old = pid(path, "proxy")
    long = {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 3000, "stream": True,
            **endless(demo_model)}
    streams: list[dict] = [{}, {}]
    first_chunk, read_on = threading.Event(), threading.Event()

    def stream_one(out: dict) -> None:
        """Reads the first chunk, then nothing until the hand-over is done: the rest (more than the
        sockets' buffers hold) waits in the old proxy."""
        with requests.post(f"{proxy}/chat/completions", json=long, stream=True, timeout=300) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:]))
                    first_chunk.set()
                    read_on.wait(300)
                elif line == b"data: [DONE]":
                    out["done"] = True
            out["text_chunks"] = sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
            out["finish"] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]

    long_ones = [threading.Thread(target=stream_one, args=(out,)) for out in streams]
    for t in long_ones:
        t.start()
    clients = Clients(proxy, 2, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 **endless(demo_model)})
    try:
        assert first_chunk.wait(60)
        restart = meshctl(path, "proxy", "restart")
        assert restart.returncode == 0, restart.stdout + restart.stderr
        new = pid(path, "proxy")
        assert new != old and f"pid {old} -> {new}" in restart.stdout
        assert psutil.pid_exists(old), "the old proxy still holds the streams it had when it handed over"
        read_on.set()
        n = len(clients.outcomes)
        wait_for(lambda: len(clients.outcomes) >= n + 6, 60, "requests served by the new proxy")
    finally:
        read_on.set()
        outcomes = clients.stop()
        for t in long_ones:
            t.join(300)
    assert set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"]
    assert all(s.get("done") and s["finish"] == "length" and s["text_chunks"] >= 2400 for s in streams), streams
    wait_for(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE, 30,
             "the old proxy to exit once its streams ended")
    log = (path.parent / "state" / "run" / "proxy.log").read_text()
    assert "socket='the proxy it replaces'" in log and "the successor serves; draining this proxy" in log


def beside(path) -> tuple[str, int]:
    """The mesh's config with its proxy on a port of its own, for a second proxy beside the mesh's."""
    (port,) = free_ports(1)
    text = path.read_text().replace(f'listen = "{status(path)["urls"]["proxy"].split("//")[1].removesuffix("/v1")}"',
                                    f'listen = "127.0.0.1:{port}"')
    assert f"127.0.0.1:{port}" in text
    other = path.with_name(f"mesh-{port}.toml")
    other.write_text(text)
    return str(other), port


@contextlib.contextmanager
def running(argv: list[str]):
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def say_hi(port: int) -> None:
    r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_a_proxy_started_while_the_controller_is_away_serves_the_generation_it_recorded(mesh, tmp_path):
    """A proxy its service manager restarts while the controller is also down: no view to hand over, so it
    starts from the controller's store, and serves."""
    path, _ = mesh
    other, port = beside(path)
    kill(pid(path, "controller"))
    log = tmp_path / "cold.log"
    with running([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", other, "--log-file", str(log)]):
        wait_for(lambda: log.exists() and "meshd-proxy serving" in log.read_text(), 60, "the proxy to serve")
        say_hi(port)
        assert "the controller's store" in log.read_text()


def test_down_while_the_controller_is_away_starts_it_and_stops_the_ranks(mesh):
    """A controller that died under a generation leaves its ranks serving; `meshctl down` stops them all the
    same: it starts the controller, which adopts them, and takes the mesh down."""
    path, _ = mesh
    ranks = [psutil.Process(n["rank"]["pid"]) for n in status(path)["nodes"]]
    kill(pid(path, "controller"))
    down = meshctl(path, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "starting the controller" in down.stdout and "the mesh is stopped" in down.stdout, down.stdout
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks left running after down: {alive}"


def test_under_systemd_socket_activation_the_first_connection_starts_the_proxy_and_is_served(mesh, tmp_path):
    path, _ = mesh
    other, port = beside(path)
    log = tmp_path / "activated.log"
    # systemd-socket-activate listens, and runs the proxy with the listener (LISTEN_FDS) at the first connection.
    with running(["systemd-socket-activate", "-l", f"127.0.0.1:{port}", sys.executable, "-m", "meshd.dataplane.proxyd",
                  "--config", other, "--log-file", str(log)]):
        wait_for(lambda: any(c.laddr.port == port for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN"),
                 30, "the activator to listen")
        say_hi(port)
        assert "socket='systemd (socket activation)'" in log.read_text()
