"""`meshd`: the controller daemon. Runs the reconciler and the control API
(loopback by default; bearer token from a 0600 file in the state directory).
The OpenAI endpoint is meshd-proxy's (meshd/dataplane/proxyd.py), which follows the fleet
through this API. Stopping the controller leaves the mesh serving, and the
proxy with it: a restarted controller adopts the running generation.
One controller per mesh: it holds the state directory's lock before it acts
on anything, and stops when a newer one has taken the mesh over."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import json
import os
import sqlite3
import ssl
import time
from pathlib import Path
from typing import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import generate_latest

from common.errors import ApiError
from common.http import (
    bearer_matches,
    json_error,
    json_errors,
    log_answer,
    read_object,
    run_daemon,
    start_sites,
    until_stopped,
)
from common.secretfile import derive, ensure_secret
from common.tls import Pair, ensure_ca, ensure_issued, local_names, server_context
from common.tomlcheck import ConfigError, listen_host, loopback, split_listen
from meshd.control import statuspage, survey
from meshd.control.audit import Refusals, Row
from meshd.nodes.agentclient import AgentError
from meshd.config import MeshConfig, load
from meshd.control.controller import Controller, EpochRefused
from meshd.metrics import Metrics
from meshd.seam import Observation
from meshd.store import Store

log = structlog.get_logger("meshd")


def control_token(state_dir: Path) -> str:
    """The control API token, created 0600 on first start."""
    return ensure_secret(state_dir / "control.token")


def control_tls(cfg: MeshConfig) -> ssl.SSLContext | None:
    """Off loopback the control API speaks TLS with a certificate from the mesh CA (both made on first use)."""
    if not cfg.control.tls:
        return None
    ca = ensure_ca(cfg.tls_dir, cfg.name)
    pair = Pair(cfg.tls_dir / "control.pem", cfg.tls_dir / "control.key")
    return server_context(ensure_issued(ca, pair, f"meshd control of mesh {cfg.name}",
                                        local_names(listen_host(cfg.control.listen))))


HEARTBEAT = 2.0  # seconds between lines of the serving stream when nothing changes


def urls(cfg: MeshConfig) -> dict:
    return {"proxy": f"http://{cfg.proxy.listen}/v1", "control": cfg.control.url,
            "metrics": f"{cfg.control.url}/metrics", "proxy_metrics": f"{cfg.proxy.url}/metrics",
            "agents": {n.name: {"api": n.agent, "metrics": f"{n.agent}/metrics"} for n in cfg.nodes}}


PAGE_COOKIE = "meshd_page"
USER_HEADER = "X-Meshd-User"  # who an authenticated caller says it is (meshctl sends user@host)
STORE_PROBE = 5.0  # seconds between the writes that prove the store takes writes (and retry those waiting)
TOKENS_EVERY = 10.0  # seconds between the status page's samples of the proxy's token counter


def accepted(ctl: Controller, request: web.Request, action: str) -> None:
    user = "".join(c for c in request.headers.get(USER_HEADER, "")[:80] if c.isprintable())
    ctl.store.record_audit(user, request.remote or "", action, "accepted")
    log.info("control action", action=action, outcome="accepted", user=user, remote=request.remote)


def store_health(ctl: Controller) -> list[str]:
    """What is wrong with this controller's ground: its store failing, a newer controller."""
    store, fence = ctl.store, ctl.store.fence
    problems = []
    if store.failing:
        since = time.strftime("%H:%M:%S", time.localtime(store.failing_since))
        problems.append(f"the store ({ctl.cfg.store_path}) fails to write since {since}: {store.failing}; "
                        f"{len(store.pending)} writes wait (free space in {ctl.cfg.state_dir})")
    if fence and fence.newer is not None:
        problems.append(f"controller {fence.newer} has taken this mesh over; this one ({fence.ballot}) acts on "
                        "nothing more")
    return problems


def while_serving(loop: Callable[[], Awaitable[None]]):
    """An aiohttp cleanup context that runs `loop` as a task for as long as the application serves."""
    async def context(app):
        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return context


def control_app(ctl: Controller, metrics: Metrics, token: str, log_file: Path | None = None) -> web.Application:
    page_cookie = derive(token, "status page cookie")  # opens the page only, never the control API

    def page_allowed(request) -> bool:
        return (loopback(request.remote) or bearer_matches(request, token)
                or hmac.compare_digest(request.cookies.get(PAGE_COOKIE, "").encode(), page_cookie.encode()))

    @web.middleware
    async def auth(request, handler):
        if request.path in ("/healthz", "/metrics", "/login"):
            return await handler(request)
        if request.path == "/" and not page_allowed(request):
            return web.Response(text=statuspage.login(ctl.cfg.name, wrong=False), status=401, content_type="text/html")
        if request.path != "/" and not bearer_matches(request, token):
            resource = request.match_info.route.resource  # a route's pattern: callers cannot make up new ones
            refused(request, f"{request.method} {resource.canonical if resource else '(no such route)'}",
                    "missing or wrong token")
            return json_error(401, "Missing or wrong control token; it is in control.token in the mesh's "
                                   "state directory (meshctl reads it for you)", code="unauthorized")
        return await handler(request)

    app = web.Application(middlewares=[json_errors, auth], client_max_size=64 << 10)
    refusals = Refusals()

    def trail(rows: list[Row]) -> None:
        for row in rows:
            ctl.store.record_audit(row.user, row.remote, row.action, row.outcome)
            log.warning("control call refused", action=row.action, outcome=row.outcome, remote=row.remote)

    def refused(request, action: str, reason: str) -> None:
        """Into the tally; a remote's first refusal of a window, and the summaries due, into the trail."""
        trail(refusals.note(request.remote or "", action, reason, time.time()))

    async def keep_store():
        while True:
            await asyncio.sleep(STORE_PROBE)
            ctl.store.put("controller", {"pid": os.getpid(), "at": time.time()})
            trail(refusals.due(time.time()))

    app.cleanup_ctx.append(while_serving(keep_store))

    async def healthz(request):
        problems = store_health(ctl)
        return web.json_response({"ok": not problems, "problems": problems, "phase": ctl.state.phase,
                                  "generation": ctl.state.generation}, status=503 if problems else 200)

    async def metrics_route(request):
        return web.Response(body=generate_latest(metrics.registry), content_type="text/plain", charset="utf-8")

    async def status(request):
        return web.json_response({**await survey.status(ctl.cfg, ctl.state, ctl.agents, ctl.store),
                                  "urls": urls(ctl.cfg), "agent_errors": ctl.agent_errors, "proxies_following": len(followers)})

    followers: set[web.StreamResponse] = set()

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
        accepted(ctl, request, "up")
        return web.json_response({"phase": ctl.state.phase, "generation": ctl.state.generation}, status=202)

    async def down(request):
        force = (await read_object(request)).get("force", False)
        if not isinstance(force, bool):
            raise ApiError(400, "'force' must be true or false", param="force")
        await ctl.down(force)
        accepted(ctl, request, "down --force" if force else "down")
        return web.json_response({"phase": ctl.state.phase, "generation": ctl.state.generation}, status=202)

    async def restart(request):
        await ctl.restart()
        accepted(ctl, request, "restart")
        return web.json_response({"phase": ctl.state.phase, "generation": ctl.state.generation}, status=202)

    async def incidents(request):
        return web.json_response({"incidents": ctl.store.incidents(200), "generations": ctl.store.generations(50),
                                  "audit": ctl.store.audit(200), "store_problems": store_health(ctl)})

    async def logs(request):
        node = request.match_info["node"]
        if node not in ctl.agents:
            return json_error(404, f"no node {node!r} in this mesh; nodes: {', '.join(ctl.agents)}",
                              code="unknown_node")
        try:
            lines = int(request.query.get("lines", "100"))
            generation = int(request.query.get("generation", ctl.state.generation))
            after = f"&after={int(request.query['after'])}" if "after" in request.query else ""
        except ValueError:
            raise ApiError(400, "'lines', 'generation' and 'after' must be integers", param="lines")
        source = request.query.get("source", "rank")
        if source not in ("rank", "agent"):
            raise ApiError(400, f"'source' must be rank or agent, got {source!r}", param="source")
        rank = [n.name for n in ctl.cfg.nodes].index(node)
        path = f"/v1/ranks/{generation}/{rank}/log" if source == "rank" else "/v1/log"
        try:
            data = await ctl.agents[node].call("GET", f"{path}?lines={lines}{after}")
        except AgentError as e:
            if e.status == 404:  # that generation never ran there, or its directory is gone
                return json_error(404, str(e), code="not_found")
            return json_error(502, str(e), code="agent_error")
        return web.json_response(data)

    async def own_log(request):
        return log_answer(request, log_file, "the controller writes no log file (it runs without --log-file, so it "
                                             "logs to its service's journal: `journalctl -u meshd`)")

    rates = statuspage.Rates()
    history = statuspage.TokenHistory(TOKENS_EVERY)

    async def sample_tokens():
        while True:
            history.note(time.time(), await statuspage.proxy_samples(ctl.session, ctl.cfg.proxy.url))
            await asyncio.sleep(history.every)

    app.cleanup_ctx.append(while_serving(sample_tokens))

    async def page(request):
        samples, meshes = await asyncio.gather(statuspage.proxy_samples(ctl.session, ctl.cfg.proxy.url),
                                               statuspage.proxy_meshes(ctl.session, ctl.cfg.proxy.url))
        rates.update(samples)
        status = await survey.status(ctl.cfg, ctl.state, ctl.agents, ctl.store)
        body = statuspage.render({**status, "urls": urls(ctl.cfg)}, ctl.store.incidents(12), rates, history, meshes)
        return web.Response(text=body, content_type="text/html")

    async def login(request):
        if request.content_type != "application/x-www-form-urlencoded":
            raise ApiError(415, "Send the token as a form field (application/x-www-form-urlencoded), as the "
                                "status page's login form does", code="unsupported_media_type")
        given = (await request.post()).get("token", "")
        if not isinstance(given, str) or not hmac.compare_digest(given.strip().encode(), token.encode()):
            refused(request, "status page login", "wrong token")
            return web.Response(text=statuspage.login(ctl.cfg.name, wrong=True), status=401, content_type="text/html")
        accepted(ctl, request, "status page login")
        resp = web.Response(status=303, headers={"Location": "/"})
        resp.set_cookie(PAGE_COOKIE, page_cookie, httponly=True, samesite="Strict", secure=ctl.cfg.control.tls,
                        max_age=30 * 86400)
        return resp

    app.router.add_get("/", page)
    app.router.add_post("/login", login)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/up", up)
    app.router.add_post("/v1/down", down)
    app.router.add_post("/v1/restart", restart)
    app.router.add_get("/v1/incidents", incidents)
    app.router.add_get("/v1/serving", serving)
    app.router.add_post("/v1/observations", observation)
    app.router.add_get("/v1/logs/{node}", logs)
    app.router.add_get("/v1/log", own_log)
    return app


def hold_lock(cfg: MeshConfig) -> int:
    """The state directory's lock (its fd), held for as long as this process lives: one controller per mesh.
    SystemExit naming the holder when another controller holds it: this one has done nothing."""
    path = cfg.state_dir / "controller.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SystemExit(f"meshd: another controller of mesh {cfg.name} (pid {holder}) holds {path}; this one "
                         f"did nothing. One controller runs a mesh: if pid {holder} is stopped (kill -STOP, a "
                         f"debugger), resume it (kill -CONT {holder}); to replace it, stop it first (kill {holder}: "
                         "the mesh keeps serving and the next controller adopts it)")
    with contextlib.suppress(OSError):  # the pid only names the holder; a full disk must not stop a controller
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def check_listen(listen: str) -> None:
    """OSError now when another process listens on `listen`: the API binds only after adoption, and a
    controller that cannot serve must not act first."""
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, *split_listen("control.listen", listen),
                                                            reuse_address=True)
    server.close()
    await server.wait_closed()


async def serve(cfg: MeshConfig, log_file: Path | None = None) -> None:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_lock(cfg)
    await check_listen(cfg.control.listen)
    token = control_token(cfg.state_dir)
    metrics = Metrics(cfg.name)
    try:
        store = Store(cfg.store_path, on_error=lambda message: metrics.store_errors.inc())
    except sqlite3.Error as e:
        raise SystemExit(f"meshd: cannot open the store {cfg.store_path} ({e}); free space in {cfg.state_dir} or "
                         "check its permissions, then start meshd again (the mesh keeps serving meanwhile)")
    metrics.store_pending.set_function(lambda: len(store.pending))
    ctl = Controller(cfg, store, metrics)
    try:
        await ctl.start()  # the epoch, then adoption: no command may arrive before the controller knows what runs
    except EpochRefused as e:
        await ctl.close()
        store.close()
        os.close(lock)
        raise SystemExit(f"meshd: mesh {cfg.name}: {e}")
    fence = store.fence
    runners = await start_sites([(control_app(ctl, metrics, token, log_file),
                                  *split_listen("control.listen", cfg.control.listen), control_tls(cfg))])
    log.info("meshd running", mesh=cfg.name, control=cfg.control.listen, epoch=str(fence.ballot),
             phase=ctl.state.phase, generation=ctl.state.generation)
    # Until a signal, or a newer controller (fence.newer says which: a signal sets the event too).
    await until_stopped(f"mesh {cfg.name}: control API on {cfg.control.listen}", stop=fence.superseded)
    log.info("meshd stopping; the mesh keeps serving and will be adopted", generation=ctl.state.generation)
    for r in runners:  # the API's loops first: they use the controller's session
        await r.cleanup()
    await ctl.close()
    store.close()
    os.close(lock)
    if fence.newer is not None:
        raise SystemExit(f"meshd: controller {fence.newer} has taken mesh {cfg.name} over ({fence.by} said so); "
                         f"this one ({fence.ballot}) stopped and acted on nothing after it. Two controllers for "
                         "these nodes (two state directories) take the mesh from each other as each starts: keep "
                         "one")


def load_checked(path: str) -> MeshConfig:
    cfg = load(path)
    for n in cfg.nodes:
        if not n.token_file.exists():
            raise ConfigError(f"nodes.{n.name}.token_file: {n.token_file} does not exist; copy the token "
                              "from that node's agent (its token_file)")
    if cfg.agents_over_tls:
        cfg.client_tls()  # ConfigError now when there is no mesh CA to check the agents against
    return cfg


def main() -> None:
    run_daemon("meshd", "meshd controller", "mesh.toml", load_checked, serve, "change control.listen",
               what=lambda cfg: f"mesh={cfg.name}")


if __name__ == "__main__":
    main()
