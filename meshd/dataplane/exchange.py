"""One client request through one or more upstream attempts.

An exchange knows the proxy only through a `Gate`: the rank 0 to send to (waited
for), what to tell the fleet, the settings and the metrics. Each attempt goes
to the `Rank0` the gate hands it, which may be another mesh's (routing.py).

- Holds the request while the fleet starts or recovers, up to `queue_wait`,
  then 503 with Retry-After; a client already streaming gets keep-alives.
- Retries a request whose upstream failed before any data reached the client
  on the next generation; an attempt is cut as soon as its mesh says its
  generation died. A stream cut after data is resumed on the next
  generation, or on another mesh with the same weights (up to `migration_limit`
  times): rank 0 reports the token ids behind each chunk in SSE comments, the
  exchange keeps what it delivered and
  sends the same request with those ids to continue from, and the client sees
  one stream (an SSE comment names the mesh and generation it resumes on).
  Past that, the stream ends with an SSE error event and `data: [DONE]`.
- A request that was in flight when `poison_after` generations of one mesh died is refused
  with 502 (and so is the same request for a while after): it may be what kills them. Deaths on
  several meshes are not added up: unrelated faults of two meshes say nothing of the request.
- Passes on rank 0's `: prefill` comments (a long prefill's progress), which count as life for the stall
  window; sends SSE keep-alive comments while rank 0 is silent; a client that goes away closes the
  upstream request, which cancels it on every rank.
- Measures time to first token, inter-token latency and tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from aiohttp import web

from common import openai_api as oa
from common.errors import error_body
from common.http import json_error
from common.states import Profile
from meshd.config import Proxy as ProxyConfig
from meshd.metrics import ProxyMetrics
from meshd.seam import Observation
from meshd.upstream import Rank0Request, Upstream, UpstreamError
from meshd.dataplane.sse import sse_blocks

RETRY_AFTER = "5"
# A chunk carries text when its "content" (chat) or "text" (completions) is a
# non-empty string. Matching bytes spares decoding every chunk of every stream.
TEXT_FIELD = re.compile(rb'"(?:content|text)":\s?"(?!")')
FINISHED = re.compile(rb'"finish_reason":\s?"')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s?(\d+)')
DRAFT_TOKENS = re.compile(rb'"draft_tokens":\s?\{"proposed":\s?(\d+),\s?"accepted":\s?(\d+)\}')  # a usage's drafts
log = structlog.get_logger("meshd.proxy")


@dataclass(frozen=True)
class Rank0:
    """Where one attempt goes: a generation's rank 0 of mesh `mesh`, over the proxy's connections to it.
    It serves `model` with runtime `profile`; `window`: how long it may stay silent (None: the agents
    judge)."""

    mesh: str
    generation: int
    url: str
    model: str
    profile: str
    window: float | None
    auth: dict[str, str] = field(repr=False)
    connections: Upstream = field(repr=False)
    fingerprint: str = ""  # of the weights the generation serves ("" unknown): where a cut stream may go on

    @property
    def resumable(self) -> bool:
        """meshd-rank reports the token ids behind each chunk, which a resumption needs."""
        return self.profile == Profile.MESHD_RANK

    @property
    def headers(self) -> dict[str, str]:
        """What the client is told of who wrote its answer (a resumed stream names the next in a comment)."""
        return {"X-Meshd-Model": self.model, "X-Meshd-Mesh": self.mesh, "X-Meshd-Generation": str(self.generation)}

    def post(self, request: Rank0Request):
        return self.connections.post(self.url + request.path, request.body(self.profile, self.model), self.auth)


class Gate(Protocol):
    """What an exchange needs of the proxy it runs in."""

    settings: ProxyConfig
    metrics: ProxyMetrics

    async def rank0(self, after: Rank0 | None, deadline: float) -> Rank0 | None:
        """Where the next attempt goes, never to `after` (the attempt that failed) again: a serving
        generation's rank 0; None when nothing serves and none comes by waiting, or none by `deadline`
        (a monotonic time). QueueFull when no mesh has room for a request that holds none yet."""

    def hopeless(self) -> bool:
        """No generation comes by waiting: the fleet failed, stopped or drains."""

    def why_unavailable(self) -> str:
        """What a client is told when no generation serves it."""

    async def report(self, observation: Observation) -> None:
        """Tell the fleet what this exchange saw."""

    async def lost(self, rank0: Rank0) -> str:
        """Return once rank 0's mesh says its generation died (it recovers from it, or failed) or ends on
        purpose with its streams cut: "cut" for that (no evidence against it), "" for a death. A generation
        that ends on purpose and lets its requests finish ("drain") is never lost."""

    async def served(self, generation: int) -> None:
        """The last attempt's generation answered the request."""

    def quarantine(self, digest: str) -> None:
        """Refuse the request with this digest for a while: it was in flight as generations died."""

    def ended_on_purpose(self, rank0: Rank0) -> bool:
        """Whether rank 0's mesh said its generation ends on purpose (a restart or recycle, drained or cut):
        its end is no evidence against a request, even when a drain outlasted its grace killed it."""


def poisoning(killed: list[tuple[str, int]], poison_after: int) -> tuple[str, list[int]] | None:
    """The mesh whose generations died with the request in flight `poison_after` times, and those
    generations (the first such mesh), or None: only one mesh's repeated deaths are evidence against it."""
    by_mesh: dict[str, list[int]] = {}
    for mesh, generation in killed:
        (died := by_mesh.setdefault(mesh, [])).append(generation)
        if len(died) >= poison_after:
            return mesh, died
    return None


def request_digest(path: str, body: dict) -> str:
    return hashlib.sha256(path.encode() + json.dumps(body, sort_keys=True).encode()).hexdigest()


def unavailable(why: str) -> web.Response:
    return json_error(503, why, code="mesh_unavailable", type_="server_error", headers={"Retry-After": RETRY_AFTER})


def quarantined(p: ProxyConfig) -> web.Response:
    return json_error(502, f"This request was in flight when {p.poison_after} generations of the mesh died; it is "
                           f"quarantined for {p.quarantine_seconds:.0f}s in case it is what kills them. Change "
                           "it, or tell the operator (meshctl events)", code="request_quarantined",
                      type_="server_error")


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


class Exchange:
    """`to_rank0` is what rank 0 is asked (its "model" set by each attempt's `Rank0`, a resumption added to it),
    its fields what the client sent (what a quarantine recognises)."""

    def __init__(self, gate: Gate, request: web.Request, req: oa.CompletionRequest, to_rank0: Rank0Request,
                 deadline: float):
        self.gate, self.request, self.req, self.deadline = gate, request, req, deadline
        self.to_rank0, self.client_body = to_rank0, to_rank0.fields
        self.headers: dict[str, str] = {}  # the attempt's, for the response
        self.killed: list[tuple[str, int]] = []  # the meshes and generations that died with it in flight
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
        self.usage = b""  # the usage rank 0 said at the end of its stream (its `: usage` comment)

    async def run(self) -> web.StreamResponse:
        p = self.gate.settings
        after: Rank0 | None = None
        while True:
            rank0 = await self._next_rank0(after)
            if rank0 is None:
                return await self._give_up(self.gate.why_unavailable())
            g = rank0.generation
            self.headers = rank0.headers
            if self.resp is not None:  # the client hears where its answer goes on (clients skip comments)
                await self.resp.write(f": resuming on mesh {rank0.mesh}, generation {g}\n\n".encode())
            try:
                resp = await (self._stream(rank0) if self.req.stream else self._whole(rank0))
            except UpstreamFailed as e:
                log.warning("upstream failed", generation=g, reason=str(e), evidence=e.evidence,
                            client_has_data=self.sent_data)
                if e.evidence:
                    await self.gate.report(Observation(g, "proxy", str(e)))
                if e.evidence and e.in_flight and not self.gate.ended_on_purpose(rank0):
                    self.killed.append((rank0.mesh, g))
                if poisoned := poisoning(self.killed, p.poison_after):
                    return await self._quarantine(*poisoned)
                if self.sent_data:
                    if self.ended:  # only the stream's last bytes were lost
                        return await self._finish()
                    if self.answer is None or self.migrations >= p.migration_limit:
                        return await self._end_stream_with_error(
                            f"The mesh failed mid-answer ({e}); retry the request")
                    self.migrations += 1
                    self.gate.metrics.migrations.inc()
                    await self.gate.report(Observation(g, "migrated"))
                else:
                    self.gate.metrics.retries.inc()
                after = rank0
                self.deadline = time.monotonic() + p.queue_wait
                continue
            if resp.status == 200:
                await self.gate.served(g)
            return resp

    async def _next_rank0(self, after: Rank0 | None) -> Rank0 | None:
        """Wait for somewhere to send to other than `after`; a client already streaming gets keep-alives."""
        while True:
            step = min(self.deadline, time.monotonic() + self.gate.settings.keepalive_interval) \
                if self.resp is not None else self.deadline
            rank0 = await self.gate.rank0(after, step)
            if rank0 is not None or self.resp is None or time.monotonic() >= self.deadline or self.gate.hopeless():
                return rank0
            await self.resp.write(b": keep-alive\n\n")

    async def _quarantine(self, mesh: str, generations: list[int]) -> web.StreamResponse:
        digest = request_digest(self.request.path, self.client_body)
        self.gate.quarantine(digest)
        log.warning("request quarantined", mesh=mesh, generations=generations, digest=digest[:16])
        if self.resp is None:
            return quarantined(self.gate.settings)
        return await self._end_stream_with_error(
            f"This request was in flight when generations {generations} of mesh {mesh} died; it is quarantined "
            f"for {self.gate.settings.quarantine_seconds:.0f}s in case it is what kills them")

    async def _give_up(self, why: str) -> web.StreamResponse:
        if self.resp is None:
            return unavailable(why)
        return await self._end_stream_with_error(why)

    async def _whole(self, rank0: Rank0) -> web.Response:
        try:
            async with asyncio.timeout(rank0.window) if rank0.window else contextlib.nullcontext():
                async with self._attempt(rank0, self.to_rank0) as r:
                    data = await r.read()
        except TimeoutError:
            raise UpstreamFailed(f"no answer within {rank0.window:.0f}s")
        except UpstreamError as e:
            raise upstream_failure(e)
        if r.status >= 500:
            raise answered_failure(r.status, data)
        if r.status == 200 and (m := COMPLETION_TOKENS.search(data)):
            self.gate.metrics.tokens.inc(int(m.group(1)))
        if r.status == 200:
            self._count_drafts(rank0.model, data)
        return web.Response(body=data, status=r.status, content_type="application/json", headers=self.headers)

    @contextlib.asynccontextmanager
    async def _attempt(self, rank0: Rank0, to_rank0: Rank0Request):
        """rank 0's answer to `body`, cut (its next read raises UpstreamFailed) once its mesh says the
        generation died (a rank 0 whose peer died may wait out the stop ladder before its stream breaks), or
        that it ends on purpose with its streams cut."""
        async def cut_when_lost() -> None:
            if await self.gate.lost(rank0) == "cut":
                r.set_exception(UpstreamFailed(f"mesh {rank0.mesh} restarts generation {rank0.generation} on purpose "
                                               "(recovery.planned_restart = \"cut\")", evidence=False))
            else:
                r.set_exception(UpstreamFailed(f"mesh {rank0.mesh} says generation {rank0.generation} died"))

        async with rank0.post(to_rank0) as r:
            watch = asyncio.ensure_future(cut_when_lost())
            try:
                yield r
            finally:
                watch.cancel()

    async def _prepare(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                    "X-Accel-Buffering": "no", **self.headers})
            self.resp.enable_chunked_encoding()
            await self.resp.prepare(self.request)
        return self.resp

    async def _stream(self, rank0: Rank0) -> web.StreamResponse:
        silent_since = time.monotonic()

        async def idle() -> None:
            if rank0.window is not None and time.monotonic() - silent_since > rank0.window:
                raise UpstreamFailed(f"no token for {rank0.window:.0f}s")
            await (await self._prepare()).write(b": keep-alive\n\n")

        to_rank0 = self.to_rank0  # told where to resume from, once the client has part of the answer
        if self.answer is not None and self.sent_data:
            a = self.answer
            to_rank0 = to_rank0.resuming(oa.Resume(tuple(self.delivered), self.chars, a["id"], a["created"], a["seed"]))
        try:
            async with self._attempt(rank0, to_rank0) as r:
                if r.status >= 500:
                    raise answered_failure(r.status, await r.read())
                if r.status != 200:
                    if self.resp is None:
                        return web.Response(body=await r.read(), status=r.status, content_type="application/json",
                                            headers=self.headers)
                    return await self._end_stream_with_error(f"rank 0 refused to resume the answer ({r.status})")
                async for lines in sse_blocks(r, self.gate.settings.keepalive_interval, idle):
                    out, confirmed, end = self._relay(lines)
                    if out:
                        silent_since = time.monotonic()
                        await (await self._prepare()).write(out)
                        if confirmed is not None:  # the chunks those ids belong to are with the client now
                            self.chars, ids = confirmed
                            self.delivered += ids
                    if end == b"[DONE]":
                        self._count_drafts(rank0.model, self.usage)
                        await self.resp.write_eof()
                        return self.resp
                    if end:
                        raise answered_failure(503, end)
                raise UpstreamFailed("rank 0 closed the stream before [DONE]")
        except UpstreamError as e:
            raise upstream_failure(e)

    def _relay(self, lines: list[bytes]) -> tuple[bytes, tuple[int, list[int]] | None, bytes]:
        """What one read of rank 0's stream sends the client: its data lines and `: prefill` comments, as
        bytes for one write; the last (chars, ids) behind them, to count as delivered once written; and how it
        ended, if it did: b"[DONE]", or rank 0's own error event (what came before it goes out first)."""
        out: list[bytes] = []
        confirmed: tuple[int, list[int]] | None = None
        ids: list[int] = []
        texts = 0
        end = b""
        for line in lines:
            if line.startswith(b": prefill "):
                out.append(line.rstrip(b"\r") + b"\n\n")
                continue
            if line.startswith(b": "):
                if line.startswith(b": ids "):
                    chars, _, given = line[6:].strip().partition(b" ")
                    self.unconfirmed = (int(chars), [int(t) for t in given.split(b",") if t])
                elif line.startswith(b": usage "):
                    self.usage = line
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
            metrics = self.gate.metrics
            now = time.monotonic()
            if self.last_chunk is None:
                metrics.ttft.observe(now - self.t0)
            else:
                metrics.inter_token.observe(now - self.last_chunk)
            for _ in range(texts - 1):
                metrics.inter_token.observe(0.0)
            self.last_chunk = now
            metrics.tokens.inc(texts)
        return b"".join(out), confirmed, end

    def _count_drafts(self, model: str, usage: bytes) -> None:
        """The drafts an answer's usage says (none when its mesh did not draft it), counted by its model."""
        if m := DRAFT_TOKENS.search(usage):
            self.gate.metrics.drafted(model, int(m.group(1)), int(m.group(2)))

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
