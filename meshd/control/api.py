"""The control API: its routes over a narrow view of the controller (`ControlView`), the control token,
and the audit trail of what callers asked. The status page's own routes are statuspage.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Awaitable, Callable, Protocol

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from common.errors import ApiError
from common.http import bearer_matches, json_error, json_errors, log_answer, read_object
from common.tomlcheck import ConfigError
from meshd import configdiff
from meshd.config import MeshConfig, load
from meshd.control import statuspage
from meshd.control.audit import Refusals, Row
from meshd.nodes.agentclient import AgentError
from meshd.seam import Observation, Serving

log = structlog.get_logger("meshd")

HEARTBEAT = 2.0  # seconds between lines of the serving stream when nothing changes
USER_HEADER = "X-Meshd-User"  # who an authenticated caller says it is (meshctl sends user@host)
STORE_PROBE = 5.0  # seconds between the writes that prove the store takes writes (and retry those waiting)


class ControlView(statuspage.PageSource, Protocol):
    """What the control API reads of the controller and asks of it."""

    nodes: tuple[str, ...]

    def now(self) -> dict: ...  # {"phase", "generation"}
    def problems(self) -> list[str]: ...  # what is wrong with its ground: the store failing, a newer controller
    def history(self) -> dict: ...  # incidents, generations, the audit trail
    def record(self, row: Row) -> None: ...  # a line of the audit trail
    def beat(self) -> None: ...  # the write that proves the store takes writes
    def serving(self) -> Serving: ...
    async def wait_serving(self, predicate: Callable[[Serving], bool], timeout: float) -> Serving: ...
    async def report(self, observation: Observation) -> None: ...
    async def up(self) -> None: ...
    async def down(self, force: bool) -> None: ...
    async def restart(self) -> None: ...
    def config(self) -> MeshConfig: ...  # what the next generation starts with
    async def apply(self, cfg: MeshConfig) -> None: ...  # the next generation's, started now
    async def node_log(self, node: str, rank_log: bool, generation: int, lines: int, after: int | None) -> dict: ...


def while_serving(loop: Callable[[], Awaitable[None]]):
    """An aiohttp cleanup context that runs `loop` as a task for as long as the application serves."""
    async def context(app):
        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return context


class Trail:
    """The audit trail: every accepted action; refusals tallied, a remote's first of a window and the
    summaries due written."""

    def __init__(self, record: Callable[[Row], None]):
        self.record = record
        self.refusals = Refusals()

    def accepted(self, request: web.Request, action: str) -> None:
        user = "".join(c for c in request.headers.get(USER_HEADER, "")[:80] if c.isprintable())
        self.record(Row(user, request.remote or "", action, "accepted"))
        log.info("control action", action=action, outcome="accepted", user=user, remote=request.remote)

    def refused(self, request: web.Request, action: str, reason: str) -> None:
        self.write(self.refusals.note(request.remote or "", action, reason, time.time()))

    def due(self) -> None:
        self.write(self.refusals.due(time.time()))

    def write(self, rows: list[Row]) -> None:
        for row in rows:
            self.record(row)
            log.warning("control call refused", action=row.action, outcome=row.outcome, remote=row.remote)


def routes(ctl: ControlView, registry: CollectorRegistry, token: str, log_file: Path | None = None) -> web.Application:
    trail = Trail(ctl.record)
    page = statuspage.Page(ctl, token, trail.accepted, trail.refused)

    @web.middleware
    async def auth(request, handler):
        if request.path in ("/healthz", "/metrics", "/login"):
            return await handler(request)
        if request.path == "/" and not page.allowed(request):
            return page.login_form(wrong=False)
        if request.path != "/" and not bearer_matches(request, token):
            resource = request.match_info.route.resource  # a route's pattern: callers cannot make up new ones
            trail.refused(request, f"{request.method} {resource.canonical if resource else '(no such route)'}",
                          "missing or wrong token")
            return json_error(401, "Missing or wrong control token; it is in control.token in the mesh's "
                                   "state directory (meshctl reads it for you)", code="unauthorized")
        return await handler(request)

    app = web.Application(middlewares=[json_errors, auth], client_max_size=64 << 10)

    async def keep_store():
        while True:
            await asyncio.sleep(STORE_PROBE)
            ctl.beat()
            trail.due()

    app.cleanup_ctx.append(while_serving(keep_store))
    app.cleanup_ctx.append(while_serving(page.sample_tokens))

    async def healthz(request):
        problems = ctl.problems()
        return web.json_response({"ok": not problems, "problems": problems, **ctl.now()},
                                 status=503 if problems else 200)

    async def metrics(request):
        return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")

    followers: set[web.StreamResponse] = set()

    async def status(request):
        return web.json_response({**await ctl.status(), "proxies_following": len(followers)})

    async def serving(request):
        """The fleet as the data plane needs it: now, then every change, one JSON object a line, and an
        empty line every HEARTBEAT seconds without a change, so a follower knows the controller is there.
        `?stream=0`: now only."""
        if request.query.get("stream") == "0":
            return web.json_response(ctl.serving().wire())
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        followers.add(resp)
        try:
            last = None
            while True:
                now = ctl.serving() if last is None else await ctl.wait_serving(lambda s: s != last, HEARTBEAT)
                await resp.write((json.dumps(now.wire()) if now != last else "").encode() + b"\n")
                last = now
        except (ConnectionError, asyncio.CancelledError):
            return resp
        finally:
            followers.discard(resp)

    async def observation(request):
        await ctl.report(Observation.from_wire(await read_object(request)))
        return web.json_response({"accepted": True}, status=202)

    async def up(request):
        await ctl.up()
        trail.accepted(request, "up")
        return web.json_response(ctl.now(), status=202)

    async def down(request):
        force = (await read_object(request)).get("force", False)
        if not isinstance(force, bool):
            raise ApiError(400, "'force' must be true or false", param="force")
        await ctl.down(force)
        trail.accepted(request, "down --force" if force else "down")
        return web.json_response(ctl.now(), status=202)

    async def restart(request):
        await ctl.restart()
        trail.accepted(request, "restart")
        return web.json_response(ctl.now(), status=202)

    async def apply(request):
        """The controller's mesh.toml read again: what changed, and (unless `dry_run`) the next generation started
        with it when a new generation applies every change; else 409 naming what needs more, nothing applied."""
        dry_run = (await read_object(request)).get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise ApiError(400, "'dry_run' must be true or false", param="dry_run")
        running = ctl.config()
        if running.path is None:
            raise ApiError(409, "this controller was started without a mesh.toml: there is none to read again",
                           code="no_config_file")
        try:
            edited = load(running.path)
        except ConfigError as e:
            raise ApiError(400, f"{running.path}: {'; '.join(e.problems)}; nothing was applied (`meshctl "
                                f"config check {running.path}` shows every mistake)", code="invalid_config")
        found = configdiff.changes(running, edited)
        more = [c for c in found if not c.needs.applies]
        answer = {"config": str(running.path), "changes": [c.wire() for c in found], "applies": not more,
                  "digest": configdiff.digest(edited), **ctl.now()}
        if dry_run:
            return web.json_response(answer)
        if more:
            return json_error(409, "nothing was applied: " + "; ".join(c.line() for c in more), code="needs_more")
        if found:
            await ctl.apply(edited)
            trail.accepted(request, "apply")
        return web.json_response(answer, status=202 if found else 200)

    async def incidents(request):
        return web.json_response({**ctl.history(), "store_problems": ctl.problems()})

    async def logs(request):
        node = request.match_info["node"]
        if node not in ctl.nodes:
            return json_error(404, f"no node {node!r} in this mesh; nodes: {', '.join(ctl.nodes)}",
                              code="unknown_node")
        try:
            lines = int(request.query.get("lines", "100"))
            generation = int(request.query.get("generation", ctl.now()["generation"]))
            after = int(request.query["after"]) if "after" in request.query else None
        except ValueError:
            raise ApiError(400, "'lines', 'generation' and 'after' must be integers", param="lines")
        source = request.query.get("source", "rank")
        if source not in ("rank", "agent"):
            raise ApiError(400, f"'source' must be rank or agent, got {source!r}", param="source")
        try:
            return web.json_response(await ctl.node_log(node, source == "rank", generation, lines, after))
        except AgentError as e:
            if e.status == 404:  # that generation never ran there, or its directory is gone
                return json_error(404, str(e), code="not_found")
            return json_error(502, str(e), code="agent_error")

    async def own_log(request):
        return log_answer(request, log_file, "the controller writes no log file (it runs without --log-file, so it "
                                             "logs to its service's journal: `journalctl -u meshd`)")

    app.router.add_get("/", page.page)
    app.router.add_post("/login", page.login)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/up", up)
    app.router.add_post("/v1/down", down)
    app.router.add_post("/v1/restart", restart)
    app.router.add_post("/v1/apply", apply)
    app.router.add_get("/v1/incidents", incidents)
    app.router.add_get("/v1/serving", serving)
    app.router.add_post("/v1/observations", observation)
    app.router.add_get("/v1/logs/{node}", logs)
    app.router.add_get("/v1/log", own_log)
    return app
