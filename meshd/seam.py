"""The seam between the data plane (meshd-proxy) and the control plane (the
controller): a read-only view of the fleet plus one call back. The proxy knows
the fleet only through this. The controller implements it; the control API
carries it across the process boundary (GET /v1/serving streams `Serving` as
`wire()` dicts, POST /v1/observations takes an `Observation`'s), and
meshd/dataplane/fleetlink.py implements it again on the proxy's side. The
planes meet in data here too: the fleet as the controller records it in its
store (`FleetRecord`, `WeightsRecord`), which the proxy and meshctl read while no controller runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Callable, Protocol

from common.errors import ApiError
from common.secretfile import derive, ensure_secret
from common.states import Phase
from meshd.store import read_value


class Source(StrEnum):
    """What an `Observation` is: evidence that a generation may be broken (`proxy`: an upstream failure;
    `probe`: the idle probe failed), a request it served (`served`), or a stream it cut that goes on on the
    next generation (`migrated`)."""

    PROXY = "proxy"
    PROBE = "probe"
    SERVED = "served"
    MIGRATED = "migrated"


SOURCES = tuple(Source)


def rank_key(state_dir: Path, create: bool = False) -> str:
    """The mesh's rank key, state_dir/rank.key, that every generation's rank secret derives from. The
    controller creates it (`create`); a reader where there is none, or where it may not read it: OSError."""
    path = state_dir / "rank.key"
    return ensure_secret(path) if create else path.read_text().strip()


def rank_secret(key: str, generation: int) -> str:
    """Generation `generation`'s rank secret: rank 0 answers only to it, and a restarted controller
    computes it again for the generation it adopts. Another generation's is refused (no replay)."""
    return derive(key, f"rank secret of generation {generation}")


@dataclass(frozen=True)
class Serving:
    """What the data plane needs to know of the fleet."""

    phase: Phase
    generation: int
    reason: str  # why it is not serving, when it is not
    rank0_url: str
    rank0_secret: str = field(default="", repr=False)  # this generation's; rank 0 answers nothing without it
    planned: str = ""  # the generation it names ends on purpose: "drain" (its requests finish on it, cut
    #                    none) or "cut" (resume them on the next); "" when it died, or does not end
    fingerprint: str = ""  # of the weights the generation loaded, as its rank 0 said when ready; "" unknown

    @property
    def ready(self) -> bool:
        return self.phase == Phase.READY

    @property
    def rank0_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.rank0_secret}"} if self.rank0_secret else {}

    def wire(self) -> dict:
        return {**asdict(self), "phase": str(self.phase)}

    @classmethod
    def from_wire(cls, d: dict) -> "Serving":
        return cls(Phase(d["phase"]), int(d["generation"]), str(d["reason"]), str(d["rank0_url"]),
                   str(d.get("rank0_secret", "")), str(d.get("planned", "")), str(d.get("fingerprint", "")))


@dataclass(frozen=True)
class Observation:
    """Something the data plane saw about generation `generation` (`Source`), with the
    HTTP status a failed probe was answered when there was one."""

    generation: int
    source: Source
    detail: str = ""
    status: int | None = None

    def wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> "Observation":
        """An observation as the control API takes it, or ApiError(400) naming the field that is wrong."""
        g, source, detail, status = d.get("generation"), d.get("source"), d.get("detail", ""), d.get("status")
        if type(g) is not int or g < 0:
            raise ApiError(400, "'generation' must be a non-negative integer", param="generation")
        if source not in SOURCES:
            raise ApiError(400, f"'source' must be one of {', '.join(SOURCES)}", param="source")
        if not isinstance(detail, str) or len(detail) > 4096:
            raise ApiError(400, "'detail' must be a string of at most 4096 characters", param="detail")
        if status is not None and (type(status) is not int or not 100 <= status <= 599):
            raise ApiError(400, "'status' must be an HTTP status (100-599) or null", param="status")
        return cls(g, Source(source), detail, status)


@dataclass(frozen=True)
class FleetRecord:
    """The fleet as the controller records it in its store (key "fleet") whenever its phase or generation
    changes: the generation a restarted controller numbers on from, what a proxy that starts while the
    controller is away serves by, and what tells meshctl whether ranks may run while no controller does."""

    phase: Phase
    generation: int

    KEY = "fleet"

    def wire(self) -> dict:
        return {"phase": str(self.phase), "generation": self.generation}

    @classmethod
    def from_wire(cls, d: object) -> "FleetRecord | None":
        """The record a stored value holds; None for no value, or one that is not such a record."""
        try:
            return cls(Phase(d["phase"]), int(d["generation"]))
        except (TypeError, KeyError, ValueError):
            return None

    @classmethod
    def read(cls, store_path: Path) -> "FleetRecord | None":
        """The record in the store at `store_path`, read without writing to it (the controller owns it); None
        where there is none, or the store cannot be read."""
        return cls.from_wire(read_value(store_path, cls.KEY))


@dataclass(frozen=True)
class WeightsRecord:
    """The fingerprint of the weights generation `generation` loaded, as the controller records it in its store
    (key "weights"; "" while its rank 0 has not said): what a proxy that starts while the controller is away
    tells other meshes' weights apart by."""

    generation: int
    fingerprint: str

    KEY = "weights"

    def wire(self) -> dict:
        return {"generation": self.generation, "fingerprint": self.fingerprint}

    @classmethod
    def from_wire(cls, d: object) -> "WeightsRecord | None":
        """The record a stored value holds; None for no value, or one that is not such a record."""
        try:
            return cls(int(d["generation"]), str(d["fingerprint"]))
        except (TypeError, KeyError, ValueError):
            return None

    @classmethod
    def read(cls, store_path: Path) -> "WeightsRecord | None":
        """The record in the store at `store_path`, read without writing to it; None where there is none."""
        return cls.from_wire(read_value(store_path, cls.KEY))


async def wait_until(changed: asyncio.Condition, serving: Callable[[], Serving],
                     predicate: Callable[[Serving], bool], timeout: float) -> Serving:
    """`serving()` once `predicate` holds for it (at once when it already does), or after `timeout`
    seconds; `changed` is notified whenever what `serving()` answers may have changed."""
    if predicate(now := serving()):
        return now
    async with changed:
        try:  # asyncio.timeout, not wait_for: under Python 3.11 a waiter cancelled while wait_for's inner task
            # took the lock back could leave the condition locked for good (tests/control/test_seam.py)
            async with asyncio.timeout(timeout):
                await changed.wait_for(lambda: predicate(serving()))
        except TimeoutError:
            pass
    return serving()


class FleetView(Protocol):
    def serving(self) -> Serving:
        """The fleet now."""

    async def wait_serving(self, predicate: Callable[[Serving], bool], timeout: float) -> Serving:
        """The fleet once `predicate` holds for it, or when `timeout` seconds have passed."""

    async def report(self, observation: Observation) -> None:
        """Tell the control plane what was seen; it decides what it means."""
