"""What observations mean, table by table: agent events and proxy observations
as the fleet sees them (cause or consequence, deterministic or not), the
proxy's stall windows, and which ranks the agent stops at once."""

import pytest

from agents.stall import blocked_on_peer
from common.statusfile import RankStatus
from common.protocol import RankExited, RankSignature, RankStalled, RankStateChanged, RebootRequired
from common.states import RankState
from meshd.control import fleet
from meshd.config import Proxy as ProxyConfig
from meshd.control.evidence import launch_refused, meaning_of, observed, readiness
from meshd.dataplane.proxy import stall_window
from meshd.seam import Observation
from meshd.upstream import COMPLETION, READY, ReadinessSeen

AT = dict(node="n1", generation=3, rank=1, at=100.0)
BAD_TYPE = "ValueError: Model type no_such_architecture not supported."

EVENTS = [
    ("killed while serving", RankExited(**AT, signal=9, state=RankState.READY),
     dict(cause="exit", detail="signal 9", consequence=False, load_line="")),
    ("exit 0 while serving", RankExited(**AT, code=0, state=RankState.BUSY, last_line="bye"),
     dict(cause="exit", detail="exit code 0", consequence=False)),
    ("crash at load", RankExited(**AT, code=1, state=RankState.LOADING, last_line=BAD_TYPE),
     dict(cause="exit", detail=f"exit code 1: {BAD_TYPE}", consequence=False, load_line=BAD_TYPE)),
    ("killed, seen late: dated by its last heartbeat",
     RankExited(**AT, signal=9, state=RankState.BUSY, alive_at=94.5), dict(detail="signal 9", at=94.5)),
    ("killed without a status file: dated when seen", RankExited(**AT, signal=9, state=RankState.BUSY),
     dict(at=100.0)),
    ("killed at load is no load line", RankExited(**AT, signal=9, state=RankState.LOADING, last_line="loading 3/9"),
     dict(consequence=False, load_line="")),
    ("exit after losing a peer", RankExited(**AT, code=1, state=RankState.READY, peer_lost=True,
                                            last_line="RuntimeError: [ring] connection to a peer was lost"),
     dict(consequence=True, load_line="")),
    ("a peer lost at init is no load line",
     RankExited(**AT, code=1, state=RankState.LOADING, peer_lost=True, last_line="[jaccl] Couldn't connect (error: 60)"),
     dict(consequence=True, load_line="")),
    ("expected exit", RankExited(**AT, code=0, expected=True), None),
    ("a rank's own fatal line", RankSignature(**AT, signature="jaccl_enomem", role="cause",
                                              line="[jaccl] Send failed with error code -12"),
     dict(cause="signature", consequence=False, reboot=False)),
    ("a lost peer's line", RankSignature(**AT, signature="ring_peer_lost", role="consequence", line="x"),
     dict(cause="signature", consequence=True)),
    ("a reboot line", RankSignature(**AT, signature="jaccl_protection_domain", severity="reboot", line="x"),
     dict(reboot=True, consequence=False)),
    ("a stopped rank", RankStalled(**AT, phase="busy", idle_for=12.0, window=10.0, frozen=True),
     dict(cause="stall", consequence=False)),
    ("a rank blocked on a peer", RankStalled(**AT, phase="busy", idle_for=12.0, window=10.0, frozen=False),
     dict(cause="stall", consequence=True)),
    ("survived SIGKILL", RebootRequired(**AT, reason="pid 7 survived"), dict(cause="reboot_required", reboot=True)),
]


@pytest.mark.parametrize("name,event,expected", EVENTS, ids=[e[0] for e in EVENTS])
def test_agent_events_as_death_evidence(name, event, expected):
    meaning = meaning_of(event)
    if expected is None:
        assert meaning is None
        return
    assert isinstance(meaning, fleet.RankDied) and (meaning.node, meaning.rank, meaning.generation) == ("n1", 1, 3)
    assert {k: getattr(meaning, k) for k in expected} == expected


def test_a_state_change_is_progress_not_evidence():
    assert meaning_of(RankStateChanged(**AT, state=RankState.LOADING, load_done=2, load_total=9)) == \
        fleet.RankReported("n1", 3, RankState.LOADING, 2, 9, 100.0)


@pytest.mark.parametrize("status,deterministic", [(400, True), (404, True), (409, False), (None, False),
                                                  (502, False)])
def test_a_launch_the_agent_refuses_is_deterministic_unless_another_generation_holds_it(status, deterministic):
    assert launch_refused("n0", 0, 2, status, "refused").deterministic == deterministic


@pytest.mark.parametrize("obs,deterministic", [
    (Observation(4, "probe", "probe answered 404", 404), True),
    (Observation(4, "probe", "probe failed: TimeoutError"), False),
    (Observation(4, "probe", "probe answered 503", 503), False),
    (Observation(4, "proxy", "ServerDisconnectedError"), False),
])
def test_what_the_proxy_saw_is_a_symptom_and_a_4xx_probe_is_deterministic(obs, deterministic):
    died = observed(obs, "n0")
    assert (died.node, died.rank, died.consequence, died.deterministic) == ("n0", 0, True, deterministic)


def test_a_served_request_is_its_own_observation():
    assert observed(Observation(5, "served"), "n0") == fleet.RequestServed(5)


URL = "http://127.0.0.1:8100"


@pytest.mark.parametrize("seen,ready,deterministic", [
    (ReadinessSeen(URL, READY, 200), True, None),
    (ReadinessSeen(URL, READY, 503), False, None),
    (ReadinessSeen(URL, READY), False, None),
    (ReadinessSeen(URL, READY, 401), False, False),
    (ReadinessSeen(URL, "/v1/models", 404), False, None),
    (ReadinessSeen(URL, COMPLETION), False, None),
    (ReadinessSeen(URL, COMPLETION, 200, '{"choices": [{"index": 0}]}'), True, None),
    (ReadinessSeen(URL, COMPLETION, 200, "not a completion"), False, False),
    (ReadinessSeen(URL, COMPLETION, 404, "no such model"), False, True),
    (ReadinessSeen(URL, COMPLETION, 500, "Internal Server Error"), False, False),
], ids=["ready", "not-yet", "no-answer", "secret-refused", "models-not-yet", "completion-no-answer",
        "completion-served", "completion-not-one", "completion-4xx", "completion-5xx"])
def test_rank0s_readiness_answers_and_the_evidence_in_them(seen, ready, deterministic):
    """An answer that is not yet ready is no evidence; a refused secret or a completion that errs is."""
    is_ready, died = readiness(seen, "n0", 4)
    assert is_ready == ready
    assert (None if died is None else (died.node, died.rank, died.generation, died.deterministic)) == \
        (None if deterministic is None else ("n0", 0, 4, deterministic))


P = ProxyConfig(token_stall=10.0, min_prefill_rate=100.0, min_decode_rate=2.0)


@pytest.mark.parametrize("profile,chars,max_tokens,stream,window", [
    ("meshd-rank", 300_000, 100, True, None),
    ("mlx-lm-server", 0, 100, True, 10.0),
    ("mlx-lm-server", 30_000, 100, True, 110.0),
    ("mlx-lm-server", 30_000, 100, False, 160.0),
])
def test_the_proxy_judges_hangs_only_without_a_status_file_and_scales_with_the_prompt(profile, chars, max_tokens,
                                                                                       stream, window):
    assert stall_window(P, profile, chars, max_tokens, stream) == window


NOW = 1000.0


@pytest.mark.parametrize("status,peer_lost,blocked", [
    ({"state": "busy", "progress_at": NOW - 0.4}, False, False),
    ({"state": "busy", "progress_at": NOW - 5.0}, False, True),
    ({"state": "ready", "progress_at": NOW - 2.0}, False, True),
    ({"state": "loading", "progress_at": NOW - 60.0}, False, False),
    (None, False, False),
    (None, True, True),
])
def test_which_ranks_are_blocked_on_a_dead_peer(status, peer_lost, blocked):
    seen = RankStatus.from_dict({"generation": 1, "rank": 0, "world": 2, "pid": 1, **status}) if status else None
    assert blocked_on_peer(seen, peer_lost, NOW) == blocked


@pytest.mark.parametrize("seen,weights", [
    (ReadinessSeen(URL, READY, 200, '{"ready": true, "weights_fingerprint": "ab12"}'), "ab12"),
    (ReadinessSeen(URL, READY, 200, '{"ready": true, "weights_fingerprint": ""}'), ""),
    (ReadinessSeen(URL, READY, 200, '{"ready": true}'), None),
    (ReadinessSeen(URL, READY, 200, "not json"), None),
    (ReadinessSeen(URL, READY, 503, '{"ready": false, "weights_fingerprint": "ab12"}'), None),
    (ReadinessSeen(URL, COMPLETION, 200, '{"weights_fingerprint": "ab12"}'), None),
], ids=["said", "changed-while-loading", "not-said", "not-json", "not-ready", "stock-completion"])
def test_the_weights_rank0_says_it_serves_with_its_readiness(seen, weights):
    """The controller records a generation's fingerprint from the answer that says it is ready, so no second
    call (which can fail under load) leaves a serving generation's weights unknown."""
    assert seen.weights == weights
