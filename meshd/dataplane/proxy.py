"""The OpenAI endpoint in front of one mesh's rank 0, or several meshes': routes, API keys, admission,
routing, the idle probe.

- Validates requests itself (the same rules as the runtime), so bad input is a
  4xx JSON error even while no generation runs.
- Admits per mesh, through a FIFO with a concurrency limit; a full queue is
  429.
- Hands each request to an `Exchange` (exchange.py) through a `Routed`, the
  exchange's `Gate`: each attempt's mesh as routing.py decides it (model,
  affinity, queue, failover, fallback), counted by mesh and reason.
- For runtimes that keep no status file (the stock profile): asks the mesh for
  one token when no request has run for a while (the idle probe), and judges
  hangs from the time rank 0 stays silent, scaled by the prompt.

It knows each mesh only through its `seam.FleetView`: what serves now, a wait
for that to change, and `report()` for what it saw.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import generate_latest

from common import openai_api as oa
from common.errors import ApiError
from common.grammars import asks_for_grammar
from common.http import bearer_matches, json_error, json_errors, read_json
from common.secretfile import derive
from common.states import Phase, Profile
from common.tomlcheck import loopback
from meshd.config import Proxy as ProxyConfig
from meshd.dataplane.admission import Admission, QueueFull
from meshd.dataplane.cors import cors
from meshd.dataplane.exchange import RETRY_AFTER, Exchange, Rank0, quarantined, request_digest, unavailable
from meshd.dataplane.proxyconfig import Front, Mesh, listed_names, served_names
from meshd.dataplane.routing import REASONS, Failed, MeshSeen, PrefixMemory, Route, conflicts, prefix_keys, route
from meshd.metrics import ProxyMetrics
from meshd.seam import FleetView, Observation, Serving
from meshd.upstream import PING, Rank0Request, Upstream, UpstreamError

log = structlog.get_logger("meshd.proxy")

CHARS_PER_TOKEN = 3  # fewer than real tokenizers average: a prompt's estimate errs long


def stall_window(p: ProxyConfig, profile: str, prompt_chars: int, max_tokens: int, stream: bool) -> float | None:
    """How long rank 0 may stay silent before the proxy calls it hung, or None when
    the agents judge (meshd-rank's status file carries the real prompt length)."""
    if profile == Profile.MESHD_RANK:
        return None
    window = p.token_stall + prompt_chars / CHARS_PER_TOKEN / p.min_prefill_rate
    return window if stream else window + max_tokens / p.min_decode_rate


def prompt_chars(req: oa.CompletionRequest) -> int:
    return sum(len(m["content"]) for m in req.messages) if req.kind == "chat" else len(req.prompt)


GONE = (Phase.FAILED, Phase.STOPPED, Phase.DRAINING)  # phases no generation comes back from by waiting
DIED = (Phase.RECOVERING, Phase.FAILED)  # of the generation it names: it died, or ends on purpose


class MeshLink:
    """One mesh the proxy fronts: its fleet view, what it serves, its admission, where requests went."""

    def __init__(self, mesh: Mesh, fleet: FleetView, connections: Upstream):
        self.name, self.cfg, self.fleet, self.connections = mesh.name, mesh.cfg, fleet, connections
        rt, p = mesh.cfg.runtime, mesh.cfg.proxy
        self.names = served_names(mesh.cfg)
        self.listed = listed_names(mesh.cfg)
        self.limits = oa.Limits(self.names[0], default_max_tokens=int(rt.args.get("max_tokens", 0)),
                                max_tokens_limit=int(rt.args.get("max_tokens_limit", 8192)),
                                aliases=self.names[1:])
        self.admission = Admission(p.concurrency, p.queue_limit)
        self.routed = dict.fromkeys(REASONS, 0)
        self.ended_on_purpose: deque[int] = deque(maxlen=64)  # the generations it said end on purpose
        self.served_generation = -1
        self.probed_generation = -1
        self.last_request_at = time.monotonic()  # when the last request ended (or the last probe ran)

    def seen(self) -> MeshSeen:
        s = self.fleet.serving()
        a = self.admission
        return MeshSeen(self.name, self.names, s.fingerprint, s.ready, s.phase in GONE, s.generation,
                        a.depth + a.running, a.depth >= a.queue_limit)

    def rank0(self, s: Serving, window: float | None = None) -> Rank0:
        return Rank0(self.name, s.generation, s.rank0_url, self.limits.model_name, self.cfg.runtime.profile, window,
                     s.rank0_auth, self.connections, s.fingerprint)

    def wire(self) -> dict:
        """This mesh in GET /v1/meshes."""
        s = self.fleet.serving()
        return {"name": self.name, "model": self.limits.model_name, "fingerprint": s.fingerprint,
                "phase": str(s.phase), "generation": s.generation, "healthy": s.ready,
                "queue": self.admission.depth, "in_flight": self.admission.running, "routed": dict(self.routed)}

    def why_unavailable(self) -> str:
        s = self.fleet.serving()
        if s.phase == Phase.FAILED:
            return f"The mesh has failed and waits for an operator: {s.reason}"
        if s.phase in (Phase.STOPPED, Phase.DRAINING):
            return "The mesh is not running; start it with `meshctl up`"
        why = f": {s.reason}" if s.reason else ""
        return f"The mesh is {s.phase} (generation {s.generation}){why} and did not come back in time; retry shortly"


class Proxy:
    """The endpoint: routes, API keys, routing and the idle probe over the meshes of `front`, each seen
    through its own `FleetView` (`fleets`, by mesh name)."""

    def __init__(self, front: Front, fleets: dict[str, FleetView], metrics: ProxyMetrics):
        self.front = front
        self.settings: ProxyConfig = front.proxy
        self.metrics = metrics
        self.connections = Upstream()  # to every rank 0
        self.links = {m.name: MeshLink(m, fleets[m.name], self.connections) for m in front.meshes}
        self.memory = PrefixMemory(front.affinity_entries)
        metrics.queue_limit.set(sum(link.admission.queue_limit for link in self.links.values()))
        for link in self.links.values():
            metrics.mesh_ready.labels(mesh=link.name).set_function(lambda f=link.fleet: float(f.serving().ready))
        self.api_keys = self._load_keys(self.settings.api_keys_file)
        self.quarantined_until: dict[str, float] = {}  # by request digest
        self.admitted = 0  # requests admitted since start (a probe that overlapped one is not judged)
        self.conflicts: list[str] = []  # meshes of one name with other weights, as last logged

    @staticmethod
    def _load_keys(path: Path | None) -> list[str]:
        if path is None:
            return []
        return [k.strip() for k in path.read_text().splitlines() if k.strip() and not k.startswith("#")]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[cors(self.settings.cors_origins), json_errors],
                              client_max_size=self.settings.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/meshes", self._meshes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application):
        tasks = [asyncio.create_task(self._probe_loop()),
                 *(asyncio.create_task(self._watch_planned(link)) for link in self.links.values())]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.connections.close()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def _text(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    def _authorized(self, request: web.Request) -> bool:
        return not self.api_keys or any(bearer_matches(request, k) for k in self.api_keys)

    def _tenant(self, request: web.Request) -> str:
        """The scope of the caller's prefix cache: one per API key (a digest of it, never the key), so that no
        key's cached prefixes answer another's; "" (one shared cache) where there are no keys."""
        key = next((k for k in self.api_keys if bearer_matches(request, k)), None)
        return derive(key, "meshd prefix cache")[:16] if key else ""

    def _unauthorized(self) -> web.Response:
        return json_error(401, "Invalid or missing API key; send 'Authorization: Bearer <key>' with a key "
                               "from the proxy's api_keys_file", code="invalid_api_key")

    def _operator(self, request: web.Request) -> bool:
        """/metrics and /v1/meshes: open on loopback (the controller's status page reads them there);
        elsewhere they want an API key like every other route, when there are keys."""
        return loopback(request.remote) or self._authorized(request)

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized()
        models = [oa.models_body(link.listed[0], aliases=link.listed[1:])["data"] for link in self.links.values()]
        unique = {m["id"]: m for ms in models for m in ms}
        return web.json_response({"object": "list", "data": list(unique.values())})

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._operator(request):
            return self._unauthorized()
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8")

    async def _meshes(self, request: web.Request) -> web.Response:
        """Every mesh: what it serves, its state, its queue, where requests went and why."""
        if not self._operator(request):
            return self._unauthorized()
        return web.json_response({"meshes": [link.wire() for link in self.links.values()],
                                  "fallback": self.front.fallback or None, "conflicts": self.watch_conflicts()})

    def watch_conflicts(self) -> list[str]:
        """The meshes that serve one name with other weights now (each mesh's controller reads its weights'
        fingerprint at every generation's start), logged as they appear and go."""
        now = conflicts([link.seen() for link in self.links.values()])
        if now != self.conflicts:
            for c in now:
                log.warning("meshes disagree", conflict=c)
            if not now:
                log.info("meshes agree again", meshes=list(self.links))
            self.conflicts = now
        return now

    async def _health(self, request: web.Request) -> web.Response:
        """200 while a mesh serves: what a load balancer in front of the endpoint asks."""
        ready = [(link.name, s) for link in self.links.values() if (s := link.fleet.serving()).ready]
        if not ready:
            return unavailable(self.why_unavailable(list(self.links.values())))
        body = {"status": "ok", "generation": ready[0][1].generation}
        return web.json_response({**body, "meshes": [name for name, _ in ready]} if self.front.several else body)

    def why_unavailable(self, links: list[MeshLink]) -> str:
        """What a client is told when none of `links` serves it."""
        if len(links) == 1:
            return links[0].why_unavailable()
        states = ", ".join(f"{link.name} {link.fleet.serving().phase}" for link in links)
        return f"No mesh serves this model now ({states}) and none came back in time; retry shortly"

    def quarantine(self, digest: str) -> None:
        self.quarantined_until[digest] = time.monotonic() + self.settings.quarantine_seconds

    def _limits_for(self, body) -> oa.Limits:
        """The limits of the model the request names: the first mesh's when it names none (or, fronting one
        mesh, any it does not serve: the runtime's own error says so)."""
        model = body.get("model") if isinstance(body, dict) else None
        for link in self.links.values():
            if model in link.names:
                return link.limits
        if self.front.several and isinstance(model, str) and model not in ("", "default"):
            names = ", ".join(f"'{link.limits.model_name}'" for link in self.links.values())
            raise ApiError(404, f"The model '{model}' does not exist; this endpoint serves {names} (GET /v1/models)",
                           param="model", code="model_not_found")
        return next(iter(self.links.values())).limits

    # --- a completion -------------------------------------------------------------------

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        route = request.path
        status = 500
        t0 = time.monotonic()
        gate: Routed | None = None
        try:
            if not self._authorized(request):
                return self._unauthorized()
            body = await read_json(request)
            limits = self._limits_for(body)
            # a grammar's check takes as long as the grammar is big: off this loop (common/grammars.py)
            req = await asyncio.to_thread(oa.parse_request, kind, body, limits) if asks_for_grammar(body) else \
                oa.parse_request(kind, body, limits)
            gate = Routed(self, limits.model_name, prefix_keys(body["messages"]) if kind == "chat" else [], req)
            resp = await self._serve(request, gate, req, body)
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            if status != 200 or self.settings.access_log:  # metrics count them all; the log has what failed
                where = gate.link if gate else None
                log.info("request", route=route, status=status, mesh=where.name if where else None,
                         generation=where.fleet.serving().generation if where else None,
                         seconds=round(time.monotonic() - t0, 4))

    async def _serve(self, request: web.Request, gate: "Routed", req: oa.CompletionRequest,
                     body: dict) -> web.StreamResponse:
        p = self.settings
        if self.quarantined_until.get(request_digest(request.path, body), 0) > time.monotonic():
            return quarantined(p)
        with gate:
            try:
                to_rank0 = Rank0Request.of(request.path, req, body, self._tenant(request))
                return await Exchange(gate, request, req, to_rank0, time.monotonic() + p.queue_wait).run()
            except QueueFull:
                return json_error(429, f"The proxy queue is full ({gate.full_at} waiting); retry later",
                                  code="queue_full", type_="rate_limit_error", headers={"Retry-After": RETRY_AFTER})

    def _gauge_queue(self) -> None:
        self.metrics.queue_depth.set(sum(link.admission.depth for link in self.links.values()))

    async def _watch_planned(self, link: MeshLink) -> None:
        """Remember each generation its mesh says ends on purpose: a drain that outlasts its grace ends the
        streams still on it later, when the mesh may already name the next generation."""
        last = (-1, "")
        while True:
            s = await link.fleet.wait_serving(lambda s: (s.generation, s.planned) != last, 3600.0)
            last = (s.generation, s.planned)
            if s.planned and s.generation not in link.ended_on_purpose:
                link.ended_on_purpose.append(s.generation)

    # --- the idle probe ---------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.watch_conflicts()
            for link in self.links.values():
                await self._maybe_probe(link)

    async def _maybe_probe(self, link: MeshLink) -> None:
        """When no request has run on a mesh for a while, ask it for one token. Only runtimes without a
        status file: meshd-rank's idle ranks move their progress at every liveness exchange, which the
        agents watch, and a probe's latency would only measure the engine's speed."""
        p = self.settings
        if link.cfg.runtime.profile == Profile.MESHD_RANK:
            return
        s = link.fleet.serving()
        if s.ready and s.generation != link.probed_generation:  # idle from when it is first seen serving
            link.probed_generation, link.last_request_at = s.generation, time.monotonic()
        if not s.ready or link.admission.running or link.admission.depth \
                or time.monotonic() - link.last_request_at < p.probe_idle:
            return
        link.last_request_at = time.monotonic()
        admitted = self.admitted
        status = None
        try:
            async with asyncio.timeout(p.probe_timeout):
                async with link.rank0(s).post(PING) as r:
                    answer = await r.read()
            if r.status == 200:
                self.metrics.probes.labels(result="ok").inc()
                return
            status = r.status
            detail = f"probe answered {r.status}: {answer[:200].decode(errors='replace')}"
        except TimeoutError:
            if self.admitted != admitted:
                return  # a request came in meanwhile and shares the steps: a slow probe then proves nothing
            detail = f"probe failed: no answer within {p.probe_timeout:g}s"
        except UpstreamError as e:
            detail = f"probe failed: {e}"
        self.metrics.probes.labels(result="failed").inc()
        await link.fleet.report(Observation(s.generation, "probe", detail, status))


class Routed:
    """One request's way through the meshes, the `Gate` its exchange goes through: each attempt's mesh as
    routing.route decides it, a place in that mesh's admission (moved with the request), what to tell
    that mesh's fleet. Its place is its own from admission to the end of the `with` block around the
    exchange, which gives it back once however the exchange ends (answered, failed, cancelled)."""

    def __init__(self, proxy: Proxy, model: str, keys: list[str], req: oa.CompletionRequest):
        self.proxy, self.model, self.keys, self.req = proxy, model, keys, req
        self.settings, self.metrics = proxy.settings, proxy.metrics
        self.slot: MeshLink | None = None  # the mesh whose admission holds this request's place
        self.link: MeshLink | None = None  # where the last attempt went
        self.failed: Failed | None = None
        self.why = ""  # why the last wait ended without a mesh, when it was not the fleets
        self.full_at = 0

    def __enter__(self) -> Routed:
        return self

    def __exit__(self, *exc) -> None:
        if (slot := self.slot) is not None:
            self.slot = None
            slot.admission.release()
            self.metrics.in_flight.dec()
            slot.last_request_at = time.monotonic()
        self.proxy._gauge_queue()

    def _route(self, affinity: tuple[str, int] | None = None) -> Route:
        seen = [link.seen() for link in self.proxy.links.values()]
        return route(seen, self.model, affinity=affinity, failed=self.failed, fallback=self.proxy.front.fallback)

    async def rank0(self, after: Rank0 | None, deadline: float) -> Rank0 | None:
        links = self.proxy.links
        self.failed = Failed(after.mesh, after.generation, after.fingerprint) if after else None
        self.why = ""
        affinity = self.proxy.memory.find(self.keys) if after is None and self.keys else None
        while True:
            was = [link.fleet.serving() for link in links.values()]
            r = self._route(affinity)
            if r.kind == "gone":
                self.why = self._why_gone()
                return None
            if r.kind == "full" and self.slot is None:
                self.full_at = sum(link.admission.depth for link in links.values())
                raise QueueFull()
            target = links[r.mesh] if r.mesh else self.slot
            if self.slot is None or (r.kind == "send" and target is not self.slot):
                try:
                    if not await self._admit(target, deadline):
                        return None
                except QueueFull:
                    if self.slot is None:
                        raise
            if r.kind == "send" and target is self.slot:
                if (s := target.fleet.serving()).ready:
                    target.routed[r.reason] += 1
                    self.metrics.routed.labels(mesh=target.name, reason=r.reason).inc()
                    self.link = target
                    return target.rank0(s, stall_window(self.settings, target.cfg.runtime.profile,
                                                        prompt_chars(self.req), self.req.params.max_tokens,
                                                        self.req.stream))
                continue  # it changed while the request waited for its place
            # A full queue frees without a word from any fleet: look again within a second.
            if not await self._changed(was, deadline if r.kind == "wait" else min(deadline, time.monotonic() + 1)):
                if time.monotonic() >= deadline:
                    return None

    async def _admit(self, target: MeshLink, deadline: float) -> bool:
        """A place in `target`'s admission, given up where the request held one before; False when none
        freed by `deadline`; QueueFull when its queue is full."""
        t0 = time.monotonic()
        links = self.proxy.links.values()
        try:
            self.metrics.queue_depth.set(sum(link.admission.depth for link in links) + 1)
            await target.admission.acquire(timeout=max(0.0, deadline - t0))
        except QueueFull:
            self.full_at = sum(link.admission.depth for link in links)
            raise
        except asyncio.TimeoutError:
            self.why = f"No slot freed within {self.settings.queue_wait:.0f}s; retry later"
            return False
        finally:
            self.proxy._gauge_queue()
        self.metrics.queue_wait.observe(time.monotonic() - t0)
        if self.slot is None:
            self.metrics.in_flight.inc()
            self.proxy.admitted += 1
        else:
            self.slot.admission.release()
        self.slot = target
        return True

    async def _changed(self, was: list[Serving], until: float) -> bool:
        """Wait until some mesh's phase or generation is not what `was` says (at once when it already is
        not); False when `until` (a monotonic time) came first."""
        waits = [asyncio.ensure_future(link.fleet.wait_serving(
            lambda s, w=w: (s.phase, s.generation) != (w.phase, w.generation), max(0.0, until - time.monotonic())))
            for link, w in zip(self.proxy.links.values(), was)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return any((s.phase, s.generation) != (w.phase, w.generation)
                   for s, w in zip((link.fleet.serving() for link in self.proxy.links.values()), was))

    def _why_gone(self) -> str:
        """Why a cut stream cannot go on, when it is that its weights are served nowhere now ("" else)."""
        f = self.failed
        if f is None or not f.fingerprint:
            return ""
        other = self.proxy.links[f.mesh].fleet.serving().fingerprint
        if other == f.fingerprint:
            return ""
        now = f"now serves other weights (fingerprint {other})" if other else "serves weights not known yet"
        return (f"The answer was cut on mesh {f.mesh} (generation {f.generation}, weights {f.fingerprint}) and no "
                f"mesh serves those weights now: mesh {f.mesh} {now}; an answer is never continued by other "
                "weights. Retry the request")

    def hopeless(self) -> bool:
        return self._route().kind == "gone"

    def why_unavailable(self) -> str:
        if self.why:
            return self.why
        links = self.proxy.links.values()
        return self.proxy.why_unavailable([link for link in links if self.model in link.names] or list(links))

    async def report(self, observation: Observation) -> None:
        await self.link.fleet.report(observation)

    async def lost(self, rank0: Rank0) -> str:
        fleet = self.proxy.links[rank0.mesh].fleet

        def died(s: Serving) -> bool:  # a newer generation alone says nothing: a recycle may overlap a drain
            return s.generation == rank0.generation and s.phase in DIED and s.planned != "drain"
        while not died(seen := await fleet.wait_serving(died, 3600.0)):
            pass
        return seen.planned

    async def served(self, generation: int) -> None:
        """Tell the mesh's controller once per generation that it answers requests (its incident's last
        step); remember where this conversation's prefix is now."""
        link = self.link
        if self.keys:
            self.proxy.memory.remember(self.keys[0], link.name, generation)
        if generation != link.served_generation:
            link.served_generation = generation
            await link.fleet.report(Observation(generation, "served"))

    def quarantine(self, digest: str) -> None:
        self.proxy.quarantine(digest)

    def ended_on_purpose(self, rank0: Rank0) -> bool:
        return rank0.generation in self.proxy.links[rank0.mesh].ended_on_purpose
