"""The OpenAI endpoint in front of rank 0: routes, API keys, admission, the idle probe.

- Validates requests itself (the same rules as the runtime), so bad input is a
  4xx JSON error even while no generation runs.
- Admits through a FIFO with a concurrency limit (1 when decoding is
  speculative); a full queue is 429.
- Hands each admitted request to an `Exchange` (exchange.py), through itself
  as the exchange's `Gate`: the rank 0 to send to, what to tell the fleet.
- For runtimes that keep no status file (the stock profile): asks the mesh for
  one token when no request has run for a while (the idle probe), and judges
  hangs from the time rank 0 stays silent, scaled by the prompt.

It knows the fleet only through `seam.FleetView`: what serves now, a wait for
that to change, and `report()` for what it saw.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import generate_latest

from common.errors import ApiError
from common.http import bearer_matches, json_error, json_errors, read_json
from common.modelref import served_name
from common.states import Phase
from common.tomlcheck import loopback
from meshd.config import MeshConfig, ping_body, rank0_body
from meshd.config import Proxy as ProxyConfig
from meshd.dataplane.admission import Admission, QueueFull
from meshd.dataplane.cors import cors
from meshd.dataplane.exchange import RETRY_AFTER, Exchange, Rank0, quarantined, request_digest, unavailable
from meshd.metrics import ProxyMetrics
from meshd.seam import FleetView, Observation, Serving
from meshd.upstream import Upstream, UpstreamError
from runtime import openai_api as oa

log = structlog.get_logger("meshd.proxy")

CHARS_PER_TOKEN = 3  # fewer than real tokenizers average: a prompt's estimate errs long


def stall_window(p: ProxyConfig, profile: str, prompt_chars: int, max_tokens: int, stream: bool) -> float | None:
    """How long rank 0 may stay silent before the proxy calls it hung, or None when
    the agents judge (meshd-rank's status file carries the real prompt length)."""
    if profile == "meshd-rank":
        return None
    window = p.token_stall + prompt_chars / CHARS_PER_TOKEN / p.min_prefill_rate
    return window if stream else window + max_tokens / p.min_decode_rate


def prompt_chars(req: oa.CompletionRequest) -> int:
    return sum(len(m["content"]) for m in req.messages) if req.kind == "chat" else len(req.prompt)


GONE = (Phase.FAILED, Phase.STOPPED, Phase.DRAINING)  # phases no generation comes back from by waiting


class Proxy:
    """The endpoint: routes, API keys, admission and the idle probe. It is the `Gate` its exchanges go
    through to one mesh's rank 0."""

    def __init__(self, cfg: MeshConfig, fleet: FleetView, metrics: ProxyMetrics):
        self.cfg = cfg
        self.settings: ProxyConfig = cfg.proxy
        self.fleet = fleet
        self.metrics = metrics
        p = cfg.proxy
        name = served_name(cfg.runtime.model, cfg.runtime.args.get("model_name"))
        self.limits = oa.Limits(name, default_max_tokens=int(cfg.runtime.args.get("max_tokens", 0)),
                                max_tokens_limit=int(cfg.runtime.args.get("max_tokens_limit", 8192)),
                                aliases=tuple(a for a in dict.fromkeys((cfg.runtime.model, Path(cfg.runtime.model).name,
                                                                        *cfg.runtime.aliases)) if a != name))
        self.admission = Admission(1 if cfg.speculative else p.concurrency, p.queue_limit)
        metrics.queue_limit.set(p.queue_limit)
        self.api_keys = self._load_keys(p.api_keys_file)
        self.connections = Upstream()  # to rank 0
        self.last_request_at = time.monotonic()  # when the last request ended (or the last probe ran)
        self.quarantined_until: dict[str, float] = {}  # by request digest
        self.served_generation = -1
        self.probed_generation = -1
        self.admitted = 0  # requests admitted since start (a probe that overlapped one is not judged)

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
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application):
        probe = asyncio.create_task(self._probe_loop())
        yield
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        self.connections.close()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def _text(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    def _authorized(self, request: web.Request) -> bool:
        return not self.api_keys or any(bearer_matches(request, k) for k in self.api_keys)

    def _unauthorized(self) -> web.Response:
        return json_error(401, "Invalid or missing API key; send 'Authorization: Bearer <key>' with a key "
                               "from the proxy's api_keys_file", code="invalid_api_key")

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized()
        return web.json_response(oa.models_body(self.limits.model_name, aliases=self.limits.aliases))

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus': open on loopback (the controller's status page reads it there); elsewhere it
        wants an API key like every other route, when there are keys."""
        if not loopback(request.remote) and not self._authorized(request):
            return self._unauthorized()
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8")

    async def _health(self, request: web.Request) -> web.Response:
        """200 only while a generation serves: what a load balancer in front of the mesh asks."""
        s = self.fleet.serving()
        if not s.ready:
            return unavailable(self.why_unavailable())
        return web.json_response({"status": "ok", "generation": s.generation})

    # --- the Gate -----------------------------------------------------------------------
    async def rank0(self, after: int, deadline: float) -> Rank0 | None:
        def usable(s: Serving) -> bool:
            return (s.ready and s.generation > after) or s.phase in GONE
        s = await self.fleet.wait_serving(usable, max(0.0, deadline - time.monotonic()))
        return self._rank0_of(s) if s.ready and s.generation > after else None

    def _rank0_of(self, s: Serving) -> Rank0:
        return Rank0(s.generation, s.rank0_url, s.rank0_auth, self.connections)

    def hopeless(self) -> bool:
        return self.fleet.serving().phase in GONE

    def why_unavailable(self) -> str:
        s = self.fleet.serving()
        if s.phase == Phase.FAILED:
            return f"The mesh has failed and waits for an operator: {s.reason}"
        if s.phase in (Phase.STOPPED, Phase.DRAINING):
            return "The mesh is not running; start it with `meshctl up`"
        why = f": {s.reason}" if s.reason else ""
        return f"The mesh is {s.phase} (generation {s.generation}){why} and did not come back in time; retry shortly"

    async def report(self, observation: Observation) -> None:
        await self.fleet.report(observation)

    async def served(self, generation: int) -> None:
        """Tell the controller once per generation that it answers requests (its incident's last step)."""
        if generation != self.served_generation:
            self.served_generation = generation
            await self.fleet.report(Observation(generation, "served"))

    def quarantine(self, digest: str) -> None:
        self.quarantined_until[digest] = time.monotonic() + self.settings.quarantine_seconds

    # --- a completion -------------------------------------------------------------------

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        route = request.path
        status = 500
        t0 = time.monotonic()
        try:
            resp = await self._serve(request, kind)
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
                log.info("request", route=route, status=status, generation=self.fleet.serving().generation,
                         seconds=round(time.monotonic() - t0, 4))

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        if not self._authorized(request):
            return self._unauthorized()
        body = await read_json(request)
        req = oa.parse_request(kind, body, self.limits)
        p = self.settings
        if self.quarantined_until.get(request_digest(request.path, body), 0) > time.monotonic():
            return quarantined(p)
        t0 = time.monotonic()
        deadline = t0 + p.queue_wait
        try:
            self.metrics.queue_depth.set(self.admission.depth + 1)
            await self.admission.acquire(timeout=p.queue_wait)
        except QueueFull:
            return json_error(429, f"The proxy queue is full ({p.queue_limit} waiting); retry later",
                              code="queue_full", type_="rate_limit_error", headers={"Retry-After": RETRY_AFTER})
        except asyncio.TimeoutError:
            return unavailable(f"No slot freed within {p.queue_wait:.0f}s; retry later")
        finally:
            self.metrics.queue_depth.set(self.admission.depth)
        self.metrics.queue_wait.observe(time.monotonic() - t0)
        self.metrics.in_flight.inc()
        self.admitted += 1
        try:
            profile = self.cfg.runtime.profile
            return await Exchange(self, request, req, rank0_body(profile, {**body, "model": self.limits.model_name}),
                                  body, stall_window(p, profile, prompt_chars(req), req.params.max_tokens, req.stream),
                                  profile == "meshd-rank", deadline).run()
        finally:
            self.metrics.in_flight.dec()
            self.admission.release()
            self.last_request_at = time.monotonic()

    # --- the idle probe ---------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self._maybe_probe()

    async def _maybe_probe(self) -> None:
        """When no request has run for a while, ask the mesh for one token. Only runtimes without a
        status file: meshd-rank's idle ranks move their progress at every liveness exchange, which the
        agents watch, and a probe's latency would only measure the engine's speed."""
        p = self.settings
        if self.cfg.runtime.profile == "meshd-rank":
            return
        s = self.fleet.serving()
        if s.ready and s.generation != self.probed_generation:  # idle from when it is first seen serving
            self.probed_generation, self.last_request_at = s.generation, time.monotonic()
        if not s.ready or self.admission.running or self.admission.depth \
                or time.monotonic() - self.last_request_at < p.probe_idle:
            return
        self.last_request_at = time.monotonic()
        admitted = self.admitted
        body = ping_body(self.cfg.runtime.profile)
        status = None
        try:
            async with asyncio.timeout(p.probe_timeout):
                async with self._rank0_of(s).post("/v1/chat/completions", body) as r:
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
        await self.fleet.report(Observation(s.generation, "probe", detail, status))
