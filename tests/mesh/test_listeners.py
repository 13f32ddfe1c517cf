"""Every listener holds its clients to limits: a request's headers within
header_timeout (else the connection is closed), its body within body_timeout
(else 408 JSON), at most max_connections open (the connection owing its headers
longest makes room, else 503 JSON), JSON nested at most MAX_DEPTH deep (else
400 JSON); rank 0's wake hub serves strangers from one thread. A listener on
real sockets with short limits, rank 0's wake hub, and a real two-rank mesh at
the default limits: the proxy, rank 0, the control API and the agent API."""

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
import tomllib
from types import SimpleNamespace

import psutil
import pytest
import requests
from aiohttp import web

from common.http import BACKLOG, DRAIN_IDLE, MAX_DEPTH, Listener, ListenerLimits, json_errors, nested_deeper, read_json
from kit.meshctl import mesh_up, meshctl
from kit.slowclients import HEAD, Chat, Trickle, allow_descriptors, deep
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports
from meshd.seam import rank_key, rank_secret
from runtime.wake import MAX_UNPROVEN, PROVE_WITHIN, WakeHub, WakeLine, wake_token

DEFAULTS = ListenerLimits()
PROXY = ListenerLimits(header_timeout=4.0, body_timeout=8.0)  # the mesh's [proxy] keys below


@contextlib.contextmanager
def listening(limits: ListenerLimits, shutdown_timeout: float = 2.0):
    """A Listener with `limits` on a loopback port, in a thread of its own: POST /echo answers the JSON
    body it read, GET /hold waits until `release` is set (`holding`: how many wait); its cleanup waits
    `shutdown_timeout` for the requests still running."""
    release, holding = threading.Event(), []

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await read_json(request))

    async def hold(request: web.Request) -> web.Response:
        holding.append(request)
        while not release.is_set():
            await asyncio.sleep(0.05)
        return web.json_response({"held": True})

    app = web.Application(middlewares=[json_errors])
    app.router.add_post("/echo", echo)
    app.router.add_get("/hold", hold)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    listener = Listener(app, limits, shutdown_timeout=shutdown_timeout)
    (port,) = free_ports(1)
    asyncio.run_coroutine_threadsafe(listener.start("127.0.0.1", port), loop).result(30)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, release=release, holding=holding,
                              listener=listener, loop=loop)
    finally:
        release.set()
        asyncio.run_coroutine_threadsafe(listener.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.mark.parametrize("value,deeper", [
    (1, False), ([], False), ({"a": [1, {"b": [2]}]}, False), ([[[]]], False),
    (json.loads(deep(MAX_DEPTH)), False), (json.loads(deep(MAX_DEPTH + 1)), True),
    ({"messages": [{"content": [{"type": "text"}]}] * 500}, False), ([1, 2, [3, [4]]], False),
])
def test_how_deep_json_nests(value, deeper):
    assert nested_deeper(value, MAX_DEPTH) is deeper


def test_a_client_that_sends_its_headers_or_body_too_slowly_is_closed_and_the_others_are_served():
    with listening(ListenerLimits(header_timeout=1.0, body_timeout=1.0, max_connections=100)) as server:
        url = server.url
        slow = Trickle(server.port, 20, every=0.2)
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as body:
            body.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                         b"\r\n{")
            for _ in range(3):
                assert requests.post(f"{url}/echo", json={"x": 1}, timeout=30).json() == {"x": 1}
            answer = body.recv(4096)
        wait_for(lambda: len(slow.closed) == 20, 30, "the slow clients to be closed")
        slow.close()
    assert max(slow.closed) < 10 and not slow.answers
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"


def test_past_the_connection_cap_the_slowest_makes_room_else_the_newcomer_is_refused_with_503_json():
    with listening(ListenerLimits(header_timeout=60.0, max_connections=8)) as server:
        url = server.url
        slow = Trickle(server.port, 8, every=0.5)
        wait_for(lambda: len(server.listener.open) == 8, 30, "the slow connections to fill the cap")
        assert requests.post(f"{url}/echo", json=[1], timeout=30).json() == [1]
        wait_for(lambda: slow.closed, 30, "the connection that owed its headers longest to make room")
        slow.close()
        holders = [threading.Thread(target=requests.get, args=(f"{url}/hold",), kwargs={"timeout": 60})
                   for _ in range(8)]
        for t in holders:
            t.start()
        wait_for(lambda: len(server.holding) == 8, 30, "every connection to run a request")
        refused = requests.post(f"{url}/echo", json=[1], timeout=30)
        server.release.set()
        for t in holders:
            t.join(60)
    assert refused.json()["error"]["code"] == "too_many_connections" and refused.headers["Retry-After"]


def send_echo(conn: socket.socket, body: bytes, then: bytes = b"") -> None:
    """POST /echo on a kept-alive connection: its head and `body`, and `then` the rest of a body still coming."""
    conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body + then), body))


def answer_to(conn: socket.socket, body: bytes) -> bytes:
    """What came back before the echo of `body` ended (or EOF)."""
    got = b""
    while not got.endswith(body):
        try:
            more = conn.recv(4096)
        except ConnectionResetError:
            break
        if not more:
            break
        got += more
    return got


def answer_on(conn: socket.socket, body: bytes) -> bytes:
    send_echo(conn, body)
    return answer_to(conn, body)


def test_a_lingering_drain_answers_a_request_sent_on_a_kept_alive_connection_and_closes_it_after():
    """meshd-proxy's drain (SIGTERM, or a hand-over to a successor): a client that reuses its kept-alive
    connection just as the drain begins gets its answer, told to close, rather than a reset request; a body
    still coming when it began, or sent in pieces after, is read whole."""
    with listening(ListenerLimits(), shutdown_timeout=120.0) as server:
        held = threading.Thread(target=requests.get, args=(f"{server.url}/hold",), kwargs={"timeout": 60})
        held.start()
        wait_for(lambda: server.holding, 30, "a request held open")
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as kept, \
                socket.create_connection(("127.0.0.1", server.port), timeout=30) as quiet, \
                socket.create_connection(("127.0.0.1", server.port), timeout=30) as sending:
            assert b" 200 " in answer_on(kept, b"[1]") and b" 200 " in answer_on(quiet, b"[0]")
            send_echo(sending, b"[3, ", b"4]")
            wait_for(lambda: [r for r, _ in server.listener.running()] == ["GET /hold", "POST /echo"], 30,
                     "the body's first half read")
            drained = asyncio.run_coroutine_threadsafe(server.listener.cleanup(linger=True), server.loop)
            wait_for(lambda: server.listener.draining, 30, "the drain to begin")
            send_echo(kept, b"[2, ", b"5]")
            time.sleep(0.3)  # the rest of the body in a later segment
            kept.sendall(b"5]")
            again = answer_to(kept, b"[2, 5]")
            assert again.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in again, again
            assert kept.recv(4096) == b"", "the connection closes after its answer"
            time.sleep(DRAIN_IDLE + 0.5)  # the rest of this body comes after the idle connections' grace
            sending.sendall(b"4]")
            assert answer_to(sending, b"[3, 4]").startswith(b"HTTP/1.1 200 ")
            assert sending.recv(4096) == b""
            assert quiet.recv(4096) == b"", "a connection that idles is closed once no body is still coming"
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
            assert not drained.done(), "the held request is still running"
            server.release.set()
            drained.result(30)
            held.join(30)


def test_a_lingering_drain_and_the_handlers_after_it_share_one_shutdown_timeout():
    """A drain whose linger waits the whole shutdown_timeout for a body that never comes gives the handlers
    still running what is left of it, not a second shutdown_timeout: a drain's promise is one budget."""
    def cut_off(url: str) -> None:
        with contextlib.suppress(requests.ConnectionError):  # cancelled when the budget ends
            requests.get(url, timeout=60)

    with listening(ListenerLimits(body_timeout=60.0), shutdown_timeout=4.0) as server:
        held = threading.Thread(target=cut_off, args=(f"{server.url}/hold",))
        held.start()
        wait_for(lambda: server.holding, 30, "a request held open")
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sending:
            send_echo(sending, b"[3, ", b"4]")  # the rest never comes
            wait_for(lambda: len(server.listener.running()) == 2, 30, "the body's first half read")
            began = time.monotonic()
            asyncio.run_coroutine_threadsafe(server.listener.cleanup(linger=True), server.loop).result(30)
            took = time.monotonic() - began
        held.join(30)
    assert 4.0 <= took < 6.0, f"the drain took {took:.1f} s of a 4 s shutdown_timeout"


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 5000])
def test_json_nested_too_deep_is_a_400_json(levels):
    with listening(ListenerLimits()) as server:
        url = server.url
        r = requests.post(f"{url}/echo", data=deep(levels), headers={"Content-Type": "application/json"}, timeout=30)
        fine = requests.post(f"{url}/echo", data=deep(MAX_DEPTH), headers={"Content-Type": "application/json"},
                             timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert f"more than {MAX_DEPTH} levels" in r.json()["error"]["message"]
    assert fine.status_code == 200


def test_strangers_on_the_wake_hub_cost_no_thread_and_a_rank_with_the_token_is_still_woken():
    allow_descriptors(4096)
    token = wake_token("s3cret", 3)
    hub = WakeHub("127.0.0.1", token, loopback_only=False)
    me = psutil.Process()
    threads, fds = me.num_threads(), me.num_fds()
    strangers = Trickle(hub.port, 300, head=b"0" * 64)
    line = WakeLine("127.0.0.1", hub.port, token)
    held = me.num_fds() - fds - 300 - 1  # the hub's end of each connection it kept open
    assert me.num_threads() <= threads + 1  # the trickling thread
    assert held <= MAX_UNPROVEN + 2, held
    wait_for(lambda: len(strangers.closed) == 300, 10 * PROVE_WITHIN, "the hub to close every stranger")
    strangers.close()
    threading.Timer(0.3, hub.wake).start()
    t0 = time.monotonic()
    line.doze(30)
    assert time.monotonic() - t0 < 10, "the rank with the token was woken"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, demo_model):
    with mesh_up(tmp_path_factory.mktemp("listeners"), demo_model,
                 runtime={"args": {"max_tokens": 4, "max_context": 512}},
                 proxy={"header_timeout": PROXY.header_timeout, "body_timeout": PROXY.body_timeout}) as (path, agents):
        status = json.loads(meshctl(path, "status", "--json").stdout)
        state = path.parent / "state"
        secret = rank_secret(rank_key(state), status["generation"])
        yield {"path": path, "agents": agents, "status": status, "proxy": status["urls"]["proxy"].removesuffix("/v1"),
               "proxy_pid": int((state / "run" / "proxy.pid").read_text().split()[0]),
               "rank0_pid": status["nodes"][0]["rank"]["pid"],
               "rank0_port": tomllib.loads(path.read_text())["runtime"]["port"],
               "rank0_auth": {"Authorization": f"Bearer {secret}"},
               "control_auth": {"Authorization": f"Bearer {(state / 'control.token').read_text().strip()}"}}


def test_slowloris_and_a_trickled_body_are_closed_by_the_proxy_while_it_serves(mesh):
    proxy = psutil.Process(mesh["proxy_pid"])
    fds = proxy.num_fds()
    port = int(mesh["proxy"].rsplit(":", 1)[1])
    chat = Chat(mesh["proxy"])
    slow = Trickle(port, 300)
    body = Trickle(port, 1, first=HEAD.replace(b"X-Pad: " + b"a" * 500, b"Content-Length: 1000\r\n\r\n{"),
                   head=b" ")
    try:
        wait_for(lambda: len(slow.closed) == 300, 12 * PROXY.header_timeout, "the proxy to close slowloris")
        wait_for(lambda: body.closed, 4 * PROXY.body_timeout, "the proxy to answer the trickled body")
    finally:
        slow.close()
        body.close()
        statuses = chat.stop()
    assert max(slow.closed) < 3 * PROXY.header_timeout, max(slow.closed)  # a ceiling; never, before
    assert statuses and set(statuses) == {200}, statuses
    (answer,) = body.answers
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer, answer
    wait_for(lambda: proxy.num_fds() <= fds + 8, 30, "the proxy's descriptors back to where they were")
    metrics = requests.get(f"{mesh['proxy']}/metrics", timeout=10).text
    refused = re.search(r'^meshd_proxy_refused_connections_total\{reason="slow_headers"\} (\S+)', metrics, re.M)
    assert refused and float(refused.group(1)) >= 300, metrics


def test_a_flood_of_trickling_connections_costs_rank0_no_thread_and_bounded_descriptors(mesh):
    allow_descriptors(4096)
    rank0 = psutil.Process(mesh["rank0_pid"])
    threads, fds = rank0.num_threads(), rank0.num_fds()
    cap = min(1000, rank0.rlimit(psutil.RLIMIT_NOFILE)[0] // 2)
    wake_port, = {c.laddr.port for c in rank0.net_connections("tcp") if c.status == "LISTEN"} - {mesh["rank0_port"]}
    chat = Chat(mesh["proxy"])
    floods = [Trickle(mesh["rank0_port"], cap + 100), Trickle(wake_port, 300)]
    seen = []
    try:
        deadline = time.monotonic() + DEFAULTS.header_timeout + PROVE_WITHIN
        while time.monotonic() < deadline:
            seen.append((rank0.num_threads(), rank0.num_fds()))
            time.sleep(0.5)
        wait_for(lambda: not any(f.socks for f in floods), 12 * DEFAULTS.header_timeout,
                 "rank 0 to close every trickling connection")
    finally:
        for f in floods:
            f.close()
        statuses = chat.stop()
    assert max(t for t, _ in seen) <= threads, (threads, seen)
    assert max(n for _, n in seen) <= fds + cap + BACKLOG + MAX_UNPROVEN + 8, (fds, cap, seen)
    assert statuses and set(statuses) == {200}, statuses
    wait_for(lambda: rank0.num_fds() <= fds + 4, 30, "rank 0's descriptors back to where they were")


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 5000])
def test_json_nested_too_deep_is_a_400_json_on_every_listener(mesh, levels):
    agent = mesh["agents"][0]
    for name, url, headers in [
            ("proxy", f"{mesh['proxy']}/v1/chat/completions", {}),
            ("rank 0", f"http://127.0.0.1:{mesh['rank0_port']}/v1/chat/completions", mesh["rank0_auth"]),
            ("control API", f"{mesh['status']['urls']['control']}/v1/observations", mesh["control_auth"]),
            ("agent API", f"{agent.url}/v1/ranks", agent.headers())]:
        r = requests.post(url, data=deep(levels), headers={**headers, "Content-Type": "application/json"}, timeout=30,
                          verify=agent.verify)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (name, r.status_code, r.text)
