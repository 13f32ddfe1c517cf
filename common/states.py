"""The vocabularies more than one layer speaks, defined once.

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

`StopMode`, how the agents stop a generation: `drain` (rank 0 finishes its
work, the others leave with it) or `kill` (the stop ladder at once).

`LadderStep`, the recovery ladder's steps (mesh.toml's `recovery.ladder`):
`restart`, `reprovision`, `reboot`.

`Severity` and `Role`, what a fatal line a rank printed means (agents/signatures.py,
`RankSignature`): `fatal` (the generation is dead) or `reboot` (this node holds
resources only a reboot frees); `cause` (this rank failed by itself) or
`consequence` (it lost a peer, whose death is the cause).

`Profile`, the launch profiles every agent knows (a node's agent config may add
others by name): `meshd-rank`, meshd's own runtime, and `mlx-lm-server`, stock
`mlx_lm.server`, which has no readiness route, lockstep steps or busy state.
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


class StopMode(StrEnum):
    DRAIN = "drain"
    KILL = "kill"


class LadderStep(StrEnum):
    RESTART = "restart"
    REPROVISION = "reprovision"
    REBOOT = "reboot"


class Severity(StrEnum):
    FATAL = "fatal"
    REBOOT = "reboot"


class Role(StrEnum):
    CAUSE = "cause"
    CONSEQUENCE = "consequence"


class Profile(StrEnum):
    MESHD_RANK = "meshd-rank"
    MLX_LM_SERVER = "mlx-lm-server"
