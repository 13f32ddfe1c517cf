"""The controller's side of the agent API: one small client per node, and the
event stream follower that resumes by sequence number after any disconnect.
A controller's client sends its epoch with every call and learns from a
refusal that a newer controller has taken the mesh over."""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import aiohttp

from common.protocol import CONTROLLER_EPOCH
from meshd.config import MeshConfig, Node
from meshd.store import Fence


def agent_session(cfg: MeshConfig) -> aiohttp.ClientSession:
    """A session for the agents' APIs; TLS pinned to the mesh CA where a node speaks https."""
    if cfg.agents_over_tls:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=cfg.client_tls()))
    return aiohttp.ClientSession()


class AgentError(Exception):
    """The agent answered with an error (`status`) or could not be reached (`status` None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AgentClient:
    def __init__(self, node: Node, session: aiohttp.ClientSession, fence: Fence | None = None):
        """`fence`: the controller's (doctor and meshctl call without one)."""
        self.node = node
        self.session = session
        self.fence = fence
        self.token = node.token_file.read_text().strip()

    @property
    def headers(self) -> dict:
        epoch = {CONTROLLER_EPOCH: str(self.fence.epoch)} if self.fence else {}
        return {"Authorization": f"Bearer {self.token}", **epoch}

    async def call(self, method: str, path: str, body=None, timeout: float = 10.0):
        try:
            async with self.session.request(method, f"{self.node.agent}{path}", json=body, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                data = await r.json(content_type=None)
                if r.status == 409 and self.fence and CONTROLLER_EPOCH in r.headers:
                    self.fence.supersede(int(r.headers[CONTROLLER_EPOCH]), f"{self.node.name}'s agent")
                if r.status >= 400:
                    raise AgentError(f"{self.node.name}: {method} {path} -> {r.status}: "
                                     f"{(data or {}).get('error', {}).get('message', data)}", r.status)
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise AgentError(f"{self.node.name}: {method} {path} failed: {type(e).__name__} {e}") from e

    async def follow(self, since: int, epoch: str | None, on_record: Callable[[dict], Awaitable[None]]) -> None:
        """Stream events after `since` of log `epoch` until the connection drops (raises AgentError)."""
        url = f"{self.node.agent}/v1/events?since={since}" + (f"&epoch={epoch}" if epoch else "")
        try:
            async with self.session.get(url, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=None, sock_read=30)) as r:
                if r.status != 200:
                    raise AgentError(f"{self.node.name}: event stream -> {r.status}")
                async for raw in r.content:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("data: "):
                        await on_record(json.loads(line[6:]))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise AgentError(f"{self.node.name}: event stream dropped: {type(e).__name__}") from e
        raise AgentError(f"{self.node.name}: event stream ended")
