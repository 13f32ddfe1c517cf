"""The mesh's authority, its pure parts: the ballot and the mesh on the wire,
what an agent promises and admits (agents/fencing.py), the promise it keeps and
how it reads it back, the highest generation it reports, and the controller's
round (meshd/epochs.py): which epoch it takes (over its own mesh's agents, never
above the bound), which generation numbers are used, whether its round holds,
what an agent's answer says of it, what the store's last epoch is worth. The
round on real processes: tests/control/test_takeover.py."""

import json

import pytest

from agents.config import load
from agents.fencing import (NOT_PROMISED, OTHER_MESH, STALE, Fencing, Promise, caller_mesh, command_refusal,
                            mesh_header, parse_promise, promise_refusal)
from agents.supervisor import Supervisor
from common.protocol import CONTROLLER_EPOCH, CONTROLLER_ID, CONTROLLER_MESH, EPOCH_MAX, Ballot, BallotError
from kit.configs import write_agent_config
from meshd.epochs import (Beaten, Granted, Held, NoEpochLeft, Reach, Short, Standing, choose_epoch,
                          generations_used, judge_round, quorum, standing, stored_epoch)

OLD, OURS, TWIN, NEWER = Ballot(18, "c0ffee"), Ballot(19, "abc123"), Ballot(19, "fed321"), Ballot(20, "aaaaaa")
REACH = {n: Reach(f"http://{n}:7701", f"/etc/meshd/{n}.token") for n in "abc"}


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
    ({CONTROLLER_EPOCH: str(2**63 - 1)}, CONTROLLER_EPOCH),
    ({CONTROLLER_EPOCH: str(EPOCH_MAX + 1)}, CONTROLLER_EPOCH),
    ({CONTROLLER_EPOCH: "1", CONTROLLER_ID: "a b"}, CONTROLLER_ID),
    ({CONTROLLER_ID: "x" * 65}, CONTROLLER_ID),
], ids=["negative", "thousands-of-digits", "past-int64", "int64-max", "past-the-bound", "space-in-id", "long-id"])
def test_a_malformed_ballot_names_its_header(headers, header):
    with pytest.raises(BallotError) as e:
        Ballot.from_headers(headers)
    assert e.value.header == header and header in str(e.value)
    assert header != CONTROLLER_EPOCH or f"from 0 to {EPOCH_MAX}" in str(e.value)


@pytest.mark.parametrize("name", ["auth", "studio mesh", "büro/2", "x" * 200])
def test_a_mesh_name_travels_percent_encoded(name):
    assert caller_mesh(mesh_header(name)) == name and mesh_header(name)[CONTROLLER_MESH].isascii()


@pytest.mark.parametrize("raw", ["", "%ff", "x" * 201], ids=["empty", "not-utf8", "too-long"])
def test_a_malformed_mesh_name_is_refused(raw):
    with pytest.raises(BallotError) as e:
        caller_mesh({CONTROLLER_MESH: raw})
    assert e.value.header == CONTROLLER_MESH


def test_ballots_order_by_epoch_then_id():
    assert OLD < OURS < TWIN < NEWER and Ballot(0) < OLD
    assert str(OURS) == "epoch 19 (abc123)" and str(Ballot(3)) == "epoch 3"


@pytest.mark.parametrize("held,asked,mesh,code", [
    (Promise(), OURS, "auth", None),
    (Promise(OLD, "auth"), OURS, "auth", None),
    (Promise(OLD), OURS, "auth", None),
    (Promise(OURS, "auth"), OURS, "auth", None),
    (Promise(TWIN, "auth"), OURS, "auth", STALE),
    (Promise(NEWER, "auth"), OURS, "auth", STALE),
    (Promise(OLD, "auth"), OURS, "other", OTHER_MESH),
    (Promise(NEWER, "auth"), OURS, "other", OTHER_MESH),
], ids=["fresh-agent", "older-held", "kept-before-meshes", "asked-again", "same-epoch-higher-id", "newer-held",
        "another-mesh-above", "another-mesh-below"])
def test_an_agent_promises_a_ballot_no_lower_than_the_one_it_holds_to_its_own_mesh(held, asked, mesh, code):
    refusal = promise_refusal(held, asked, mesh)
    assert (refusal and refusal.code) == code
    assert code != STALE or (str(held.ballot) in refusal.message and str(asked) in refusal.message)
    assert code != OTHER_MESH or ("'auth'" in refusal.message and f"'{mesh}'" in refusal.message
                                  and "DELETE /v1/epoch?mesh=auth" in refusal.message)


@pytest.mark.parametrize("held,caller,mesh,code", [
    (Promise(OURS, "auth"), OURS, "auth", None),
    (Promise(OURS, "auth"), OURS, None, None),
    (Promise(OURS, "auth"), OLD, "auth", STALE),
    (Promise(TWIN, "auth"), OURS, "auth", STALE),
    (Promise(OLD, "auth"), OURS, "auth", NOT_PROMISED),
    (Promise(), OURS, "auth", NOT_PROMISED),
    (Promise(OLD, "auth"), NEWER, "other", OTHER_MESH),
], ids=["promised", "names-no-mesh", "stale", "lost-the-tie", "away-during-the-round", "state-wiped",
        "another-mesh"])
def test_an_agent_admits_commands_only_from_the_controller_it_promised(held, caller, mesh, code):
    refusal = command_refusal(held, caller, mesh)
    assert (refusal and refusal.code) == code
    assert code != NOT_PROMISED or "POST /v1/epoch" in refusal.message


@pytest.mark.parametrize("text,kept", [
    ("18\n", Promise(Ballot(18))),
    ('{"epoch": 19, "controller": "abc123", "at": 5.0}', Promise(OURS, None, 5.0)),
    ('{"epoch": 19, "controller": "abc123", "mesh": "auth", "at": 5}', Promise(OURS, "auth", 5)),
    ("{not json", "is not JSON"),
    ("", "is not JSON"),
    ("[18]", "holds [18]"),
    (f"{2**63 - 1}", f"its epoch {2**63 - 1} is not an integer from 0 to {EPOCH_MAX}"),
    ('{"epoch": -1, "controller": ""}', "its epoch -1"),
    ('{"epoch": true, "controller": ""}', "its epoch True"),
    ('{"epoch": "19", "controller": ""}', "its epoch '19' is not an integer"),
    ('{"epoch": 19}', "its controller id None"),
    ('{"epoch": 19, "controller": "a b"}', "its controller id 'a b'"),
    ('{"epoch": 19, "controller": "x", "mesh": ""}', "its mesh ''"),
    ('{"epoch": 19, "controller": "x", "at": "noon"}', "its time 'noon'"),
], ids=["kept-before-ids", "kept-before-meshes", "bound", "garbled", "empty", "not-an-object", "int64-max",
        "negative", "bool", "string-epoch", "no-id", "bad-id", "empty-mesh", "bad-time"])
def test_a_kept_promise_is_read_with_its_reasons(text, kept):
    read = parse_promise(text)
    assert read == kept if isinstance(kept, Promise) else (isinstance(read, str) and kept in read)


def test_a_promise_and_its_mesh_outlive_the_agent_and_a_release_keeps_the_ballot(tmp_path):
    path = tmp_path / "controller_epoch"
    path.write_text("18\n")
    assert Fencing(path).held == Promise(Ballot(18))
    fencing = Fencing(path)
    fencing.promise(OURS, "auth")
    again = Fencing(path)
    assert again.held == Promise(OURS, "auth", fencing.held.at) and json.loads(path.read_text())["mesh"] == "auth"
    assert again.view() == {"epoch": 19, "controller": "abc123", "promised_at": fencing.held.at, "mesh": "auth"}
    again.release()
    assert Fencing(path).held == Promise(OURS, None, fencing.held.at)


def test_a_promise_file_that_cannot_be_trusted_refuses_every_controller_until_it_is_deleted(tmp_path):
    path = tmp_path / "controller_epoch"
    path.write_text(f"{2**63 - 1}\n")
    fencing = Fencing(path)
    refusal = fencing.check()
    assert refusal and str(path) in refusal.message and f"{2**63 - 1}" in refusal.message
    assert f"rm {path}" in refusal.message and path.read_text() == f"{2**63 - 1}\n"
    path.unlink()
    assert fencing.check() is None and fencing.held == Promise()


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
    (0, {"a": Held(OLD, 40, "auth"), "b": Held(Ballot(3), 2, "auth")}, 19),
    (30, {"a": Held(OLD), "b": Held(OLD)}, 31),
    (0, {"a": Held(OLD), "b": Held(Ballot(2)), "c": "connection refused"}, 19),
    (0, {"a": Held(Ballot(2), 0, "auth"), "b": Held(Ballot(3), 0, "auth"), "c": Held(NEWER, 0, "other")}, 4),
    (0, {"a": Held(Ballot(EPOCH_MAX - 1), 0, "auth"), "b": Held(Ballot(3))}, EPOCH_MAX),
], ids=["fresh-mesh", "controllers-of-another-state-dir", "store-ahead", "one-of-three-away",
        "another-meshs-epoch-is-not-ours", "the-last-epoch-there-is"])
def test_a_starting_controller_takes_an_epoch_above_all_its_agents_hold(last, heard, want):
    assert choose_epoch("auth", last, heard, REACH) == want


@pytest.mark.parametrize("heard,have,need", [
    ({"b": Held(Ballot(5, "abc"), 3, "other")}, 0, 1),
    ({"a": Held(Ballot(0)), "b": Held(Ballot(5), 3, "other")}, 1, 2),
    ({"a": Held(Ballot(0)), "b": Held(Ballot(5), 3, "other"), "c": "connection refused"}, 1, 2),
], ids=["the-one-node-of-its-config-serves-another-mesh", "one-of-two-serves-another", "one-other-one-away"])
def test_an_agent_of_another_mesh_counts_for_no_majority(heard, have, need):
    short = choose_epoch("auth", 0, heard, REACH)
    assert isinstance(short, Short) and (short.have, short.need) == (have, need)
    assert set(short.foreign) == {"b"} and "'other'" in short.foreign["b"] and "'auth'" in short.foreign["b"]
    reason = short.reason()
    assert f"{have} of {len(heard)} agents answered" in reason and "free or remove the nodes of another mesh" in reason
    assert "curl -X DELETE -H \"Authorization: Bearer $(cat /etc/meshd/b.token)\" " \
           "'http://b:7701/v1/epoch?mesh=other'" in reason
    assert ("start the agents that did not answer" in reason) == ("c" in heard)


def test_no_epoch_is_taken_above_the_bound():
    at_max = choose_epoch("auth", 7, {"a": Held(Ballot(EPOCH_MAX), 0, "auth"), "b": Held(Ballot(3))}, REACH)
    assert at_max == NoEpochLeft({"a": Ballot(EPOCH_MAX)})
    reason = at_max.reason()
    assert f"a holds epoch {EPOCH_MAX}" in reason and "took none and stored none" in reason
    assert "delete controller_epoch" in reason and "start those agents" not in reason


@pytest.mark.parametrize("value,want", [
    (None, 0), (0, 0), (41, 41), (EPOCH_MAX - 1, EPOCH_MAX - 1),
    (EPOCH_MAX, "is not an integer from 0"), (2**63, "is not an integer"), (-3, "-3"), ("12", "12"), (True, "True"),
], ids=["none-yet", "zero", "an-epoch", "the-last-below-the-bound", "the-bound", "past-int64", "negative",
        "a-string", "a-bool"])
def test_the_stores_last_epoch_is_read_with_its_reasons(value, want):
    got = stored_epoch(value)
    assert got == want if isinstance(want, int) else (isinstance(got, str) and want in got)


@pytest.mark.parametrize("heard,want", [
    ({"a": Held(Ballot(0)), "b": Held(Ballot(0))}, 0),
    ({"a": Held(OLD, 40), "b": Held(OLD, 39)}, 40),
    ({"a": Held(OLD, 40), "b": Held(Ballot(0), 0)}, 40),
    ({"a": Held(OLD, 12), "b": Held(OLD, 12), "c": "connection refused"}, 12),
    ({"a": Held(OLD, 12, "auth"), "b": Held(OLD, 12), "c": Held(NEWER, 90, "other")}, 12),
], ids=["fresh-mesh", "one-started-before-the-other-died", "one-state-dir-wiped", "one-of-three-away",
        "another-meshs-generations-are-not-ours"])
def test_the_generations_used_are_the_highest_any_answering_agent_of_the_mesh_ran(heard, want):
    assert generations_used("auth", heard) == want


def test_an_agent_reports_the_highest_generation_its_state_directory_keeps(tmp_path):
    write_agent_config(tmp_path, "node0", 7701)
    sup = Supervisor(load(tmp_path / "agent.toml"))
    assert sup.highest_generation() == 0
    for name in ("gen-0", "gen-40", "gen-7", "gen-x", "snapshots"):
        (sup.state_dir / name).mkdir()
    assert sup.highest_generation() == 40


def test_no_epoch_is_taken_before_a_majority_answered():
    short = choose_epoch("auth", 0, {"a": Held(OLD), "b": "connection refused"}, REACH)
    assert short == Short("answered", 1, 2, {"b": "connection refused"})
    reason = short.reason()
    assert "1 of 2 agents answered" in reason and "a majority (2)" in reason and "b: connection refused" in reason
    assert "start the agents that did not answer or make them reachable" in reason and "another mesh" not in reason
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
