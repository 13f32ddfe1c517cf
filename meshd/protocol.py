"""Messages shared by the controller and the agents.

`RankSpec` is desired (what the controller asks an agent to run); events are
observations, named in the past tense, each carrying the node, generation and
rank it is about. Events travel as JSON objects with a `kind` field and, on
the agent's stream, a sequence number `seq`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class RankSpec:
    """What a node should run: parameters only, never a command line."""

    generation: int
    rank: int
    world: int
    profile: str
    model: str
    hostfile: dict
    port: int = 8100
    host: str = "127.0.0.1"
    ring_port: int = 32323
    seed: int = 0
    env: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "Event"
    node: str
    generation: int
    rank: int
    at: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True)
class RankStarted(Event):
    kind: ClassVar[str] = "RankStarted"
    pid: int = 0
    adopted: bool = False


@dataclass(frozen=True)
class RankStateChanged(Event):
    """The rank's own status file moved to another state (loading, armed, ready...)."""

    kind: ClassVar[str] = "RankStateChanged"
    state: str = ""
    load_done: int = 0
    load_total: int = 0


@dataclass(frozen=True)
class RankExited(Event):
    """The process is gone. `expected` when the agent was stopping it; `code`
    is None when it was not the agent's child (adopted) or was killed by a
    signal (then `signal` is set)."""

    kind: ClassVar[str] = "RankExited"
    pid: int = 0
    code: int | None = None
    signal: int | None = None
    expected: bool = False


@dataclass(frozen=True)
class RankSignature(Event):
    """A known fatal line in the rank's log."""

    kind: ClassVar[str] = "RankSignature"
    signature: str = ""
    severity: str = "fatal"
    line: str = ""


@dataclass(frozen=True)
class RankStalled(Event):
    kind: ClassVar[str] = "RankStalled"
    phase: str = ""
    idle_for: float = 0.0
    window: float = 0.0


@dataclass(frozen=True)
class RebootRequired(Event):
    kind: ClassVar[str] = "RebootRequired"
    reason: str = ""


@dataclass(frozen=True)
class OrphansSwept(Event):
    kind: ClassVar[str] = "OrphansSwept"
    killed: tuple = ()
    survived: tuple = ()


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (RankStarted, RankStateChanged, RankExited, RankSignature, RankStalled, RebootRequired,
                OrphansSwept)
}


def event_from_dict(data: dict[str, Any]) -> Event:
    cls = EVENT_TYPES[data["kind"]]
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in data.items() if k in names}
    for k in ("killed", "survived"):
        if k in values:
            values[k] = tuple(values[k])
    return cls(**values)
