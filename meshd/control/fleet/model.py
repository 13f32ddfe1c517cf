"""The fleet's model: its state, the events `step` takes (past tense), the actions it returns
(imperative), and the vocabularies they speak. Values only: frozen, no live objects, no clock."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

from common.states import LadderStep, Phase, RankState, StopMode
from meshd.config import Recovery, Recycle


class Cause(StrEnum):
    """What an incident's evidence was (`RankDied.cause`, `Incident.cause`; the store and the restart
    metric's `reason` label keep the value)."""

    EXIT = "exit"  # the rank's process ended unasked
    SIGNATURE = "signature"  # it printed a known fatal line (agents/signatures.py)
    STALL = "stall"  # it stopped progressing
    REBOOT_REQUIRED = "reboot_required"  # processes survived SIGKILL on its node
    LAUNCH = "launch"  # its agent would not start it
    PROXY = "proxy"  # the proxy saw rank 0 fail a request
    PROBE = "probe"  # the proxy's idle probe failed
    READINESS = "readiness"  # rank 0's readiness probe answered against it
    PREFLIGHT = "preflight"  # the preflight refused the start
    START_TIMEOUT = "start_timeout"  # not ready within start_deadline
    RECYCLE = "recycle"  # a planned incident: the generation ends on purpose, no failure


RECYCLE = Cause.RECYCLE


class Moment(StrEnum):
    """The steps of an incident's timeline, each with when it happened."""

    PLANNED = "planned"  # a planned recycle began
    DETECTED = "detected"  # death evidence arrived
    STOPPED = "stopped"  # the generation's stop ladders ended
    SWEPT = "swept"  # then the sweep
    BACKOFF = "backoff"  # a wait before the next start began
    STARTED = "started"  # the next generation was asked for
    LOADED = "loaded"  # its last rank loaded
    READY = "ready"  # it served again
    SERVED = "served"  # it answered its first request


class GenerationNote(StrEnum):
    """What the store notes of a generation (`NoteGeneration.what`)."""

    STARTED = "started"
    READY = "ready"
    ENDED = "ended"


# --- state ------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy(Recovery):
    nodes: tuple[str, ...] = ()
    recycle: Recycle = Recycle()


@dataclass(frozen=True)
class Incident:
    opened_at: float
    cause: Cause
    node: str
    rank: int
    generation: int
    detail: str
    steps: tuple[str, ...] = ()
    consequences: tuple[str, ...] = ()  # "node rank R: what it said", peers that only lost the cause
    timeline: tuple[tuple[Moment, float], ...] = ()  # (step, when)
    primary: bool = True  # the named rank failed by itself (not a consequence of a peer)
    migrated: int = 0  # streams it cut that resumed on the next generation

    def at(self, step: Moment, when: float) -> "Incident":
        return replace(self, timeline=self.timeline + ((step, when),))


@dataclass(frozen=True)
class RankView:
    """One node's rank of the current generation, as its agent last reported it."""

    node: str
    state: RankState = RankState.SPAWNED
    load_done: int = 0
    load_total: int = 0


@dataclass(frozen=True)
class FleetState:
    phase: Phase = Phase.STOPPED
    generation: int = 0
    failures: tuple[float, ...] = ()  # times of failures still inside the window
    ladder_step: int = 0  # index into policy.ladder for the next recovery
    backoff_until: float | None = None
    ready_since: float | None = None
    idle_since: float | None = None  # since when no rank of the generation reported itself busy
    started_at: float | None = None
    incident: Incident | None = None
    reason: str = ""  # why failed / what is pending
    reboot_nodes: tuple[str, ...] = ()
    restart_requested: bool = False  # the generation ends on purpose: start the next, count no failure
    ranks: tuple[RankView, ...] = ()
    last_load_failure: str = ""  # what the previous generation said when it died before serving
    closing: Incident | None = None  # closed at ready, waiting for its first served request
    steps: int = 0  # rank 0's lockstep steps in this generation, as last counted
    numbered_to: int = 0  # the highest generation number the agents have used, whichever controller's
    planned: str = ""  # the generation ends on purpose: its planned_restart ("drain", "cut"); "" otherwise
    due_since: float | None = None  # since when the serving generation is due a recycle, waiting for idle
    steps_asked_at: float | None = None  # when rank 0's steps were last asked for ([recycle] steps)


# --- events (past tense) -------------------------------------------------------
@dataclass(frozen=True)
class UpRequested:
    pass


@dataclass(frozen=True)
class DownRequested:
    force: bool = False


@dataclass(frozen=True)
class RestartRequested:
    pass


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class MeshReady:
    generation: int


@dataclass(frozen=True)
class RankReported:
    """A rank's own state, as its agent reported it (`at`: when the agent saw it)."""
    node: str
    generation: int
    state: RankState
    load_done: int = 0
    load_total: int = 0
    at: float | None = None


@dataclass(frozen=True)
class StepsCounted:
    """Rank 0 of generation G has made `steps` lockstep steps (its status file, through its agent)."""
    generation: int
    steps: int


@dataclass(frozen=True)
class RankDied:
    """Death evidence about one rank (`cause`: what it was). `consequence`: the rank only lost a peer.
    `deterministic`: no restart fixes it. `load_line`: the rank died before it served, saying this (the
    same line twice in a row is deterministic)."""
    node: str
    rank: int
    generation: int
    cause: Cause
    detail: str = ""
    reboot: bool = False
    consequence: bool = False
    deterministic: bool = False
    load_line: str = ""
    at: float | None = None  # when it happened, by the agent's clock (None: when it arrives)

    def describe(self) -> str:
        return f"{self.node} rank {self.rank}: {self.cause}: {self.detail}"


@dataclass(frozen=True)
class LaunchesSent:
    """Every node was asked to start its rank of generation G (a refusal came as its own evidence): rank 0's
    readiness is probed from now on."""
    generation: int


@dataclass(frozen=True)
class NotReadyYet:
    """Rank 0 of generation G answered its readiness probe not ready yet (or not at all, with no evidence of
    a death)."""
    generation: int


@dataclass(frozen=True)
class StopsEnded:
    """Generation G's stop ladders ended on every node at `stopped_at` (`survivors`: the nodes where processes
    survived SIGKILL); its sweep is next."""
    generation: int
    survivors: tuple[str, ...] = ()
    stopped_at: float | None = None


@dataclass(frozen=True)
class GenerationStopped:
    """Generation G is gone everywhere: the stop ladders ended at `stopped_at`, then the sweep."""
    generation: int
    survivors: tuple[str, ...] = ()
    stopped_at: float | None = None


@dataclass(frozen=True)
class StartRefused:
    """The preflight refused to start generation G: a mistake no restart fixes."""
    generation: int
    reason: str


@dataclass(frozen=True)
class RequestServed:
    """The proxy answered a request from generation G."""
    generation: int


@dataclass(frozen=True)
class RequestMigrated:
    """A stream generation G cut resumes on the next generation."""
    generation: int


@dataclass(frozen=True)
class StepDone:
    """A ladder step other than restart (reprovision, reboot) finished."""
    step: LadderStep
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Adopted:
    """A restarted controller found generation G running on every node."""
    generation: int
    ready: bool


@dataclass(frozen=True)
class DiedUnwatched:
    """A restarted controller found that generation `died.generation` lost a rank while no controller
    watched (the agents kept its exit): an incident like any death, then the next generation."""
    died: RankDied


@dataclass(frozen=True)
class GenerationsFound:
    """A starting controller found generations up to `highest` run or recorded on the agents (rank logs,
    records), whichever controller numbered them: the next generation it starts is numbered above them."""
    highest: int


@dataclass(frozen=True)
class LeftoversFound:
    """A restarted controller found ranks that make no whole generation (the
    newest of them is `generation`): they must stop before anything starts, and
    their generation numbers are never reused. `up`: the operator's last word
    was up, so the next generation starts once they are gone."""
    generation: int
    up: bool


FleetEvent = (UpRequested | DownRequested | RestartRequested | Tick | MeshReady | RankReported | StepsCounted
              | RankDied | LaunchesSent | NotReadyYet | StopsEnded | GenerationStopped | StartRefused | RequestServed
              | RequestMigrated | StepDone | Adopted | DiedUnwatched | GenerationsFound | LeftoversFound)


# --- actions (imperative) -----------------------------------------------------
@dataclass(frozen=True)
class StartGeneration:
    generation: int


@dataclass(frozen=True)
class StopGeneration:
    generation: int
    mode: StopMode
    grace: float


@dataclass(frozen=True)
class Sweep:
    """Stop what is left of meshd on every node (nothing of it runs between generations), then tell the fleet
    that generation G is gone (`GenerationStopped`, with what its stop found)."""
    generation: int
    survivors: tuple[str, ...] = ()
    stopped_at: float | None = None


@dataclass(frozen=True)
class ProbeReadiness:
    """Ask rank 0 of generation G whether it serves, `after` seconds from now; its answer comes back as
    `MeshReady`, death evidence or `NotReadyYet`."""
    generation: int
    after: float = 0.0


@dataclass(frozen=True)
class CountSteps:
    """Read rank 0's lockstep steps in generation G (`StepsCounted` when its agent says)."""
    generation: int


@dataclass(frozen=True)
class RunStep:
    step: LadderStep  # reprovision | reboot
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpenIncident:
    incident: Incident
    planned: str = ""  # a planned recycle's trigger (age, window); "" for a failure


@dataclass(frozen=True)
class IncidentUpdated:
    incident: Incident


@dataclass(frozen=True)
class CloseIncident:
    incident: Incident
    serving_back_at: float
    steps: tuple[str, ...]


@dataclass(frozen=True)
class NoteGeneration:
    generation: int
    what: GenerationNote
    detail: str = ""


Action = (StartGeneration | StopGeneration | Sweep | ProbeReadiness | CountSteps | RunStep | OpenIncident
          | IncidentUpdated | CloseIncident | NoteGeneration)


class Result(NamedTuple):
    """What one transition made: the state after it, and what to carry out."""

    state: FleetState
    actions: list[Action]
