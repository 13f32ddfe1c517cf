"""The Exchange's loop with a fake `Gate`: what the client gets, what the fleet is told and where each
attempt went, row by row, without processes. The gate hands out the attempts a row scripts, each a rank 0
whose answer is scripted too (its chunks, then how it ends); the exchange runs behind an in-process HTTP
server the test's client reads from. The gate holds a place in a real `Admission` the way the proxy's
`Routed` does (taken at the first attempt, given back when the `with` block around the exchange ends),
and every row ends with that place given back exactly once."""

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common import openai_api as oa
from common.states import Profile
from meshd.config import Proxy as ProxyConfig
from meshd.dataplane.admission import Admission
from meshd.dataplane.exchange import Exchange, Rank0
from meshd.metrics import ProxyMetrics
from meshd.seam import Source
from meshd.upstream import Rank0Request, UpstreamError

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
ANSWER = b': meshd {"id": "chatcmpl-1", "created": 1, "seed": 7}\n\n'


def chunk(text: str, chars: int, ids: str) -> bytes:
    """One chunk as meshd-rank streams it: the token ids behind it in a comment, then its data."""
    data = json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
    return f": ids {chars} {ids}\ndata: {data}\n\n".encode()


DONE = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
DIED_503 = b'{"error": {"message": "a rank died", "code": "generation_failed"}}'
# a drafting mesh's stream: the usage rank 0 says the proxy before [DONE] (runtime/server.py's `: usage`)
DRAFTED = (b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n: usage {"prompt_tokens": 3, '
           b'"completion_tokens": 8, "draft_tokens": {"proposed": 9, "accepted": 6}}\n\ndata: [DONE]\n\n')


@dataclass(frozen=True)
class Attempt:
    """One rank 0 the gate hands out, and its answer: `status`, `chunks`, then `end`: "done" (the body
    ends), "cut" (the connection breaks), "dies" (silent until its mesh says the generation died),
    "silent" (silent for good), "refused" (no connection)."""

    mesh: str
    generation: int
    chunks: tuple[bytes, ...] = ()
    end: str = "done"
    status: int = 200
    fingerprint: str = "w1"


class FakeAnswer:
    """Rank 0's answer as the exchange reads it (upstream.Answer's reading side)."""

    def __init__(self, attempt: Attempt):
        self.status, self.end = attempt.status, attempt.end
        self.pending = list(attempt.chunks)
        self.error: Exception | None = None
        self.woken = asyncio.Event()
        self.closed = False

    def set_exception(self, e: Exception) -> None:
        self.error = self.error or e
        self.woken.set()

    async def readany(self) -> bytes:
        if self.error is None and self.pending:
            return self.pending.pop(0)
        if self.error is None and self.end == "cut":
            raise UpstreamError("rank 0 closed the connection before the end of its answer", sent=True)
        if self.error is None and self.end in ("dies", "silent"):
            await self.woken.wait()
        if self.error is not None:
            raise self.error
        return b""

    async def read(self) -> bytes:  # a refusal's whole body: the rows script those ending "done"
        body, self.pending = b"".join(self.pending), []
        return body


class FakeConnections:
    """What `Rank0.post` goes through: the attempt's scripted answer; the bodies posted, recorded."""

    def __init__(self, attempt: Attempt, gate: "FakeGate"):
        self.attempt, self.gate = attempt, gate

    @asynccontextmanager
    async def post(self, url: str, body: dict, headers: dict):
        self.gate.posted.append(json.loads(json.dumps(body)))  # as sent, like the real one
        if self.attempt.end == "refused":
            raise UpstreamError("cannot connect to rank 0", sent=False)
        answer = FakeAnswer(self.attempt)
        self.gate.answers.append(answer)
        try:
            yield answer
        finally:
            answer.closed = True


class FakeGate:
    """The proxy as an exchange sees it: `attempts` handed out in turn (None once they run out, with
    `why`), what the exchange tells the fleet recorded, a place in `admission` held from the first attempt
    to the end of the `with` block."""

    def __init__(self, attempts: list[Attempt], why: str = "The mesh is recovering; retry shortly"):
        self.settings = ProxyConfig(keepalive_interval=30.0)
        self.metrics = ProxyMetrics("t")
        self.attempts, self.why = list(attempts), why
        self.admission = Admission(1, 4)
        self.held = False
        self.releases = 0
        self.ended = asyncio.Event()
        self.sent: list[Rank0] = []
        self.posted: list[dict] = []
        self.answers: list[FakeAnswer] = []
        self.reports: list[tuple[int, Source]] = []
        self.served_by: list[int] = []
        self.quarantined: list[str] = []

    def __enter__(self) -> "FakeGate":
        return self

    def __exit__(self, *exc) -> None:
        if self.held:
            self.held = False
            self.releases += 1
            self.admission.release()
        self.ended.set()

    async def rank0(self, after: Rank0 | None, deadline: float) -> Rank0 | None:
        if not self.held:
            await self.admission.acquire(timeout=30.0)
            self.held = True
        if not self.attempts:
            return None
        a = self.attempts.pop(0)
        assert after is None or (a.mesh, a.generation) != (after.mesh, after.generation)
        self.sent.append(r := Rank0(a.mesh, a.generation, "http://rank0", "m", Profile.MESHD_RANK, None, {},
                                    FakeConnections(a, self), a.fingerprint))
        return r

    def hopeless(self) -> bool:
        return not self.attempts

    def why_unavailable(self) -> str:
        return self.why

    async def report(self, observation) -> None:
        self.reports.append((observation.generation, observation.source))

    async def lost(self, rank0: Rank0) -> str:
        if rank0.connections.attempt.end != "dies":
            await asyncio.Event().wait()
        return ""

    async def served(self, generation: int) -> None:
        self.served_by.append(generation)

    def quarantine(self, digest: str) -> None:
        self.quarantined.append(digest)

    def ended_on_purpose(self, rank0: Rank0) -> bool:
        return False


async def exchange(gate: FakeGate, body: dict, leave_after: bytes = b""):
    """POST `body` to an endpoint whose handler runs an exchange through `gate` (as the proxy's `_serve`
    does); the status, headers and body the client got. `leave_after`: the client goes away once the body
    holds it."""
    req = oa.parse_request("chat", body, oa.Limits("m", default_max_tokens=0, max_tokens_limit=64))

    async def handler(request: web.Request) -> web.StreamResponse:
        with gate:
            return await Exchange(gate, request, req, Rank0Request.of(CHAT, req, body, ""),
                                  asyncio.get_running_loop().time() + 30).run()

    app = web.Application()
    app.router.add_post(CHAT, handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post(CHAT, json=body)
        got = b""
        try:
            async for data in resp.content.iter_any():
                got += data
                if leave_after and leave_after in got:
                    resp.close()
                    break
        except aiohttp.ClientError:
            pass
        await asyncio.wait_for(gate.ended.wait(), 30)
        return resp.status, resp.headers, got


def data_texts(got: bytes) -> list[str]:
    """The content of each chunk the client got, and the error events' messages."""
    texts = []
    for line in got.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            texts += [event["error"]["message"]] if "error" in event else \
                [c["delta"]["content"] for c in event["choices"] if c["delta"].get("content")]
    return texts


HEL = (ANSWER, chunk("Hel", 3, "11,12"))
ROWS = {
    "a straight answer": dict(
        attempts=[Attempt("a", 1, (*HEL, chunk("lo", 5, "13"), DONE))],
        texts=["Hel", "lo"], sent=[("a", 1)], reports=[], served=[1], mesh="a"),
    "a cut stream resumed on the next generation, from the ids the client has": dict(
        attempts=[Attempt("a", 1, HEL, end="cut"), Attempt("a", 2, (chunk("lo", 5, "13"), DONE))],
        texts=["Hel", "lo"], sent=[("a", 1), ("a", 2)], reports=[(1, Source.PROXY), (1, Source.MIGRATED)],
        served=[2], resumed=[11, 12], says=b": resuming on mesh a, generation 2"),
    "a generation that dies under a silent attempt fails over to another mesh": dict(
        attempts=[Attempt("a", 1, end="dies"), Attempt("b", 4, (*HEL, DONE))],
        texts=["Hel"], sent=[("a", 1), ("b", 4)], reports=[(1, Source.PROXY)], served=[4], mesh="b"),
    "a refused connection (reported) and a 503 while loading (not) are retried, neither a death": dict(
        attempts=[Attempt("a", 1, end="refused"),
                  Attempt("a", 2, (b'{"error": {"code": "loading"}}',), status=503),
                  Attempt("b", 1, (*HEL, DONE))],
        texts=["Hel"], sent=[("a", 1), ("a", 2), ("b", 1)], reports=[(1, Source.PROXY)],
        served=[1], mesh="b"),
    "generations that die with the request in flight quarantine it before any data: 502": dict(
        attempts=[Attempt("a", 1, (DIED_503,), status=503), Attempt("a", 2, end="dies"),
                  Attempt("a", 3, (*HEL, DONE))],
        status=502, code="request_quarantined", sent=[("a", 1), ("a", 2)],
        reports=[(1, Source.PROXY), (2, Source.PROXY)], served=[], quarantined=1),
    "generations that die with the request in flight quarantine it mid-stream: an error event": dict(
        attempts=[Attempt("a", 1, HEL, end="cut"), Attempt("a", 2, end="dies")],
        texts=["Hel", "This request was in flight when generations [1, 2] of mesh a died; it is quarantined "
                      "for 600s in case it is what kills them"],
        sent=[("a", 1), ("a", 2)], reports=[(1, Source.PROXY), (1, Source.MIGRATED), (2, Source.PROXY)],
        served=[], quarantined=1, resumed=[11, 12]),
    "a cut stream its weights are served nowhere for ends with why": dict(
        attempts=[Attempt("a", 1, HEL, end="cut")], why="no mesh serves those weights now; retry",
        texts=["Hel", "no mesh serves those weights now; retry"], sent=[("a", 1)],
        reports=[(1, Source.PROXY), (1, Source.MIGRATED)], served=[]),
    "a long prefill's progress comments reach the client before its first chunk": dict(
        attempts=[Attempt("a", 1, (ANSWER, b": prefill 256/4096 tokens\n\n",
                                   b": prefill 512/4096 tokens, 256 tok/s, first token in ~14.0 s\n\n", *HEL[1:], DONE))],
        texts=["Hel"], sent=[("a", 1)], reports=[], served=[1],
        says=b": prefill 256/4096 tokens\n\n: prefill 512/4096 tokens, 256 tok/s, first token in ~14.0 s\n\ndata: "),
    "a drafted answer's usage stays with the proxy, which counts its drafts by model": dict(
        attempts=[Attempt("a", 1, (*HEL, DRAFTED))], texts=["Hel"], sent=[("a", 1)], reports=[], served=[1],
        drafts={"proposed": 9.0, "accepted": 6.0}),
    "a resumed answer counts the drafts of the generation that finished it": dict(
        attempts=[Attempt("a", 1, HEL, end="cut"), Attempt("a", 2, (chunk("lo", 5, "13"), DRAFTED))],
        texts=["Hel", "lo"], sent=[("a", 1), ("a", 2)], reports=[(1, Source.PROXY), (1, Source.MIGRATED)],
        served=[2], resumed=[11, 12], drafts={"proposed": 9.0, "accepted": 6.0}),
    "nothing serves and nothing comes: 503": dict(
        attempts=[], status=503, code="mesh_unavailable", sent=[], reports=[], served=[]),
    "the client goes away mid-answer: the attempt is closed": dict(
        attempts=[Attempt("a", 1, HEL, end="silent")], leave_after=b"Hel",
        texts=["Hel"], sent=[("a", 1)], reports=[], served=[], closed=True),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_the_exchange_loop(row):
    async def scenario():
        gate = FakeGate(row["attempts"], **({"why": row["why"]} if "why" in row else {}))
        status, headers, got = await exchange(gate, BODY, row.get("leave_after", b""))
        return gate, status, headers, got

    gate, status, headers, got = asyncio.run(scenario())
    assert status == row.get("status", 200)
    if "code" in row:
        assert json.loads(got)["error"]["code"] == row["code"]
    else:
        assert data_texts(got) == row["texts"]
        if not row.get("closed"):
            assert got.endswith(b"data: [DONE]\n\n") and got.count(b"[DONE]") == 1
    if "mesh" in row:
        assert headers["X-Meshd-Mesh"] == row["mesh"]
    if "says" in row:
        assert row["says"] in got
    assert b": ids" not in got and b": meshd" not in got and b": usage" not in got  # what the proxy keeps for itself
    drafts = {o: gate.metrics.registry.get_sample_value("meshd_proxy_draft_tokens_total", {"model": "m", "outcome": o})
              for o in ("proposed", "accepted")}
    assert drafts == row.get("drafts", {"proposed": None, "accepted": None})
    assert [(r.mesh, r.generation) for r in gate.sent] == row["sent"]
    assert gate.reports == row["reports"]
    assert gate.served_by == row["served"]
    assert len(gate.quarantined) == row.get("quarantined", 0)
    resumes = [b["meshd"]["resume"]["ids"] for b in gate.posted if "resume" in b["meshd"]]
    assert resumes == ([row["resumed"]] if "resumed" in row else [])
    assert all(a.closed for a in gate.answers)
    assert (gate.releases, gate.admission.running, gate.admission.depth) == (1, 0, 0)
