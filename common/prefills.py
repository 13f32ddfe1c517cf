"""Long prefills as a client and an operator see them: which prompts going in are long, when each is said, its
rate and when its first token is expected; and the words they are said in (the stream's SSE comment,
`meshctl status`, the status page).

An engine gives each prompt going in as a `Position`; rank 0 feeds them to a `Watch` after every step, which
says the long ones (`due`) at most every `every` seconds each. A prefill is long when what its cache did not
hold is at least `LONG_TOKENS`, or once it has gone on for `LONG_SECONDS`. Its rate is measured from when
the watch first saw it (None until it moved since); its first token is expected when the rest goes in at that
rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LONG_TOKENS = 2048  # a prompt this long (what its cache did not hold) is said from its first chunk on
LONG_SECONDS = 1.0  # a shorter one once it has been going in this long
EVERY = 1.0  # seconds between two words of one prefill, by default (rank's --prefill-report-every)
RID_SHOWN = 16  # characters of a request id an operator's views show


@dataclass(frozen=True)
class Position:
    """A request's prompt going in, as its engine holds it: `done` of its `total` tokens through the target
    (what its cache held counts as done)."""

    rid: str
    done: int
    total: int


@dataclass(frozen=True)
class Progress:
    """A long prefill as it is said: `rate` in tokens a second since it was first seen and `eta` the seconds
    to its first token at that rate (None before it moved)."""

    rid: str
    done: int
    total: int
    rate: float | None
    eta: float | None

    def words(self) -> str:
        return words(self.done, self.total, self.rate, self.eta)

    def comment(self) -> bytes:
        """The SSE comment a streamed answer carries (clients skip comments)."""
        return f": prefill {self.words()}\n\n".encode()

    def shown(self) -> dict:
        """As a rank's status file holds it: the id shortened, the rate and eta rounded."""
        return {**asdict(self), "rid": self.rid[:RID_SHOWN],
                "rate": None if self.rate is None else round(self.rate, 1),
                "eta": None if self.eta is None else round(self.eta, 1)}


def long_prefills(status: dict) -> list[str]:
    """The long prefills rank 0 says in a mesh's status (the control API's GET /v1/status), a line each, as
    `meshctl status` and the status page show them; every rank steps the same prompts, so rank 0's are the
    mesh's."""
    lines = []
    for n in status.get("nodes", []):
        r = n.get("rank") or {}
        if r.get("rank") == 0:
            lines += [f"prefill {p['rid']} on {n['node']} rank 0: {words(p['done'], p['total'], p['rate'], p['eta'])}"
                      for p in (r.get("status") or {}).get("prefills", [])]
    return lines


def words(done: int, total: int, rate: float | None, eta: float | None) -> str:
    """`2048/4096 tokens, 812 tok/s, first token in ~2.5 s` (the rate and the wait left out while not known)."""
    said = f"{done}/{total} tokens"
    if rate is not None:
        said += f", {rate:.0f} tok/s"
    if eta is not None:
        said += f", first token in ~{eta:.1f} s" if eta < 60 else f", first token in ~{eta / 60:.0f} min"
    return said


@dataclass
class Seen:
    """What the watch knows of one prefill: when it first saw it, how far it was then, when it last said it."""

    since: float
    done: int
    said: float | None = None


def is_long(seen: Seen, total: int, now: float) -> bool:
    return total - seen.done >= LONG_TOKENS or now - seen.since >= LONG_SECONDS


def due(seen: Seen, total: int, now: float, every: float) -> bool:
    """Whether a prefill is said now: it is long, and was not said in the last `every` seconds."""
    return is_long(seen, total, now) and (seen.said is None or now - seen.said >= every)


def progress(seen: Seen, at: Position, now: float) -> Progress:
    moved, took = at.done - seen.done, now - seen.since
    rate = moved / took if moved > 0 and took > 0 else None
    return Progress(at.rid, at.done, at.total, rate, (at.total - at.done) / rate if rate else None)


class Watch:
    """The prefills going in, from one step to the next (a clock injected: `now`)."""

    def __init__(self, every: float = EVERY):
        self.every = every
        self._seen: dict[str, Seen] = {}

    def step(self, positions: list[Position], now: float) -> tuple[list[Progress], list[Progress]]:
        """The long prefills due to be said now, and every long prefill; those no longer going in are
        forgotten."""
        seen = {p.rid: self._seen.get(p.rid) or Seen(now, p.done) for p in positions}
        self._seen = seen
        said, long = [], []
        for p in positions:
            s = seen[p.rid]
            if not is_long(s, p.total, now):
                continue
            long.append(progress(s, p, now))
            if due(s, p.total, now, self.every):
                s.said = now
                said.append(long[-1])
        return said, long
