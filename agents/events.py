"""The agent's event log: sequence-numbered, persisted to the state directory,
so a controller that reconnects (to this agent or to its restarted self)
resumes after the last sequence number it saw without losing an event."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path

from common.protocol import Event


class EventLog:
    def __init__(self, path: Path, keep: int = 10_000):
        self.path = path
        self._keep = keep
        self._events: deque[dict] = deque(maxlen=keep)
        self._cond = asyncio.Condition()
        self.seq = 0
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a crash
                self._events.append(record)
                self.seq = max(self.seq, record["seq"])
            if len(self._events) < sum(1 for _ in path.open()):
                self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in self._events))
        tmp.replace(self.path)

    async def emit(self, event: Event) -> dict:
        async with self._cond:
            self.seq += 1
            record = {"seq": self.seq, **event.to_dict()}
            self._events.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.seq % self._keep == 0:
                self._rewrite()
            self._cond.notify_all()
            return record

    def since(self, seq: int) -> list[dict]:
        return [e for e in self._events if e["seq"] > seq]

    async def wait_after(self, seq: int, timeout: float) -> list[dict]:
        """Events after `seq`, waiting up to `timeout` for the first one."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.seq > seq), timeout)
            except asyncio.TimeoutError:
                return []
        return self.since(seq)
