"""The fleet, a pure state machine in three parts: its model (`model.py`: the state, the events `step`
takes, the actions it returns), its rules (`rules.py`: `step`; `recycling.py`: when a generation is due its
planned recycle) and what a restarted controller adopts (`adoption.py`). Its public names are importable
from here."""

from meshd.control.fleet.adoption import decide_adoption, unwatched_death
from meshd.control.fleet.model import (
    RECYCLE, Action, Adopted, Cause, CloseIncident, CountSteps, DiedUnwatched, DownRequested, FleetEvent, FleetState,
    GenerationNote, GenerationsFound, GenerationStopped, Incident, IncidentUpdated, LaunchesSent, LeftoversFound,
    MeshReady, Moment, NoteGeneration, NotReadyYet, OpenIncident, Policy, ProbeReadiness, RankDied, RankReported,
    RankView, RequestMigrated, RequestServed, RestartRequested, Result, RunStep, StartGeneration, StartRefused,
    StepDone, StepsCounted, StopGeneration, StopsEnded, Sweep, Tick, UpRequested)
from meshd.control.fleet.recycling import recycle_due, window_opened, worn
from meshd.control.fleet.rules import READINESS_POLL, STEPS_EVERY, awaiting_ready, backoff, counts_restart, step

__all__ = [
    "READINESS_POLL", "RECYCLE", "STEPS_EVERY", "Action", "Adopted", "Cause", "CloseIncident", "CountSteps",
    "DiedUnwatched", "DownRequested", "FleetEvent", "FleetState", "GenerationNote", "GenerationsFound",
    "GenerationStopped", "Incident", "IncidentUpdated", "LaunchesSent", "LeftoversFound", "MeshReady", "Moment",
    "NoteGeneration", "NotReadyYet", "OpenIncident", "Policy", "ProbeReadiness", "RankDied", "RankReported",
    "RankView", "RequestMigrated", "RequestServed", "RestartRequested", "Result", "RunStep", "StartGeneration",
    "StartRefused", "StepDone", "StepsCounted", "StopGeneration", "StopsEnded", "Sweep", "Tick", "UpRequested",
    "awaiting_ready", "backoff", "counts_restart", "decide_adoption", "recycle_due", "step", "unwatched_death",
    "window_opened", "worn"]
