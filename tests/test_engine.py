"""The token tape and the seeded sampler, on real mlx caches and arrays."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from runtime.engine import SeededSampler, TokenTape


def cache_of(n: int) -> list:
    c = KVCache()
    keys = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
    c.update_and_fetch(keys, keys)
    return [c]


def test_tape_returns_the_longest_stored_prefix_trimmed_to_what_is_shared():
    tape = TokenTape(capacity=4)
    tape.store((1, 2, 3, 4), cache_of(4))
    tape.store((9, 9), cache_of(2))
    cache, n = tape.take((1, 2, 3, 7, 8))
    assert n == 3
    assert cache[0].offset == 3
    assert cache[0].state[0][0, 0, :3, 0].tolist() == [0, 1, 2]


def test_tape_leaves_at_least_one_token_to_prefill():
    tape = TokenTape()
    tape.store((1, 2, 3), cache_of(3))
    cache, n = tape.take((1, 2, 3))
    assert n == 2 and cache[0].offset == 2


def test_tape_take_copies_so_the_stored_entry_survives():
    tape = TokenTape()
    tape.store((1, 2, 3, 4), cache_of(4))
    first, _ = tape.take((1, 2, 5))
    second, n = tape.take((1, 2, 3, 4, 5))
    assert first[0].offset == 2 and n == 4 and second[0].offset == 4


def test_tape_miss_and_eviction():
    tape = TokenTape(capacity=2)
    assert tape.take((1, 2)) == (None, 0)
    tape.store((1, 1), cache_of(2))
    tape.store((2, 2), cache_of(2))
    tape.store((3, 3), cache_of(2))
    assert len(tape) == 2
    assert tape.take((1, 1, 1)) == (None, 0)


def test_extending_tape_replaces_its_prefix():
    tape = TokenTape()
    tape.store((1, 2), cache_of(2))
    tape.store((1, 2, 3, 4), cache_of(4))
    assert len(tape) == 1


def test_seeded_sampler_replays_and_differs_by_seed():
    logits = mx.zeros((1, 50))

    def draw(seed):
        sampler = SeededSampler(seed, 1.0, 1.0)
        return [sampler(logits).item() for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    resumed = SeededSampler(1, 1.0, 1.0, start=12)
    assert [resumed(logits).item() for _ in range(8)] == draw(1)[12:]
