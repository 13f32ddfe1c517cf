"""What a restarted controller makes of the ranks its agents report: pure over
`common.protocol.RankReport`s; its answer is an event that goes through `step`."""

from __future__ import annotations

from common.protocol import RankReport
from common.states import RankState
from meshd.control.fleet.model import Adopted, Cause, DiedUnwatched, LeftoversFound, RankDied, UpRequested

Adoption = Adopted | DiedUnwatched | LeftoversFound | UpRequested


def decide_adoption(views: dict[str, list[RankReport] | None], nodes: tuple[str, ...], *, desired_up: bool,
                    rank0_ready: bool) -> Adoption | None:
    """What a restarted controller makes of the ranks its agents report (`views`:
    node -> that agent's rank records, None when it did not answer): the event
    to feed, or None for nothing (yet).

    One generation with each node running exactly its own rank: adopt it. Nothing
    running: start when the operator's last word was up. Anything else is the
    leftovers of a broken generation, to stop, but never on a partial view: an
    agent that does not answer may be restarting beside a rank that serves. With
    a partial view, the answering nodes running their own ranks of one generation
    while rank 0 serves are adopted; anything else waits for the whole view."""
    live = {node: [r for r in views[node] if r.state != RankState.EXITED] for node in nodes
            if views.get(node) is not None}
    gens = {r.generation for rs in live.values() for r in rs}
    own = len(gens) == 1 and all(len(live[n]) == 1 and live[n][0].rank == i
                                 for i, n in enumerate(nodes) if n in live)
    partial = len(live) < len(nodes)
    died = unwatched_death(views, nodes) if desired_up else None
    if not gens:
        return DiedUnwatched(died) if died else (UpRequested() if desired_up else None)
    if own and not partial and not died:
        return Adopted(gens.pop(), ready=rank0_ready)
    if own and rank0_ready and not died:
        return Adopted(gens.pop(), ready=True)
    if partial:
        return None
    return DiedUnwatched(died) if died else LeftoversFound(max(gens), desired_up)


def unwatched_death(views: dict[str, list[RankReport] | None], nodes: tuple[str, ...]) -> RankDied | None:
    """A rank of the newest generation the agents know that exited without being asked to: the one that
    failed by itself before one that only lost a peer, then the lowest rank."""
    records = [(i, n, r) for i, n in enumerate(nodes) for r in (views.get(n) or [])]
    if not records:
        return None
    last = max(r.generation for _, _, r in records)
    dead = [(r.peer_lost, i, n, r) for i, n, r in records
            if r.generation == last and r.state == RankState.EXITED and not r.expected]
    if not dead:
        return None
    lost, _, node, r = min(dead, key=lambda d: d[:2])
    how = f"signal {r.exit_signal}" if r.exit_signal else f"exit code {r.exit_code}"
    return RankDied(node, r.rank, last, Cause.EXIT, f"{how}, while no controller watched", consequence=lost)
