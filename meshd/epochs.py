"""The controller's epoch, granted by the agents. A starting controller reads
the ballot every agent has promised, takes an epoch above the highest it found
(and above its store's last), and asks every agent to promise it: a prepare and
promise round, as a fencing token from a quorum is. It commands nothing before a
majority of the mesh's agents promised; an agent that was away promises before
its first command. The same answers name the highest generation each agent has
run or recorded, which the controller numbers its generations above. The
decisions of the round are here, pure: which epoch to take, which generation
numbers are used, whether a round holds, what an agent's answer says of this
controller. The round itself runs in the reconciler
(meshd/control/controller.py) over the agent client, which holds the `Fence`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import structlog

from common.protocol import Ballot

log = structlog.get_logger("meshd.controller")


@dataclass
class Fence:
    """A controller's ballot. A newer one met in the store or named by an agent sets `superseded`: this
    controller is stale, and must act on nothing more."""

    ballot: Ballot
    newer: Ballot | None = None
    by: str = ""
    superseded: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def epoch(self) -> int:
        return self.ballot.epoch

    def supersede(self, newer: Ballot, by: str) -> None:
        if self.newer is None:
            log.error("a newer controller has taken this mesh over; this one stops", epoch=str(self.ballot),
                      newer=str(newer), by=by)
        self.newer, self.by = newer, by
        self.superseded.set()


class Held(NamedTuple):
    """An agent's answer to a starting controller: the ballot it has promised, and the highest generation it
    has run or recorded (its ranks, its rank logs), whichever controller numbered it."""

    ballot: Ballot
    generation: int = 0


class Standing(str, Enum):
    """What the ballot an agent holds says of this controller."""

    PROMISED = "promised"  # it holds this controller's ballot: commands go through
    SUPERSEDED = "superseded"  # a newer controller's: this one is stale
    UNPROMISED = "unpromised"  # an older one: it has not promised this controller (away during the round, reset)


def standing(ours: Ballot, held: Ballot) -> Standing:
    if held == ours:
        return Standing.PROMISED
    return Standing.SUPERSEDED if held > ours else Standing.UNPROMISED


def quorum(nodes: int) -> int:
    """Promises a controller needs before it commands: a majority of the mesh's agents, so that of two
    controllers' rounds at least one agent sees both."""
    return nodes // 2 + 1


@dataclass(frozen=True)
class Short:
    """Fewer than a majority answered (`asked`: what was asked of them); `missing`: node -> why not."""

    asked: str
    have: int
    need: int
    missing: dict[str, str]

    def reason(self) -> str:
        why = "; ".join(f"{node}: {what}" for node, what in self.missing.items())
        return (f"{self.have} of {self.have + len(self.missing)} agents {self.asked}, and a majority ({self.need}) "
                f"must before a controller commands any ({why}); start those agents or make them reachable "
                "(`meshctl doctor` names what is wrong), then start the controller again")


@dataclass(frozen=True)
class Granted:
    """A majority promised; `missing` (node -> why) promise before their first command."""

    missing: dict[str, str]


@dataclass(frozen=True)
class Beaten:
    """An agent holds a newer ballot than this controller's: another controller took the mesh over while this
    one started (two on two state directories at once)."""

    newer: Ballot
    node: str


def choose_epoch(last: int, heard: dict[str, Held | str]) -> int | Short:
    """The epoch a starting controller takes: one above the store's `last` and above every ballot the agents
    answered with (`heard`: node -> what it holds, or why it did not answer). Only when a majority
    answered: every epoch a majority ever promised is then known (two majorities share an agent)."""
    held = [h.ballot for h in heard.values() if isinstance(h, Held)]
    need = quorum(len(heard))
    if len(held) < need:
        return Short("answered", len(held), need, {n: h for n, h in heard.items() if isinstance(h, str)})
    return max([last, *(b.epoch for b in held)]) + 1


def generations_used(heard: dict[str, Held | str]) -> int:
    """The highest generation any answering agent has run or recorded (0: none). A generation the controller
    starts is numbered above it and above its store's, so a fresh or restored state directory never reuses the
    number of another controller's rank log, status file or record; a generation that runs is adopted under
    its own number."""
    return max((h.generation for h in heard.values() if isinstance(h, Held)), default=0)


def judge_round(ours: Ballot, heard: dict[str, Ballot | str]) -> Granted | Beaten | Short:
    """Where the round stands after asking each agent to promise `ours` (`heard`: node -> the ballot it holds
    now, or why it did not answer). A newer ballot anywhere beats this controller, whatever else promised:
    it was taken after this one read the agents."""
    newer = [(b, n) for n, b in heard.items() if isinstance(b, Ballot) and standing(ours, b) == Standing.SUPERSEDED]
    if newer:
        return Beaten(*max(newer))
    promised = [n for n, b in heard.items() if b == ours]
    missing = {n: b if isinstance(b, str) else f"it holds {b}" for n, b in heard.items() if b != ours}
    need = quorum(len(heard))
    return Granted(missing) if len(promised) >= need else Short(f"promised {ours}", len(promised), need, missing)
