"""The agent's HTTP API: its routes over a narrow view of the supervisor (`AgentView`), the bearer token,
and the controller's fence.

Every route but /healthz and /metrics needs `Authorization: Bearer <token>`
(the metrics route takes its own token when `metrics_token_file` is set).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Protocol

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from agents import node as node_facts
from agents.config import AgentConfig
from agents.events import EventLog
from agents.fencing import OTHER_MESH, Fencing, caller_mesh, command_refusal, mesh_refusal, promise_refusal
from agents.launch import BadSpec
from agents.supervisor import Conflict
from agents.watch import RankRecord
from common.errors import ApiError
from common.http import bearer_matches, json_error, json_errors, log_answer, read_json, read_object
from common.protocol import (CONTROLLER_EPOCH, CONTROLLER_ID, CONTROLLER_MESH, EPOCH_ROUTE, Ballot, BallotError,
                             RankSpec, StopResult)
from common.states import StopMode

log = structlog.get_logger("meshd.agent")


class AgentView(Protocol):
    """What the routes read of the supervisor and ask of it; the supervisor changes its own state."""

    config: AgentConfig
    events: EventLog
    wired_limit: dict | None
    reboot_required: str | None

    def current_generation(self) -> int | None: ...
    def highest_generation(self) -> int: ...
    def ranks(self) -> dict: ...
    def log_path(self, generation: int, rank: int) -> Path: ...
    async def start(self, spec: RankSpec, mesh: str | None = None) -> tuple[RankRecord, bool]: ...
    async def stop(self, generation: int, mode: StopMode, grace: float) -> StopResult: ...
    async def sweep(self, grace: float, current: int | None | str) -> dict: ...


def auth_middleware(token: str, metrics_token: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        path = request.path
        if path == "/healthz" or (path == "/metrics" and metrics_token is None):
            return await handler(request)
        if not bearer_matches(request, metrics_token if path == "/metrics" else token):
            return json_error(401, "Missing or wrong bearer token; send 'Authorization: Bearer <token>' "
                                   "with the token from this agent's token_file", code="unauthorized")
        return await handler(request)
    return check


HELD = web.RequestKey("held", bool)  # a ballot of this agent's mesh came: its answer names the promised one
MESH = web.RequestKey("mesh", object)  # the mesh the call names (None: none)


def fence_middleware(fencing: Fencing, node: str):
    """After the token: a command (POST) from a controller other than the one this agent promised is refused
    with 409, naming the promised ballot, and one of another mesh with 409 naming both meshes; `POST /v1/epoch`
    asks for the promise itself. Every answer to a call that carries a ballot of this agent's mesh names the
    promised one, so a controller learns on any call that another took over or that this agent has not promised
    it yet. Calls without a ballot (doctor, an operator) pass. A malformed ballot is refused with 400, and every
    controller's command with 503 while the promise file cannot be trusted (its reads pass, naming no ballot).
    Each command let through is logged with whose it was."""
    @web.middleware
    async def check(request: web.Request, handler):
        try:
            caller, mesh = Ballot.from_headers(request.headers), caller_mesh(request.headers)
        except BallotError as e:
            log.warning("ballot refused", node=node, route=request.path, header=e.header, reason=str(e))
            raise ApiError(400, str(e), param=e.header)
        request[MESH] = mesh
        if caller is None:
            return await handler(request)
        unreadable = fencing.check()
        request[HELD] = unreadable is None and mesh_refusal(fencing.held, mesh) is None
        if request.method != "POST" or request.path == EPOCH_ROUTE:
            return await handler(request)
        if unreadable:
            log.warning("controller refused", node=node, controller=str(caller), route=request.path,
                        code=unreadable.code)
            return json_error(503, unreadable.message, code=unreadable.code, param=CONTROLLER_EPOCH)
        refusal = command_refusal(fencing.held, caller, mesh)
        if refusal is not None:
            log.warning("controller refused", node=node, controller=str(caller), mesh=mesh,
                        promised=str(fencing.held.ballot), serves=fencing.held.mesh, route=request.path,
                        code=refusal.code)
            return json_error(409, refusal.message, code=refusal.code,
                              param=CONTROLLER_MESH if refusal.code == OTHER_MESH else CONTROLLER_EPOCH)
        log.info("command", node=node, route=request.path, controller=str(caller) if caller else "none (unfenced)")
        return await handler(request)
    return check


def held_headers(fencing: Fencing):
    """Names the promised ballot in the answer to every call that carried one (a stream's too)."""
    async def name(request: web.Request, response: web.StreamResponse) -> None:
        if request.get(HELD):
            response.headers.update(fencing.held.ballot.headers())
    return name


def parse_spec(body) -> RankSpec:
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object describing the rank", code="invalid_json")
    spec_fields = RankSpec.__dataclass_fields__
    unknown = sorted(set(body) - set(spec_fields))
    if unknown:
        raise ApiError(400, f"Unknown field(s) {unknown}; a start request takes: {', '.join(spec_fields)}",
                       param=unknown[0])
    types = {"generation": int, "rank": int, "world": int, "profile": str, "model": str, "hostfile": dict,
             "port": int, "host": str, "ring_port": int, "seed": int, "env": dict, "args": dict, "devices": str}
    required = ("generation", "rank", "world", "profile", "model", "hostfile")
    for name in required:
        if name not in body:
            raise ApiError(400, f"'{name}' is required", param=name)
    for name, kind in types.items():
        if name in body and (not isinstance(body[name], kind) or (kind is int and isinstance(body[name], bool))):
            raise ApiError(400, f"'{name}' must be a {kind.__name__}, got {body[name]!r}", param=name)
    for name in ("generation", "rank", "world", "port", "ring_port", "seed"):
        if name in body and body[name] < (1 if name == "world" else 0):
            raise ApiError(400, f"'{name}' must not be negative" if name != "world" else "'world' must be >= 1",
                           param=name)
    if body["rank"] >= body["world"]:
        raise ApiError(400, f"'rank' {body['rank']} must be below 'world' {body['world']}", param="rank")
    return RankSpec(**body)


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def routes(sup: AgentView, fencing: Fencing, registry: CollectorRegistry, token: str,
           metrics_token: str | None = None, log_file: Path | None = None) -> web.Application:
    """The agent's API over `sup`; its ballot promised in `fencing`, its metrics in `registry`."""
    cfg = sup.config
    app = web.Application(middlewares=[json_errors, auth_middleware(token, metrics_token),
                                       fence_middleware(fencing, cfg.node)], client_max_size=1 << 20)
    app.on_response_prepare.append(held_headers(fencing))

    async def healthz(request):
        return web.json_response({"ok": True, "node": cfg.node, "generation": sup.current_generation()})

    async def metrics(request):
        return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")

    async def node(request):
        model, package = request.query.get("model"), request.query.get("package")
        return web.json_response({"node": cfg.node, **await node_facts.facts(model, cfg.node, package),
                                  "state_dir": str(cfg.state_dir), "state_free_bytes": free_bytes(cfg.state_dir),
                                  "snapshots_bytes": node_facts.tree_files(cfg.state_dir / "snapshots")[1],
                                  "wired_limit_applied": sup.wired_limit,
                                  "reboot_required": sup.reboot_required, "allow_reboot": cfg.allow_reboot,
                                  "launch": {"profiles": {p.name: sorted(p.args) for p in cfg.profiles.values()},
                                             "env_allowlist": list(cfg.env_allowlist)}})

    async def list_ranks(request):
        return web.json_response(sup.ranks())

    async def start_rank(request):
        spec = parse_spec(await read_json(request))
        try:
            rec, created = await sup.start(spec, caller_mesh(request.headers))  # (the fence checked the name)
        except BadSpec as e:
            raise ApiError(400, str(e), param=e.param)
        except Conflict as e:
            return json_error(409, str(e), code="generation_running")
        return web.json_response({"created": created, **rec.view()}, status=201 if created else 200)

    async def stop_generation(request):
        try:
            generation = int(request.match_info["generation"])
        except ValueError:
            raise ApiError(400, "the generation in the path must be an integer", param="generation")
        body = await read_object(request)
        try:
            mode = StopMode(body.get("mode", StopMode.DRAIN))
        except ValueError:
            raise ApiError(400, f"'mode' must be {' or '.join(repr(str(m)) for m in StopMode)}, "
                                f"got {body.get('mode')!r}", param="mode") from None
        grace = body.get("grace", cfg.grace_seconds)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= 3600:
            raise ApiError(400, f"'grace' must be seconds between 0 and 3600, got {grace!r}", param="grace")
        return web.json_response((await sup.stop(generation, mode, float(grace))).to_dict())

    async def sweep(request):
        body = await read_object(request)
        grace = body.get("grace", 5.0)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= 600:
            raise ApiError(400, f"'grace' must be seconds between 0 and 600, got {grace!r}", param="grace")
        current = body.get("generation", "live")
        if current not in ("live", None) and (isinstance(current, bool) or not isinstance(current, int)):
            raise ApiError(400, f"'generation' must be an integer or null, got {current!r}", param="generation")
        return web.json_response(await sup.sweep(float(grace), current))

    async def rank_log(request):
        try:
            generation, rank = int(request.match_info["generation"]), int(request.match_info["rank"])
        except ValueError:
            raise ApiError(400, "generation and rank must be integers", param="generation")
        return log_answer(request, sup.log_path(generation, rank),
                          f"no log for generation {generation} rank {rank} on {cfg.node}",
                          node=cfg.node, generation=generation, rank=rank)

    async def own_log(request):
        return log_answer(request, log_file, f"agent {cfg.node} writes no log file (it runs without --log-file, "
                                             f"so it logs to its service's journal: `journalctl -u meshd-agent` on "
                                             f"{cfg.node})", node=cfg.node)

    async def events(request):
        raw = request.query.get("since", request.headers.get("Last-Event-ID", "0"))
        try:
            since = int(raw)
        except ValueError:
            raise ApiError(400, f"'since' must be a sequence number, got {raw!r}", param="since")
        since = sup.events.resume_point(since, request.query.get("epoch"))
        if request.query.get("stream", "1") == "0":
            return web.json_response({"node": cfg.node, "epoch": sup.events.epoch, "seq": sup.events.seq,
                                      "events": sup.events.since(since)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(f": meshd-agent {cfg.node} epoch {sup.events.epoch} seq {sup.events.seq}\n\n".encode())
        while True:
            batch = await sup.events.wait_after(since, timeout=10.0)
            if not batch:
                await resp.write(b": keep-alive\n\n")
                continue
            for record in batch:
                await resp.write(f"id: {record['seq']}\ndata: {json.dumps(record)}\n\n".encode())
                since = record["seq"]

    def promise_view() -> dict:
        if unreadable := fencing.check():
            raise ApiError(503, unreadable.message, code=unreadable.code, type="server_error")
        return {"node": cfg.node, **fencing.view(), "highest_generation": sup.highest_generation()}

    async def epoch(request):
        return web.json_response(promise_view())

    async def promise(request):
        asked, mesh = Ballot.from_headers(request.headers), request[MESH]
        if asked is None or mesh is None:
            raise ApiError(400, f"send the ballot to promise in {CONTROLLER_EPOCH} (and the controller's id in "
                                f"{CONTROLLER_ID}) and its mesh's name in {CONTROLLER_MESH}",
                           param=CONTROLLER_EPOCH if asked is None else CONTROLLER_MESH)
        promise_view()  # 503 while the promise file cannot be trusted
        refusal = promise_refusal(fencing.held, asked, mesh)
        if refusal is not None:
            log.warning("promise refused", node=cfg.node, asked=str(asked), mesh=mesh,
                        promised=str(fencing.held.ballot), serves=fencing.held.mesh, code=refusal.code)
            return json_error(409, refusal.message, code=refusal.code,
                              param=CONTROLLER_MESH if refusal.code == OTHER_MESH else CONTROLLER_EPOCH)
        if (asked, mesh) != (fencing.held.ballot, fencing.held.mesh):
            log.info("promised", node=cfg.node, controller=str(asked), mesh=mesh, before=str(fencing.held.ballot),
                     served=fencing.held.mesh)
        fencing.promise(asked, mesh)
        return web.json_response(promise_view())

    async def release(request):
        """An operator's: this agent serves no mesh from now on (`?mesh=` names the one it serves, so a release
        meant for another node's mesh changes nothing here); the promised ballot stays."""
        mesh = request.query.get("mesh")
        if not mesh:
            raise ApiError(400, "name the mesh this agent is released from: ?mesh=NAME (GET /v1/epoch says which "
                                "it serves)", param="mesh")
        promise_view()  # 503 while the promise file cannot be trusted
        if fencing.held.mesh not in (None, mesh):
            return json_error(409, f"this agent serves mesh {fencing.held.mesh!r}, not {mesh!r}; nothing was "
                                   "released", code=OTHER_MESH, param="mesh")
        if fencing.held.mesh is not None:
            log.warning("released from its mesh", node=cfg.node, mesh=mesh, promised=str(fencing.held.ballot))
            fencing.release()
        return web.json_response(promise_view())

    async def clear_snapshots(request):
        """Every prefix snapshot on this node deleted (`meshctl cache clear`), its ranks serving on: each makes
        its folder again at its next write."""
        cleared = await asyncio.to_thread(node_facts.clear_folder, cfg.state_dir / "snapshots")
        log.info("snapshots cleared", node=cfg.node, **cleared)
        return web.json_response({"node": cfg.node, **cleared})

    async def reboot(request):
        if not cfg.allow_reboot:
            return json_error(403, f"reboot is not allowed on {cfg.node}; set allow_reboot = true in its "
                                   "agent config, or reboot it over SSH", code="reboot_not_allowed")
        result = await node_facts.run_tool(list(cfg.reboot_command), timeout=30)
        if not result["ok"]:
            return json_error(502, f"reboot command failed on {cfg.node}: {result['error']}",
                              code="reboot_failed")
        return web.json_response({"rebooting": True, "node": cfg.node, "at": time.time()}, status=202)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/node", node)
    app.router.add_get("/v1/ranks", list_ranks)
    app.router.add_post("/v1/ranks", start_rank)
    app.router.add_post("/v1/generations/{generation}/stop", stop_generation)
    app.router.add_post("/v1/sweep", sweep)
    app.router.add_get("/v1/ranks/{generation}/{rank}/log", rank_log)
    app.router.add_get("/v1/log", own_log)
    app.router.add_get("/v1/events", events)
    app.router.add_post("/v1/reboot", reboot)
    app.router.add_delete("/v1/snapshots", clear_snapshots)
    app.router.add_get(EPOCH_ROUTE, epoch)
    app.router.add_post(EPOCH_ROUTE, promise)
    app.router.add_delete(EPOCH_ROUTE, release)
    return app
