"""The agent's event log: sequence-numbered, persisted to the state directory,
so a controller that reconnects (to this agent or to its restarted self)
resumes after the last sequence number it saw without losing an event. What
else an event sets off on the agent listens to the log (`subscribe`): the
standby's trigger, for one (agents/standby.py `trigger`).

Each log has an epoch, made when the log is (a reinstall or a wiped state
directory makes a new one); every record carries it. A reader whose epoch is
another one reads the log from its start: its sequence numbers belong to a log
that is gone.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import deque
from pathlib import Path
from typing import Awaitable, Callable

from common.protocol import Event

Listener = Callable[[Event], Awaitable[None]]


class EventLog:
    def __init__(self, path: Path, keep: int = 10_000):
        self.path = path
        self._keep = keep
        self._events: deque[dict] = deque(maxlen=keep)
        self._cond = asyncio.Condition()
        self._listeners: list[Listener] = []
        self.seq = 0
        epoch_file = path.with_name(path.name + ".epoch")
        if not path.exists() or not epoch_file.exists():
            epoch_file.write_text(secrets.token_hex(8) + "\n")
        self.epoch = epoch_file.read_text().strip()
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

    def subscribe(self, listener: Listener) -> None:
        """`listener(event)` awaited after each event is logged, in the order subscribed."""
        self._listeners.append(listener)

    async def emit(self, event: Event) -> dict:
        record = await self._log(event)
        for listener in self._listeners:
            await listener(event)
        return record

    async def _log(self, event: Event) -> dict:
        async with self._cond:
            self.seq += 1
            record = {"seq": self.seq, "epoch": self.epoch, **event.to_dict()}
            self._events.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.seq % self._keep == 0:
                self._rewrite()
            self._cond.notify_all()
            return record

    def resume_point(self, seq: int, epoch: str | None) -> int:
        """Where a reader that saw `seq` of log `epoch` goes on from in this log."""
        return seq if epoch in (None, "", self.epoch) else 0

    def since(self, seq: int) -> list[dict]:
        return [e for e in self._events if e["seq"] > seq]

    async def wait_after(self, seq: int, timeout: float) -> list[dict]:
        """Events after `seq`, waiting up to `timeout` for the first one."""
        async with self._cond:
            try:  # asyncio.timeout, not wait_for: see meshd/seam.py wait_until
                async with asyncio.timeout(timeout):
                    await self._cond.wait_for(lambda: self.seq > seq)
            except TimeoutError:
                return []
        return self.since(seq)
