"""A daemon's own log file, rotated by size in the process: launchd has no
journal, and newsyslog cannot rotate a file a job holds open (it would go on
writing to the renamed one). `--log-file` on the daemons sends their log here."""

from __future__ import annotations

import threading
from pathlib import Path

import structlog

from common.secretfile import open_appending


def rotated(path: Path, i: int = 1) -> Path:
    """The ith older file of a log: LOG.1 is the one before the live LOG."""
    return path.with_name(f"{path.name}.{i}")


class RotatingLog:
    """A text file renamed to PATH.1 (older ones to .2 .. .keep, the oldest dropped) when it grows past
    `max_bytes`; created 0600."""

    def __init__(self, path: Path, max_bytes: int = 64 << 20, keep: int = 5):
        self.path, self.max_bytes, self.keep = Path(path), max_bytes, keep
        self._lock = threading.Lock()
        self.lost, self.lost_why = 0, ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()

    def _open(self) -> None:
        self._file = open_appending(self.path, "ab", buffering=0)  # unbuffered: nothing lost waits to go out later
        self._size = self._file.tell()

    def write(self, text: str) -> int:
        """Never raises: on a full disk the line is lost (counted in a line once writing works again), and
        the daemon goes on."""
        with self._lock:
            try:
                if self.lost:
                    self._file.write(f"({self.lost} log lines lost: {self.lost_why})\n".encode())
                    self.lost = 0
                data = text.encode()
                self._file.write(data)
                self._size += len(data)
                if self._size >= self.max_bytes:
                    self._rotate()
            except OSError as e:
                self.lost, self.lost_why = self.lost + 1, e.strerror
                return 0
            return len(text)

    def flush(self) -> None:
        """Nothing waits in a buffer: every write went to the file."""

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.keep - 1, 0, -1):
            if rotated(self.path, i).exists():
                rotated(self.path, i).replace(rotated(self.path, i + 1))
        self.path.replace(rotated(self.path))
        self._open()


def tail(path: Path, lines: int) -> tuple[list[str], int] | None:
    """The last `lines` lines of a log (its rotated file first), and the live file's size: where `after`
    goes on from. None when there is no such log."""
    if not path.exists():
        return None
    data, size = b"", 0
    for part in (rotated(path), path):  # the rotated file, then the live one
        if part.exists():
            with part.open("rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                data += (b"\n" if data and not data.endswith(b"\n") else b"") + f.read()  # one file's cut line
    return data.decode(errors="replace").splitlines()[-lines:], size


def after(path: Path, offset: int) -> tuple[list[str], int] | None:
    """The whole lines written to a live log after byte `offset`, and the offset after them; a file rotated
    since (shorter than `offset`) is read from its start."""
    if not path.exists():
        return None
    with path.open("rb") as f:
        f.seek(0, 2)
        start = offset if offset <= f.tell() else 0
        f.seek(start)
        data = f.read(1 << 20)
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace").splitlines(), start + end


def log_to(path: Path, max_bytes: int = 64 << 20, keep: int = 5) -> RotatingLog:
    """Send structlog's lines (timestamped, no colours) to a rotating file at `path`."""
    out = RotatingLog(path, max_bytes, keep)
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso"),
                                    structlog.dev.ConsoleRenderer(colors=False)],
                        logger_factory=structlog.PrintLoggerFactory(file=out))
    return out
