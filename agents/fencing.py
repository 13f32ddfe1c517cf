"""Fencing: the controller ballot this agent has promised, kept in its state
directory. A starting controller asks every agent for its promise
(`POST /v1/epoch`) with a ballot above any it found; an agent promises a ballot
no lower than the one it holds, and admits a command only from the controller it
promised, so a controller that was stopped and resumed after another took over
is refused, and one that has not asked this agent yet (it was away during the
controller's round) asks before its first command."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from common.protocol import Ballot

log = structlog.get_logger("meshd.agent")

STALE = "stale_controller"
NOT_PROMISED = "epoch_not_promised"


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str


def promise_refusal(held: Ballot, asked: Ballot) -> Refusal | None:
    """May this agent, holding `held`, promise `asked`? The same ballot again is the same controller asking
    again (it lost the answer, or this agent was away)."""
    return None if asked >= held else _stale(held, asked)


def command_refusal(held: Ballot, caller: Ballot) -> Refusal | None:
    """May the controller of `caller` command this agent, which promised `held`? Only the one it promised."""
    if caller == held:
        return None
    if caller < held:
        return _stale(held, caller)
    return Refusal(NOT_PROMISED, f"controller {caller} has not asked this agent for its promise (it holds {held}): "
                                 "a controller asks for it (POST /v1/epoch) before it commands")


def _stale(held: Ballot, caller: Ballot) -> Refusal:
    return Refusal(STALE, f"controller {caller} is older than {held}, which this agent has promised and which has "
                          "taken this mesh over: a stale controller is refused")


class Fencing:
    """The promised ballot and when it was promised, as `controller_epoch` in the state directory (JSON; a
    bare integer is an epoch kept before ballots had ids)."""

    def __init__(self, path: Path):
        self.path = path
        self.held, self.at = Ballot(0), None
        try:
            kept = json.loads(path.read_text())
            self.held, self.at = (Ballot(kept), None) if isinstance(kept, int) else \
                (Ballot(int(kept["epoch"]), str(kept["controller"])), kept.get("at"))
        except (OSError, ValueError, KeyError, TypeError):  # none kept yet (or unreadable): no promise
            pass

    def view(self) -> dict:
        return {"epoch": self.held.epoch, "controller": self.held.controller, "promised_at": self.at}

    def promise(self, ballot: Ballot) -> None:
        """Hold `ballot` from now on, also across restarts (written and synced before the answer goes out)."""
        if ballot == self.held:
            return
        self.held, self.at = ballot, time.time()
        part = self.path.with_name(self.path.name + ".part")
        try:
            with part.open("w") as f:
                f.write(json.dumps({"epoch": ballot.epoch, "controller": ballot.controller, "at": self.at}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, self.path)
        except OSError as e:  # a full disk: held in memory, written with the next promise
            log.error("controller promise not written", epoch=ballot.epoch, controller=ballot.controller,
                      path=str(self.path), error=str(e))
