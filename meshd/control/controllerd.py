"""`meshd`: the controller daemon. Runs the reconciler and the control API
(loopback by default; bearer token from a 0600 file in the state directory).
The OpenAI endpoint is meshd-proxy's (meshd/dataplane/proxyd.py), which follows the fleet
through this API. Stopping the controller leaves the mesh serving, and the
proxy with it: a restarted controller adopts the running generation."""

from __future__ import annotations

import asyncio
import hmac
import json
import ssl
from pathlib import Path

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
from meshd.nodes.agentclient import AgentError
from meshd.config import MeshConfig, load
from meshd.control.controller import Controller
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
USER_HEADER = "X-Meshd-User"  # who the caller says it is (meshctl sends user@host); the audit trail keeps it


def audit(ctl: Controller, request: web.Request, action: str, outcome: str) -> None:
    user = "".join(c for c in request.headers.get(USER_HEADER, "")[:80] if c.isprintable())
    ctl.store.record_audit(user, request.remote or "", action, outcome)
    log.info("control action", action=action, outcome=outcome, user=user, remote=request.remote)


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
            audit(ctl, request, f"{request.method} {request.path}", "refused: missing or wrong token")
            return json_error(401, "Missing or wrong control token; it is in control.token in the mesh's "
                                   "state directory (meshctl reads it for you)", code="unauthorized")
        return await handler(request)

    app = web.Application(middlewares=[json_errors, auth], client_max_size=64 << 10)

    async def healthz(request):
        return web.json_response({"ok": True, "phase": ctl.state.phase, "generation": ctl.state.generation})

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
        audit(ctl, request, "up", "accepted")
        return web.json_response({"phase": ctl.state.phase, "generation": ctl.state.generation}, status=202)

    async def down(request):
        force = (await read_object(request)).get("force", False)
        if not isinstance(force, bool):
            raise ApiError(400, "'force' must be true or false", param="force")
        await ctl.down(force)
        audit(ctl, request, "down --force" if force else "down", "accepted")
        return web.json_response({"phase": ctl.state.phase, "generation": ctl.state.generation}, status=202)

    async def restart(request):
        await ctl.restart()
        audit(ctl, request, "restart", "accepted")
        return web.json_response({"phase": ctl.state.phase, "generation": ctl.state.generation}, status=202)

    async def incidents(request):
        return web.json_response({"incidents": ctl.store.incidents(200), "generations": ctl.store.generations(50),
                                  "audit": ctl.store.audit(200)})

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

    async def page(request):
        rates.update(await statuspage.proxy_samples(ctl.session, ctl.cfg.proxy.url))
        status = await survey.status(ctl.cfg, ctl.state, ctl.agents, ctl.store)
        body = statuspage.render({**status, "urls": urls(ctl.cfg)}, ctl.store.incidents(12), rates)
        return web.Response(text=body, content_type="text/html")

    async def login(request):
        if request.content_type != "application/x-www-form-urlencoded":
            raise ApiError(415, "Send the token as a form field (application/x-www-form-urlencoded), as the "
                                "status page's login form does", code="unsupported_media_type")
        given = (await request.post()).get("token", "")
        if not isinstance(given, str) or not hmac.compare_digest(given.strip().encode(), token.encode()):
            audit(ctl, request, "status page login", "refused: wrong token")
            return web.Response(text=statuspage.login(ctl.cfg.name, wrong=True), status=401, content_type="text/html")
        audit(ctl, request, "status page login", "accepted")
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


async def serve(cfg: MeshConfig, log_file: Path | None = None) -> None:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    token = control_token(cfg.state_dir)
    store = Store(cfg.store_path)
    metrics = Metrics(cfg.name)
    ctl = Controller(cfg, store, metrics)
    await ctl.start()  # adopt first: no command may arrive before the controller knows what runs
    runners = await start_sites([(control_app(ctl, metrics, token, log_file),
                                  *split_listen("control.listen", cfg.control.listen), control_tls(cfg))])
    log.info("meshd running", mesh=cfg.name, control=cfg.control.listen,
             phase=ctl.state.phase, generation=ctl.state.generation)
    await until_stopped(f"mesh {cfg.name}: control API on {cfg.control.listen}")
    log.info("meshd stopping; the mesh keeps serving and will be adopted", generation=ctl.state.generation)
    await ctl.close()
    for r in runners:
        await r.cleanup()
    store.close()


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
    run_daemon("meshd", "meshd controller", "mesh.toml", load_checked, serve, "change control.listen")


if __name__ == "__main__":
    main()
