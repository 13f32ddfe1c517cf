"""The two state vocabularies, defined once.

`RankState`, one rank as its agent reports it (a generation changes state as a
unit only in the fleet's eyes; each rank moves on its own):

    spawned   the agent started the process; no status file yet
    loading   reading and sharding weights (`load_done`/`load_total`)
    armed     loaded, past the arm barrier, not yet admitting
    ready     in the lockstep loop, idle
    busy      in the lockstep loop, a request in flight
    draining  leaving the loop at the same step as every other rank
    exited    the process is gone (exit code or signal on the record)

`Phase`, the fleet as the controller sees it (one generation G at a time):

    stopped     nothing runs; `meshctl up` starts generation G+1
    starting    generation G spawned, not every rank ready yet
    ready       generation G serves
    recovering  generation G died; stopping it, climbing the ladder, backing off
    draining    `meshctl down`: generation G finishes its work and exits
    failed      given up (too many failures, or a cause no restart fixes);
                serves 503 until an operator acts
"""

from __future__ import annotations

from enum import StrEnum


class RankState(StrEnum):
    SPAWNED = "spawned"
    LOADING = "loading"
    ARMED = "armed"
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    EXITED = "exited"


class Phase(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RECOVERING = "recovering"
    DRAINING = "draining"
    FAILED = "failed"
