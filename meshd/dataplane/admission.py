"""The proxy's FIFO admission: at most `limit` requests run, at most
`queue_limit` wait for a slot, in the order they came."""

from __future__ import annotations

import asyncio
from collections import deque


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
