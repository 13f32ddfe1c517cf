"""Adoption: a restarted controller keeps a healthy running generation. It waits
(bounded) for every agent to say what runs; what a partial view cannot settle is
settled once the view is whole. What to adopt is decided in
meshd/control/fleet/adoption.py (pure); the reconciler is seen through `Adopter`."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import structlog

from common.protocol import RankReport
from common.states import Phase
from meshd.control import fleet, survey
from meshd.nodes.agentclient import AgentClient

log = structlog.get_logger("meshd.controller")


class Adopter(Protocol):
    """What adoption reads of the reconciler and asks of it."""

    agents: dict[str, AgentClient]
    agent_errors: dict[str, str]
    policy: fleet.Policy
    state: fleet.FleetState

    def desired_up(self) -> bool: ...
    async def readiness(self) -> tuple[bool, fleet.RankDied | None, str | None]: ...
    def learn_weights(self, generation: int, said: str | None) -> None: ...
    async def feed(self, event: fleet.FleetEvent) -> None: ...


async def adopt(ctl: Adopter) -> bool:
    """What runs, adopted (or stopped, or restarted, as `fleet.decide_adoption` says) once every agent answered
    or `adopt_wait` passed. False: the view was not whole and settled nothing; `adopt_when_whole` settles it."""
    deadline = time.monotonic() + ctl.policy.adopt_wait
    while None in (views := await survey.rank_views(ctl.agents, ctl.agent_errors)).values() \
            and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    if await _decide(ctl, views) or None not in views.values():
        return True
    log.warning("adoption waits for agents", missing=[n for n, v in views.items() if v is None])
    return False


async def adopt_when_whole(ctl: Adopter) -> None:
    """Asked again every 2 s while the fleet is stopped, until every agent answers."""
    while ctl.state.phase == Phase.STOPPED:
        await asyncio.sleep(2.0)
        views = await survey.rank_views(ctl.agents, ctl.agent_errors)
        if None not in views.values():
            await _decide(ctl, views)
            return


async def _decide(ctl: Adopter, views: dict[str, list[RankReport] | None]) -> bool:
    ready, _, said = await ctl.readiness()
    decision = fleet.decide_adoption(views, ctl.policy.nodes, desired_up=ctl.desired_up(), rank0_ready=ready)
    if decision is None:
        return False
    log.info("adopting", decision=repr(decision))
    if isinstance(decision, fleet.Adopted):
        ctl.learn_weights(decision.generation, said)
    await ctl.feed(decision)
    return True
