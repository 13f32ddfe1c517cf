"""The launch manifest: what this agent started and where (generation, rank, pid, create time, log and
status files), written before a start returns so that an agent killed and started again adopts the ranks
that still run and tells retired generations' leftovers from the live one."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from common.statusfile import write_atomic


@dataclass
class ManifestEntry:
    """One started rank as the manifest keeps it."""

    generation: int
    rank: int
    pid: int
    create_time: float
    spawned_at: float
    log_path: Path
    status_path: Path | None
    port: int
    host: str
    profile: str

    def to_dict(self) -> dict:
        return {**asdict(self), "log_path": str(self.log_path),
                "status_path": str(self.status_path) if self.status_path else None}

    @classmethod
    def from_dict(cls, d: dict) -> ManifestEntry:
        return cls(int(d["generation"]), int(d["rank"]), int(d["pid"]), float(d["create_time"]),
                   float(d["spawned_at"]), Path(d["log_path"]), Path(d["status_path"]) if d["status_path"] else None,
                   int(d["port"]), str(d["host"]), str(d["profile"]))


class Manifest:
    """The manifest file (`manifest.json` in the agent's state directory), replaced whole at each write."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[ManifestEntry]:
        """The entries; none when the file is missing or unreadable (an agent's first start)."""
        try:
            return [ManifestEntry.from_dict(d) for d in json.loads(self.path.read_text())]
        except (OSError, ValueError, TypeError, KeyError):
            return []

    def write(self, entries: list[ManifestEntry]) -> None:
        write_atomic(self.path, [e.to_dict() for e in entries])

    def record(self, entry: ManifestEntry) -> None:
        """`entry` in place of any of its generation and rank."""
        self.keep(lambda e: (e.generation, e.rank) != (entry.generation, entry.rank), [entry])

    def keep(self, which, extra: list[ManifestEntry] = ()) -> None:
        """Only the entries `which` accepts (and `extra`)."""
        self.write([e for e in self.read() if which(e)] + list(extra))
