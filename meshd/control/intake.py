"""The agents' events into the controller: every agent's event log streamed,
resumed by sequence number, with a 1 s poll of the same log as the backstop.
Each record is kept in the store once, decoded into a `common.protocol` event
at this edge and handed on as what it means to the fleet (`evidence.meaning_of`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import structlog

from common.protocol import event_from_dict
from common.states import Phase
from meshd.control import fleet
from meshd.control.evidence import meaning_of
from meshd.metrics import Metrics
from meshd.nodes.agentclient import AgentClient, AgentError
from meshd.store import Store

log = structlog.get_logger("meshd.controller")


class Intake:
    """Reads each agent's log once. `errors` (node -> why its agent did not answer) is shared with
    whoever else asks the agents; `fleet_now()` is the fleet now, `feed` takes what an event means."""

    def __init__(self, agents: dict[str, AgentClient], store: Store, metrics: Metrics, errors: dict[str, str],
                 fleet_now: Callable[[], fleet.FleetState], feed: Callable[[fleet.FleetEvent], Awaitable[None]]):
        self.agents = agents
        self.store = store
        self.metrics = metrics
        self.errors = errors
        self.fleet_now = fleet_now
        self.feed = feed
        # node -> {"epoch", "seq"}: where each agent's event log was read up to
        self.seen: dict[str, dict] = {node: mark if isinstance(mark, dict) else {"epoch": None, "seq": mark}
                                      for node, mark in store.get("agent_seq", {}).items()}

    def loops(self) -> list:
        """What runs for as long as the controller does: a stream per agent, and the poll."""
        return [self._follow(node) for node in self.agents] + [self._poll_loop()]

    def _mark(self, node: str) -> tuple[int, str | None]:
        mark = self.seen.get(node, {})
        return mark.get("seq", 0), mark.get("epoch")

    async def on_record(self, node: str, record: dict) -> None:
        seq, epoch = self._mark(node)
        if record.get("epoch") not in (None, epoch):
            seq = 0  # the agent's log was reset (reinstalled, state wiped): its numbering starts again
        if record["seq"] <= seq:
            return  # the stream and the poll both deliver; keep the first
        self.seen[node] = {"epoch": record.get("epoch", epoch), "seq": record["seq"]}
        self.store.put("agent_seq", self.seen)
        self.store.record_event(record)
        try:
            ev = event_from_dict(record)
        except ValueError as e:
            log.warning("agent event not understood", node=node, error=str(e))
            return
        meaning = meaning_of(ev)
        state = self.fleet_now()
        if isinstance(meaning, fleet.RankDied) and meaning.generation == state.generation \
                and state.phase in (Phase.READY, Phase.STARTING):
            self.metrics.detection.observe(max(0.0, time.time() - ev.at))
        if meaning is not None:
            await self.feed(meaning)

    async def _follow(self, node: str) -> None:
        delay = 0.2
        while True:
            try:
                await self.agents[node].follow(*self._mark(node), lambda r: self.on_record(node, r))
            except AgentError as e:
                self.errors[node] = str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            else:
                delay = 0.2

    async def _poll_loop(self) -> None:
        """The backstop: events missed by a stream arrive here within a second.
        All agents at once, so one that does not answer delays no other."""
        async def poll(node: str, client: AgentClient) -> None:
            seq, epoch = self._mark(node)
            try:
                data = await client.events(seq, epoch, timeout=5)
                self.errors.pop(node, None)
                self.metrics.agent_up.labels(node=node).set(1)
            except AgentError as e:
                self.errors[node] = str(e)
                self.metrics.agent_up.labels(node=node).set(0)
                return
            for record in data["events"]:
                await self.on_record(node, record)

        while True:
            await asyncio.sleep(1.0)
            await asyncio.gather(*(poll(node, client) for node, client in self.agents.items()))
