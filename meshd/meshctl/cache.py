"""`meshctl cache clear`: every node's prefix snapshots deleted, each by its own agent (`DELETE /v1/snapshots`:
the agent is the only one that touches its node's disk), all nodes at once. The ranks serve on; what they hold
in memory goes with their generation (`meshctl restart`)."""

from __future__ import annotations

import asyncio

from meshd.config import MeshConfig, Node
from meshd.nodes.agentclient import AgentClient, AgentError, agent_session


def failure(node: Node, status: int | None, message: str) -> str:
    """What to say of a node whose agent did not clear its snapshots (`status`: its HTTP answer, None when it
    was not reached), with the fix."""
    if status is None:
        return f"not reached at {node.agent} ({message}); is its agent running? `meshctl doctor` checks every node"
    if status == 401:
        return (f"its agent refused the token in {node.token_file} (401): copy the token from that node's agent "
                "(its token_file)")
    if status in (404, 405):
        return (f"its agent does not know DELETE /v1/snapshots ({status}): it runs an older meshd; "
                "`meshctl agents install` updates it")
    return f"its agent answered {status}: {message}"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cleared(answer: dict) -> str:
    """One node's line for what its agent deleted."""
    line = f"deleted {answer['files']} file{'' if answer['files'] == 1 else 's'} ({mib(answer['bytes'])}) in " \
           f"{answer['folder']}"
    if answer["problems"]:
        line += f"; could not delete {len(answer['problems'])}: " + "; ".join(answer["problems"][:5])
    return line


async def clear(cfg: MeshConfig) -> dict[str, dict]:
    """Each node's answer: the agent's ({folder, files, bytes, problems}), or {"error"}."""
    async with agent_session(cfg) as session:
        async def one(node: Node) -> dict:
            try:
                return await AgentClient(node, session).clear_snapshots()
            except AgentError as e:
                return {"error": failure(node, e.status, str(e).removeprefix(f"{node.name}: "))}
            except OSError as e:  # its token file
                return {"error": f"cannot read its token file {node.token_file} ({e.strerror})"}
        answers = await asyncio.gather(*(one(n) for n in cfg.nodes))
    return {n.name: a for n, a in zip(cfg.nodes, answers)}
