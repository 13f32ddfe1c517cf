"""The rank's heartbeat: a JSON status file written atomically (write, then
rename) at every state change and at least once a second while alive.

The agent reads it to tell loading from armed from busy, and to detect stalls:
`progress_at` moves on every load step, prefill chunk, decode step and idle
liveness collective, so a rank blocked in a collective stops moving it while
the heartbeat thread keeps `updated_at` fresh.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATES = ("loading", "armed", "ready", "busy", "draining", "exited")


@dataclass
class RankStatus:
    generation: int
    rank: int
    world: int
    pid: int
    state: str = "loading"
    load_done: int = 0
    load_total: int = 0
    step: int = 0
    tokens: int = 0
    requests_in_flight: int = 0
    prompt_tokens_in_flight: int = 0
    progress_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)


def write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_status(path: str | Path) -> dict | None:
    """The last status written, or None when there is none (yet) or it is unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class Heartbeat:
    """Owns the RankStatus of this process. `update()` changes fields and
    writes at once on a state change; a daemon thread rewrites it every
    `interval` seconds so a reader can tell a live rank from a frozen one."""

    def __init__(self, path: str | Path | None, status: RankStatus, interval: float = 0.5):
        self._path = Path(path) if path else None
        self._status = status
        self._interval = interval
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._write()
        self._thread.start()
        return self

    def snapshot(self) -> dict:
        with self._lock:
            return asdict(self._status)

    def update(self, *, progress: bool = False, flush: bool = False, **fields) -> None:
        with self._lock:
            changed_state = flush or ("state" in fields and fields["state"] != self._status.state)
            for k, v in fields.items():
                setattr(self._status, k, v)
            if progress:
                self._status.step += 1
                self._status.progress_at = time.time()
        if changed_state:
            self._write()

    def stop(self, final_state: str = "exited") -> None:
        self._stop.set()
        self.update(state=final_state)

    def _write(self) -> None:
        if self._path is None:
            return
        with self._write_lock:
            with self._lock:
                self._status.updated_at = time.time()
                data = asdict(self._status)
            write_atomic(self._path, data)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._write()
