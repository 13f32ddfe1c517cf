"""A frozen rank (SIGSTOP: its loop and its heartbeat both stopped) is the cause of its incident, and the
peers that stalled waiting for it, their heartbeats alive, are consequences, in whatever order and however
late the agents' stall reports reach the controller. The reports go through the controller's own reading of
agent events (evidence.meaning_of) into the fleet, as they do in the controller."""

import pytest

from common.protocol import RankStalled
from meshd.control import fleet as f
from meshd.control.evidence import meaning_of

NODES = ("n0", "n1", "n2", "n3")
POLICY = f.Policy(nodes=NODES, max_failures=5)  # death_window: the default 2 s
FROZE = 100.0  # rank 0 stops (SIGSTOP) here; the peers block in their next collective right after


def stalled(rank: int, stopped_moving: float, window: float, frozen: bool) -> RankStalled:
    """The report of rank `rank`'s agent once its window has run out (0.1 s later: its poll)."""
    idle = window + 0.1
    return RankStalled(node=f"n{rank}", generation=1, rank=rank, at=stopped_moving + idle, phase="busy",
                       idle_for=idle, window=window, frozen=frozen)


def peer(rank: int, window: float = 10.0) -> RankStalled:
    return stalled(rank, FROZE + 0.05, window, frozen=False)


def rank0(window: float = 10.0) -> RankStalled:
    return stalled(0, FROZE, window, frozen=True)


RESTARTED = [(112.0, f.GenerationStopped(1)), (112.0, f.Tick())]  # generation 2 starting
SERVES = RESTARTED + [(118.0, f.MeshReady(2))]  # generation 2 serves: the incident is closing

# (arrivals at the controller, in order: (when, agent event or fleet event)), the rank blamed
ORDERS = [
    ("frozen first", [(110.2, rank0()), (110.3, peer(1))], 0),
    ("frozen 0.5 s after a peer", [(110.2, peer(1)), (110.7, rank0(10.5))], 0),
    ("frozen after the death window: its longer prompt's window",
     [(110.2, peer(1)), (113.3, rank0(13.0))], 0),
    ("frozen after two peers, their agents quicker", [(110.2, peer(1)), (110.3, peer(2)), (115.0, rank0(14.8))], 0),
    ("frozen once the next generation starts", [(110.2, peer(1))] + RESTARTED + [(114.0, rank0(13.8))], 0),
    ("frozen once the next generation serves", [(110.2, peer(1))] + SERVES + [(125.0, rank0(24.8))], 0),
    ("a rank that froze after its peers had stalled is not their cause",
     [(110.2, peer(1)), (123.3, stalled(2, FROZE + 13.0, 10.0, frozen=True))], 1),
]


@pytest.mark.parametrize("arrivals,blamed", [o[1:] for o in ORDERS], ids=[o[0] for o in ORDERS])
def test_a_frozen_rank_is_blamed_for_the_peers_that_stalled_waiting_for_it(arrivals, blamed):
    state = f.step(f.FleetState(), f.UpRequested(), 0.0, POLICY)[0]
    state = f.step(state, f.MeshReady(1), 10.0, POLICY)[0]
    for now, ev in arrivals:
        state = f.step(state, meaning_of(ev) if isinstance(ev, RankStalled) else ev, now, POLICY)[0]
    incident = state.incident if state.incident and state.incident.generation == 1 else state.closing
    assert (incident.generation, incident.cause, incident.node, incident.rank) == (1, "stall", f"n{blamed}", blamed)
    assert incident.opened_at == 110.2  # the first report opened it: one incident, whoever came first
    if blamed == 0:
        assert incident.primary and "heartbeat alive" not in incident.detail
        peers = {ev.node for _, ev in arrivals if isinstance(ev, RankStalled) and not ev.frozen}
        assert {c.split(" ")[0] for c in incident.consequences} == peers
        assert all("its heartbeat alive" in c for c in incident.consequences)
