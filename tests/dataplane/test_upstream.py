"""meshd-proxy's client for rank 0 against real sockets: every way an answer's
body ends, keep-alive reuse, and what a failure says about the request."""

import asyncio

import pytest

from meshd.meshctl.ports import free_ports
from meshd.dataplane.sse import sse_blocks
from meshd.upstream import Upstream, UpstreamError

LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\": 1}\r\n"
CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b"data: a\n\n", b"data: b\n", b"\n")) + b"0\r\n\r\n")
HTTP10 = b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: a\n\ndata: b\n\n"  # ends by closing


async def serve(answer: bytes, close: bool, seen: list):
    """A server that reads one request a time and writes `answer` (then closes, when `close`)."""
    async def handle(reader, writer):
        seen.append(writer.get_extra_info("peername"))
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
            if close:
                writer.close()
                return
    (port,) = free_ports(1)
    return await asyncio.start_server(handle, "127.0.0.1", port), f"http://127.0.0.1:{port}/v1/chat/completions"


@pytest.mark.parametrize("answer,close,body", [
    (LENGTH, False, b'{"ok": 1}\r\n'),
    (CHUNKED, False, b"data: a\n\ndata: b\n\n"),
    (HTTP10, True, b"data: a\n\ndata: b\n\n"),
], ids=["length", "chunked", "closed-by-the-server"])
def test_every_way_an_answer_ends_and_keep_alive_reuse(answer, close, body):
    async def main():
        seen = []
        server, url = await serve(answer, close, seen)
        up = Upstream()
        for _ in range(3):
            async with up.post(url, {"messages": []}, {"Authorization": "Bearer s"}) as r:
                assert (r.status, await r.read()) == (200, body)
        up.close()
        server.close()
        return len(seen)
    connections = asyncio.run(main())
    assert connections == (3 if close else 1)  # kept alive unless the server ends each answer by closing


def test_a_refused_connection_never_reached_rank0_and_a_cut_answer_may_have():
    async def main():
        (port,) = free_ports(1)
        with pytest.raises(UpstreamError) as refused:
            async with Upstream().post(f"http://127.0.0.1:{port}/x", {}, {}):
                pass
        cut_short = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"
        server, url = await serve(cut_short, True, [])
        async with Upstream().post(url, {}, {}) as r:
            with pytest.raises(UpstreamError) as cut:
                await r.read()
        server.close()
        return refused.value, cut.value
    refused, cut = asyncio.run(main())
    assert not refused.sent and "cannot connect" in str(refused)
    assert cut.sent and "before the end of its answer" in str(cut)


def test_an_answer_given_up_half_way_closes_its_connection():
    async def main():
        seen = []
        server, url = await serve(CHUNKED[:-5], False, seen)  # never ends
        up = Upstream()
        async with up.post(url, {}, {}) as r:
            assert await r.readany()
        async with up.post(url, {}, {}) as r:  # the first connection was not reused half way
            assert await r.readany()
        server.close()
        return len(seen), up.idle
    connections, idle = asyncio.run(main())
    assert connections == 2 and not any(idle.values())


def test_a_long_line_arriving_slowly_comes_whole_and_silences_get_keepalives():
    """An SSE line of 300 KB written in three parts with pauses longer than the keep-alive interval: the
    relay gets it whole, once, and keep-alives flow meanwhile; a keep-alive that raises ends the stream."""
    big = b"data: " + b"x" * 300_000
    parts = [big[:100_000], big[100_000:200_000], big[200_000:] + b"\n\ndata: [DONE]\n\n"]

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.3)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main():
        (port,) = free_ports(1)
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        idles, lines = [], []

        async def on_idle():
            idles.append(1)

        async with Upstream().post(url, {}, {}) as r:
            async for block in sse_blocks(r, 0.1, on_idle):
                lines += [line for line in block if line]

        async def stalled():
            raise TimeoutError("no token for 0s")

        with pytest.raises(TimeoutError, match="no token"):
            async with Upstream().post(url, {}, {}) as r:
                async for _ in sse_blocks(r, 0.1, stalled):
                    pass
        server.close()
        return lines, len(idles)

    lines, idles = asyncio.run(main())
    assert lines == [big, b"data: [DONE]"] and idles >= 2
