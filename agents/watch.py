"""Watch one rank: turn its exit, its log lines and its status file into events.

Exit is awaited on the child itself (SIGCHLD-driven, within milliseconds);
an adopted rank (spawned by an earlier agent) is polled every 20 ms. The log
and the status file are read every 50 ms. The exit report also carries the
rank's last heartbeat, which dates the death when the exit is seen late.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Awaitable, Callable

from agents.manifest import ManifestEntry
from agents.signatures import CONSEQUENCE, classify
from agents.stall import StallWindows, stall_verdict
from common import procs
from common.logfile import rotated
from common.protocol import Event, RankExited, RankSignature, RankStalled, RankStateChanged
from common.states import RankState
from common.statusfile import RankStatus, read_status

Emit = Callable[[Event], Awaitable[None]]


@dataclass
class RankRecord(ManifestEntry):
    """A rank this agent watches: its manifest entry and what watching it learned."""

    proc: asyncio.subprocess.Process | None = None  # None when adopted
    state: RankState = RankState.SPAWNED
    status: RankStatus | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    stopping: bool = False
    stalled: bool = False
    signatures: list[str] = field(default_factory=list)
    peer_lost: bool = False
    last_line: str = ""

    @property
    def target(self) -> procs.Target:
        return procs.Target(self.pid, self.create_time)

    @property
    def done(self) -> bool:
        return self.state == RankState.EXITED

    @classmethod
    def adopted(cls, e: ManifestEntry) -> RankRecord:
        """A rank an earlier agent started, as its manifest entry says."""
        return cls(**{f.name: getattr(e, f.name) for f in fields(ManifestEntry)}, proc=None)

    def manifest_entry(self) -> ManifestEntry:
        return ManifestEntry(**{f.name: getattr(self, f.name) for f in fields(ManifestEntry)})

    def view(self) -> dict:
        res = procs.resources(self.target) if not self.done else {"rss_bytes": 0, "cpu_seconds": 0.0}
        return {**self.manifest_entry().to_dict(), "state": self.state,
                "status": asdict(self.status) if self.status else None,
                "exit_code": self.exit_code, "exit_signal": self.exit_signal, "stalled": self.stalled,
                "expected": self.stopping, "peer_lost": self.peer_lost,
                "signatures": self.signatures, **res}


class RankWatcher:
    def __init__(self, rec: RankRecord, emit: Emit, node: str, windows: StallWindows, log_max_bytes: int):
        self.rec, self.emit, self.node = rec, emit, node
        self.windows = windows
        self.log_max_bytes = log_max_bytes
        self._offset = rec.log_path.stat().st_size if rec.proc is None and rec.log_path.exists() else 0
        self._partial = b""
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._exit_loop()), asyncio.create_task(self._observe_loop())]

    def _event(self, cls, **kw) -> Event:
        return cls(node=self.node, generation=self.rec.generation, rank=self.rec.rank, at=time.time(), **kw)

    async def _exit_loop(self) -> None:
        rec = self.rec
        if rec.proc is not None:
            code = await rec.proc.wait()
            if code < 0:
                rec.exit_signal = -code
            else:
                rec.exit_code = code
        else:
            while procs.alive(rec.target):
                await asyncio.sleep(0.02)
        await self._scan_log()  # the last lines often say why
        last = self._status_file()
        last_state, rec.state = rec.state, RankState.EXITED
        await self.emit(self._event(RankExited, pid=rec.pid, code=rec.exit_code, signal=rec.exit_signal,
                                    expected=rec.stopping, state=last_state,
                                    last_line=(self._partial.decode(errors="replace").strip() or rec.last_line)[-300:],
                                    peer_lost=rec.peer_lost, alive_at=last.updated_at if last else None))
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()

    async def _observe_loop(self) -> None:
        while not self.rec.done:
            await self._scan_log()
            await self._read_status()
            await asyncio.sleep(0.05)

    async def _scan_log(self) -> None:
        path = self.rec.log_path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size < self._offset:
            self._offset = 0
        if size == self._offset:
            if size > self.log_max_bytes:
                self._rotate(path)  # quiet since the last poll: the rank is unlikely to write in the gap
            return
        with path.open("rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset = size
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            if line.strip():
                self.rec.last_line = line.strip()
            sig = classify(line)
            if sig is not None and sig.name not in self.rec.signatures:  # once per rank: a closed socket repeats
                self.rec.signatures.append(sig.name)
                self.rec.peer_lost |= sig.role == CONSEQUENCE
                await self.emit(self._event(RankSignature, signature=sig.name, severity=sig.severity,
                                            role=sig.role, line=line[-500:]))
        if size > 2 * self.log_max_bytes:
            self._rotate(path)  # writing without a pause: bound the disk all the same

    def _rotate(self, path: Path) -> None:
        """Copy the log to LOG.1 and empty it (the rank holds it open, appending: a rename would not
        rotate it). The copy reads until a read finds nothing new and the file is emptied right then, so
        lines the rank writes during the copy land in it; only the instant between that last read and the
        truncate is a gap, which is why a log is rotated once it has been quiet for a poll (the last
        lines before a rank dies are the ones that say why) and only past twice the cap while busy. The
        copy takes LOG.1's place whole (written aside, then renamed): a reader never finds half of it."""
        aside = rotated(path).with_name(rotated(path).name + ".part")
        with path.open("rb") as src, aside.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            aside.replace(rotated(path))
            os.truncate(path, 0)
        self._offset = 0

    def _status_file(self) -> RankStatus | None:
        """This rank's status file as last written; None without one (yet), or a previous generation's."""
        status = read_status(self.rec.status_path) if self.rec.status_path else None
        return status if status is not None and status.generation == self.rec.generation else None

    async def _read_status(self) -> None:
        rec = self.rec
        if rec.status_path is None:
            return
        status = self._status_file()
        previous = rec.status
        rec.status = status
        if status is not None:
            state = status.state
            moved = previous is None or state != previous.state or (
                state == RankState.LOADING and status.load_done != previous.load_done)
            if moved and state != RankState.EXITED:
                rec.state = state
                # When the rank wrote it (a state change is written at once), not when this poll saw it.
                changed = self._event(RankStateChanged, state=state, load_done=status.load_done,
                                      load_total=status.load_total)
                await self.emit(replace(changed, at=status.updated_at))
        if rec.stopping:
            return
        verdict = stall_verdict(status, time.time(), rec.spawned_at, self.windows)
        if verdict and not rec.stalled:
            rec.stalled = True
            await self.emit(self._event(RankStalled, phase=verdict.phase, idle_for=verdict.idle_for,
                                        window=verdict.window, frozen=verdict.frozen))
        elif verdict is None and rec.stalled:
            rec.stalled = False
