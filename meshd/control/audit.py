"""The control API's audit trail: every accepted action, under the name its
caller gives; refused calls tallied per remote address and route, one row
when the first comes and one summary when its window ends, so a flood of
wrong tokens neither grows the store nor hides what was done. A refused
caller's claimed name is never recorded."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

WINDOW = 60.0  # seconds over which the refusals of one remote and route are summed into one row
TALLIES = 200  # (remote, route) pairs tallied at once; the refusals of any more are summed under OTHERS
OTHERS = "other addresses"


@dataclass(frozen=True)
class Row:
    user: str
    remote: str
    action: str
    outcome: str


@dataclass
class Tally:
    since: float
    reasons: Counter = field(default_factory=Counter)  # the refusals after the first


class Refusals:
    """Which refusals become rows: `note` for each refused call, `due` at any time for the summaries of the
    windows that ended. Pure: time is an argument."""

    def __init__(self, window: float = WINDOW, tallies: int = TALLIES):
        self.window, self.tallies = window, tallies
        self.open: dict[tuple[str, str], Tally] = {}

    def note(self, remote: str, action: str, reason: str, now: float) -> list[Row]:
        rows = self.due(now)
        key = (remote, action)
        if key not in self.open and len(self.open) >= self.tallies:
            key = (OTHERS, action)
        tally = self.open.get(key)
        if tally is None:
            self.open[key] = Tally(now)
            return rows + [Row("", *key, f"refused: {reason}")]
        tally.reasons[reason] += 1
        return rows

    def due(self, now: float) -> list[Row]:
        ended = [(key, self.open.pop(key)) for key, t in list(self.open.items()) if now - t.since >= self.window]
        return [Row("", *key, f"refused {t.reasons.total()} more time(s) in {now - t.since:.0f}s: "
                              f"{t.reasons.most_common(1)[0][0]}") for key, t in ended if t.reasons]
