"""The controller's epoch, granted by the agents. A starting controller reads
the ballot every agent has promised, takes an epoch above the highest it found
(and above its store's last), and asks every agent to promise it: a prepare and
promise round, as a fencing token from a quorum is. Ballots are bound to a mesh
(its mesh.toml's name): an agent that serves another mesh neither counts toward
the majority nor is promised. It commands nothing before a majority of the mesh's
agents promised; an agent that was away promises before its first command. The
same answers name the highest generation each agent has run or recorded, which
the controller numbers its generations above. Epochs are bounded
(`common.protocol.EPOCH_MAX`): one out of range, from an agent or the store, is
refused with its reason and never taken. The decisions of the round are here,
pure: which epoch to take, which generation numbers are used, whether a round
holds, what an agent's answer says of this controller. The round itself runs in
the reconciler (meshd/control/controller.py) over the agent client, which holds
the `Fence`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple
from urllib.parse import quote

import structlog

from agents.fencing import mesh_header
from common.protocol import EPOCH_MAX, EPOCH_ROUTE, Ballot

log = structlog.get_logger("meshd.controller")


@dataclass
class Fence:
    """A controller's ballot. A newer one met in the store or named by an agent sets `superseded`: this
    controller is stale, and must act on nothing more."""

    ballot: Ballot
    mesh: str = ""
    newer: Ballot | None = None
    by: str = ""
    superseded: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def epoch(self) -> int:
        return self.ballot.epoch

    def headers(self) -> dict[str, str]:
        """What every call of this controller carries: its ballot and its mesh."""
        return {**self.ballot.headers(), **mesh_header(self.mesh)}

    def supersede(self, newer: Ballot, by: str) -> None:
        if self.newer is None:
            log.error("a newer controller has taken this mesh over; this one stops", epoch=str(self.ballot),
                      newer=str(newer), by=by)
        self.newer, self.by = newer, by
        self.superseded.set()


class Held(NamedTuple):
    """An agent's answer to a starting controller: the ballot it has promised, the highest generation it has
    run or recorded (its ranks, its rank logs), whichever controller numbered it, and the mesh it serves (None:
    none yet)."""

    ballot: Ballot
    generation: int = 0
    mesh: str | None = None


class Reach(NamedTuple):
    """Where an operator reaches a node's agent: its URL and the file with its token (mesh.toml's)."""

    agent: str
    token_file: str


def belongs(held: Held, mesh: str) -> bool:
    """Whether an agent that answered `held` is one of `mesh`'s: it serves it, or no mesh yet."""
    return held.mesh is None or held.mesh == mesh


def foreign(held: Held, mesh: str, reach: Reach) -> tuple[str, str] | None:
    """Why an agent that answered `held` does not belong to `mesh`, and the fix (None: it does belong)."""
    if belongs(held, mesh):
        return None
    return (f"it serves mesh {held.mesh!r} (it promised {held.ballot}), not {mesh!r}",
            f"remove the node from this mesh.toml; or, if it left mesh {held.mesh!r} for good (or that mesh was "
            f"renamed {mesh!r}), stop {held.mesh!r}'s controller and release the node: curl -X DELETE -H "
            f"\"Authorization: Bearer $(cat {reach.token_file})\" "
            f"'{reach.agent}{EPOCH_ROUTE}?mesh={quote(held.mesh, safe='')}'")


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
    """Fewer than a majority answered (`asked`: what was asked of them); `missing`: node -> why not; `foreign`:
    node -> why an agent that answered does not count (it serves another mesh)."""

    asked: str
    have: int
    need: int
    missing: dict[str, str]
    foreign: dict[str, str] = field(default_factory=dict)

    def reason(self) -> str:
        why = "; ".join(f"{node}: {what}" for node, what in {**self.missing, **self.foreign}.items())
        fix = " and ".join((["start the agents that did not answer or make them reachable"] if self.missing else [])
                           + (["free or remove the nodes of another mesh"] if self.foreign else []))
        return (f"{self.have} of {self.have + len(self.missing) + len(self.foreign)} agents {self.asked}, and a "
                f"majority ({self.need}) must before a controller commands any ({why}); {fix} (`meshctl doctor` "
                "names what is wrong), then start the controller again")


RESET_PROMISE = ("on each of those nodes stop the agent, delete controller_epoch in its state directory and start it "
                 "again (its ranks keep running), then start the controller again")


@dataclass(frozen=True)
class NoEpochLeft:
    """Agents hold the highest epoch there is (`held`: node -> its ballot): no controller can take one above."""

    held: dict[str, Ballot]

    def reason(self) -> str:
        who = ", ".join(f"{node} holds {ballot}" for node, ballot in self.held.items())
        return (f"{who}, the highest epoch there is ({EPOCH_MAX}), so no controller can take one above it; this "
                f"one took none and stored none. Such a promise was written by hand or by a broken client: "
                f"{RESET_PROMISE}")


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


def belonging(mesh: str, heard: dict[str, Held | str], reach: dict[str, Reach]) -> tuple[dict[str, Held],
                                                                                        dict[str, str]]:
    """The agents that answered and belong to `mesh` (they serve it, or no mesh yet), and node -> why each other
    one that answered does not, with the fix (`reach`: node -> where its agent is)."""
    ours, others = {}, {}
    for node, h in heard.items():
        if isinstance(h, Held):
            why = foreign(h, mesh, reach[node])
            if why is None:
                ours[node] = h
            else:
                others[node] = ": ".join(why)
    return ours, others


def choose_epoch(mesh: str, last: int, heard: dict[str, Held | str],
                 reach: dict[str, Reach]) -> int | Short | NoEpochLeft:
    """The epoch a starting controller of `mesh` takes: one above the store's `last` and above every ballot its
    agents answered with (`heard`: node -> what it holds, or why it did not answer; an agent of another mesh is
    none of its agents; `reach`: node -> where its agent is, for the fix). Only when a majority of the mesh's
    nodes answered as its agents: every epoch a majority ever promised is then known (two majorities share an
    agent). Never above `EPOCH_MAX`; `last` is below it (`stored_epoch`)."""
    ours, others = belonging(mesh, heard, reach)
    need = quorum(len(heard))
    if len(ours) < need:
        return Short("answered", len(ours), need, {n: h for n, h in heard.items() if isinstance(h, str)}, others)
    if at_max := {n: h.ballot for n, h in ours.items() if h.ballot.epoch >= EPOCH_MAX}:
        return NoEpochLeft(at_max)
    return max([last, *(h.ballot.epoch for h in ours.values())]) + 1


def stored_epoch(value) -> int | str:
    """The store's last epoch as read (None: none yet), or why it is not one a controller can take an epoch
    above (corrupt, or no epoch left above it): such a value is ignored, and the agents' promises alone number
    the next."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < EPOCH_MAX:
        return f"the store's last epoch {str(value)[:40]} is not an integer from 0 to {EPOCH_MAX - 1}"
    return value


def generations_used(mesh: str, heard: dict[str, Held | str]) -> int:
    """The highest generation any answering agent of `mesh` has run or recorded (0: none). A generation the
    controller starts is numbered above it and above its store's, so a fresh or restored state directory never
    reuses the number of another controller's rank log, status file or record; a generation that runs is adopted
    under its own number."""
    return max((h.generation for h in heard.values() if isinstance(h, Held) and belongs(h, mesh)), default=0)


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
