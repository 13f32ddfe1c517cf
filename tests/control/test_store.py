"""The controller's store on its own ground: a real SQLite file on a real
filesystem filled to the last byte (writes wait, in order, and land once
there is room), a WAL that stays small, a stale controller's writes refused,
and the audit trail's tally of refusals."""

import pytest

from common.protocol import EPOCH_MAX, Ballot
from kit.smallfs import fill, free, small_filesystem
from meshd.control.audit import OTHERS, Refusals, Row
from meshd.control.fleet import Incident
from meshd import store as store_module
from meshd.store import EPOCH, WAL_LIMIT, Store


def test_writes_to_a_full_disk_wait_in_order_and_land_once_there_is_room(tmp_path):
    errors = []
    with small_filesystem(tmp_path / "state", "2m") as state:
        store = Store(state / "meshd.sqlite", on_error=errors.append)
        store.put("desired", "up")
        fill(state)
        incident = Incident(100.0, "exit", "node1", 1, 4, "exit code -9")
        store.open_incident(incident)
        store.put("fleet", {"phase": "recovering", "generation": 4})
        store.update_incident(incident, serving_back_at=107.5)
        store.record_audit("me@host", "127.0.0.1", "restart", "accepted")
        store.put("fleet", {"phase": "ready", "generation": 5})  # replaces the waiting value of the key
        assert store.failing and "full" in store.failing and errors
        assert len(store.pending) == 4 and store.get("fleet") == {"phase": "ready", "generation": 5}
        assert store.incidents() == [], "nothing reached the disk"

        assert not store.retry()
        free(state)
        assert store.retry() and store.failing is None and store.pending == []
        (row,) = store.incidents()
        assert (row["opened_at"], row["generation"], row["serving_back_at"]) == (100.0, 4, 107.5)
        assert [(a["action"], a["outcome"]) for a in store.audit()] == [("restart", "accepted")]
        store.close()
        assert Store(state / "meshd.sqlite").get("fleet") == {"phase": "ready", "generation": 5}


def test_the_wal_is_checkpointed_and_stays_small(tmp_path):
    store = Store(tmp_path / "meshd.sqlite")
    wal = tmp_path / "meshd.sqlite-wal"
    biggest = 0
    for seq in range(700):  # 6 MB of events: SQLite's default WAL grows to 4 MB before its first checkpoint
        store.record_event({"node": "n", "seq": seq, "kind": "RankStateChanged", "generation": 1, "rank": 0,
                            "at": float(seq), "detail": "x" * 8000})
        biggest = max(biggest, wal.stat().st_size)
    assert biggest <= WAL_LIMIT + (256 << 10), biggest
    store.close()
    assert not wal.exists() or wal.stat().st_size == 0


def test_a_controller_of_an_older_epoch_writes_nothing_once_a_newer_one_took_the_store(tmp_path):
    old = Store(tmp_path / "meshd.sqlite")
    stale = old.take_epoch(Ballot(old.last_epoch() + 1, "a"), "test")
    old.put("desired", "up")
    new = Store(tmp_path / "meshd.sqlite")
    fence = new.take_epoch(Ballot(new.last_epoch() + 1, "b"), "test")
    assert (stale.epoch, fence.epoch) == (1, 2)
    old.open_incident(Incident(5.0, "exit", "node0", 0, 3, "exit code 1"))
    old.put("desired", "down")
    assert stale.superseded.is_set() and (stale.newer, stale.by) == (Ballot(2), "the store")
    assert new.incidents() == [] and new.get("desired") == "up" and not fence.superseded.is_set()


def test_refusals_are_kept_apart_and_never_evict_an_accepted_action(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "REFUSALS_KEEP", 30)
    store = Store(tmp_path / "meshd.sqlite")
    store.record_audit("me@host", "127.0.0.1", "restart", "accepted")
    for _ in range(80):
        store.record_audit("", "10.0.0.9", "POST /v1/down", "refused: missing or wrong token")
    store.record_audit("me@host", "127.0.0.1", "down", "accepted")
    rows = store.audit(40)
    assert [r["action"] for r in (rows[0], rows[-1])] == ["down", "restart"] and len(rows) == 2 + 40 // 4
    kept = store.db.execute("SELECT COUNT(*) FROM audit WHERE outcome LIKE 'refused%'").fetchone()[0]
    assert kept == 30


REFUSED = "refused: missing or wrong token"


@pytest.mark.parametrize("calls, then, rows", [
    ([("10.0.0.9", "POST /v1/down", 0.0)], 1.0, [Row("", "10.0.0.9", "POST /v1/down", REFUSED)]),
    ([("10.0.0.9", "POST /v1/down", 0.0)] * 3000, 60.0,
     [Row("", "10.0.0.9", "POST /v1/down", REFUSED),
      Row("", "10.0.0.9", "POST /v1/down", "refused 2999 more time(s) in 60s: missing or wrong token")]),
    ([("10.0.0.9", "POST /v1/down", 0.0), ("10.0.0.9", "GET /v1/status", 1.0), ("10.0.0.8", "POST /v1/down", 2.0)],
     3.0, [Row("", "10.0.0.9", "POST /v1/down", REFUSED), Row("", "10.0.0.9", "GET /v1/status", REFUSED),
           Row("", "10.0.0.8", "POST /v1/down", REFUSED)]),
    ([("10.0.0.9", "POST /v1/down", 0.0), ("10.0.0.9", "POST /v1/down", 70.0)], 71.0,
     [Row("", "10.0.0.9", "POST /v1/down", REFUSED)] * 2),
    ([(f"10.0.1.{i}", "POST /v1/down", 0.0) for i in range(5)], 1.0,
     [Row("", "10.0.1.0", "POST /v1/down", REFUSED), Row("", "10.0.1.1", "POST /v1/down", REFUSED),
      Row("", "10.0.1.2", "POST /v1/down", REFUSED), Row("", OTHERS, "POST /v1/down", REFUSED)]),
], ids=["the first at once", "a flood in two rows", "a tally per remote and route", "a window each",
        "past the tallies kept, one for the rest"])
def test_refused_calls_become_a_row_at_first_and_a_summary_when_their_window_ends(calls, then, rows):
    tally = Refusals(window=60.0, tallies=3)
    written = [row for remote, action, at in calls for row in tally.note(remote, action, "missing or wrong token", at)]
    assert written + tally.due(then) == rows


@pytest.mark.parametrize("kept", [2**63, EPOCH_MAX, -4, "x"], ids=["past-int64", "the-bound", "negative", "string"])
def test_a_corrupt_epoch_in_the_store_is_ignored_and_replaced_and_none_out_of_range_is_stored(tmp_path, kept):
    store = Store(tmp_path / "meshd.sqlite")
    store.put(EPOCH, kept)
    assert store.last_epoch() == 0
    fence = store.take_epoch(Ballot(3, "a"), "test")
    store.put("desired", "up")
    assert store.last_epoch() == 3 and store.get("desired") == "up" and not fence.superseded.is_set()
    with pytest.raises(ValueError):
        store.take_epoch(Ballot(EPOCH_MAX + 1, "b"), "test")
    assert Store(tmp_path / "meshd.sqlite").last_epoch() == 3
