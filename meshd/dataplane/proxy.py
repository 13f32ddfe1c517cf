"""The OpenAI proxy in front of rank 0.

- Validates requests itself (the same rules as the runtime), so bad input is a
  4xx JSON error even while no generation runs.
- Admits through a FIFO with a concurrency limit (1 when decoding is
  speculative); a full queue is 429.
- Holds requests while the fleet starts or recovers, up to `queue_wait`, then
  503 with Retry-After.
- Retries a request whose upstream failed before any data reached the client
  on the next generation; after data, a stream ends with an SSE error event and
  `data: [DONE]`. A request that was in flight when `poison_after` generations
  died is refused with 502 (and so is the same request for a while after): it
  may be what kills them.
- Sends SSE keep-alive comments while the upstream is silent (long prefills).
- A client that goes away closes the upstream request, which cancels it on
  every rank.
- Measures queue wait, time to first token, inter-token latency and tokens.
- For runtimes that keep no status file (the stock profile): asks the mesh for
  one token when no request has run for a while (the idle probe), and judges
  hangs from the time rank 0 stays silent, scaled by the prompt.

It knows the fleet only through `seam.FleetView`: what serves now, a wait for
that to change, and `report()` for what it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
from collections import deque
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import generate_latest

from common.errors import ApiError, error_body
from common.http import bearer_matches, json_error, json_errors, read_json
from common.modelref import served_name
from common.states import Phase
from common.tomlcheck import loopback
from meshd.config import MeshConfig, ping_body, rank0_body
from meshd.config import Proxy as ProxyConfig
from meshd.metrics import ProxyMetrics
from meshd.seam import FleetView, Observation, Serving
from meshd.upstream import Answer, Upstream, UpstreamError
from runtime import openai_api as oa

RETRY_AFTER = "5"
# A chunk carries text when its "content" (chat) or "text" (completions) is a
# non-empty string. Matching bytes spares decoding every chunk of every stream.
TEXT_FIELD = re.compile(rb'"(?:content|text)":\s?"(?!")')
FINISHED = re.compile(rb'"finish_reason":\s?"')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s?(\d+)')
log = structlog.get_logger("meshd.proxy")


class QueueFull(Exception):
    pass


class Admission:
    """FIFO admission: at most `limit` running, at most `queue_limit` waiting."""

    def __init__(self, limit: int, queue_limit: int):
        self.limit, self.queue_limit = limit, queue_limit
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def depth(self) -> int:
        return len(self._waiters)

    async def acquire(self, timeout: float) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.queue_limit:
            raise QueueFull()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we gave up: pass it on
            else:
                fut.cancel()
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


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


def request_digest(path: str, body: dict) -> str:
    return hashlib.sha256(path.encode() + json.dumps(body, sort_keys=True).encode()).hexdigest()


def cors(origins: tuple[str, ...]):
    """Browsers on `origins` ("*": any) may call the endpoint: their preflight is answered and every
    answer names the origin. No origin configured: no CORS header at all."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in origins or origin in origins)
        if request.method == "OPTIONS" and allowed and request.headers.get("Access-Control-Request-Method"):
            resp = web.Response(status=204)
        else:
            resp = await handler(request)
        if allowed:
            resp.headers.update({"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                                 "Access-Control-Allow-Headers": "Authorization, Content-Type",
                                 "Access-Control-Allow-Methods": "GET, POST, OPTIONS"})
        return resp
    return middleware


class UpstreamFailed(Exception):
    """Rank 0 could not be reached or failed before answering. `evidence` when
    the failure itself says the generation is broken (no connection, a cut
    stream, a stall), rather than an answer like 503 while draining;
    `in_flight` when rank 0 had taken the request when it failed."""

    def __init__(self, message: str, evidence: bool = True, in_flight: bool = True):
        super().__init__(message)
        self.evidence = evidence
        self.in_flight = in_flight


def answered_failure(status: int, body: bytes) -> UpstreamFailed:
    """Rank 0 answered 5xx: `generation_failed` means a rank died under this request; anything else
    (loading, draining) means it never took it."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    died = code == "generation_failed"
    return UpstreamFailed(f"rank 0 answered {status}" + (f" ({code})" if code else ""), evidence=died, in_flight=died)


def upstream_failure(e: UpstreamError) -> UpstreamFailed:
    """No answer from rank 0, as the proxy judges it: a refused connection never reached it; anything
    later cut a request it had taken."""
    return UpstreamFailed(str(e), in_flight=e.sent)


class Proxy:
    def __init__(self, cfg: MeshConfig, fleet: FleetView, metrics: ProxyMetrics):
        self.cfg = cfg
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
        self.rank0 = Upstream()  # connections to rank 0
        self.last_request_at = time.monotonic()  # when the last request ended (or the last probe ran)
        self.quarantine: dict[str, float] = {}  # request digest -> refused until
        self.served_generation = -1
        self.probed_generation = -1
        self.admitted = 0  # requests admitted since start (a probe that overlapped one is not judged)

    @staticmethod
    def _load_keys(path: Path | None) -> list[str]:
        if path is None:
            return []
        return [k.strip() for k in path.read_text().splitlines() if k.strip() and not k.startswith("#")]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[cors(self.cfg.proxy.cors_origins), json_errors],
                              client_max_size=self.cfg.proxy.max_body_bytes)
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
        self.rank0.close()

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
            return self._unavailable(self._why_unavailable())
        return web.json_response({"status": "ok", "generation": s.generation})

    def _unavailable(self, why: str) -> web.Response:
        return json_error(503, why, code="mesh_unavailable", type_="server_error",
                          headers={"Retry-After": RETRY_AFTER})

    async def _wait_serving(self, after: int, deadline: float) -> Serving | None:
        """The generation to send to: ready and newer than `after`. None when
        the fleet is down, failed, or not back before the deadline."""
        def usable(s: Serving) -> bool:
            return (s.ready and s.generation > after) or s.phase in (Phase.FAILED, Phase.STOPPED, Phase.DRAINING)
        s = await self.fleet.wait_serving(usable, max(0.0, deadline - time.monotonic()))
        return s if s.ready and s.generation > after else None

    def _why_unavailable(self) -> str:
        s = self.fleet.serving()
        if s.phase == Phase.FAILED:
            return f"The mesh has failed and waits for an operator: {s.reason}"
        if s.phase in (Phase.STOPPED, Phase.DRAINING):
            return "The mesh is not running; start it with `meshctl up`"
        why = f": {s.reason}" if s.reason else ""
        return f"The mesh is {s.phase} (generation {s.generation}){why} and did not come back in time; retry shortly"

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
            if status != 200 or self.cfg.proxy.access_log:  # metrics count them all; the log has what failed
                log.info("request", route=route, status=status, generation=self.fleet.serving().generation,
                         seconds=round(time.monotonic() - t0, 4))

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        if not self._authorized(request):
            return self._unauthorized()
        body = await read_json(request)
        req = oa.parse_request(kind, body, self.limits)
        if self.quarantine and self.quarantine.get(request_digest(request.path, body), 0) > time.monotonic():
            return self._quarantined()
        p = self.cfg.proxy
        t0 = time.monotonic()
        deadline = t0 + p.queue_wait
        try:
            self.metrics.queue_depth.set(self.admission.depth + 1)
            await self.admission.acquire(timeout=p.queue_wait)
        except QueueFull:
            return json_error(429, f"The proxy queue is full ({p.queue_limit} waiting); retry later",
                              code="queue_full", type_="rate_limit_error", headers={"Retry-After": RETRY_AFTER})
        except asyncio.TimeoutError:
            return self._unavailable(f"No slot freed within {p.queue_wait:.0f}s; retry later")
        finally:
            self.metrics.queue_depth.set(self.admission.depth)
        self.metrics.queue_wait.observe(time.monotonic() - t0)
        self.metrics.in_flight.inc()
        self.admitted += 1
        try:
            return await _Exchange(self, request, req, body, deadline).run()
        finally:
            self.metrics.in_flight.dec()
            self.admission.release()
            self.last_request_at = time.monotonic()

    def _quarantined(self) -> web.Response:
        p = self.cfg.proxy
        return json_error(502, f"This request was in flight when {p.poison_after} generations of the mesh died; it is "
                               f"quarantined for {p.quarantine_seconds:.0f}s in case it is what kills them. Change "
                               "it, or tell the operator (meshctl events)", code="request_quarantined",
                          type_="server_error")

    async def served(self, g: int) -> None:
        """Tell the controller once per generation that it answers requests (its incident's last step)."""
        if g != self.served_generation:
            self.served_generation = g
            await self.fleet.report(Observation(g, "served"))

    # --- the idle probe ---------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self._maybe_probe()

    async def _maybe_probe(self) -> None:
        """When no request has run for a while, ask the mesh for one token. Only runtimes without a
        status file: meshd-rank's idle ranks move their progress at every liveness exchange, which the
        agents watch, and a probe's latency would only measure the engine's speed."""
        p = self.cfg.proxy
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
                async with self.rank0.post(s.rank0_url + "/v1/chat/completions", body, s.rank0_auth) as r:
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


async def sse_blocks(content: Answer, idle: float, on_idle):
    """An SSE stream's complete lines (bytes, without their newline, whatever their length), a list per
    read; `on_idle()` every `idle` seconds nothing arrives, from a watchdog beside the read, so a read is
    never cancelled (no line is cut in two) and costs no timer of its own. An exception `on_idle` raises
    ends the stream with it."""
    last = time.monotonic()

    async def watchdog() -> None:
        due = last + idle
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if time.monotonic() - last < idle:  # something arrived meanwhile
                due = last + idle
                continue
            try:
                await on_idle()
            except Exception as e:  # handed to the reader, which raises it
                content.set_exception(e)
                return
            due = time.monotonic() + idle

    watcher = asyncio.ensure_future(watchdog())
    buf = b""
    try:
        while True:
            data = await content.readany()
            if not data:
                if buf:
                    yield [buf]
                return
            last = time.monotonic()
            buf += data
            if b"\n" in data:
                *lines, buf = buf.split(b"\n")
                yield lines
    finally:
        watcher.cancel()


class _Exchange:
    """One client request through one or more upstream attempts.

    A stream cut by its generation's death after data reached the client is
    resumed on the next generation (up to `migration_limit` times): rank 0
    reports the token ids behind each chunk in SSE comments, the proxy keeps
    what it delivered and sends the same request with those ids to continue
    from; the client sees one stream, kept open by keep-alive comments while
    the mesh recovers."""

    def __init__(self, proxy: Proxy, request: web.Request, req: oa.CompletionRequest, body: dict, deadline: float):
        self.p, self.request, self.req, self.deadline = proxy, request, req, deadline
        self.body = rank0_body(proxy.cfg.runtime.profile, {**body, "model": proxy.limits.model_name})
        self.client_body = body  # as the client sent it: what a quarantine recognises
        self.killed: list[int] = []  # generations that died with this request in flight
        p = proxy.cfg.proxy
        self.window = stall_window(p, proxy.cfg.runtime.profile, prompt_chars(req), req.params.max_tokens, req.stream)
        self.upstream = ""
        self.auth: dict[str, str] = {}
        self.resp: web.StreamResponse | None = None  # prepared once anything reached the client
        self.sent_data = False
        self.t0 = time.monotonic()
        self.last_chunk: float | None = None
        # What the client has of the answer, for a resumption: its id, created and seed (rank 0's first
        # comment), the token ids and characters of the chunks forwarded, whether its end went out.
        self.answer: dict | None = None
        self.delivered: list[int] = []
        self.chars = 0
        self.unconfirmed: tuple[int, list[int]] | None = None  # an ids comment whose chunk is not forwarded yet
        self.ended = False
        self.migrations = 0

    async def run(self) -> web.StreamResponse:
        after = -1
        while True:
            serving = await self._next_generation(after)
            if serving is None:
                return await self._give_up(self.p._why_unavailable())
            g = serving.generation
            self.upstream = serving.rank0_url + self.request.path
            self.auth = serving.rank0_auth
            try:
                resp = await (self._stream(g) if self.req.stream else self._whole(g))
            except UpstreamFailed as e:
                log.warning("upstream failed", generation=g, reason=str(e), evidence=e.evidence,
                            client_has_data=self.sent_data)
                if e.evidence:
                    await self._report(g, str(e))
                if e.evidence and e.in_flight:
                    self.killed.append(g)
                if len(self.killed) >= self.p.cfg.proxy.poison_after:
                    return await self._quarantine()
                if self.sent_data:
                    if self.ended:  # only the stream's last bytes were lost
                        return await self._finish()
                    if self.answer is None or self.migrations >= self.p.cfg.proxy.migration_limit:
                        return await self._end_stream_with_error(
                            f"The mesh failed mid-answer ({e}); retry the request")
                    self.migrations += 1
                    self.p.metrics.migrations.inc()
                    await self.p.fleet.report(Observation(g, "migrated"))
                else:
                    self.p.metrics.retries.inc()
                after = g
                self.deadline = time.monotonic() + self.p.cfg.proxy.queue_wait
                continue
            if resp.status == 200:
                await self.p.served(g)
            return resp

    async def _next_generation(self, after: int) -> Serving | None:
        """Wait for a generation newer than `after`; a client already streaming gets keep-alives."""
        while True:
            step = min(self.deadline, time.monotonic() + self.p.cfg.proxy.keepalive_interval) \
                if self.resp is not None else self.deadline
            serving = await self.p._wait_serving(after, step)
            phase = self.p.fleet.serving().phase
            if serving is not None or self.resp is None or time.monotonic() >= self.deadline \
                    or phase in (Phase.FAILED, Phase.STOPPED, Phase.DRAINING):
                return serving
            await self.resp.write(b": keep-alive\n\n")

    async def _quarantine(self) -> web.StreamResponse:
        digest = request_digest(self.request.path, self.client_body)
        self.p.quarantine[digest] = time.monotonic() + self.p.cfg.proxy.quarantine_seconds
        log.warning("request quarantined", generations=self.killed, digest=digest[:16])
        if self.resp is None:
            return self.p._quarantined()
        return await self._end_stream_with_error(
            f"This request was in flight when generations {self.killed} died; it is quarantined")

    async def _report(self, g: int, detail: str) -> None:
        await self.p.fleet.report(Observation(g, "proxy", detail))

    async def _give_up(self, why: str) -> web.StreamResponse:
        if self.resp is None:
            return self.p._unavailable(why)
        return await self._end_stream_with_error(why)

    async def _whole(self, g: int) -> web.Response:
        try:
            async with asyncio.timeout(self.window) if self.window else contextlib.nullcontext():
                async with self.p.rank0.post(self.upstream, self.body, self.auth) as r:
                    data = await r.read()
        except TimeoutError:
            raise UpstreamFailed(f"no answer within {self.window:.0f}s")
        except UpstreamError as e:
            raise upstream_failure(e)
        if r.status >= 500:
            raise answered_failure(r.status, data)
        if r.status == 200 and (m := COMPLETION_TOKENS.search(data)):
            self.p.metrics.tokens.inc(int(m.group(1)))
        return web.Response(body=data, status=r.status, content_type="application/json")

    async def _prepare(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                    "X-Accel-Buffering": "no"})
            self.resp.enable_chunked_encoding()
            await self.resp.prepare(self.request)
        return self.resp

    def _stream_body(self) -> dict:
        """What rank 0 gets: asked for the token ids of each chunk, and told where to resume from."""
        meshd = {"ids": True}
        if self.answer is not None and self.sent_data:
            meshd["resume"] = {"ids": self.delivered, "chars": self.chars, **self.answer}
        return {**self.body, "meshd": meshd}

    async def _stream(self, g: int) -> web.StreamResponse:
        silent_since = time.monotonic()

        async def idle() -> None:
            if self.window is not None and time.monotonic() - silent_since > self.window:
                raise UpstreamFailed(f"no token for {self.window:.0f}s")
            await (await self._prepare()).write(b": keep-alive\n\n")

        body = self._stream_body() if self.p.cfg.runtime.profile == "meshd-rank" else self.body
        try:
            async with self.p.rank0.post(self.upstream, body, self.auth) as r:
                if r.status >= 500:
                    raise answered_failure(r.status, await r.read())
                if r.status != 200:
                    if self.resp is None:
                        return web.Response(body=await r.read(), status=r.status, content_type="application/json")
                    return await self._end_stream_with_error(f"rank 0 refused to resume the answer ({r.status})")
                async for lines in sse_blocks(r, self.p.cfg.proxy.keepalive_interval, idle):
                    out, confirmed, end = self._relay(lines)
                    if out:
                        silent_since = time.monotonic()
                        await (await self._prepare()).write(out)
                        if confirmed is not None:  # the chunks those ids belong to are with the client now
                            self.chars, ids = confirmed
                            self.delivered += ids
                    if end == b"[DONE]":
                        await self.resp.write_eof()
                        return self.resp
                    if end:
                        raise answered_failure(503, end)
                raise UpstreamFailed("rank 0 closed the stream before [DONE]")
        except UpstreamError as e:
            raise upstream_failure(e)

    def _relay(self, lines: list[bytes]) -> tuple[bytes, tuple[int, list[int]] | None, bytes]:
        """What one read of rank 0's stream sends the client: its data lines, as bytes for one write;
        the last (chars, ids) behind them, to count as delivered once written; and how it ended, if it
        did: b"[DONE]", or rank 0's own error event (what came before it goes out first)."""
        out: list[bytes] = []
        confirmed: tuple[int, list[int]] | None = None
        ids: list[int] = []
        texts = 0
        end = b""
        for line in lines:
            if line.startswith(b": "):
                if line.startswith(b": ids "):
                    chars, _, given = line[6:].strip().partition(b" ")
                    self.unconfirmed = (int(chars), [int(t) for t in given.split(b",") if t])
                elif line.startswith(b": meshd ") and self.answer is None:
                    self.answer = json.loads(line[8:])
                continue
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload.startswith(b'{"error"'):
                end = payload
                break
            if payload.startswith(b"[DONE]"):
                end = b"[DONE]"
            else:
                self.sent_data = True
                texts += TEXT_FIELD.search(payload) is not None
                self.ended |= FINISHED.search(payload) is not None
            out.append(line.rstrip(b"\r") + b"\n\n")
            if self.unconfirmed is not None:
                chars, more = self.unconfirmed
                ids += more
                confirmed = (chars, ids)
                self.unconfirmed = None
            if end:
                break
        if texts:  # the chunks of one read arrived together: the first after its gap, the rest at once
            now = time.monotonic()
            if self.last_chunk is None:
                self.p.metrics.ttft.observe(now - self.t0)
            else:
                self.p.metrics.inter_token.observe(now - self.last_chunk)
            for _ in range(texts - 1):
                self.p.metrics.inter_token.observe(0.0)
            self.last_chunk = now
            self.p.metrics.tokens.inc(texts)
        return b"".join(out), confirmed, end

    async def _finish(self) -> web.StreamResponse:
        resp = await self._prepare()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _end_stream_with_error(self, message: str) -> web.StreamResponse:
        resp = await self._prepare()
        err = error_body(message, "server_error", None, "mesh_failed")
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        return await self._finish()
