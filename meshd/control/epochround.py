"""The controller's epoch round, over the agent client: what every agent of the
mesh promised, an epoch above it all and the store's last, recorded, then promised
by a majority (meshd/epochs.py decides each step, pure). Asked again each second
until the wait has passed; the controller commands nothing before it holds."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Awaitable, Callable, Iterable

import structlog

from common.protocol import Ballot
from meshd import epochs
from meshd.config import MeshConfig
from meshd.nodes.agentclient import AgentClient, AgentError
from meshd.store import Store

log = structlog.get_logger("meshd.controller")


class EpochRefused(Exception):
    """The agents did not grant this controller an epoch: another took the mesh over as it started, no
    majority of the mesh's agents answered, or they hold the highest epoch there is. It has commanded
    nothing."""


async def ask(agents: dict[str, AgentClient], errors: dict[str, str], question: Callable[[AgentClient], Awaitable],
              nodes: Iterable[str]) -> dict[str, epochs.Held | Ballot | str]:
    """`question(client)` of each node's agent at once: its answer, or why it did not answer (also kept in
    `errors`, node -> the agent's error)."""
    async def one(node: str) -> epochs.Held | Ballot | str:
        try:
            return await question(agents[node])
        except AgentError as e:
            errors[node] = str(e)
            return str(e).removeprefix(f"{node}: ")

    nodes = list(nodes)
    return dict(zip(nodes, await asyncio.gather(*(one(n) for n in nodes))))


async def take_epoch(cfg: MeshConfig, store: Store, agents: dict[str, AgentClient], errors: dict[str, str],
                     wait: float) -> int:
    """The round for `cfg`'s mesh; every agent client holds the fence once the epoch is taken. Returns the
    highest generation the mesh's agents that answered have run or recorded; EpochRefused when the agents did
    not grant it within `wait` seconds (at once when none is left to take, or another controller beat it)."""
    deadline = time.monotonic() + wait
    mesh = cfg.name
    reach = {n.name: epochs.Reach(n.agent, str(n.token_file)) for n in cfg.nodes}
    ballot, heard = None, {}
    while True:
        if ballot is None:
            found = await ask(agents, errors, AgentClient.held, agents)
            verdict = epochs.choose_epoch(mesh, store.last_epoch(), found, reach)
            if isinstance(verdict, epochs.NoEpochLeft):
                raise EpochRefused(verdict.reason())
            if isinstance(verdict, int):
                ballot = Ballot(verdict, secrets.token_hex(6))
                fence = store.take_epoch(ballot, mesh)
                for client in agents.values():
                    client.fence = fence
                continue
        else:
            heard.update(await ask(agents, errors, AgentClient.promise, [n for n in agents if heard.get(n) != ballot]))
            verdict = epochs.judge_round(ballot, heard)
            match verdict:
                case epochs.Granted(missing=missing):
                    log.info("epoch promised", epoch=str(ballot), promised=len(heard) - len(missing),
                             away=missing or None)
                    return epochs.generations_used(mesh, found)
                case epochs.Beaten(newer=newer, node=node):
                    raise EpochRefused(
                        f"controller {newer} took this mesh over as this one ({ballot}) started ({node}'s agent "
                        "promised it): two controllers for one mesh, on two state directories. This one commanded "
                        "nothing; to have it run the mesh, stop the other, then start this one (it takes over)")
        if time.monotonic() >= deadline:
            raise EpochRefused(verdict.reason())
        await asyncio.sleep(1.0)
