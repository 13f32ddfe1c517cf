"""The rank's heartbeat: it owns this process's `RankStatus` and writes the
status file (common/statusfile.py) at every state change and at least once a
`interval` while alive, so the agent can tell a live rank from a frozen one."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from common.states import RankState
from common.statusfile import RankStatus, write_atomic


class Heartbeat:
    """`update()` changes fields and writes at once on a state change; a daemon
    thread rewrites the file every `interval` seconds."""

    def __init__(self, path: str | Path | None, status: RankStatus, interval: float = 0.5,
                 sample: Callable[[], dict] = dict):
        self._path = Path(path) if path else None
        self._sample = sample  # fields read afresh at every periodic write (memory figures)
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

    def stop(self, final_state: RankState = RankState.EXITED) -> None:
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
            self.update(**self._sample())
            self._write()
