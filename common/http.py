"""HTTP pieces shared by the rank server, the agent, the proxy and the
controller: JSON errors in the OpenAI shape for every failure, aiohttp's own
included (unknown route, wrong method, oversized body); a JSON body reader that
names the problem and holds the body to a deadline and a nesting depth; the
listener every server runs, which holds each connection to its limits; a
constant-time bearer check; and the daemons' entry point."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import resource
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import StreamReader, web
from aiohttp.web_protocol import RequestHandler

from common import logfile, proctitle, sdnotify
from common.errors import ApiError, error_body, error_type
from common.tomlcheck import ConfigError


def json_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None, headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(message, type_ or error_type(status), param, code), status=status,
                             headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"No route {request.method} {request.path}; see the API reference in docs/",
                   405: f"Method {request.method} is not allowed on {request.path}",
                   413: f"The request body is larger than this server accepts ({request.content_length} bytes); "
                        "send a smaller body"}.get(e.status, e.text or e.reason)
        return json_error(e.status, message, headers={k: v for k, v in e.headers.items()
                                                     if k in ("Allow", "Retry-After")})


BODY_TIMEOUT = web.AppKey("body_timeout", float)  # an app's ListenerLimits.body_timeout, for read_json


def default_max_connections() -> int:
    """1000, or half the descriptors this process may open where that is fewer (launchd gives 256)."""
    return min(1000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


@dataclass(frozen=True)
class ListenerLimits:
    """What clients may hold of a listener. `header_timeout`: seconds from a connection's start, or from
    the first byte after an answer, until a request's headers are in (else the connection is closed);
    `body_timeout`: seconds a handler waits for the whole body (else 408); `max_connections`: open at
    once (one more takes the place of the connection that owes its headers longest, or is answered 503
    and closed when none does; those it replaces close within one batch of accepts, BACKLOG)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = field(default_factory=default_max_connections)


MAX_DEPTH = 64  # JSON nesting a body may have: far more than any request needs, far less than the stack holds


def nested_deeper(value, limit: int) -> bool:
    """Whether `value` (decoded JSON) nests lists and objects more than `limit` levels deep."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
    return bool(level)


async def read_json(request: web.Request):
    """The decoded body, or ApiError saying what is wrong with it: 400 (not JSON, nested deeper than
    MAX_DEPTH), 408 (not all there within the listener's body_timeout), 413 (too large)."""
    timeout = request.config_dict.get(BODY_TIMEOUT, ListenerLimits.body_timeout)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"The request body exceeds {request.client_max_size} bytes; send a smaller body",
                       code="body_too_large")
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout:g}s; send it at once",
                       code="body_timeout")
    if not raw:
        raise ApiError(400, "The request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
        deep = nested_deeper(body, MAX_DEPTH)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json")
    except RecursionError:  # deeper than the parser's stack reaches
        deep = True
    if deep:
        raise ApiError(400, f"The request body nests JSON more than {MAX_DEPTH} levels deep; send a flatter body",
                       code="invalid_json")
    return body


async def read_object(request: web.Request) -> dict:
    """An optional JSON object body ({} when there is none), or ApiError(400)."""
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object", code="invalid_json")
    return body


def log_answer(request: web.Request, path: Path | None, missing: str, **fields) -> web.Response:
    """A log's tail (`?lines=N`) or the whole lines after byte `?after=B`, as {**fields, lines, offset} (the
    offset to follow from); 404 saying `missing` when there is no such log."""
    try:
        lines = int(request.query.get("lines", "200"))
        start = int(request.query["after"]) if "after" in request.query else None
    except ValueError:
        raise ApiError(400, "'lines' and 'after' must be integers", param="lines")
    found = None if path is None else \
        logfile.tail(path, max(1, min(lines, 10_000))) if start is None else logfile.after(path, max(0, start))
    if found is None:
        return json_error(404, missing, code="not_found")
    return web.json_response({**fields, "lines": found[0], "offset": found[1]})


def bearer_matches(request: web.Request, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time."""
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


BACKLOG = 128  # connections the kernel queues for a listener; also the most one batch of accepts takes
REFUSAL_LINGER = 1.0  # seconds a refused connection's request is read and dropped, so that the answer is not reset
DRAIN_IDLE = 1.0  # seconds a kept-alive connection idles before a lingering drain closes it


def answer_bytes(status: int, reason: str, message: str, code: str, headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 answer with an error body, for a connection no handler answers; it closes after."""
    body = json.dumps(error_body(message, error_type(status), None, code)).encode()
    head = {"Content-Type": "application/json", "Content-Length": str(len(body)), "Connection": "close", **headers}
    return f"HTTP/1.1 {status} {reason}\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() \
        + b"\r\n" + body


class _Refusal(asyncio.Protocol):
    """A connection over the cap: its answer is written at once, its request read and dropped until the
    client closes or REFUSAL_LINGER passes."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.closing: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.closing = asyncio.get_running_loop().call_later(REFUSAL_LINGER, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing.cancel()


class _Connection(asyncio.Protocol):
    """One client's connection, handed on to aiohttp's handler for it, open from when it is accepted
    (a TLS handshake included). `owing_since`: since when the client owes a request's headers (its
    start, or its first byte after an answer); None while a request runs or the connection idles
    between requests, since `idle_since`."""

    def __init__(self, open_: dict[RequestHandler, _Connection], handler: RequestHandler):
        self.open, self.handler = open_, handler
        self.transport: asyncio.Transport | None = None  # once the handshake, if any, is done
        self.busy = False
        self.owing_since: float | None = time.monotonic()
        self.idle_since = 0.0
        self.request, self.busy_since = "", 0.0  # the request it runs (method and path), or ran last
        self.body: StreamReader | None = None  # the body of the request it runs, or ran last
        open_[handler] = self

    def settled(self, now: float) -> bool:
        """Whether a drain may close it now without losing a request: its request's body has all come
        (aiohttp reads nothing more of a closing connection), or it idled DRAIN_IDLE since its last answer."""
        if self.busy:
            return self.body is None or self.body.is_eof()
        return self.owing_since is None and now - self.idle_since >= DRAIN_IDLE

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open.pop(self.handler, None)
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.owing_since is None and not self.busy:
            self.owing_since = time.monotonic()
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class Listener:
    """`app` on one listening socket (TLS with a context), every connection held to `limits`: a client
    that goes away cancels its handler; one that sends its headers too slowly is closed, one past
    the cap refused. `on_refusal(why)` counts them: "slow_headers" or "cap". Once draining, every answer
    closes its connection."""

    def __init__(self, app: web.Application, limits: ListenerLimits | None = None, shutdown_timeout: float = 2.0,
                 on_refusal: Callable[[str], None] = lambda why: None):
        self.limits = limits or ListenerLimits()
        self.shutdown_timeout = shutdown_timeout
        self.on_refusal = on_refusal
        self.open: dict[RequestHandler, _Connection] = {}
        self.draining = False
        self._full = answer_bytes(503, "Service Unavailable", f"This server holds its limit of "
                                  f"{self.limits.max_connections} open connections; retry shortly",
                                  "too_many_connections", {"Retry-After": "1"})
        open_ = self.open

        @web.middleware
        async def busy(request: web.Request, handler):
            conn = open_.get(request.protocol)
            if conn is not None:
                conn.busy, conn.owing_since, conn.body = True, None, request.content
                conn.request, conn.busy_since = f"{request.method} {request.path}", time.monotonic()
            try:
                response = await handler(request)
                if self.draining:
                    response.force_close()  # closed once written; unsent yet, it says "Connection: close"
                return response
            finally:
                if conn is not None:
                    conn.busy, conn.idle_since = False, time.monotonic()

        app.middlewares.insert(0, busy)
        app[BODY_TIMEOUT] = self.limits.body_timeout
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str | None = None, port: int | None = None, *, sock: socket.socket | None = None,
                    tls: ssl.SSLContext | None = None) -> None:
        await self.runner.setup()
        self._server = await asyncio.get_running_loop().create_server(
            self._accept, host, port, sock=sock, ssl=tls, backlog=BACKLOG,
            ssl_handshake_timeout=self.limits.header_timeout if tls else None)
        self._sweeper = asyncio.create_task(self._sweep())

    def _accept(self) -> asyncio.Protocol:
        if len(self.open) >= self.limits.max_connections:
            slowest = min((c for c in self.open.values() if c.owing_since is not None and c.transport),
                          key=lambda c: c.owing_since, default=None)
            if slowest is None:  # every connection runs a request or idles between two: refuse the newcomer
                self.on_refusal("cap")
                return _Refusal(self._full)
            self._close(slowest)
        return _Connection(self.open, self.runner.server())

    def _close(self, slow: _Connection) -> None:
        self.on_refusal("slow_headers")
        slow.owing_since = None
        if slow.transport is None:  # its TLS handshake failed, or never ended (ssl_handshake_timeout)
            self.open.pop(slow.handler, None)
        else:
            slow.transport.abort()

    async def _sweep(self) -> None:
        """Close the connections that owe their headers longer than header_timeout."""
        timeout = self.limits.header_timeout
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            cutoff = time.monotonic() - timeout
            for conn in [c for c in self.open.values() if c.owing_since is not None and c.owing_since < cutoff]:
                self._close(conn)

    def running(self) -> list[tuple[str, float]]:
        """The requests running now, each its method and path and how long it has run, the longest first."""
        now = time.monotonic()
        return sorted(((c.request, now - c.busy_since) for c in list(self.open.values()) if c.busy),
                      key=lambda r: -r[1])

    async def cleanup(self, linger: bool = False) -> None:
        """Stop accepting, let the handlers finish, close every connection: shutdown_timeout at most in all.
        `linger`: first answer what still comes on the open connections, each answer closing its
        connection, until each idles DRAIN_IDLE and every running request's body has come: a client that
        reuses a kept-alive connection at that moment gets its answer, where closing it at once would
        have reset its request, and one still sending a body is not cut off."""
        deadline = time.monotonic() + self.shutdown_timeout
        if self._server is not None:
            self._server.close()
        self.draining = True
        if linger:
            while time.monotonic() < deadline and not all(c.settled(time.monotonic()) for c in self.open.values()):
                await asyncio.sleep(0.05)
        if self._sweeper is not None:
            self._sweeper.cancel()
        # the handlers get what is left (aiohttp reads 0 as no limit)
        self.runner._shutdown_timeout = max(deadline - time.monotonic(), 0.01)
        await self.runner.cleanup()


async def start_sites(apps: list[tuple[web.Application, str, int, ssl.SSLContext | None]],
                      shutdown_timeout: float = 2.0) -> list[Listener]:
    """Listen with each app (over TLS where it has a context), with the default ListenerLimits."""
    listeners = []
    for app, host, port, tls in apps:
        listener = Listener(app, shutdown_timeout=shutdown_timeout)
        await listener.start(host, port, tls=tls)
        listeners.append(listener)
    return listeners


async def until_stopped(status: str, stop: asyncio.Event | None = None, main_pid: bool = False) -> None:
    """Tell systemd we are ready (and ping its watchdog while the loop runs);
    return on SIGTERM or SIGINT (the handlers only set `stop`), or when the
    caller sets `stop`. `main_pid`: also say this process is the service's main
    one (a successor that took over from it)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sdnotify.notify((f"MAINPID={os.getpid()}\n" if main_pid else "") + f"READY=1\nSTATUS={status}")
    interval = sdnotify.watchdog_interval()
    pings = asyncio.create_task(sdnotify.watchdog_pings(interval)) if interval else None
    await stop.wait()
    sdnotify.notify("STOPPING=1")
    if pings:
        pings.cancel()


def run_daemon(prog: str, description: str, config_help: str, load, serve, listen_fix: str, *,
               what: Callable[..., str], pidfile: bool = False, loop_factory=None) -> None:
    """The daemons' entry point: `--config FILE` (and `--pidfile FILE`, handed to `serve`, when asked for);
    a config mistake or a port that cannot be bound ends the process with a message saying what to fix.
    Its process title is `prog`, `what` the loaded config says it serves, and the config."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help=config_help)
    p.add_argument("--log-file", type=Path, help="write the log here, rotated by size (launchd has no journal)")
    if pidfile:
        p.add_argument("--pidfile", type=Path, help="where to write this process's pid once it serves")
    args = p.parse_args()
    if args.log_file:
        logfile.log_to(args.log_file)
    try:
        cfg = load(args.config)
    except ConfigError as e:
        sys.exit(f"{prog}: {e}")
    proctitle.set_title(proctitle.daemon(prog, what(cfg), args.config))
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(cfg, args.log_file, *([args.pidfile] if pidfile else [])))
    except OSError as e:
        sys.exit(f"{prog}: cannot listen ({e.strerror}); {listen_fix}")
