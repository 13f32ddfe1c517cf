"""The controller's side of the agent API: one small client per node, and the
event stream follower that resumes by sequence number after any disconnect.
A controller's client sends its ballot with every call, asks the agent for its
promise before the first (and again when the agent has lost it), and learns from
any answer that a newer controller has taken the mesh over: from then on it
calls no agent."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable
from urllib.parse import urlencode

import aiohttp

from common.protocol import EPOCH_ROUTE, Ballot, BallotError, RankReport, RankSpec, StopResult
from common.states import StopMode
from meshd.config import MeshConfig, Node
from meshd.epochs import Fence, Held, Standing, standing


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


@dataclass(frozen=True)
class Ranks:
    """GET /v1/ranks: the ranks an agent knows of and its standby."""

    node: str
    generation: int | None  # its live generation
    reports: tuple[RankReport, ...]  # each rank, read for what the controller and the doctor judge by
    views: tuple[dict, ...]  # each rank as the agent shows it (its status file, resources), for display
    standby: int | None  # the standby's pid
    standby_ready: bool

    @classmethod
    def from_wire(cls, d: dict) -> Ranks:
        return cls(d["node"], d["generation"], tuple(RankReport.from_dict(r) for r in d["ranks"]),
                   tuple(d["ranks"]), d.get("standby"), bool(d.get("standby_ready")))


@dataclass(frozen=True)
class Swept:
    """POST /v1/sweep: the debris stopped ({pid, reason, what} each), what survived SIGKILL, the ladder's steps."""

    killed: tuple[dict, ...]
    survived: tuple[dict, ...]
    steps: tuple[str, ...]


def _query(**params) -> str:
    given = {k: v for k, v in params.items() if v is not None}
    return f"?{urlencode(given)}" if given else ""


class AgentClient:
    def __init__(self, node: Node, session: aiohttp.ClientSession, fence: Fence | None = None):
        """`fence`: the controller's, once it has taken its epoch (doctor and meshctl call without one)."""
        self.node = node
        self.session = session
        self.fence = fence
        self.promised = False  # this agent holds the fence's ballot, as far as its last answer said
        self._asking = asyncio.Lock()
        self.token = node.token_file.read_text().strip()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}", **(self.fence.headers() if self.fence else {})}

    async def call(self, method: str, path: str, body=None, timeout: float = 10.0):
        """The agent's JSON answer. A controller's call goes only to an agent that promised its ballot (it is
        asked first), and never once another controller has taken the mesh over; a command the agent refuses
        because it lost the promise meanwhile (restarted, its state wiped) is sent once more after asking."""
        if self.fence is not None:
            await self.ensure_promised()
        status, data, _ = await self._request(method, path, body, timeout)
        if status == 409 and self.fence is not None and not self.promised and self.fence.newer is None:
            await self.ensure_promised()
            status, data, _ = await self._request(method, path, body, timeout)
        if status >= 400:
            raise AgentError(f"{self.node.name}: {method} {path} -> {status}: "
                             f"{(data or {}).get('error', {}).get('message', data)}", status)
        return data

    # --- one method per agent route -------------------------------------------------------------------
    async def node_facts(self, model: str | None = None, package: str | None = None,
                         timeout: float = 10.0) -> dict:
        """GET /v1/node: the node's facts (boot id, memory, the model's files and fingerprint when `model` is
        named, the launch profiles, ...) as agents/node.py gathers them."""
        return await self.call("GET", f"/v1/node{_query(model=model, package=package)}", timeout=timeout)

    async def ranks(self, timeout: float = 10.0) -> Ranks:
        return Ranks.from_wire(await self.call("GET", "/v1/ranks", timeout=timeout))

    async def start_rank(self, spec: RankSpec, timeout: float = 30.0) -> bool:
        """POST /v1/ranks; whether it started the rank (False: it was running already)."""
        return bool((await self.call("POST", "/v1/ranks", asdict(spec), timeout=timeout))["created"])

    async def stop_generation(self, generation: int, mode: StopMode, grace: float | None = None,
                              timeout: float = 10.0) -> StopResult:
        """POST /v1/generations/G/stop; `grace` None: the agent's own."""
        body = {"mode": str(mode), **({} if grace is None else {"grace": grace})}
        return StopResult.from_dict(await self.call("POST", f"/v1/generations/{generation}/stop", body, timeout))

    async def sweep(self, grace: float, generation: int | None, timeout: float = 60.0) -> Swept:
        """POST /v1/sweep: stop the debris; `generation` may keep running (None: none of this agent's ranks)."""
        d = await self.call("POST", "/v1/sweep", {"grace": grace, "generation": generation}, timeout)
        return Swept(tuple(d["killed"]), tuple(d["survived"]), tuple(d["steps"]))

    async def rank_log(self, generation: int, rank: int, lines: int, after: int | None = None,
                       timeout: float = 10.0) -> dict:
        """GET /v1/ranks/G/r/log: the log's last `lines` (or those written after offset `after`) and its
        offset, as common/http.log_answer gives them (the control API relays it as is)."""
        return await self.call("GET", f"/v1/ranks/{generation}/{rank}/log{_query(lines=lines, after=after)}",
                               timeout=timeout)

    async def agent_log(self, lines: int, after: int | None = None, timeout: float = 10.0) -> dict:
        """GET /v1/log: the agent's own log, as rank_log."""
        return await self.call("GET", f"/v1/log{_query(lines=lines, after=after)}", timeout=timeout)

    async def events(self, since: int, epoch: str | None, timeout: float = 5.0) -> dict:
        """GET /v1/events?stream=0: {node, epoch, seq, events} after `since` of log `epoch`."""
        return await self.call("GET", f"/v1/events?stream=0&since={since}&epoch={epoch or ''}", timeout=timeout)

    async def reboot(self, timeout: float = 40.0) -> None:
        await self.call("POST", "/v1/reboot", timeout=timeout)

    async def clear_snapshots(self, timeout: float = 600.0) -> dict:
        """DELETE /v1/snapshots: {folder, files, bytes, problems}."""
        return await self.call("DELETE", "/v1/snapshots", timeout=timeout)

    async def _request(self, method: str, path: str, body, timeout: float) -> tuple[int, object, Ballot | None]:
        """The answer's status, its JSON and the ballot the agent names in it."""
        try:
            async with self.session.request(method, f"{self.node.agent}{path}", json=body, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                held = self._heard(r.headers)
                return r.status, await r.json(content_type=None), held
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise AgentError(f"{self.node.name}: {method} {path} failed: {type(e).__name__} {e}") from e

    def _heard(self, headers) -> Ballot | None:
        """The ballot this agent names in its answer, and what it says of this controller taken in."""
        try:
            held = Ballot.from_headers(headers)
        except BallotError:
            return None
        if held is None or self.fence is None:
            return held
        match standing(self.fence.ballot, held):
            case Standing.SUPERSEDED:
                self.fence.supersede(held, f"{self.node.name}'s agent")
            case Standing.UNPROMISED:
                self.promised = False
            case Standing.PROMISED:
                self.promised = True
        return held

    async def held(self) -> Held:
        """The ballot this agent has promised, the highest generation it has run and the mesh it serves
        (AgentError when it does not answer, or cannot say: its promise file cannot be trusted)."""
        data = await self.call("GET", EPOCH_ROUTE, timeout=5)
        return Held(Ballot(int(data["epoch"]), str(data["controller"])), int(data["highest_generation"]),
                    data.get("mesh"))

    async def promise(self) -> Ballot:
        """Ask for the promise of this controller's ballot; the ballot the agent holds after it (this one's, or
        a newer one's of this mesh that refused it). AgentError when it does not answer, serves another mesh or
        cannot trust its promise file."""
        status, data, held = await self._request("POST", EPOCH_ROUTE, None, 5)
        if status not in (200, 409) or held is None:
            message = data.get("error", {}).get("message", data) if isinstance(data, dict) else data
            raise AgentError(f"{self.node.name}: POST {EPOCH_ROUTE} -> {status}: {message}", status)
        return held

    async def ensure_promised(self) -> None:
        """Ask for the promise unless this agent holds it; AgentError when it refuses or does not answer, and
        at once when another controller has taken the mesh over."""
        async with self._asking:
            if not self.promised and self.fence.newer is None:
                await self.promise()
        if self.fence.newer is not None:
            raise AgentError(f"{self.node.name}: not called: controller {self.fence.newer} has taken this mesh "
                             f"over ({self.fence.by} said so); this one ({self.fence.ballot}) acts on nothing more")

    async def follow(self, since: int, epoch: str | None, on_record: Callable[[dict], Awaitable[None]]) -> None:
        """Stream events after `since` of log `epoch` until the connection drops (raises AgentError)."""
        url = f"{self.node.agent}/v1/events?since={since}" + (f"&epoch={epoch}" if epoch else "")
        try:
            if self.fence is not None:
                await self.ensure_promised()
            async with self.session.get(url, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=None, sock_read=30)) as r:
                self._heard(r.headers)
                if r.status != 200:
                    raise AgentError(f"{self.node.name}: event stream -> {r.status}")
                async for raw in r.content:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("data: "):
                        await on_record(json.loads(line[6:]))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise AgentError(f"{self.node.name}: event stream dropped: {type(e).__name__}") from e
        raise AgentError(f"{self.node.name}: event stream ended")
