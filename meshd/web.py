"""HTTP pieces shared by the rank server, the agent and the controller: JSON
errors in the OpenAI shape for every failure, including aiohttp's own (unknown
route, wrong method, oversized body), and a JSON body reader that names the
problem."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from aiohttp import web

from meshd import sdnotify
from runtime.openai_api import ApiError, error_body

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


def json_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None, headers: dict | None = None) -> web.Response:
    kind = type_ or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return web.json_response(error_body(message, kind, param, code), status=status, headers=headers)


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


async def start_sites(apps: list[tuple[web.Application, str, int]], shutdown_timeout: float = 2.0) -> list[web.AppRunner]:
    """Listen with each app; client disconnects cancel their handlers."""
    runners = []
    for app, host, port in apps:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    return runners


async def until_stopped(status: str) -> None:
    """Tell systemd we are ready (and ping its watchdog while the loop runs);
    return on SIGTERM or SIGINT (the handlers only set an event)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sdnotify.notify(f"READY=1\nSTATUS={status}")
    interval = sdnotify.watchdog_interval()
    pings = asyncio.create_task(sdnotify.watchdog_pings(interval)) if interval else None
    await stop.wait()
    sdnotify.notify("STOPPING=1")
    if pings:
        pings.cancel()


def run_daemon(prog: str, description: str, config_help: str, load, serve, listen_fix: str) -> None:
    """The daemons' entry point: `--config FILE`, a config mistake or a port
    that cannot be bound ends the process with a message saying what to fix."""
    from meshd.config import ConfigError

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help=config_help)
    args = p.parse_args()
    try:
        cfg = load(args.config)
    except ConfigError as e:
        sys.exit(f"{prog}: {e}")
    try:
        asyncio.run(serve(cfg))
    except OSError as e:
        sys.exit(f"{prog}: cannot listen ({e.strerror}); {listen_fix}")
