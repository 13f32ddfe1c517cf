"""Fencing: the highest controller epoch this agent has been called with,
kept in its state directory. Each controller takes a higher epoch than the
last one of its mesh and sends it with every call; a command from an older
one (a controller stopped, then resumed after another took over) is refused."""

from __future__ import annotations

import os
from pathlib import Path

import structlog

log = structlog.get_logger("meshd.agent")


def admits(highest: int, epoch: int) -> bool:
    """May a controller of `epoch` command this agent, the highest it has seen being `highest`?"""
    return epoch >= highest


class Fencing:
    def __init__(self, path: Path):
        self.path = path
        try:
            self.highest = int(path.read_text())
        except (OSError, ValueError):
            self.highest = 0

    def see(self, epoch: int) -> None:
        """A call of `epoch` came (authenticated): a newer epoch is kept, also across restarts."""
        if epoch <= self.highest:
            return
        self.highest = epoch
        part = self.path.with_name(self.path.name + ".part")
        try:
            part.write_text(f"{epoch}\n")
            os.replace(part, self.path)
        except OSError as e:  # a full disk: held in memory, written with the next newer epoch
            log.error("controller epoch not written", epoch=epoch, path=str(self.path), error=str(e))
