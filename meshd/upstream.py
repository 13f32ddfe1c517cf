"""The HTTP/1.1 client for rank 0 (meshd-proxy's relay, the controller's
readiness probe): keep-alive connections per address, a request written in
one piece, the answer parsed by httptools (C); and what is asked of rank 0
(`Rank0Request`), shaped for its runtime profile.
aiohttp's client cost the proxy more per request than everything else it does
(bench/proxy_overhead.py); this one does what the relay needs and no more.

An answer's body ends by its length, its last chunk, or (an HTTP/1.0 server
such as mlx_lm.server's streams) the connection's close. A connection goes
back to the pool only after a whole answer that allows it; an exchange given
up half way (the client left) closes it, so rank 0 sees the disconnect.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import httptools

from common import openai_api as oa
from common.states import Profile

READY = "/internal/ready"  # meshd-rank's: 200 once its own one-token generation went through every rank
COMPLETION = "/v1/chat/completions"
HIGH_WATER = 1 << 20  # bytes of body waiting for the relay before reading from rank 0 pauses
# A connection idle longer than this is not reused: rank 0 (aiohttp) closes idle ones after 75 s, and a
# request written into one it is closing would look like a rank 0 that died with it.
IDLE_REUSE = 30.0


@dataclass(frozen=True)
class Rank0Request:
    """What the proxy asks of rank 0, built once from the parsed request: the route, the client's OpenAI
    fields (as common/openai_api.py validated them) and meshd's own extension (`internal`, the body's `meshd`
    object, which only meshd-rank takes)."""

    path: str
    fields: dict
    internal: oa.Internal = oa.Internal()

    @classmethod
    def of(cls, path: str, req: oa.CompletionRequest, fields: dict, tenant: str) -> "Rank0Request":
        """`req` (parsed from `fields`) for the prefix cache of `tenant`; a stream of one answer reports the
        token ids of its chunks, which its resumption needs."""
        return cls(path, fields, oa.Internal(ids=req.stream and req.n == 1, tenant=tenant))

    def resuming(self, resume: oa.Resume) -> "Rank0Request":
        return replace(self, internal=replace(self.internal, resume=resume))

    def body(self, profile: str, model: str | None = None) -> dict:
        """The JSON rank 0 of `profile` takes, for `model` (None: its own): meshd-rank's with the `meshd`
        object; stock mlx_lm.server loads whatever path "model" names, so it is sent its own
        ("default_model")."""
        body = self.fields if model is None else {**self.fields, "model": model}
        if profile == Profile.MLX_LM_SERVER:
            return {**body, "model": "default_model"}
        internal = self.internal.wire() if profile == Profile.MESHD_RANK else {}
        return {**body, "meshd": internal} if internal else body


# One token asked of rank 0: the readiness check and the idle probe
PING = Rank0Request(COMPLETION, {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})


class UpstreamError(Exception):
    """No answer from rank 0. `sent`: the request may have reached it (the exchange broke after it
    was written), rather than never leaving (no connection)."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class Answer(asyncio.Protocol):
    """One connection to rank 0, and the answer it is reading."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._new_answer()

    def _new_answer(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None
        self.headed = self.loop.create_future()
        self.body = bytearray()
        self.complete = False
        self.framed = False  # a length or chunks say where the body ends (else the close does)
        self.keep_alive = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future | None = None

    # --- httptools' callbacks ----------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # the parser forgets it once the answer is complete
        if not self.headed.done():
            self.headed.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body += body
        if len(self.body) > HIGH_WATER:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # --- asyncio's -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.set_exception(UpstreamError(f"rank 0 answered malformed HTTP ({e})", sent=True))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.status is not None and not self.framed and self.error is None:
            self.complete = True  # an HTTP/1.0 body ends with its connection
            self._wake()
        elif not self.complete:
            self.set_exception(UpstreamError("rank 0 closed the connection before the end of its answer"
                                             + (f" ({exc})" if exc else ""), sent=True))

    # --- the relay's ------------------------------------------------------------------
    def set_exception(self, e: Exception) -> None:
        """End the answer with `e`: the next read raises it."""
        self.error = self.error or e
        if not self.headed.done():
            self.headed.set_exception(e)
        self._wake()

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last read, at once when there are some; b"" at the end."""
        while not self.body and not self.complete and self.error is None:
            self._waiter = self.loop.create_future()
            await self._waiter
        if self.body:
            data = bytes(self.body)
            self.body.clear()
            self.transport.resume_reading()
            return data
        if self.error is not None:
            raise self.error
        return b""

    async def read(self) -> bytes:
        chunks = []
        while data := await self.readany():
            chunks.append(data)
        return b"".join(chunks)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def reusable(self) -> bool:
        return self.complete and self.error is None and not self.closed and self.keep_alive


class Upstream:
    """Keep-alive connections to rank 0 (to each address it had)."""

    def __init__(self):
        self.idle: dict[tuple[str, int], list[Answer]] = {}
        self._where: dict[str, tuple[str, int, bytes]] = {}

    def _split(self, url: str) -> tuple[str, int, bytes]:
        if (where := self._where.get(url)) is None:
            u = urlsplit(url)
            where = self._where[url] = (u.hostname, u.port or 80, (u.path or "/").encode())
        return where

    async def _connect(self, host: str, port: int) -> Answer:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: Answer(loop), host, port)
        except OSError as e:
            raise UpstreamError(f"cannot connect to rank 0 at {host}:{port} ({e.strerror or e})", sent=False)
        return conn

    def get(self, url: str, headers: dict[str, str]):
        """GET `url`; yields the answer once its status line and headers are in."""
        return self._exchange(b"GET", url, headers, None)

    def post(self, url: str, body: dict, headers: dict[str, str]):
        """POST `body` as JSON; yields the answer once its status line and headers are in."""
        return self._exchange(b"POST", url, headers, json.dumps(body).encode())

    @asynccontextmanager
    async def _exchange(self, method: bytes, url: str, headers: dict[str, str], data: bytes | None):
        host, port, path = self._split(url)
        head = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
        if data is not None:
            head = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data) + head
        name = (f"[{host}]" if ":" in host else host).encode()
        request = b"%s %s HTTP/1.1\r\nHost: %s:%d\r\n" % (method, path, name, port) + head + b"\r\n" + (data or b"")
        pool = self.idle.setdefault((host, port), [])
        conn = None
        while pool and conn is None:
            conn = pool.pop()
            if conn.closed or time.monotonic() - conn.idle_since > IDLE_REUSE:
                conn.transport.close()
                conn = None
        if conn is None:
            conn = await self._connect(host, port)
        conn._new_answer()
        conn.transport.write(request)
        try:
            await conn.headed
            yield conn
        finally:
            if conn.reusable():
                conn.idle_since = time.monotonic()
                pool.append(conn)
            else:
                conn.transport.close()

    def close(self) -> None:
        for pool in self.idle.values():
            for conn in pool:
                conn.transport.close()
        self.idle.clear()


@dataclass(frozen=True)
class ReadinessSeen:
    """What asking rank 0 at `url` whether it serves saw: the route that settled it, the HTTP status it
    answered (None: no answer in time) and its body (a completion's)."""

    url: str
    route: str
    status: int | None = None
    body: str = ""

    @property
    def secret_refused(self) -> bool:
        return self.route == READY and self.status == 401

    @property
    def weights(self) -> str | None:
        """The fingerprint of the weights a meshd-rank rank 0 says it serves with its readiness ("" when they
        changed while it loaded); None when the answer does not say."""
        if self.route != READY or self.status != 200:
            return None
        try:
            said = json.loads(self.body).get("weights_fingerprint")
        except (ValueError, AttributeError):
            return None
        return said if isinstance(said, str) else None


async def probe_ready(rank0: Upstream, url: str, auth: dict[str, str], profile: str,
                      completion_timeout: float) -> ReadinessSeen:
    """Ask rank 0 whether it serves: meshd-rank on its readiness route; a runtime without one by its
    /v1/models answering, then a real one-token completion."""
    route = READY if profile == Profile.MESHD_RANK else "/v1/models"
    try:
        async with asyncio.timeout(2):
            async with rank0.get(url + route, auth) as r:
                body = await r.read()
        if route == READY:
            return ReadinessSeen(url, route, r.status, body.decode(errors="replace"))
        if r.status != 200:
            return ReadinessSeen(url, route, r.status)
        route = COMPLETION
        async with asyncio.timeout(completion_timeout):
            async with rank0.post(url + route, PING.body(profile), auth) as r:
                body = await r.read()
    except (UpstreamError, TimeoutError):
        return ReadinessSeen(url, route)
    return ReadinessSeen(url, route, r.status, body.decode(errors="replace"))
