"""Rank 0's HTTP frontend: the OpenAI API, readiness and drain routes.

It runs an aiohttp server on its own thread and event loop. Requests are
validated and tokenized here, then handed to the lockstep loop as runtime/engine/jobs.py's
messages through `collect()` (called by the loop, on the main thread); the loop
hands each request's answer back through `started()` / `emit()` / `fail()`, which
reach the request's handler as `Answered` events. Nothing here touches MLX.
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from aiohttp import web

from common import openai_api as oa
from common.errors import ApiError, error_body
from common.grammars import GrammarError
from common.prefills import Progress
from common.http import Listener, bearer_matches, json_error, json_errors, read_json
from runtime.engine import grammar
from runtime.engine.jobs import Emission, Job
from runtime.lockstep import Cancel, Drain, DrainMode, Insert, Message


class FrontendPhase(StrEnum):
    """Rank 0's doors: shut while the model loads and warms up, open, then shut again for good."""

    LOADING = "loading"
    ADMITTING = "admitting"
    DRAINING = "draining"


WARMUP = "meshd-warmup"  # the readiness generation's request id


@dataclass(frozen=True)
class Started:
    """The ranks took the request, `cached` tokens of its prompt from the cache."""

    cached: int


@dataclass(frozen=True)
class Failed:
    """The request ends with an error (`code`: `generation_failed` or `draining`, see `Frontend.fail`)."""

    message: str
    code: str


# what the loop hands a request's handler: its start, each token, a failure, its long prefill's progress
Answered = Started | Emission | Failed | Progress


@dataclass
class Pending:
    """Where the loop's events for one answer go: its request's queue, each event with the answer's `row` (its
    index among the request's `n`)."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    row: int = 0

    def put(self, event: Answered) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.row, event))


class Frontend:
    def __init__(self, tokenizer, limits: oa.Limits, *, generation: int, context_length: int,
                 host: str, port: int, drain_deadline: float = 30.0, max_body_bytes: int = 4 << 20,
                 secret: str = ""):
        self.tokenizer = tokenizer
        self.limits = limits
        self.generation = generation
        self.weights_fingerprint = ""  # of the weights the ranks loaded, said with readiness (set after the load)
        self.context_length = context_length
        self.host, self.port = host, port
        self.drain_deadline = drain_deadline
        self.max_body_bytes = max_body_bytes
        self.secret = secret  # every route wants it as a bearer token, when set
        self.phase = FrontendPhase.LOADING
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._drain_started: float | None = None
        self._drain_escalated = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._eos = set(tokenizer.eos_token_ids)

    # --- lifecycle (main thread) ---------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._serve())
            except BaseException as e:  # reported to the caller of start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="frontend", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors, self._auth], client_max_size=self.max_body_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
        app.router.add_get("/internal/ready", self._ready)
        app.router.add_post("/internal/drain", self._drain)
        return app

    async def _serve(self) -> None:
        self._listener = Listener(self.app())
        await self._listener.start(self.host, self.port)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.secret and not bearer_matches(request, self.secret):
            return json_error(401, "Missing or wrong rank secret: rank 0 answers only its controller and proxy; "
                                   "send requests through the proxy", code="unauthorized")
        return await handler(request)

    def stop(self) -> None:
        if self._loop is None or self._listener is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._listener.cleanup(), self._loop)
        try:
            fut.result(timeout=5)
        except Exception:  # shutting down anyway; the process exits next
            pass

    # --- the loop's side (main thread) ----------------------------------------
    def warm_up(self, prompt: list[int]) -> None:
        """Armed: before admitting anyone, prove the engine works with a real one-token generation
        through the lockstep loop on every rank; `emit` opens the doors when it finishes."""
        self._inbox.put(Insert(Job(WARMUP, tuple(prompt), 1, 0, oa.SamplingParams(max_tokens=1).sampling())))

    def begin_drain(self, mode: DrainMode) -> None:
        with self._lock:
            first = self.phase != FrontendPhase.DRAINING
            self.phase = FrontendPhase.DRAINING
            if first:
                self._drain_started = time.monotonic()
        self._inbox.put(Drain(mode))

    def collect(self, block: bool, timeout: float = 1.0) -> list[Message]:
        """Messages for the next exchange. Blocks up to `timeout` when idle,
        which paces the idle liveness collective."""
        out = []
        try:
            out.append(self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        if (self._drain_started is not None and not self._drain_escalated
                and time.monotonic() - self._drain_started > self.drain_deadline):
            self._drain_escalated = True
            out.append(Drain(DrainMode.CANCEL))
        return out

    def _pending_for(self, rid: str) -> Pending | None:
        with self._lock:
            return self._pending.get(rid)

    def started(self, rid: str, cached: int) -> None:
        if (p := self._pending_for(rid)) is not None:
            p.put(Started(cached))

    def prefilled(self, said: list[Progress]) -> None:
        """Long prefills' progress, to their streams (common/prefills.py says when)."""
        for progress in said:
            if (p := self._pending_for(progress.rid)) is not None:
                p.put(progress)

    def emit(self, emissions: list[Emission]) -> None:
        for e in emissions:
            if e.rid == WARMUP and e.finish_reason is not None:
                with self._lock:
                    if self.phase == FrontendPhase.LOADING:
                        self.phase = FrontendPhase.ADMITTING
            elif (p := self._pending_for(e.rid)) is not None:
                p.put(e)

    def fail(self, rid: str, message: str, code: str = "generation_failed") -> None:
        """End a request with an error: `generation_failed` (a rank died under it) or `draining`
        (the generation is leaving and cancelled it; nothing is broken)."""
        if (p := self._pending_for(rid)) is not None:
            p.put(Failed(message, code))

    def fail_all(self, message: str, flush: float = 1.0) -> None:
        """End every request with an error and wait (up to `flush` seconds) until their answers
        went out: the process exits next, and a cut connection says less than an error."""
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self.fail(rid, message)
        deadline = time.monotonic() + flush
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)

    # --- HTTP (frontend thread) ------------------------------------------------
    async def _ready(self, request: web.Request) -> web.Response:
        body = {"ready": self.phase == FrontendPhase.ADMITTING, "phase": self.phase, "generation": self.generation,
                "weights_fingerprint": self.weights_fingerprint}
        return web.json_response(body, status=200 if self.phase == FrontendPhase.ADMITTING else 503)

    async def _drain(self, request: web.Request) -> web.Response:
        body = await read_json(request) if request.can_read_body else {}
        raw = body.get("mode", DrainMode.FINISH) if isinstance(body, dict) else None
        try:
            mode = DrainMode(raw)
        except ValueError:
            raise ApiError(400, f"'mode' must be {' or '.join(repr(str(m)) for m in DrainMode)}, got {raw!r}",
                           param="mode") from None
        self.begin_drain(mode)
        return web.json_response({"draining": True, "mode": mode, "generation": self.generation}, status=202)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(oa.models_body(self.limits.model_name))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def _text(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "text")

    def _unavailable(self) -> web.Response:
        why = "loading the model" if self.phase == FrontendPhase.LOADING else "draining"
        return json_error(503, f"Generation {self.generation} is {why} and admits no request; retry shortly",
                          code="unavailable", type_="server_error", headers={"Retry-After": "2"})

    def _tokenize(self, req: oa.CompletionRequest) -> list[int]:
        if req.kind == "chat":
            try:
                ids = self.tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True,
                                                         tools=list(req.tools) or None, **req.template_kwargs)
            except Exception as e:  # a template that rejects these messages is the caller's input
                raise ApiError(400, f"The chat template rejected these messages: {e}", param="messages")
            param = "messages"
        else:
            ids = self.tokenizer.encode(req.prompt)
            param = "prompt"
        room = self.context_length - (req.params.max_tokens if req.params.named else 1)
        if len(ids) > room:
            raise ApiError(
                400,
                f"The prompt is {len(ids)} tokens; with max_tokens={req.params.max_tokens} it exceeds "
                f"the context length of {self.context_length}. Shorten the {param} or lower max_tokens",
                param=param, code="context_length_exceeded")
        return list(ids)

    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        req = oa.parse_request(kind, await read_json(request), self.limits, internal=True, grammars=grammar.builder())
        if req.params.grammar:  # compiled in the grammar worker, off this loop (runtime/engine/grammar.py)
            try:
                await asyncio.wrap_future(grammar.prepare(req.params.grammar))
            except GrammarError as e:
                raise ApiError(400, f"'{req.params.held_by}' cannot hold an answer on this model: {e}. Leave that "
                                    "part out or rewrite it", param=req.params.held_by, code="invalid_value")
        if self.tokenizer.has_thinking and not req.thinking_off and (refused := oa.missing_reasoning(req)):
            raise refused
        if self.phase != FrontendPhase.ADMITTING:
            return self._unavailable()
        prompt = self._tokenize(req)
        resume = req.internal.resume
        done = len(resume.ids) if resume else 0
        rid = resume.id if resume else oa.new_id(kind)
        seed = resume.seed if resume else (req.params.seed if req.params.seed is not None else random.getrandbits(63))
        # n answers: n rows of the batch, each its own job with its own seed
        rows = [_Run(self, req, rid if req.n == 1 else f"{rid}-{i}", i, prompt) for i in range(req.n)]
        answer = _Answer(req, rid, seed, rows)
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.phase != FrontendPhase.ADMITTING:
                return self._unavailable()
            for row in rows:
                self._pending[row.rid] = Pending(loop, answer.events, row.index)
        # an answer whose length the client left open stops at the end of the context at the latest
        max_tokens = req.params.max_tokens if req.params.named else \
            min(req.params.max_tokens, self.context_length - len(prompt))
        if max_tokens > done:
            for row in rows:
                self._inbox.put(Insert(Job(row.rid, (*prompt, *(resume.ids if resume else ())), max_tokens - done,
                                           oa.row_seed(seed, row.index), req.params.sampling(), done,
                                           req.params.logprobs, req.internal.tenant, req.params.draft_tokens)))
        else:  # a resumed answer that had all its tokens: only its end was lost
            self._pending[rid].put(Emission(rid, None, "length"))
        try:
            return await (answer.stream(request) if req.stream else answer.whole())
        finally:
            with self._lock:
                for row in rows:
                    self._pending.pop(row.rid, None)
            for row in rows:
                if not row.engine_done:
                    self._inbox.put(Cancel(row.rid))


class _Run:
    """Turns one answer's token events into text, honouring stop strings: row `index` of its request, the job
    `rid` of the ranks. A resumed answer starts from the tokens and the text its client already has."""

    def __init__(self, fe: Frontend, req: oa.CompletionRequest, rid: str, index: int, prompt: list[int]):
        self.fe, self.req, self.rid, self.index = fe, req, rid, index
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        tok = fe.tokenizer
        self.thinking = oa.Thinking(tok.think_start, tok.think_end) if req.kind == "chat" and tok.has_thinking \
            else None
        # the template left a think block open: the answer starts in its reasoning
        self.reasoning_first = self.thinking is not None and tok.rfind_think_start(prompt) > tok.rfind_think_end(prompt)
        self.regions = (0, 0, 0)  # oa.answer_regions of the text so far
        # the markers around the model's tool calls, when the request offers tools and the model can call them
        self.tool_markers = (tok.tool_call_start, tok.tool_call_end) if req.tools and tok.has_tool_calling else None
        self.spans: list[tuple[int, int]] = []  # its closed tool calls in the text
        self.content_end = 0  # where the content stops: the end, or where a call opens that did not close
        self.calls: list[dict] = []  # parsed, as {name, arguments}
        self.cached = 0
        self.detok = fe.tokenizer.detokenizer
        resume = req.internal.resume
        for token in resume.ids if resume else ():
            self.detok.add_token(token)
        self.text = self.detok.text
        self.sent = resume.chars if resume else 0
        self.resumed = len(resume.ids) if resume else 0  # tokens of the answer its client already has
        self.generated = 0
        self.drafts: tuple[int, int] | None = None  # (proposed, accepted) so far, when a drafting engine answers
        self.created = resume.created if resume else int(time.time())
        self.unreported: list[int] = []  # token ids not yet reported with a chunk
        self.logprobs: list[oa.TokenLogprob] = []  # when the request asked for them
        self.logprobs_sent = 0  # how many of them went out with a chunk
        self.said = list(resume.ids) if resume else []  # the answer's tokens
        self.stuck: dict | None = None  # the error of an answer its grammar left no token (oa.grammar_stuck)
        self.finished = False  # the answer ended (length, EOS or a stop string)
        self.engine_done = False  # the ranks stopped working on it themselves

    def _advance(self, e: Emission) -> tuple[str, str, list[tuple[int, dict]], str | None]:
        """Feed one token; returns (new reasoning, new content to send, tool calls that closed with
        their indexes, finish reason). One cursor (`sent`) runs over the whole text; stop strings apply to
        the content alone, and a tool call's text is never content."""
        token, reason = e.token, e.finish_reason
        if e.cached is not None:
            self.cached = e.cached
        if e.drafts is not None:
            self.drafts = tuple(a + b for a, b in zip(self.drafts or (0, 0), e.drafts))
        if token is not None and not (reason == "stop" and token in self.fe._eos):
            self.generated += 1
            if e.logprob is not None:
                decode = self.fe.tokenizer.decode
                self.logprobs.append(oa.TokenLogprob(decode([token]), e.logprob, len(self.detok.text),
                                                     tuple((decode([t]), lp) for t, lp in e.top)))
            self.detok.add_token(token)
            self.unreported.append(token)
            self.said.append(token)
        self.engine_done = reason is not None
        if reason == "stop" and self.req.params.grammar and token in self.fe._eos:
            why = grammar.dead_end(self.req.params.grammar, self.prompt, self.said)
            if why is not None:
                reason = oa.GRAMMAR_STUCK
                self.stuck = oa.grammar_stuck(self.req, why, self.fe.tokenizer.decode(self.said))
        if reason is not None:
            self.detok.finalize()
        self.text = self.detok.text
        self.regions = r0, r1, c0 = oa.answer_regions(self.text, self.thinking, self.reasoning_first)
        stops = self.req.params.stop
        content = self.text[c0:]
        cut = oa.find_stop(content, stops) if stops else -1
        if cut >= 0:
            self.text, reason = self.text[:c0 + cut], "stop"
        if reason is not None:
            self.finished = True
            end = len(self.text)
        elif self.thinking and not self.reasoning_first and not self.text.strip():
            end = self.sent  # whitespace before a possible think block: content or not, it is not known yet
        else:
            end = len(self.text) - (oa.held_back(content, stops) if stops else 0)
        closed = []
        self.content_end = len(self.text)
        if self.tool_markers:
            start, stop = self.tool_markers
            self.spans, open_at = oa.tool_spans(self.text, start, stop, c0)
            if open_at is not None:  # a call being written (dropped if the answer ends inside it)
                end = self.content_end = min(end, open_at)
            elif reason is None:
                end -= oa.held_back(self.text[c0:end], (start,))
            calls = [call for a, b in self.spans if self.sent <= a and b <= end for call in self._parse(a, b)]
            if open_at is not None and reason == "length":  # cut inside a call: the call as far as it was written
                calls += oa.partial_calls(self.text[open_at + len(start):])
            for call in calls:
                self.calls.append(call)
                closed.append((len(self.calls) - 1, call))
            if reason == "stop" and self.calls:
                reason = "tool_calls"
        thought = self.text[max(self.sent, r0):min(end, r1)]
        piece = "".join(self.text[a:b] for a, b in oa.outside(self.spans, max(self.sent, c0), end))
        self.sent = max(self.sent, end)
        return thought, piece, closed, reason

    def _parse(self, a: int, b: int) -> list[dict]:
        """A closed call block's text as its calls, [{name, arguments}, ...], by the model's own tool parser:
        one call, or a list where a block holds several (DeepSeek-V4's parallel calls; mlx-lm's server takes
        both). A block it cannot read is dropped, as mlx-lm's server drops it."""
        start, stop = self.tool_markers
        try:
            calls = self.fe.tokenizer.tool_parser(self.text[a + len(start):b - len(stop)], list(self.req.tools))
        except (ValueError, KeyError, TypeError, AttributeError):
            return []
        return [c for c in (calls if isinstance(calls, list) else [calls])
                if isinstance(c, dict) and isinstance(c.get("name"), str)]

    def reasoning_and_content(self) -> tuple[str, str]:
        r0, r1, c0 = self.regions
        return self.text[r0:r1], "".join(self.text[a:b] for a, b in oa.outside(self.spans, c0, self.content_end))

    def unsent_logprobs(self) -> list[oa.TokenLogprob]:
        """The logprobs of the tokens since the last chunk (each goes out once, with the next chunk)."""
        fresh = self.logprobs[self.logprobs_sent:]
        self.logprobs_sent = len(self.logprobs)
        return fresh

    def usage(self) -> dict:
        return oa.usage(self.prompt_tokens, self.resumed, self.generated, self.cached, self.drafts)


class _Answer:
    """A request's answers (its `n` rows, each a `_Run`) as one response, whole or streamed; a streamed chunk
    names its row (`index`).

    With `meshd.ids` (the proxy asks, for an answer of one row) each streamed chunk is preceded by an SSE
    comment `: ids CHARS ID,ID,...`: the token ids this chunk completes and how many characters of text the
    client has once it is delivered; the stream starts with `: meshd {"id", "created", "seed"}`. Every stream
    that ends with its answers says their usage in `: usage {...}` before `[DONE]`, asked for or not (the proxy
    counts their drafts by model). The proxy keeps these comments (to resume the answer if this generation dies)
    and passes on only `: prefill` ones, a long prefill's progress (common/prefills.py).
    """

    def __init__(self, req: oa.CompletionRequest, rid: str, seed: int, rows: list[_Run]):
        self.req, self.rid, self.seed, self.rows = req, rid, seed, rows
        self.created = rows[0].created
        self.events: asyncio.Queue = asyncio.Queue()

    async def _events(self, progress: bool = False):
        """Each row's tokens and failure, as they come (a row's start only sets how much was cached); with
        `progress`, its long prefill's progress too."""
        while True:
            index, event = await self.events.get()
            row = self.rows[index]
            if isinstance(event, Started):
                row.cached = event.cached
                continue
            if isinstance(event, Progress) and not progress:
                continue
            yield row, event

    def usage(self) -> dict:
        usages = [row.usage() for row in self.rows]
        return usages[0] if len(usages) == 1 else oa.summed_usage(usages)

    async def whole(self) -> web.Response:
        choices: dict[int, dict] = {}
        async for row, event in self._events():
            if isinstance(event, Failed):
                return json_error(503, event.message, code=event.code, type_="server_error",
                                  headers={"Retry-After": "2"})
            *_, reason = row._advance(event)
            if row.stuck is not None:
                return web.json_response(row.stuck, status=422)
            if reason is not None:
                reasoning, content = row.reasoning_and_content()
                body = oa.completion_body(self.req, self.rid, self.created, content, reason, self.usage(),
                                          row.logprobs, reasoning, row.calls, row.index)
                choices[row.index] = body["choices"][0]
                if len(choices) == len(self.rows):
                    return web.json_response({**body, "choices": [choices[i] for i in sorted(choices)]})
        raise AssertionError("event stream ended without a finish")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        only = self.rows[0] if len(self.rows) == 1 and self.req.internal.ids else None  # reports its ids

        async def send(obj) -> None:
            comment = b""
            if only and isinstance(obj, dict) and "choices" in obj and obj["choices"]:
                comment = f": ids {only.sent} {','.join(map(str, only.unreported))}\n\n".encode()
                only.unreported.clear()
            await resp.write(comment + b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())
                             + b"\n\n")

        if only:
            meta = {"id": self.rid, "created": self.created, "seed": self.seed}
            await resp.write(b": meshd " + json.dumps(meta).encode() + b"\n\n")
        # the role goes out once per answer
        first = set() if self.req.internal.resume else {row.index for row in self.rows}
        left = len(self.rows)
        async for row, event in self._events(progress=True):
            if isinstance(event, Progress):  # `: prefill ...`, the one comment the proxy passes on to clients
                await resp.write(event.comment())
                continue
            if isinstance(event, Failed):
                await send(error_body(event.message, "server_error", None, event.code))
                break
            thought, piece, calls, reason = row._advance(event)
            if thought or piece or calls or row.index in first:
                await send(oa.chunk_body(self.req, self.rid, self.created,
                                         piece if piece or not (thought or calls) else None, None,
                                         first=row.index in first, logprobs=row.unsent_logprobs(), reasoning=thought,
                                         tool_calls=calls, index=row.index))
                first.discard(row.index)
            if reason is not None:  # an answer its grammar left stuck says why in its last chunk
                await send(oa.chunk_body(self.req, self.rid, self.created, None, reason,
                                         logprobs=row.unsent_logprobs(), index=row.index) | (row.stuck or {}))
                left -= 1
                if not left:
                    if self.req.include_usage:
                        await send(oa.usage_chunk(self.req, self.rid, self.created, self.usage()))
                    await resp.write(b": usage " + json.dumps(self.usage()).encode() + b"\n\n")
                    break
        await send(b"[DONE]")
        await resp.write_eof()
        return resp
