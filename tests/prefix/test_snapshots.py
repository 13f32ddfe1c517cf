"""Prefix snapshots (runtime/prefix/snapshot.py): the agreement, eviction and kind decisions as tables; the writer on
real caches (chained for plain KV caches, whole for a sliding window), a budget and a full disk; and one real
2-rank ring mesh of agents: after a SIGKILL mid-stream the next generation answers the next turn and the cut
stream exactly, their prefixes from the snapshots, and ignores a corrupted, truncated or foreign snapshot on one
rank; a restarted rank restores while it serves, a request waiting for a tape being restored only when that is
sooner than prefilling it. DeepSeek-V4's caches on omlx's own model: tests/pinned/test_v4_snapshots.py."""

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from common.openai_api import SamplingParams
from kit.agents import make_agents
from kit.demo_answers import endless
from kit.smallfs import fill, small_filesystem
from kit.snapshots import EVERY, Gen, answer_in_flight, metric
from kit.waiting import wait_for
from runtime.engine.jobs import Job
from kit.drafters import undrafted
from runtime.lockstep import Cancel, Drain, DrainMode, Insert, RestoreFirst
from runtime.rank import parse_args
from runtime.server import WARMUP
from runtime.prefix.rates import Rates
from runtime.restore import MARGIN, Restorer, plan, settled, worth_waiting
from runtime.prefix.snapshot import (Identity, Segment, Snapshots, agree, digest, due, ends, evict, expired, read_header,
                              read_segment, scan, segment_files, serving, snapshot_key, snapshot_kind, tape_id, whole)
from runtime.prefix import snapshot
from runtime.prefix.store import PrefixStore
from runtime.prefix.tape import TokenTape

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~670 tokens: a prefill of seconds on two ranks


def seg(sid, parent="", nbytes=10, used_at=0.0, end=2, whole_=False):
    """A segment appended to `parent` (its tokens from 1), or from the first token: with no parent, or `whole_`
    (its caches' whole state, grown from `parent`)."""
    return Segment(sid, parent, 0 if whole_ or not parent else 1, end, nbytes, used_at)


@pytest.mark.parametrize("written, have, every, final, whole_, expect", [
    (0, 670, 256, False, False, True),  # a long prefill ended
    (0, 40, 256, False, False, False),  # a short one waits for its answer's end
    (0, 40, 256, True, False, True),  # which writes it
    (670, 700, 16, False, False, True),  # an answer in flight, every 16 tokens
    (670, 685, 16, False, False, False),
    (700, 700, 16, True, False, False),  # nothing new at the end
    (0, 159, 16, False, True, True),  # a whole state: its prefill ended
    (159, 211, 16, False, True, False),  # in flight, it waits for a quarter of it to be new
    (159, 212, 16, False, True, True),
    (159, 160, 16, True, True, True),  # its end is written whatever is new
])
def test_when_a_tape_is_written(written, have, every, final, whole_, expect):
    assert due(written, have, every, final, whole_) is expect


@pytest.mark.parametrize("leaf_types, expect", [
    (["KVCache", "KVCache"], "append"),  # llama, qwen3: a segment is the new tokens
    (["RotatingKVCache", "KVCache"], "whole"),  # gemma3's windows beside its global layers
    (["RotatingKVCache", "RotatingKVCache", "PoolingCache", "PoolingCache"], "whole"),  # DeepSeek-V4's (omlx)
    (["ArraysCache", "KVCache"], None),  # qwen3_next's recurrent state: not proven here
    (["QuantizedKVCache"], None),
    ([], None),
])
def test_a_cache_is_snapshotted_by_its_new_tokens_or_whole_as_its_leaves_allow(leaf_types, expect):
    assert snapshot_kind(leaf_types) == expect


@pytest.mark.parametrize("held, expect", [
    ([["a", "b", "c"], ["c", "b"]], ["b", "c"]),  # rank 0's order, only what every rank holds
    ([["a"], []], []),  # missing on one rank: nothing
    ([["a", "b"]], ["a", "b"]),  # a mesh of one
    ([["a", "b"], ["a", "b"], ["b"]], ["b"]),
])
def test_the_ranks_agree_on_the_tapes_they_all_hold(held, expect):
    assert agree(held) == expect


def test_only_tapes_whole_down_to_the_first_token_are_offered_and_only_their_ends_restored():
    segments = {"a": seg("a", used_at=1), "b": seg("b", "a", used_at=3), "c": seg("c", "gone", used_at=2),
                "d": seg("d", "c"), "e": seg("e", "a", used_at=2)}
    assert whole(segments) == ["a", "e", "b"]  # c and d hang off a missing segment; least recently used first
    assert ends(["a", "e", "b"], {s: g.parent for s, g in segments.items()}) == ["e", "b"]


def test_a_whole_state_needs_no_parent_and_the_one_it_grew_from_is_neither_restored_nor_kept_for_it():
    # p's state whole (start 0), then w's, grown from p, and o's, grown from a snapshot deleted since
    segments = {"p": seg("p", end=100, used_at=1), "w": seg("w", "p", end=130, used_at=2, whole_=True),
                "o": seg("o", "gone", end=50, used_at=3, whole_=True), "x": seg("x", "o", end=60, used_at=4)}
    assert whole(segments) == ["p", "w", "o", "x"]
    assert ends(whole(segments), {s: g.parent for s, g in segments.items()}) == ["w", "x"]
    assert evict(segments, 25) == ["p", "w"]  # o stays while x is appended to it


@pytest.mark.parametrize("sids, parents, whole_states, expect", [
    (["a", "b", "c"], {"a": "", "b": "a", "c": "b"}, False, ["c"]),  # a chain's end, cut back to any prefix
    (["a", "b", "c"], {"a": "", "b": "a", "c": "b"}, True, ["b", "c"]),  # and the state c grew from
    (["a", "x", "b", "y"], {"a": "", "x": "", "b": "a", "y": "x"}, True, ["a", "x", "b", "y"]),  # two tapes
    (["b", "c"], {"b": "gone", "c": "b"}, True, ["b", "c"]),
])
def test_the_restore_takes_each_tapes_end_and_of_whole_states_the_one_it_grew_from(sids, parents, whole_states,
                                                                                  expect):
    assert serving(sids, parents, whole_states) == expect


@pytest.mark.parametrize("segments, budget, expect", [
    ({"a": seg("a", used_at=1), "b": seg("b", used_at=2)}, 20, []),  # fits
    ({"a": seg("a", used_at=1), "b": seg("b", used_at=2)}, 15, ["a"]),  # least recently used first
    # a parent goes only once nothing extends it, even when it is older than another tape
    ({"p": seg("p", used_at=0), "c": seg("c", "p", used_at=5), "x": seg("x", used_at=3)}, 15, ["x", "c"]),
    ({"p": seg("p", used_at=0), "c": seg("c", "p", used_at=1), "x": seg("x", used_at=3)}, 15, ["c", "p"]),
    ({"a": seg("a", nbytes=50)}, 10, ["a"]),
])
def test_eviction_keeps_the_most_recently_used_tapes_within_the_budget(segments, budget, expect):
    assert evict(segments, budget) == expect


@pytest.mark.parametrize("segments, now, max_age, expect", [
    ({"a": seg("a", used_at=0.0), "b": seg("b", used_at=90.0)}, 100.0, 50.0, ["a"]),
    ({"a": seg("a", used_at=0.0), "b": seg("b", used_at=90.0)}, 100.0, 0.0, []),  # 0: kept while the budget allows
    ({"a": seg("a", used_at=0.0), "b": seg("b", "a", used_at=10.0)}, 100.0, 50.0, ["b", "a"]),  # the end first
    ({"a": seg("a", used_at=0.0), "b": seg("b", "a", used_at=90.0)}, 100.0, 50.0, []),  # a is what b appends to
    ({"a": seg("a", used_at=0.0), "w": seg("w", "a", used_at=90.0, whole_=True)}, 100.0, 50.0, ["a"]),
])
def test_tapes_unused_past_the_max_age_expire_ends_first_and_never_under_a_kept_one(segments, now, max_age, expect):
    assert expired(segments, now, max_age) == expect


# --- the writer on real caches ------------------------------------------------------------------------------

ME = Identity("model", 1, 0, "layout")


def real_cache(n: int, layers: int = 2) -> list:
    cache = []
    for i in range(layers):
        c = KVCache()
        # a token's keys depend on its position only, as a real prefix's do
        x = (mx.arange(n)[None, None, :, None] * 100 + mx.arange(2)[None, :, None, None] * 10
             + mx.arange(4) + i).astype(mx.float32)
        c.update_and_fetch(x, -x)
        cache.append(c)
    mx.eval([c.state[:2] for c in cache])
    return cache


def test_a_follow_up_appends_only_its_new_tokens_and_restores_exactly(tmp_path):
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    first = tuple(range(10))
    since = snaps.stage(first, real_cache(10), ("", 0), final=True)
    follow = first + (50, 51, 52)
    snaps.stage(follow, real_cache(13), snaps.base(since[0], 10), final=True)
    snaps.close()
    headers = sorted((int(h["start"]), int(h["end"])) for h in map(read_header, snaps.folder.glob("*.safetensors")))
    assert headers == [(0, 10), (10, 13)]

    again = Snapshots(tmp_path, ME, 1 << 20, every=4)
    [(tokens, cache, sid)] = again.restore(ends(again.held(), {s: g.parent for s, g in again.segments.items()}),
                                           fresh=lambda: [KVCache(), KVCache()])
    assert tokens == follow and sid == tape_id(follow)
    want = real_cache(13)
    for got, ref in zip(cache, want):
        assert got.offset == 13 and mx.array_equal(got.keys, ref.keys[..., :13, :]).item()
        assert mx.array_equal(got.values, ref.values[..., :13, :]).item()
    again.close()


def test_a_sliding_window_past_its_size_is_snapshotted_whole_and_restores_as_it_was(tmp_path):
    cache = [KVCache(), RotatingKVCache(max_size=8)]
    for c in cache:
        c.update_and_fetch(*(mx.arange(5 * 4, dtype=mx.float32).reshape(1, 1, 5, 4),) * 2)
        for t in range(7):  # one at a time: the window rotates over its oldest tokens in place
            c.update_and_fetch(*(mx.full((1, 1, 1, 4), 100.0 + t),) * 2)
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    snaps.stage(tuple(range(12)), cache, ("", 0), final=True)
    snaps.close()
    [header] = map(read_header, snaps.folder.glob("*.safetensors"))
    assert (header["start"], header["end"], header["parent"]) == ("0", "12", "")

    again = Snapshots(tmp_path, ME, 1 << 20, every=4)
    [(tokens, restored, _)] = again.restore(again.held(), fresh=lambda: [KVCache(), RotatingKVCache(max_size=8)])
    assert tokens == tuple(range(12))
    step = (mx.full((1, 1, 1, 4), -1.0),) * 2
    for live, back in zip(cache, restored):
        assert back.offset == live.offset == 12
        assert all(mx.array_equal(a, b).item() for a, b in zip(back.update_and_fetch(*step),
                                                                  live.update_and_fetch(*step)))
    again.close()


def test_past_the_budget_the_least_recently_used_tapes_are_deleted(tmp_path):
    snaps = Snapshots(tmp_path, ME, 6000, every=4)
    tapes = [tuple(range(first * 100, first * 100 + 10)) for first in range(4)]  # unrelated, ~2 kB on disk each
    for tape in tapes:
        snaps.stage(tape, real_cache(10), ("", 0), final=True)
    snaps.close()
    kept = {s.sid for s in snaps.segments.values()}
    assert snaps.written == 4 and snaps.nbytes <= 6000 and 0 < len(kept) < 4
    assert kept == {tape_id(t) for t in tapes[-len(kept):]}  # the newest
    assert len(list(snaps.folder.glob("*.safetensors"))) == len(kept)


def test_a_full_disk_skips_the_snapshot_and_says_so(tmp_path):
    with small_filesystem(tmp_path / "small", "1m") as root:
        snaps = Snapshots(root, ME, 1 << 30, every=4)
        fill(root)
        snaps.stage(tuple(range(10)), real_cache(10), ("", 0), final=True)
        snaps.close()
        assert snaps.skipped == {"disk_full": 1} and snaps.written == 0
        assert not list(snaps.folder.iterdir())  # no half-written file left behind


@pytest.mark.parametrize("agreed, parents, whole_states, capacity, expect", [
    (["a", "b", "c"], {"a": "", "b": "", "c": ""}, False, 8, ["c", "b", "a"]),  # most recently used first
    (["a", "b", "c"], {"a": "", "b": "", "c": ""}, False, 2, ["c", "b"]),  # as many as the tape keeps
    (["a", "b"], {"a": "", "b": "a"}, False, 8, ["b"]),  # b extends a: its end serves a's prompts too
    (["a", "b"], {"a": "", "b": "a"}, True, 8, ["b", "a"]),  # a whole state serves only what extends it
    (["a"], {"a": ""}, False, 0, []),
])
def test_the_restore_plan_takes_the_most_recent_serving_tapes_first(agreed, parents, whole_states, capacity,
                                                                    expect):
    assert plan(agreed, parents, whole_states, capacity) == expect


@pytest.mark.parametrize("extra, to_read, to_build, read_bps, build_bps, prefill_tps, expect", [
    (12000, 1_800_000_000, 1_800_000_000, 2e9, 4e9, 5000, True),  # 0.9 s to read, 0.45 s to build: 2.4 s to prefill
    (12000, 1_800_000_000, 1_800_000_000, 1e9, 2e9, 5000, False),  # 1.8 s to read: sooner, but not with the build
    (12000, 1_600_000_000, 1_600_000_000, 1.6e9, 1.6e9, 4600, False),  # 2 s against 2.6 s: within the margin
    (12000, 400_000_000, 1_600_000_000, 1.6e9, 1.6e9, 4600, True),  # most of it read already: 1.25 s left
    (12000, 3_200_000_000, 1_600_000_000, 1.6e9, 1.6e9, 4600, False),  # another tape's read before it
    (12000, 0, 800_000_000, 0, 1.6e9, 4600, True),  # read, half built: nothing left to read needs no read rate
    (12000, 0, 0, 0, 0, 4600, True),  # built: it joins at this iteration
    (12000, 1_800_000_000, 1_800_000_000, 1e9, 1e9, 8000, False),
    (12000, 1_800_000_000, 1_800_000_000, 4e9, 0, 5000, True),  # the build not measured yet: as slow as the read
    (20, 100_000_000, 100_000_000, 1e9, 1e9, 1000, False),  # a short prompt: prefilling 20 tokens beats reading 100 MB
    (12000, 1_800_000_000, 1_800_000_000, 0, 1e9, 5000, False),  # no rate measured yet: it never waits on a guess
    (12000, 0, 1_800_000_000, 0, 0, 5000, False),
    (12000, 1_800_000_000, 1_800_000_000, 1e9, 1e9, 0, False),
    (0, 1, 1, 1e9, 1e9, 5000, False),  # the tape serves nothing more than the token tape does
])
def test_a_request_waits_for_a_tape_being_restored_only_when_what_is_left_of_it_is_well_under_a_prefill(
        extra, to_read, to_build, read_bps, build_bps, prefill_tps, expect):
    assert worth_waiting(extra, to_read, to_build, read_bps, build_bps, prefill_tps) == expect


@pytest.mark.parametrize("pieces, expect", [
    ([(512, 0.1), (512, 0.1)], 5120.0),
    ([(17, 0.03), (3, 0.02)], 0.0),  # a turn's few new tokens: a forward's fixed cost, not a prefill's rate
    ([(512, 0.1), (17, 0.03), (1024, 0.2)], 5120.0),
])
def test_the_prefill_rate_restores_weigh_is_of_whole_chunks(demo_model, pieces, expect):
    store = PrefixStore(load(str(demo_model))[0], prefill_step_size=512)
    for tokens, seconds in pieces:
        store.prefilled(tokens, seconds)
    assert store.rates.prefill_tps == pytest.approx(expect)


def test_the_rates_are_kept_for_the_next_generation(tmp_path):
    Rates(tmp_path / "rates.json").note(read_bps=1e9, build_bps=5e8, prefill_tps=3000.0)
    kept = wait_for(lambda: (tmp_path / "rates.json").exists() and Rates(tmp_path / "rates.json"), 10, "the rates saved")
    assert (kept.read_bps, kept.build_bps, kept.prefill_tps) == (1e9, 5e8, 3000.0)


@pytest.mark.parametrize("results, expect", [
    ([{"a": True}, {"a": True}], {"a": True}),
    ([{"a": True, "b": True}, {"a": True}], {"a": True}),  # b: rank 1 has not read it yet
    ([{"a": True}, {"a": False}], {"a": False}),  # rank 1 could not: nobody keeps it
    ([{"b": True, "a": True}, {"a": True, "b": True}], {"b": True, "a": True}),  # rank 0's order
    ([{}, {"a": True}], {}),
])
def test_a_restored_tape_joins_when_every_rank_is_done_with_it_and_only_if_every_rank_has_it(results, expect):
    got = settled(results)
    assert got == expect and list(got) == list(expect)


def test_a_tape_restored_behind_serving_never_pushes_out_a_newer_one():
    tape = TokenTape(capacity=2)
    new = (1, 2, 3, 4)
    tape.store(new, real_cache(4), "new")
    assert not tape.store_older((1, 2, 3), real_cache(3), "old-prefix")  # the newer one serves all it serves
    assert tape.store_older((7, 8, 9), real_cache(3), "old")
    assert not tape.store_older((5, 6), real_cache(2), "older")  # no room: the newer ones stay
    assert tape.served((1, 2, 3, 4, 5)) == 4 and tape.served((7, 8, 9, 10)) == 3
    tape.store((20, 21), real_cache(2), "newest")
    assert tape.served((7, 8, 9, 10)) == 0 and tape.served((1, 2, 3, 4, 5)) == 4  # the restored one went first
    assert (tape.hits, tape.misses) == (0, 0)  # `served` only asks


@pytest.mark.parametrize("writers", [1, 4])
def test_a_segment_is_durable_on_its_own_and_its_name_is_the_digest_of_its_bytes(tmp_path, writers, monkeypatch):
    """Its arrays written side by side or one by one, a segment is the same file: its name the digest of its
    header and of each array's bytes in the file's order (each keyed as the whole)."""
    monkeypatch.setattr(snapshot, "SIDE_BY_SIDE", 0)  # this small segment's arrays to the writers too
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4, writers=writers)
    snaps.stage(tuple(range(10)), real_cache(10), ("", 0), final=True)
    snaps.close()
    [path] = segment_files(snaps.folder)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    h = digest(b"")  # the key of these snapshots: none
    h.update(data[:8 + n])
    for name, t in header.items():
        if name != "__metadata__":
            a, b = t["data_offsets"]
            one = digest(b"")
            one.update(data[8 + n + a:8 + n + b])
            h.update(one.digest())
    assert path.name.split(".")[1] == h.hexdigest()
    arrays = mx.load(str(path))  # a plain safetensors file: any reader takes it
    assert arrays["tokens"].tolist() == list(range(10)) and arrays["0.0"].shape == (1, 2, 10, 4)
    assert all(mx.array_equal(arrays[f"{i}.0"], c.keys[..., :10, :]).item()
               and mx.array_equal(arrays[f"{i}.1"], c.values[..., :10, :]).item() for i, c in enumerate(real_cache(10)))


def test_the_writer_reports_what_is_pending_and_the_snapshots_of_a_bfloat16_cache_restore_exactly(tmp_path):
    cache = real_cache(12)
    for c in cache:
        c.keys, c.values = c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16)
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    snaps.stage(tuple(range(12)), cache, ("", 0), final=False)
    assert snaps.stats()["snapshots_pending"] == 1 and snaps.stats()["snapshot_pending_bytes"] > 0
    snaps.close()
    assert snaps.stats()["snapshots_pending"] == 0 and snaps.written == 1
    again = Snapshots(tmp_path, ME, 1 << 20, every=4)
    [(_, back, _)] = again.restore(again.held(), fresh=lambda: [KVCache(), KVCache()])
    for b, c in zip(back, cache):
        assert b.keys.dtype == mx.bfloat16 and mx.array_equal(b.keys[..., :12, :], c.keys[..., :12, :]).item()
    again.close()


@pytest.mark.parametrize("spoil", [
    lambda h: {**h, "__metadata__": ["a", "list"]},  # the metadata of another shape
    lambda h: {**h, "tokens": 5},  # an entry that is not a tensor's
    lambda h: {**h, "tokens": {**h["tokens"], "dtype": "Q7"}},  # a dtype no reader knows
    lambda h: {**h, "tokens": {**h["tokens"], "shape": [999]}},  # a shape its bytes do not hold
], ids=["metadata-list", "tokens-int", "unknown-dtype", "shape-past-its-bytes"])
def test_a_malformed_segment_is_skipped_at_start_and_never_stops_the_rank(tmp_path, spoil):
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    snaps.stage(tuple(range(10)), real_cache(10), ("", 0), final=True)
    snaps.close()
    [path] = segment_files(snaps.folder)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(spoil(json.loads(data[8:8 + n]))).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    assert scan(snaps.folder, ME)[1] == {path: "truncated"}
    again = Snapshots(tmp_path, ME, 1 << 20, every=4)  # a rank's start: it goes on, the file deleted and counted
    assert again.skipped == {"truncated": 1} and not path.exists() and again.held() == []
    again.close()


def test_a_snapshot_folder_deleted_while_serving_fails_that_write_is_made_again_and_the_writer_goes_on(tmp_path):
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    snaps.stage(tuple(range(10)), real_cache(10), ("", 0), final=True)
    wait_for(lambda: snaps.written == 1, 10, "the first segment")
    shutil.rmtree(tmp_path)  # what an operator does after doctor's space warning
    snaps.stage(tuple(range(100, 110)), real_cache(10), ("", 0), final=True)  # finds the folder gone: failed
    snaps.stage(tuple(range(200, 210)), real_cache(10), ("", 0), final=True)
    snaps.close()
    assert snaps.written == 2 and snaps.skipped == {"write_failed": 1} and snaps.stats()["snapshots_pending"] == 0
    assert len(segment_files(snaps.folder)) == 1 and snaps.nbytes == sum(p.stat().st_size for p in
                                                                        segment_files(snaps.folder))
    assert snaps.held() == [tape_id(range(200, 210))]  # the deleted one forgotten
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path, snaps.folder)} == {"0o700"}  # made again, private


def restorer_over(tmp_path, tapes: list[tuple], read_bps: float, prefill_tps: float, taps=None, reading=None):
    """A rank of one that served `tapes` in its last generation (their last positions' `taps` kept with them),
    now restoring them while it serves, with these rates measured before (its thread's reads through
    `reading(read)`, when given)."""
    snaps = Snapshots(tmp_path, ME, 1 << 24, every=4)
    for tape in tapes:
        snaps.stage(tape, real_cache(len(tape)), ("", 0), final=True, taps=taps)
    snaps.close()
    again = Snapshots(tmp_path, ME, 1 << 24, every=4)
    if reading:  # what the thread's reads go through
        again.read = reading(again.read)
    rates = Rates(None)
    rates.note(read_bps=read_bps, prefill_tps=prefill_tps)
    tape = TokenTape(capacity=8)
    restorer = Restorer.agree(again, lambda b: [b], tape, lambda: [KVCache(), KVCache()], rates, print, rank=0)
    wait_for(lambda: len(restorer.tokens) == len(tapes), 10, "what the pending tapes hold, read first")
    return restorer, tape


def insert(rid, prompt):
    return Insert(Job(rid, tuple(prompt), 1, 0, {}))


@pytest.mark.parametrize("newer,skipped", [
    ([(10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 99)], {"superseded": 1}),  # the first conversation's next turn
    ([(500 + i, 1, 2) for i in range(8)], {"capacity": 2}),  # eight newer conversations
], ids=["superseded", "no room"])
def test_a_restored_tape_the_token_tape_does_not_keep_is_counted_with_why(tmp_path, newer, skipped):
    restorer, tape = restorer_over(tmp_path, [tuple(range(10, 20)), tuple(range(30, 40))], 0, 0)
    for tokens in newer:  # served while the restores went on
        tape.store(tokens, real_cache(len(tokens)))
    wait_for(lambda: restorer.adopt(lambda b: [b]) is not None and not restorer.pending, 10, "the restores")
    assert restorer.snaps.skipped == skipped and restorer.snaps.restored == 2 - sum(skipped.values())


def test_a_restored_cache_is_built_a_leaf_an_iteration_so_requests_step_between_its_parts(tmp_path):
    tokens = tuple(range(10, 30))
    restorer, tape = restorer_over(tmp_path, [tokens], 0, 0)
    restorer.build_bytes = 1  # a leaf an iteration: the cache has two
    wait_for(lambda: restorer._read, 10, "the tape read by the thread")
    assert restorer.buildable  # a request waiting for it has the loop exchange without a doze from here
    assert restorer.adopt(lambda b: [b]) == [] and len(tape) == 0  # its first leaf built: the loop steps on
    assert restorer.buildable
    time.sleep(0.5)  # the steps the loop takes between the parts
    assert restorer.adopt(lambda b: [b]) == [tape_id(tokens)] and tape.served(tokens + (1,)) == len(tokens)
    assert not restorer.buildable
    # the build's rate is over the wall time its parts took, what a request waiting for it would wait
    assert 0 < restorer.rates.build_bps <= restorer.snaps.nbytes_of(tape_id(tokens)) * 4 / 0.5


def test_a_restored_tape_gives_the_next_turn_the_taps_its_snapshot_kept(tmp_path):
    tokens, taps = tuple(range(10, 30)), mx.random.normal((1, 4, 6))  # DSpark's stages' context for the next turn
    restorer, tape = restorer_over(tmp_path, [tokens], 0, 0, taps=taps)
    wait_for(lambda: restorer.adopt(lambda b: [b]) == [tape_id(tokens)], 10, "the tape restored")
    assert mx.array_equal(tape.take(tokens + (7,))[4], taps).item()
    assert tape.take(tokens[:17] + (7,))[4].shape == (1, 1, 6)  # of a shorter prefix, those before it


def test_a_request_that_a_pending_tape_serves_waits_for_it_and_a_new_conversation_goes_at_once(tmp_path):
    old = tuple(range(100, 160))
    restorer, tape = restorer_over(tmp_path, [old], read_bps=1e9, prefill_tps=100.0)
    assert restorer.pending == [tape_id(old)] and len(tape) == 0
    outbox = restorer.screen([insert("turn", old + (7, 8)), insert("new", (1, 2, 3)), insert(WARMUP, old + (9,))],
                             through=WARMUP)
    # the next turn of the old conversation waits, its tape first in every rank's queue; the others go
    assert outbox == [RestoreFirst(tape_id(old)), insert("new", (1, 2, 3)),
                      insert(WARMUP, old + (9,))] and restorer.holding
    adopted = wait_for(lambda: restorer.adopt(lambda b: [b]), 10, "the tape read and adopted")  # at loop iterations
    assert adopted == [tape_id(old)] and not restorer.pending
    assert restorer.screen([], through=WARMUP) == [insert("turn", old + (7, 8))] and not restorer.holding
    assert tape.served(old + (7, 8)) == len(old)  # it starts from the restored tape


def test_a_request_goes_at_once_when_prefilling_is_sooner_than_reading_or_nothing_was_measured(tmp_path):
    old = tuple(range(100, 160))
    for read_bps, prefill_tps in ((1.0, 1e6), (0.0, 1e6), (1e9, 0.0)):
        restorer, _ = restorer_over(tmp_path / f"{read_bps}-{prefill_tps}", [old], read_bps, prefill_tps)
        assert restorer.screen([insert("turn", old + (7, 8))], through=WARMUP) == [insert("turn", old + (7, 8))]


def test_a_held_request_cancelled_or_drained_is_never_left_behind(tmp_path):
    old = tuple(range(100, 160))
    restorer, _ = restorer_over(tmp_path, [old], read_bps=1e9, prefill_tps=100.0)
    restorer.screen([insert("a", old + (1,)), insert("b", old + (2,))], through=WARMUP)
    cancel, drain = Cancel("a"), Drain(DrainMode.FINISH)
    assert restorer.screen([cancel], through=WARMUP) == [cancel]  # "a" is gone for good
    assert restorer.screen([drain], through=WARMUP) == [insert("b", old + (2,)), drain]  # refused by the drain
    assert not restorer.holding


def test_the_tape_a_request_waits_for_is_built_before_a_tape_read_or_begun_before_it(tmp_path):
    old, newer = tuple(range(100, 160)), tuple(range(300, 360))
    restorer, tape = restorer_over(tmp_path, [old, newer], read_bps=1e9, prefill_tps=100.0)
    assert restorer.pending == [tape_id(newer), tape_id(old)]  # the conversation served last first
    restorer.build_bytes = 1  # a leaf an iteration: each cache has two
    wait_for(lambda: len(restorer._read) == 2, 10, "both tapes read")
    assert restorer.adopt(lambda b: [b]) == []  # the newer one's first leaf
    assert restorer.screen([insert("turn", old + (7,))], through=WARMUP) == [RestoreFirst(tape_id(old))]
    restorer.first(tape_id(old))  # as every rank does when the loop's exchange brings it
    assert restorer.adopt(lambda b: [b]) == []  # the old one's first leaf: the newer one's build set aside
    assert restorer.adopt(lambda b: [b]) == [tape_id(old)]  # ... and its second: it joins first
    assert restorer.screen([], through=WARMUP) == [insert("turn", old + (7,))]
    assert restorer.adopt(lambda b: [b]) == [tape_id(newer)]  # the one set aside goes on where it was
    assert tape.served(newer + (1,)) == len(newer) and tape.served(old + (1,)) == len(old)


def test_a_request_waits_only_when_its_tape_and_what_the_thread_reads_before_it_are_well_under_a_prefill(tmp_path):
    old, newer = tuple(range(100, 160)), tuple(range(300, 360))
    gates = {tape_id(newer): threading.Event(), tape_id(old): threading.Event()}

    def each_tape_at_its_gate(read):
        def reading(sid, types, on_part=lambda nbytes: None):
            gates[sid].wait(30)
            return read(sid, types, on_part)
        return reading

    restorer, _ = restorer_over(tmp_path, [old, newer], 0, 0, reading=each_tape_at_its_gate)
    nbytes = restorer.snaps.nbytes_of(tape_id(old))  # the newer tape's are as many
    # reading and building the old tape: 2 * nbytes / 1e6 s; with the newer tape's read before it, 3x that
    rates = {"read_bps": 1e6, "prefill_tps": MARGIN * len(old) * 1e6 / (2.5 * nbytes)}
    restorer.rates.note(**rates)
    wait_for(lambda: restorer._reading, 10, "the thread at the newer tape")
    assert restorer.screen([insert("turn", old + (7,))], through=WARMUP) == [insert("turn", old + (7,))]
    gates[tape_id(newer)].set()
    wait_for(lambda: (restorer._reading or ("",))[0] == tape_id(old), 10, "the thread at the old tape")
    restorer.rates.note(**rates)  # as before the newer tape's read, which measured its own
    assert restorer.screen([insert("next", old + (8,))], through=WARMUP) == [RestoreFirst(tape_id(old))]
    gates[tape_id(old)].set()


def test_the_next_generation_restores_the_conversation_served_last_first_not_the_tapes_restored_behind_it(tmp_path):
    old, newer = tuple(range(100, 160)), tuple(range(300, 360))
    restorer, _ = restorer_over(tmp_path, [old, newer], 0, 0)
    adopted = []
    wait_for(lambda: adopted.extend(restorer.adopt(lambda b: [b])) or not restorer.pending, 10, "the restores")
    assert adopted == [tape_id(newer), tape_id(old)]  # the old one joined last
    restorer.snaps.close()
    assert Snapshots(tmp_path, ME, 1 << 24, every=4).held() == [tape_id(old), tape_id(newer)]  # least recent first


def test_a_restorer_closed_at_a_drain_reads_no_further_tape_and_the_rank_exits_without_a_traceback(tmp_path):
    """A drained rank exits while its thread reads tapes (a real interpreter's end): closed, as the rank closes
    it once drained, the thread stops before its next tape. Left open, its next read asks the ended
    interpreter for threads: "Exception in thread snapshot-reader" in the rank's log, every drain on an H100."""
    script = f"""
import atexit, sys, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from runtime.prefix.rates import Rates
from runtime.prefix.snapshot import Identity, Snapshots
from runtime.prefix.tape import TokenTape
from runtime.restore import Restorer
ME = Identity("model", 1, 0, "layout")
def cache():
    layers = [KVCache() for _ in range(8)]
    for c in layers:
        c.update_and_fetch(mx.ones((1, 2, 4000, 64)), mx.ones((1, 2, 4000, 64)))
    return layers
snaps = Snapshots(Path(sys.argv[1]), ME, 1 << 30, every=1 << 20)
for i in range(8):
    snaps.stage(tuple(range(i * 5000, i * 5000 + 4000)), cache(), ("", 0), final=True)
snaps.close()
again = Snapshots(Path(sys.argv[1]), ME, 1 << 30, every=1 << 20)
restorer = Restorer.agree(again, lambda b: [b], TokenTape(8), lambda: [KVCache() for _ in range(8)], Rates(None),
                          print, 0)
while not restorer._reading:
    time.sleep(0.001)
restorer.close()
atexit.register(time.sleep, 1.0)  # an exit takes a while (a rank's transport), the thread reading meanwhile
print("exiting with", len(restorer.pending), "pending", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "exiting with 8 pending" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr


def test_a_long_prompt_is_snapshotted_chunk_by_chunk_as_it_is_prefilled_so_a_death_loses_one_chunk(
        demo_model, tmp_path):
    model, tokenizer = load(str(demo_model))
    prompt = tuple(tokenizer.encode(LONG))[:200]
    snaps = Snapshots(tmp_path, ME, 1 << 30, every=16)
    engine = undrafted(model, set(), prefill_step_size=32, prefixes=PrefixStore(model, prefill_step_size=32,
                                                                                 snapshots=snaps))
    engine.insert(Job("long", prompt, 8, 0, SamplingParams(max_tokens=8, temperature=0.0).sampling()))
    while not engine.step():  # the prefill, chunk by chunk, up to the answer's first token
        pass
    snaps.close()  # what was staged by then, written
    chain = sorted((s.start, s.end) for s in snaps.segments.values())
    # one segment a chunk, each appended to the one before, all but the last `every` tokens at most
    assert chain[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chain, chain[1:])), chain
    assert all(end - start <= 32 for start, end in chain) and chain[-1][1] >= len(prompt) - 1 - 16, chain
    last = max(snaps.segments.values(), key=lambda s: s.end)
    last.path.unlink()  # the segment a death would have lost
    again = Snapshots(tmp_path, ME, 1 << 30, every=16)
    [(tokens, cache, _)] = again.restore(ends(again.held(), {s: g.parent for s, g in again.segments.items()}),
                                         fresh=lambda: make_prompt_cache(model))
    assert tokens == prompt[:last.start] and len(tokens) >= 199 - 2 * 32  # all but the last chunk
    again.close()
    assert engine.prefixes.rates.prefill_tps > 0  # its pieces' rate: what a restore weighs against a prefill


def test_batched_answers_are_snapshotted_as_they_stream_and_a_row_restores_exactly(demo_model, tmp_path):
    model, tokenizer = load(str(demo_model))
    sampling = SamplingParams(max_tokens=48, temperature=0.0).sampling()
    prompts = [tuple(tokenizer.encode(LONG))[:40], tuple(tokenizer.encode("Drain before close. " * 4))]
    snaps = Snapshots(tmp_path, ME, 1 << 30, every=16)
    engine = undrafted(model, set(), prefixes=PrefixStore(model, snapshots=snaps))
    for i, prompt in enumerate(prompts):
        engine.insert(Job(f"r{i}", prompt, 48, 0, sampling))  # the second joins the first: a batch of two
    told = {"r0": [], "r1": []}
    while all(len(t) < 40 for t in told.values()):  # both answers in flight, neither at its end
        for e in engine.step():
            told[e.rid].append(e.token)
    snaps.pump()
    snaps.close()
    again = Snapshots(tmp_path, ME, 1 << 30, every=16)
    tapes = again.restore(ends(again.held(), {s: g.parent for s, g in again.segments.items()}),
                          fresh=lambda: make_prompt_cache(model))
    assert len(tapes) == 2
    for tokens, cache, _ in tapes:
        i = next(i for i, p in enumerate(prompts) if tokens[:len(p)] == p)
        answer = tokens[len(prompts[i]):]
        assert len(answer) >= 16 and list(answer) == told[f"r{i}"][:len(answer)]  # part of the answer, on disk
        ref = make_prompt_cache(model)
        want = model(mx.array(tokens + (7,))[None], cache=ref)[0, -1]
        got = model(mx.array([7])[None], cache=cache)[0, -1]  # the restored row goes on as a fresh prefill does
        assert mx.allclose(got, want, atol=1e-4).item()
    again.close()


def test_snapshots_are_private_and_a_forged_one_is_skipped_without_the_nodes_key(tmp_path):
    key = snapshot_key(tmp_path / "snapshot.key")
    assert snapshot_key(tmp_path / "snapshot.key") == key and (tmp_path / "snapshot.key").stat().st_mode & 0o777 == 0o600
    snaps = Snapshots(tmp_path / "snapshots", ME, 1 << 20, every=4, key=key)
    snaps.stage(tuple(range(10)), real_cache(10), ("", 0), final=True)
    snaps.close()
    [path] = segment_files(snaps.folder)
    # a conversation's tokens: only its user reads them
    assert path.stat().st_mode & 0o777 == 0o600
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in (snaps.root, snaps.folder))
    # a writer to the folder replaces the keys and values and names the file by the digest it can compute
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    unkeyed, _, _ = read_segment(path, b"")
    forged = path.rename(path.with_name(f"{path.name.split('.')[0]}.{unkeyed}.safetensors"))
    again = Snapshots(tmp_path / "snapshots", ME, 1 << 20, every=4, key=key)
    assert again.restore(again.held(), fresh=lambda: [KVCache(), KVCache()]) == []
    assert again.skipped == {"corrupt": 1} and not forged.exists()
    again.close()


def test_tenants_never_share_a_prefix_in_memory_or_on_disk_and_a_restore_keeps_whose_it_is(tmp_path):
    """With API keys the proxy scopes each caller's prefix cache: a tape of one tenant never serves another's
    prompt, so neither cached_tokens nor the first token's speed tells one what the other sent."""
    secret = tuple(range(40))
    tape = TokenTape(capacity=8)
    tape.store(secret, real_cache(40), tape_id(secret, "alice"), "alice")
    assert tape.served(secret + (1,), "alice") == 40
    assert tape.served(secret + (1,), "bob") == 0 and tape.served(secret + (1,)) == 0
    cache, cached, _, _, _ = tape.take(secret[:20] + (99,), "bob")
    assert (cache, cached, tape.misses) == (None, 0, 1)  # a miss, as if nothing were held
    assert tape_id(secret, "alice") != tape_id(secret, "bob") != tape_id(secret)

    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    for tenant in ("alice", "bob"):
        snaps.stage(secret, real_cache(40), ("", 0), final=True, tenant=tenant)
    snaps.close()
    again = Snapshots(tmp_path, ME, 1 << 20, every=4)
    tape = TokenTape(capacity=8)
    restorer = Restorer.agree(again, lambda b: [b], tape, lambda: [KVCache(), KVCache()], Rates(None), print, 0)
    wait_for(lambda: (restorer.adopt(lambda b: [b]), not restorer.pending)[1], 10, "both tapes restored")
    assert tape.served(secret + (1,), "alice") == tape.served(secret + (1,), "bob") == 40
    assert tape.served(secret + (1,), "carol") == 0
    again.close()


def test_a_tape_in_use_is_kept_and_one_unused_past_its_age_is_deleted_at_the_start(tmp_path):
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4, max_age=86400)
    old, daily = tuple(range(10)), tuple(range(50, 60))
    for tape in (old, daily):
        snaps.stage(tape, real_cache(10), ("", 0), final=True)
    snaps.close()
    week_ago = time.time() - 7 * 86400
    for path in segment_files(snaps.folder):
        os.utime(path, (week_ago, week_ago))
    again = Snapshots(tmp_path, ME, 1 << 20, every=4, max_age=30 * 86400)  # within a month: both kept
    assert set(again.held()) == {tape_id(old), tape_id(daily)}
    again.used(tape_id(daily))  # a hit in memory: its files' age refreshed by the writer
    again.close()
    last = Snapshots(tmp_path, ME, 1 << 20, every=4, max_age=86400)
    assert last.held() == [tape_id(daily)] and last.skipped == {"expired": 1}
    last.close()


def test_a_writer_that_stops_says_so_and_nothing_more_is_staged_for_no_one(tmp_path):
    snaps = Snapshots(tmp_path, ME, 1 << 20, every=4)
    snaps._queue.put(lambda: 1 / 0)  # whatever breaks the thread outside a write
    wait_for(lambda: snaps.writer_error, 10, "the writer's stop")
    assert snaps.stats()["snapshot_writer_error"] == "ZeroDivisionError: division by zero"
    assert snaps.stage(tuple(range(10)), real_cache(10), ("", 0), final=True) == ("", 0)
    assert snaps.stats()["snapshots_pending"] == 0


def test_many_unusable_or_unshared_tapes_are_counted_each_and_said_in_one_line_a_reason(tmp_path):
    lines = []
    snaps = Snapshots(tmp_path, ME, 1 << 30, every=4, log=lines.append)
    for i in range(300):
        snaps.stage((i, i + 1, 7), real_cache(3), ("", 0), final=True)
    snaps.close(timeout=120)
    for path in segment_files(snaps.folder)[:200]:
        path.write_bytes(b"\x00" * 3)  # cut short
    lines.clear()
    again = Snapshots(tmp_path, ME, 1 << 30, every=4, log=lines.append)
    assert again.skipped == {"truncated": 200} and len(again.held()) == 100
    assert len(lines) == 1 and lines[0].startswith("snapshot skipped (truncated): 200 file(s) unusable, deleted")
    lines.clear()
    offers = [json.dumps({"mesh": ME.mesh, "tapes": again.held()}).encode(),
              json.dumps({"mesh": ME.mesh, "tapes": again.held()[:10]}).encode()]  # another rank holds 10 of them
    restorer = Restorer.agree(again, lambda b: offers, TokenTape(8), lambda: [KVCache(), KVCache()], Rates(None),
                              print, rank=1)
    assert again.skipped["missing"] == 90 and len(restorer.pending) == 8
    assert again.skipped["capacity"] == 2 and len(lines) == 2  # the two the token tape has no room for, said too
    restorer.close()
    again.close()


# --- the mesh ------------------------------------------------------------------------------------------------

SPOILED = {"corrupt": "Drain before close. " * 4, "foreign": "Pack my box with five dozen jugs. " * 3,
           "truncated": "hello world " * 8}


def spoil(folder, twin, prompt: list[int], how: str) -> None:
    """Rank 1's first segment of the tapes that start with `prompt`: bytes flipped, replaced by another
    rank's (foreign), or cut short."""
    for path in segment_files(folder):
        tokens = mx.load(str(path))["tokens"].tolist()
        n = min(len(tokens), len(prompt))
        if read_header(path)["parent"] or tokens[:n] != prompt[:n]:
            continue
        data = bytearray(path.read_bytes())
        if how == "corrupt":
            data[-100] ^= 0xFF
        elif how == "truncated":
            data = data[:len(data) // 2]
        else:
            data = next(twin.glob(f"{path.name.split('.')[0]}.*.safetensors")).read_bytes()
        path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def story(demo_model, reference, tmp_path_factory):
    """Generation 1 answers a long prompt and three short ones and is killed mid-stream; rank 1's snapshots
    of the short ones are spoiled; generation 2 serves the long one's next turn, the resumed stream and the
    short ones again."""
    agents = make_agents(tmp_path_factory.mktemp("snapshots"), 2)
    for agent in agents:
        agent.start()
    folders = [a.dir / "state" / "snapshots" for a in agents]
    tok = reference.tokenizer
    cut = {"messages": [{"role": "user", "content": "What is the answer? " * 4}], "max_tokens": 4 * EVERY,
           "temperature": 1.0, "seed": 11, **endless(demo_model)}
    convo = [{"role": "user", "content": LONG}]
    out = {"convo": convo, "prompt": tok.apply_chat_template(convo, add_generation_prompt=True),
           "cut_prompt": tok.apply_chat_template(cut["messages"], add_generation_prompt=True),
           "short": {how: [{"role": "user", "content": text}] for how, text in SPOILED.items()}}

    try:
        generation_1(agents, demo_model, folders, cut, out)
        for how, msgs in out["short"].items():
            spoil(next(folders[1].glob("*-w2-r1")), next(folders[0].glob("*-w2-r0")),
                  tok.apply_chat_template(msgs, add_generation_prompt=True), how)
        generation_2(agents, demo_model, cut, out)
    finally:
        for agent in agents:
            agent.kill()
    return out


def generation_1(agents, model, folders, cut, out):
    """The long prompt's first turn and the short ones answered; rank 1 SIGKILLed while `cut` streams."""
    g1 = Gen(agents, model, 1)
    try:
        out["answer"], _ = g1.chat(out["convo"])
        out["first"] = {how: g1.chat(msgs)[0] for how, msgs in out["short"].items()}
        out["head"], out["delivered"], out["chars"], _, r = g1.stream(cut, stop_after=2 * EVERY)
        wait_for(lambda: all(answer_in_flight(next(f.glob("*-w2-r*")), out["cut_prompt"]) for f in folders),
                 60, "the answer in flight to be snapshotted on both ranks")
        g1.sigkill(1)
        r.close()
    finally:
        g1.stop()


def generation_2(agents, model, cut, out):
    g2 = Gen(agents, model, 2)
    try:
        out["restored"] = [g2.restored(r)["snapshots_restored"] for r in range(2)]
        out["skipped"] = [g2.status(r)["snapshots_skipped"] for r in range(2)]
        out["turn"] = out["convo"] + [{"role": "assistant", "content": out["answer"]},
                                      {"role": "user", "content": "And?"}]
        out["next"], out["next_cached"] = g2.chat(out["turn"])
        head = out["head"]
        resume = {"ids": out["delivered"], "chars": out["chars"], "id": head["id"], "created": head["created"],
                  "seed": head["seed"]}
        served = g2.settled(0)["tape_hit_tokens"]
        _, out["resumed"], _, out["resumed_cached"], _ = g2.stream(cut, resume=resume)
        out["resumed_from_tape"] = g2.settled(0)["tape_hit_tokens"] - served
        _, out["uninterrupted"], _, _, _ = g2.stream({**cut, "seed": head["seed"]})
        out["again"] = {how: g2.chat(msgs) for how, msgs in out["short"].items()}
        out["metrics"] = [{"restored": metric(a, "meshd_agent_rank_snapshots_total", outcome="restored"),
                           "missing": metric(a, "meshd_agent_rank_snapshots_skipped_total", reason="missing"),
                           "bytes": metric(a, "meshd_agent_rank_snapshot_bytes")} for a in agents]
    finally:
        g2.stop()


def test_after_a_sigkill_the_next_turn_is_exact_and_its_prefix_comes_from_the_snapshots(story, reference):
    assert all(n >= 2 for n in story["restored"]), story["restored"]  # the long answer's tape and the cut one's
    assert all(m["restored"] >= 2 and m["bytes"] > 0 for m in story["metrics"]), story["metrics"]  # agents' /metrics
    tok = reference.tokenizer
    ids = tok.apply_chat_template(story["turn"], add_generation_prompt=True)
    assert story["next"] == reference(ids, 24)  # greedy: what one process decodes from scratch
    assert story["next_cached"] >= len(story["prompt"])  # the whole first turn came from the restored tape


def test_a_cut_stream_resumes_from_its_snapshot_and_matches_the_uninterrupted_answer(story):
    assert len(story["delivered"]) >= 2 * EVERY
    assert story["resumed"][:len(story["delivered"])] == story["delivered"]
    assert story["resumed"] == story["uninterrupted"]  # seeded: the same draws, the same tokens
    # the prompt and at least one snapshot of the answer in flight were restored, not prefilled again; the
    # client's usage counts that answer once, as completion, and only its prompt as cached
    assert story["resumed_from_tape"] >= len(story["cut_prompt"]) - 1 + EVERY
    assert story["resumed_cached"] == len(story["cut_prompt"])


def test_a_corrupted_foreign_or_truncated_snapshot_on_one_rank_is_ignored_and_the_answer_is_still_exact(story):
    skipped0, skipped1 = story["skipped"]
    assert all(skipped1.get(how, 0) >= 1 for how in SPOILED), skipped1
    assert skipped0.get("missing", 0) >= 3, skipped0  # rank 0 held them whole, but not every rank did
    assert story["metrics"][0]["missing"] == skipped0["missing"]
    for how, msgs in story["short"].items():
        answer, cached = story["again"][how]
        assert answer == story["first"][how], how
        assert cached < len(msgs[0]["content"]) // 4, how  # prefilled afresh: at most the template's start shared


@pytest.mark.parametrize("flag", ["--snapshot-every", "--snapshot-budget-mb"])
def test_a_snapshot_setting_below_one_is_refused_naming_the_flag_and_the_way_off(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "m", flag, "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{flag} must be at least 1, got 0" in err and "--snapshots off" in err
