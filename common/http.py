"""HTTP pieces shared by the rank server, the agent, the proxy and the
controller: JSON errors in the OpenAI shape for every failure, aiohttp's own
included (unknown route, wrong method, oversized body); a JSON body reader that
names the problem; a constant-time bearer check; and the daemons' entry point."""

from __future__ import annotations

import argparse
import asyncio
import os
import hmac
import json
import signal
import ssl
import sys
from pathlib import Path

from aiohttp import web

from common import logfile, sdnotify
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


async def read_json(request: web.Request):
    """The decoded body, or ApiError(400) saying what is wrong with it."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"The request body exceeds {request.client_max_size} bytes; send a smaller body",
                       code="body_too_large")
    if not raw:
        raise ApiError(400, "The request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json")


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


async def start_sites(apps: list[tuple[web.Application, str, int, ssl.SSLContext | None]],
                      shutdown_timeout: float = 2.0) -> list[web.AppRunner]:
    """Listen with each app (over TLS where it has a context); client disconnects cancel their handlers."""
    runners = []
    for app, host, port, tls in apps:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
        runners.append(runner)
    return runners


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
               pidfile: bool = False, loop_factory=None) -> None:
    """The daemons' entry point: `--config FILE` (and `--pidfile FILE`, handed to `serve`, when asked for);
    a config mistake or a port that cannot be bound ends the process with a message saying what to fix."""
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
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(cfg, args.log_file, *([args.pidfile] if pidfile else [])))
    except OSError as e:
        sys.exit(f"{prog}: cannot listen ({e.strerror}); {listen_fix}")
