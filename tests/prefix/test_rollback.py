"""What undoes a verify's cache writes (runtime/prefix/rollback.py) and where a verify and a prompt are cut
(runtime/models/pools.py `pieces`, `prompt_piece`), at the newest mlx-lm: a trim where a trim gives back exactly what
the step wrote, else each cache leaf (a CacheList's members, a sliding window past its size, a recurrent state) as
the step found it, however often it is undone; a step cut back to its first places by writing them again from
what it recorded, as feeding only those places leaves the caches. The same on omlx's own DeepSeek-V4 caches:
tests/pinned/test_rollback.py."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from runtime.prefix import rollback
from runtime.models.pools import pieces, prompt_piece, verify_width


def kv(n: int, value: float = 0.0):
    return mx.full((1, 1, n, 2), value), mx.full((1, 1, n, 2), value)


def places(start: int, n: int):
    """`n` positions' keys and values, each position's its own number."""
    k = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 1, 1, 2))
    return k, -k


def fed(caches, steps) -> None:
    for start, n in steps:
        for c in caches:
            c.update_and_fetch(*places(start, n))


def held(cache) -> tuple:
    """What the cache holds: a growing cache's keys and values up to its offset, a window's whole buffer."""
    n = cache.offset if type(cache) is KVCache else cache.keys.shape[2]
    return cache.offset, getattr(cache, "_idx", None), cache.keys[..., :n, :].tolist(), cache.values[..., :n, :].tolist()


@pytest.mark.parametrize("cache, fed, ahead, exact", [
    (KVCache(), 0, 6, True),
    (RotatingKVCache(max_size=16), 8, 6, True),  # the step stays inside the window
    (RotatingKVCache(max_size=16), 12, 6, False),  # it rotates over what a trim would give back
    (ArraysCache(1), 0, 1, False),  # a recurrent state has no trim
])
def test_a_trim_undoes_a_step_only_where_it_gives_back_exactly_what_the_step_wrote(cache, fed, ahead, exact):
    if fed:
        cache.update_and_fetch(*kv(fed))
    assert rollback.trims_exactly(cache, ahead) is exact


def test_every_leaf_comes_back_as_the_step_found_it_however_often_it_is_undone():
    grown, window, state = KVCache(), RotatingKVCache(max_size=4), ArraysCache(1)
    for c in (grown, window):
        c.update_and_fetch(*kv(6))
    state[0] = mx.zeros((1, 2))
    caches = [grown, CacheList(window, state)]
    before = (grown.offset, window.offset, window._idx, window.keys.shape)
    saved = rollback.checkpoint(caches, 2)
    assert not saved.trims and [leaf for leaf, _ in saved.trimmed] == [grown]
    for _ in range(2):  # a refused verify's undo, then the cut's
        for c in (grown, window):
            c.update_and_fetch(*kv(1, 1.0))  # the window writes in place: a copy of it would see this
        state[0] = state[0] + 1
        saved.undo()
        assert (grown.offset, window.offset, window._idx, window.keys.shape) == before
        assert float(window.keys.sum()) == float(state[0].sum()) == 0.0


@pytest.mark.parametrize("offset, length, windows, expected", [
    (300, 6, (), [6]),  # nothing pools: one forward
    (300, 6, (4,), [6]),  # completes one window (at 303): one forward
    (302, 6, (4,), [5, 1]),  # 303 and 307 complete windows: cut before the second
    (303, 6, (4,), [4, 2]),
    (0, 1, (4,), [1]),
    (120, 12, (4, 128), [7, 4, 1]),  # the smaller window cuts first
])
def test_a_verify_is_cut_before_it_would_complete_a_second_window(offset, length, windows, expected):
    assert pieces(offset, length, windows) == expected


@pytest.mark.parametrize("asked, block, windows, expected", [
    (0, 5, (4,), 3),  # the block by default, fewer than a ratio-4 window: a verify of 4 places completes one
    (5, 5, (4,), 3),
    (2, 5, (4,), 2),  # fewer asked: fewer fed
    (9, 5, (), 5),  # no overlapping pool: the whole block, never more
    (0, 5, (8, 128), 5),
])
def test_a_verify_feeds_at_most_the_drafts_that_keep_it_one_forward(asked, block, windows, expected):
    width = verify_width(asked, block, windows)
    assert width == expected
    assert all(pieces(offset, 1 + width, windows) == [1 + width] for offset in range(300, 300 + 2 * block))


@pytest.mark.parametrize("at, length, said, chunk, windows, expected", [
    (0, 301, 0, 128, (4,), 128),  # a prompt: chunks, as the plain decoder prefills
    (256, 301, 0, 128, (4,), 44),  # up to its last token, left for the step that samples
    (256, 341, 40, 128, (4,), 44),  # a resumed answer's prompt (301 tokens, 40 said): chunks up to its last token
    (300, 341, 40, 128, (4,), 7),  # from it as decoding fed them: each piece completes one window (at 303)
    (307, 341, 40, 128, (4,), 4),
    (300, 341, 40, 128, (), 40),  # nothing pools: the rest of it at once
    (300, 341, 40, 16, (), 16),  # at most a chunk
])
def test_a_prompt_is_cut_in_chunks_and_a_resumed_answers_tokens_as_decoding_fed_them(at, length, said, chunk,
                                                                                     windows, expected):
    assert prompt_piece(at, length, said, chunk, windows) == expected


@pytest.mark.parametrize("kept", [1, 2, 4, 5, 6])
def test_a_step_cut_back_by_its_recorded_writes_holds_what_feeding_only_its_kept_places_holds(kept):
    """A window past its size (a trim would give back what it rotated over) and a growing cache; the step
    comes in two writes (as a verify's pieces do), the cut keeps the first `kept` of its six places."""
    def mesh():
        return [KVCache(), RotatingKVCache(max_size=8)]
    caches, expected = mesh(), mesh()
    fed(caches + expected, [(0, 10), (10, 1)])
    saved = rollback.checkpoint(caches, 6, recording=True)
    assert saved.replays and [leaf for leaf, _ in saved.trimmed] == caches[:1]
    fed(caches, [(11, 4), (15, 2)])
    assert saved.cut(kept)
    fed(expected, [(11, min(kept, 4))] + ([(15, kept - 4)] if kept > 4 else []))
    assert [held(c) for c in caches] == [held(c) for c in expected]
    fed(caches + expected, [(11 + kept, 3)])  # and they go on alike
    assert [held(c) for c in caches] == [held(c) for c in expected]
    assert all("update_and_fetch" not in vars(c) for c in caches), "the recording ends with the cut"


def test_a_cache_written_from_inside_the_model_is_not_cut_by_replay_and_a_release_ends_recording():
    window, state = RotatingKVCache(max_size=4), ArraysCache(1)
    fed([window], [(0, 6)])
    saved = rollback.checkpoint([window, state], 2, recording=True)
    fed([window], [(6, 2)])
    assert not saved.replays and not saved.cut(1)  # a recurrent state: its kept places must be fed again
    assert window.offset == 8 and "update_and_fetch" in vars(window)
    saved.release()
    assert "update_and_fetch" not in vars(window)
