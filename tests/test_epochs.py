"""The mesh's authority, its pure parts: the ballot on the wire, what an agent
promises and admits (agents/fencing.py) and the highest generation it reports,
and the controller's round (meshd/epochs.py): which epoch it takes, which
generation numbers are used, whether its round holds, what an agent's answer
says of it. The round on real processes: tests/test_takeover.py."""

import json

import pytest

from agents.config import load
from agents.fencing import NOT_PROMISED, STALE, Fencing, command_refusal, promise_refusal
from agents.supervisor import Supervisor
from common.protocol import CONTROLLER_EPOCH, CONTROLLER_ID, Ballot, BallotError
from kit.configs import write_agent_config
from meshd.epochs import (Beaten, Granted, Held, Short, Standing, choose_epoch, generations_used, judge_round, quorum,
                          standing)

OLD, OURS, TWIN, NEWER = Ballot(18, "c0ffee"), Ballot(19, "abc123"), Ballot(19, "fed321"), Ballot(20, "aaaaaa")


@pytest.mark.parametrize("headers,ballot", [
    ({}, None),
    ({CONTROLLER_ID: "abc123"}, None),
    ({CONTROLLER_EPOCH: "7"}, Ballot(7, "")),
    ({CONTROLLER_EPOCH: "19", CONTROLLER_ID: "abc123"}, Ballot(19, "abc123")),
], ids=["none", "id-alone", "epoch-alone", "both"])
def test_a_ballot_travels_in_two_headers(headers, ballot):
    assert Ballot.from_headers(headers) == ballot
    assert ballot is None or Ballot.from_headers(ballot.headers()) == ballot


@pytest.mark.parametrize("headers,header", [
    ({CONTROLLER_EPOCH: "-1"}, CONTROLLER_EPOCH),
    ({CONTROLLER_EPOCH: "9" * 4400}, CONTROLLER_EPOCH),
    ({CONTROLLER_EPOCH: str(2**63)}, CONTROLLER_EPOCH),
    ({CONTROLLER_EPOCH: "1", CONTROLLER_ID: "a b"}, CONTROLLER_ID),
    ({CONTROLLER_ID: "x" * 65}, CONTROLLER_ID),
], ids=["negative", "thousands-of-digits", "past-int64", "space-in-id", "long-id"])
def test_a_malformed_ballot_names_its_header(headers, header):
    with pytest.raises(BallotError) as e:
        Ballot.from_headers(headers)
    assert e.value.header == header and header in str(e.value)


def test_ballots_order_by_epoch_then_id():
    assert OLD < OURS < TWIN < NEWER and Ballot(0) < OLD
    assert str(OURS) == "epoch 19 (abc123)" and str(Ballot(3)) == "epoch 3"


@pytest.mark.parametrize("held,asked,code", [
    (Ballot(0), OURS, None),
    (OLD, OURS, None),
    (OURS, OURS, None),
    (TWIN, OURS, STALE),
    (NEWER, OURS, STALE),
], ids=["fresh-agent", "older-held", "asked-again", "same-epoch-higher-id", "newer-held"])
def test_an_agent_promises_a_ballot_no_lower_than_the_one_it_holds(held, asked, code):
    refusal = promise_refusal(held, asked)
    assert (refusal and refusal.code) == code
    assert refusal is None or (str(held) in refusal.message and str(asked) in refusal.message)


@pytest.mark.parametrize("held,caller,code", [
    (OURS, OURS, None),
    (OURS, OLD, STALE),
    (TWIN, OURS, STALE),
    (OLD, OURS, NOT_PROMISED),
    (Ballot(0), OURS, NOT_PROMISED),
], ids=["promised", "stale", "lost-the-tie", "away-during-the-round", "state-wiped"])
def test_an_agent_admits_commands_only_from_the_controller_it_promised(held, caller, code):
    refusal = command_refusal(held, caller)
    assert (refusal and refusal.code) == code
    assert code != NOT_PROMISED or "POST /v1/epoch" in refusal.message


def test_a_promise_outlives_the_agent_and_an_epoch_kept_before_ids_still_counts(tmp_path):
    path = tmp_path / "controller_epoch"
    path.write_text("18\n")
    assert (Fencing(path).held, Fencing(path).at) == (Ballot(18), None)
    fencing = Fencing(path)
    fencing.promise(OURS)
    again = Fencing(path)
    assert again.held == OURS and again.at == fencing.at and json.loads(path.read_text())["controller"] == "abc123"
    assert again.view() == {"epoch": 19, "controller": "abc123", "promised_at": fencing.at}
    path.write_text("{not json")
    assert Fencing(path).held == Ballot(0)


@pytest.mark.parametrize("held,want", [
    (OURS, Standing.PROMISED), (TWIN, Standing.SUPERSEDED), (NEWER, Standing.SUPERSEDED),
    (OLD, Standing.UNPROMISED), (Ballot(0), Standing.UNPROMISED),
])
def test_what_the_ballot_an_agent_names_says_of_this_controller(held, want):
    assert standing(OURS, held) == want


@pytest.mark.parametrize("nodes,need", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (8, 5)])
def test_a_majority_of_the_mesh_must_promise(nodes, need):
    assert quorum(nodes) == need


@pytest.mark.parametrize("last,heard,want", [
    (0, {"a": Held(Ballot(0)), "b": Held(Ballot(0))}, 1),
    (0, {"a": Held(OLD, 40), "b": Held(Ballot(3), 2)}, 19),
    (30, {"a": Held(OLD), "b": Held(OLD)}, 31),
    (0, {"a": Held(OLD), "b": Held(Ballot(2)), "c": "connection refused"}, 19),
], ids=["fresh-mesh", "agents-that-served-another", "store-ahead", "one-of-three-away"])
def test_a_starting_controller_takes_an_epoch_above_all_it_found(last, heard, want):
    assert choose_epoch(last, heard) == want


@pytest.mark.parametrize("heard,want", [
    ({"a": Held(Ballot(0)), "b": Held(Ballot(0))}, 0),
    ({"a": Held(OLD, 40), "b": Held(OLD, 39)}, 40),
    ({"a": Held(OLD, 40), "b": Held(Ballot(0), 0)}, 40),
    ({"a": Held(OLD, 12), "b": Held(OLD, 12), "c": "connection refused"}, 12),
], ids=["fresh-mesh", "one-started-before-the-other-died", "one-state-dir-wiped", "one-of-three-away"])
def test_the_generations_used_are_the_highest_any_answering_agent_ran(heard, want):
    assert generations_used(heard) == want


def test_an_agent_reports_the_highest_generation_its_state_directory_keeps(tmp_path):
    write_agent_config(tmp_path, "node0", 7701)
    sup = Supervisor(load(tmp_path / "agent.toml"))
    assert sup.highest_generation() == 0
    for name in ("gen-0", "gen-40", "gen-7", "gen-x", "snapshots"):
        (sup.state_dir / name).mkdir()
    assert sup.highest_generation() == 40


def test_no_epoch_is_taken_before_a_majority_answered():
    short = choose_epoch(0, {"a": Held(OLD), "b": "connection refused"})
    assert short == Short("answered", 1, 2, {"b": "connection refused"})
    reason = short.reason()
    assert "1 of 2 agents answered" in reason and "a majority (2)" in reason and "b: connection refused" in reason
    assert "meshctl doctor" in reason and "start the controller again" in reason


@pytest.mark.parametrize("heard,want", [
    ({"a": OURS, "b": OURS}, Granted({})),
    ({"a": OURS, "b": OURS, "c": "timed out"}, Granted({"c": "timed out"})),
    ({"a": OURS, "b": "timed out", "c": "refused"}, Short(f"promised {OURS}", 1, 2, {"b": "timed out",
                                                                                      "c": "refused"})),
    ({"a": OURS, "b": TWIN}, Beaten(TWIN, "b")),
    ({"a": OURS, "b": OURS, "c": NEWER}, Beaten(NEWER, "c")),
    ({"a": TWIN, "b": NEWER}, Beaten(NEWER, "b")),
], ids=["all-promised", "one-away", "no-majority", "lost-the-tie", "beaten-though-a-majority-promised",
        "the-newest-named"])
def test_the_round_holds_with_a_majority_and_no_newer_ballot(heard, want):
    assert judge_round(OURS, heard) == want
