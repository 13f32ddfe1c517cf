"""meshd-proxy's view of the fleet: `seam.FleetView` over the control API.

It follows GET /v1/serving (the fleet now, then every change, an empty line at
each heartbeat) and sends what the proxy sees to POST /v1/observations. While
the controller is away (its stream broke or went quiet) the proxy keeps serving
the last generation it was told of. Evidence against that generation then holds
new requests back (up to the proxy's queue_wait, as during any recovery) until
the controller is back with a newer one; the evidence itself is delivered when
it is.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque
from dataclasses import replace
from typing import Callable

import aiohttp
import structlog

from common.states import Phase
from meshd.config import MeshConfig
from meshd.seam import FleetRecord, Observation, Serving, Source, WeightsRecord, rank_key, rank_secret, wait_until

log = structlog.get_logger("meshd.fleetlink")

SILENCE = 6.0  # seconds without a line (three of the controller's heartbeats): the controller is away
EVIDENCE = (Source.PROXY, Source.PROBE)
NOT_YET = Serving(Phase.STARTING, 0, "meshd-proxy has not reached the controller yet", "")


def remembered(cfg: MeshConfig) -> Serving | None:
    """The fleet as the controller last recorded it in its store, for a proxy that starts while the
    controller is away: the generation, rank 0's address by the config, its secret from the mesh's rank
    key. None when there is no record (or no key: the proxy runs as the controller's user)."""
    fleet, weights = FleetRecord.read(cfg.store_path), WeightsRecord.read(cfg.store_path)
    try:
        key = rank_key(cfg.state_dir)
    except OSError:
        return None
    if fleet is None:
        return None
    fingerprint = weights.fingerprint if weights is not None and weights.generation == fleet.generation else ""
    return Serving(fleet.phase, fleet.generation, "as the controller last recorded it", cfg.rank0_url,
                   rank_secret(key, fleet.generation), fingerprint=fingerprint)


def local_view(told: Serving | None, connected: bool, suspect: int | None) -> Serving:
    """What the proxy serves by: what the controller last said, except that a generation the proxy saw
    fail while the controller is away is recovering until the controller says otherwise."""
    if told is None:
        return NOT_YET
    if not connected and told.ready and suspect == told.generation:
        return replace(told, phase=Phase.RECOVERING,
                       reason=f"generation {told.generation} failed while the controller is away; waiting for it")
    return told


class RemoteFleet:
    def __init__(self, cfg: MeshConfig, told: Serving | None = None):
        self.cfg = cfg
        self.told = told  # what the controller last said (or the proxy this one replaced had heard)
        self.connected = False
        self.suspect: int | None = None
        self.pending: deque[Observation] = deque(maxlen=64)  # reports the controller has not taken yet
        self.changed = asyncio.Condition()
        self._delivering = asyncio.Lock()
        self.session: aiohttp.ClientSession | None = None
        self._tls: ssl.SSLContext | None = cfg.client_tls() if cfg.control.tls else None

    # --- FleetView ------------------------------------------------------------------
    def serving(self) -> Serving:
        return local_view(self.told, self.connected, self.suspect)

    async def wait_serving(self, predicate: Callable[[Serving], bool], timeout: float) -> Serving:
        return await wait_until(self.changed, self.serving, predicate, timeout)

    async def report(self, observation: Observation) -> None:
        if not self.connected and observation.source in EVIDENCE:
            await self._update(suspect=observation.generation)
        self.pending.append(observation)
        if self.connected:
            await self._deliver()

    # --- following the controller -----------------------------------------------------
    async def follow(self) -> None:
        """Follow the controller for as long as the proxy runs, reconnecting whenever it is away."""
        self.session = aiohttp.ClientSession()
        pause = 0.1
        try:
            while True:
                try:
                    await self._follow_once()
                    why = "the controller ended the stream"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as e:
                    why = f"{type(e).__name__}: {e}"
                if self.connected:
                    log.warning("the controller is away; serving the last generation it named", reason=why,
                                generation=self.told.generation if self.told else None)
                    await self._update(connected=False)
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)
        finally:
            await self.session.close()

    async def _follow_once(self) -> None:
        headers = {"Authorization": f"Bearer {self._token()}"}
        timeout = aiohttp.ClientTimeout(total=None, connect=SILENCE, sock_read=SILENCE)
        async with self.session.get(f"{self.cfg.control.url}/v1/serving", headers=headers, timeout=timeout,
                                    ssl=self._tls) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                  message=(await r.text())[:200])
            async for line in r.content:
                if line.strip():
                    await self._update(told=Serving.from_wire(json.loads(line)))
                if not self.connected:
                    log.info("following the controller", generation=self.told.generation if self.told else None)
                    await self._update(connected=True, suspect=None)  # the controller judges from here on
                    await self._deliver()

    def _token(self) -> str:
        path = self.cfg.state_dir / "control.token"
        try:
            return path.read_text().strip()
        except OSError as e:  # the controller writes it at its first start
            raise OSError(f"cannot read the control token at {path} ({e.strerror})") from None

    async def _update(self, **changes) -> None:
        async with self.changed:
            for k, v in changes.items():
                setattr(self, k, v)
            if self.told is not None and self.suspect is not None and self.told.generation != self.suspect:
                self.suspect = None  # the controller has moved on from the generation the proxy saw fail
            self.changed.notify_all()

    async def _deliver(self) -> None:
        """Send the reports the controller has not taken, oldest first; keep them when it is away."""
        async with self._delivering:
            while self.pending:
                try:
                    async with self.session.post(f"{self.cfg.control.url}/v1/observations",
                                                 json=self.pending[0].wire(), ssl=self._tls,
                                                 headers={"Authorization": f"Bearer {self._token()}"},
                                                 timeout=aiohttp.ClientTimeout(total=10)) as r:
                        if r.status >= 500:
                            return
                        if r.status != 202:
                            log.error("the controller refused a report", status=r.status,
                                      answer=(await r.text())[:200])
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    return
                self.pending.popleft()
