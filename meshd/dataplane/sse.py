"""Reading rank 0's server-sent events: whole lines, with a watchdog for silence."""

from __future__ import annotations

import asyncio
import time

from meshd.upstream import Answer


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
