"""A frozen rank (SIGSTOP: its loop and its heartbeat both stopped) is the cause of its incident, and the
peers that stalled waiting for it, their heartbeats alive, are consequences, in whatever order and however
late the agents' stall reports reach the controller. So is a killed rank (SIGKILL) for its peer's closed
socket, the proxy's cut connection and a stall, whichever arrives first and however late its exit is seen
(a CUDA process is reaped 0.15-0.24 s after its socket refuses; a starved agent sees it seconds later).
The reports go through the controller's own reading of agent events and proxy observations
(evidence.meaning_of, evidence.observed) into the fleet, as they do in the controller."""

from itertools import permutations

import pytest

from common.protocol import RankExited, RankSignature, RankStalled
from common.states import RankState
from meshd.control import fleet as f
from meshd.control.evidence import meaning_of, observed
from meshd.seam import Observation

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


KILLED = 200.0  # n1's rank is killed (SIGKILL) here; its last heartbeat was 0.3 s before
REAPS = {  # when its agent sees the exit, the rank's last heartbeat, whether the stop's end waits for it
    "fast": (KILLED + 0.05, KILLED - 0.3, True),
    "slow": (KILLED + 6.0, KILLED - 0.3, True),
    "slow, no status file": (KILLED + 6.0, None, True),  # nothing dates it earlier than when it was seen
    "seen after the stop ended (its agent starved)": (KILLED + 12.0, KILLED - 0.3, False),
}
EVIDENCE = {  # each piece: (the earliest it can reach the controller, what reaches it)
    "peer's line": (KILLED + 0.15, meaning_of(RankSignature(
        node="n0", generation=1, rank=0, at=KILLED + 0.1, signature="ring_peer_closed", role="consequence",
        line="[ring] Socket 12 was closed by the peer"))),
    "proxy's": (KILLED + 0.1, observed(Observation(1, "proxy", "rank 0 closed the connection"), "n0")),
    "stall": (KILLED + 10.2, meaning_of(stalled(2, KILLED + 0.05, 10.0, frozen=False))),
}


def arrivals_of(order: tuple[str, ...], reap: str) -> list:
    """The pieces in this order, each as soon as it can come after the one before; the generation's stop
    (begun at the first arrival) ends once the killed rank is reaped (unless its agent did not answer the
    stop), then the next generation starts."""
    seen, alive, waited = REAPS[reap]
    pieces = {**EVIDENCE, "exit": (seen + 0.01, meaning_of(RankExited(
        node="n1", generation=1, rank=1, at=seen, signal=9, state=RankState.BUSY, alive_at=alive)))}
    now, arrivals = 0.0, []
    for name in order:
        earliest, died = pieces[name]
        now = max(now + 0.3, earliest)
        arrivals.append((now, died))
    stopped = max(arrivals[0][0], seen if waited else 0.0) + 0.5
    return sorted(arrivals + [(stopped, f.GenerationStopped(1, stopped_at=stopped)), (stopped, f.Tick())],
                  key=lambda a: a[0])


KILLS = [(order, reap) for reap in REAPS for order in permutations(["exit", *EVIDENCE])]


@pytest.mark.parametrize("order,reap", KILLS, ids=[f"{reap}: {', '.join(order)}" for order, reap in KILLS])
def test_a_killed_rank_is_blamed_whatever_came_first_and_however_slowly_it_was_reaped(order, reap):
    state = f.step(f.FleetState(), f.UpRequested(), 0.0, POLICY)[0]
    state = f.step(state, f.MeshReady(1), 10.0, POLICY)[0]
    arrivals = arrivals_of(order, reap)
    for now, ev in arrivals:
        state = f.step(state, ev, now, POLICY)[0]
    incident = state.incident
    assert (state.generation, incident.generation) == (2, 1)
    assert (incident.cause, incident.node, incident.rank, incident.detail, incident.primary) == \
        ("exit", "n1", 1, "signal 9", True)
    first = next(ev for _, ev in arrivals if isinstance(ev, f.RankDied))
    assert incident.opened_at == arrivals[0][0]
    assert first.cause == "exit" or first.describe() in incident.consequences


def test_a_rank_own_fatal_line_after_the_death_window_does_not_take_over():
    """Only an exit is this incident's however late it happened: a fatal line past the window is another
    failure (printed while the generation was being stopped, say), not the cause."""
    state = f.step(f.FleetState(), f.UpRequested(), 0.0, POLICY)[0]
    state = f.step(state, f.MeshReady(1), 10.0, POLICY)[0]
    for now, ev in [(KILLED, EVIDENCE["proxy's"][1]),
                    (KILLED + 4.0, meaning_of(RankSignature(node="n2", generation=1, rank=2, at=KILLED + 3.9,
                                                            signature="jaccl_enomem", role="cause", line="-12")))]:
        state = f.step(state, ev, now, POLICY)[0]
    assert (state.incident.cause, state.incident.node, state.incident.primary) == ("proxy", "n0", False)
