"""The seam between the data plane (the proxy) and the control plane (the
controller): a read-only view of the fleet plus one call back. The proxy knows
the fleet only through this; the controller implements it in-process today,
and the same three calls can cross a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from common.states import Phase


@dataclass(frozen=True)
class Serving:
    """What the data plane needs to know of the fleet."""

    phase: Phase
    generation: int
    reason: str  # why it is not serving, when it is not
    rank0_url: str
    rank0_secret: str = field(default="", repr=False)  # this generation's; rank 0 answers nothing without it

    @property
    def ready(self) -> bool:
        return self.phase == Phase.READY

    @property
    def rank0_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.rank0_secret}"} if self.rank0_secret else {}


@dataclass(frozen=True)
class Observation:
    """Something the data plane saw about generation `generation`: that it may be
    broken (`proxy`: an upstream failure; `probe`: the idle probe failed, with the
    HTTP status when there was one), that it served a request (`served`), or that
    a stream it cut goes on on the next generation (`migrated`)."""

    generation: int
    source: str  # proxy | probe | served | migrated
    detail: str = ""
    status: int | None = None


class FleetView(Protocol):
    def serving(self) -> Serving:
        """The fleet now."""

    async def wait_serving(self, predicate: Callable[[Serving], bool], timeout: float) -> Serving:
        """The fleet once `predicate` holds for it, or when `timeout` seconds have passed."""

    async def report(self, observation: Observation) -> None:
        """Tell the control plane what was seen; it decides what it means."""
