"""What the agents say runs, asked of every agent at once: each node's rank
records (a restarted controller adopts by them) and the mesh's status as the
control API answers it; and rank 0's step count, asked of its agent. All three
read GET /v1/ranks one way, typed (`AgentClient.ranks`)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from common.protocol import RankReport
from meshd.config import MeshConfig
from meshd.control import fleet
from meshd.nodes.agentclient import AgentClient, AgentError
from meshd.store import Store


async def rank_views(agents: dict[str, AgentClient], errors: dict[str, str]) -> dict[str, list[RankReport] | None]:
    """Every agent's rank records; None for an agent that does not answer (why, into `errors`)."""
    async def view(node: str, client: AgentClient) -> list[RankReport] | None:
        try:
            return list((await client.ranks(timeout=5)).reports)
        except AgentError as e:
            errors[node] = str(e)
            return None

    return dict(zip(agents, await asyncio.gather(*(view(n, c) for n, c in agents.items()))))


async def rank0_steps(agent: AgentClient, generation: int) -> int | None:
    """The lockstep steps rank 0 of `generation` has made, from its status file as its agent reads it;
    None when the agent does not answer or has no status of that rank."""
    try:
        ranks = await agent.ranks(timeout=5)
    except AgentError:
        return None
    return next((r.step for r in ranks.reports if r.generation == generation and r.rank == 0), None)


async def status(cfg: MeshConfig, s: fleet.FleetState, agents: dict[str, AgentClient], store: Store) -> dict:
    async def one(n):
        try:
            ranks = await agents[n.name].ranks(timeout=3)
            rank = next((view for report, view in zip(reversed(ranks.reports), reversed(ranks.views))
                         if report.generation == s.generation), None)
            return {"node": n.name, "agent": n.agent, "agent_ok": True, "rank": rank}
        except AgentError as e:
            return {"node": n.name, "agent": n.agent, "agent_ok": False, "error": str(e), "rank": None}

    nodes = await asyncio.gather(*(one(n) for n in cfg.nodes))
    incidents = store.incidents(1)
    ballot = store.fence.ballot
    return {"mesh": cfg.name, "epoch": ballot.epoch, "controller_id": ballot.controller,
            "phase": s.phase, "generation": s.generation, "reason": s.reason,
            "ready_since": s.ready_since, "failures_in_window": len(s.failures),
            "backoff_until": s.backoff_until, "nodes": list(nodes),
            "load": [asdict(r) for r in s.ranks],
            "last_incident": incidents[0] if incidents else None}
