"""Messages between the controller and the agents.

`RankSpec` is desired (what the controller asks an agent to run: parameters,
never a command line); events are observations, named in the past tense, each
about one node, generation and rank. Events travel as JSON objects with a
`kind` field and, on the agent's stream, a sequence number `seq`; a receiver
decodes them at its edge with `event_from_dict` and matches them by class.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Mapping, NamedTuple

from common.states import RankState, Role, Severity

# The headers every controller call to an agent carries: the controller's ballot, its epoch and its id. An agent
# checks them on every command (agents/fencing.py) and answers every such call with the ballot it has promised.
CONTROLLER_EPOCH = "X-Meshd-Controller-Epoch"
CONTROLLER_ID = "X-Meshd-Controller"
CONTROLLER_MESH = "X-Meshd-Mesh"  # the calling controller's mesh (its mesh.toml's name, percent-encoded)
EPOCH_ROUTE = "/v1/epoch"  # the agent's route for a controller's ballot: GET what it promised, POST to ask
# The highest epoch there is: a controller start takes one above the highest promised, so a billion starts (one a
# second for 31 years); a larger value on the wire or in a promise file is corrupt, refused with its reason.
EPOCH_MAX = 10**9
CONTROLLER_ID_FORM = re.compile(r"[0-9A-Za-z._-]{1,64}")


class BallotError(ValueError):
    """A malformed ballot header; `header` names it."""

    def __init__(self, header: str, message: str):
        super().__init__(message)
        self.header = header


class Ballot(NamedTuple):
    """A controller's claim on the mesh: the epoch it took and its own id (random, one per controller run).
    Ordered by epoch, then id, the same way on every agent: two controllers that took the same epoch at the
    same moment are told apart, and the higher one wins everywhere. (0, "") is no controller's."""

    epoch: int
    controller: str = ""

    def __str__(self) -> str:
        return f"epoch {self.epoch}" + (f" ({self.controller})" if self.controller else "")

    def headers(self) -> dict[str, str]:
        return {CONTROLLER_EPOCH: str(self.epoch), **({CONTROLLER_ID: self.controller} if self.controller else {})}

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> "Ballot | None":
        """The ballot in these headers; None without an epoch; BallotError for a malformed one."""
        controller = headers.get(CONTROLLER_ID, "")
        if controller and not CONTROLLER_ID_FORM.fullmatch(controller):
            raise BallotError(CONTROLLER_ID, f"{CONTROLLER_ID} must be 1 to 64 letters, digits, '.', '_' or '-', "
                                             f"got {controller[:40]!r}")
        raw = headers.get(CONTROLLER_EPOCH)
        if raw is None:
            return None
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or int(raw) > EPOCH_MAX:
            raise BallotError(CONTROLLER_EPOCH, f"{CONTROLLER_EPOCH} must be an integer from 0 to {EPOCH_MAX}, "
                                                f"got {raw[:40]!r}")
        return cls(int(raw), controller)


@dataclass(frozen=True)
class RankSpec:
    """What a node should run."""

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
    devices: str = ""  # the node's GPUs for this rank (CUDA_VISIBLE_DEVICES); "": its place on its host
    secret: str = field(default="", repr=False)  # the generation's rank secret, passed in the environment


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
    warm: bool = False  # the agent's standby took it: its imports and device init were done


@dataclass(frozen=True)
class RankStateChanged(Event):
    """The rank's own status file moved to another state (loading, armed, ready...)."""

    kind: ClassVar[str] = "RankStateChanged"
    state: RankState = RankState.SPAWNED
    load_done: int = 0
    load_total: int = 0


@dataclass(frozen=True)
class RankExited(Event):
    """The process is gone. `expected` when the agent's stop ended it (not one
    already exiting when the stop began); `code` is None when it was not the
    agent's child (adopted) or was killed by a signal (then `signal` is set).
    `state` is where it was when it went (loading: it never served),
    `last_line` the last line it printed (what a crash says), `peer_lost`
    whether it had printed that it lost a peer (then its death is a
    consequence of that peer's). `at` is when the agent saw the exit, which may
    be seconds after the death (a process slow to reap, a starved agent);
    `alive_at` is the rank's last heartbeat in its status file (None without
    one): it died between the two."""

    kind: ClassVar[str] = "RankExited"
    pid: int = 0
    code: int | None = None
    signal: int | None = None
    expected: bool = False
    state: RankState = RankState.SPAWNED
    last_line: str = ""
    peer_lost: bool = False
    alive_at: float | None = None


@dataclass(frozen=True)
class RankSignature(Event):
    """A known fatal line in the rank's log. Severity `reboot` means this node
    holds resources only a reboot frees: the one report of that need."""

    kind: ClassVar[str] = "RankSignature"
    signature: str = ""
    severity: Severity = Severity.FATAL
    role: Role = Role.CAUSE  # or consequence: this rank lost a peer
    line: str = ""


@dataclass(frozen=True)
class RankStalled(Event):
    kind: ClassVar[str] = "RankStalled"
    phase: str = ""
    idle_for: float = 0.0
    window: float = 0.0
    frozen: bool = False  # its heartbeat stopped too (the process is stopped), not only its loop


@dataclass(frozen=True)
class RebootRequired(Event):
    """Processes survived SIGKILL here: only a reboot of this node frees them."""

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
    """The event a JSON record describes; ValueError when it describes none."""
    try:
        cls = EVENT_TYPES[data["kind"]]
    except (KeyError, TypeError):
        raise ValueError(f"not an agent event: {str(data)[:200]}") from None
    values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
    for name in ("killed", "survived"):
        if name in values:
            values[name] = tuple(values[name])
    for name, vocabulary in (("state", RankState), ("severity", Severity), ("role", Role)):
        if name in values:
            values[name] = vocabulary(values[name])
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"{data['kind']} record is incomplete: {e}") from None


@dataclass(frozen=True)
class RankReport:
    """One rank as its agent reports it (GET /v1/ranks), read for what the controller and the doctor
    judge by: which generation and rank, its process, where it is, and how it went."""

    generation: int
    rank: int
    pid: int = 0
    state: RankState = RankState.SPAWNED
    expected: bool = True  # it exited because the agent was stopping it
    peer_lost: bool = False
    exit_code: int | None = None
    exit_signal: int | None = None
    step: int | None = None  # its lockstep steps, from its status file (None without one)

    @classmethod
    def from_dict(cls, d: dict) -> "RankReport":
        return cls(int(d["generation"]), int(d["rank"]), int(d.get("pid", 0)), RankState(d["state"]),
                   bool(d.get("expected", True)), bool(d.get("peer_lost", False)), d.get("exit_code"),
                   d.get("exit_signal"), (d.get("status") or {}).get("step"))


@dataclass(frozen=True)
class StopResult:
    """What stopping a generation on one node did: the ladder's steps, the
    processes it ended (not those already exiting when asked: they ended by
    themselves) and those that survived SIGKILL."""

    generation: int
    stopped: tuple[int, ...] = ()
    survivors: tuple[int, ...] = ()
    steps: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "StopResult":
        return cls(int(data["generation"]), tuple(data.get("stopped", ())), tuple(data.get("survivors", ())),
                   tuple(data.get("steps", ())))
