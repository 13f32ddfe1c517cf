"""omlx's own DeepSeek-V4 (flyto-mlx's code, at its pins) cut back to checkpoints (runtime/prefix/checkpoints.py):
its compressed layers' CacheLists hold a 16-token sliding window and pools of ratio 4 (overlapping windows, the
sparse Indexer past index_topk) and 128, all written in place. A cache that went on past a checkpoint (its
window rotated, pools completed, open windows overwritten) and is cut back there answers a second prompt that
shares that prefix as a fresh prefill of the second prompt does, token for token and logprob for logprob, at
every kind of stop: a chunk's end, a message marker mid-window, the first prompt's end. A cut that leaves the
windows as they are answers otherwise: the model's answer depends on its caches."""

import copy

import mlx.core as mx
import pytest

from kit import cutback
from pinned.dsv4 import tiny_v4
from runtime.prefix.checkpoints import Held, cut, stops
from runtime.prefix.rollback import leaves
from runtime.prefix.snapshot import Identity, Snapshots, leaf_types

MARK = 7
EVERY = 64
ANSWER = 24  # greedy tokens: the window rotates and ratio-4 pools complete while they are said


@pytest.fixture(scope="module")
def model():
    return tiny_v4()


def tokens(seed: int, n: int) -> list[int]:
    return [8 + t for t in mx.random.randint(0, 490, (n,), key=mx.random.key(seed)).tolist()]


FIRST = tokens(1, 150) + [MARK] + tokens(2, 149)  # 300 tokens: two ratio-128 pools, 75 ratio-4 rows


def prefill(model, cache, prompt, start, marked=None):
    return cutback.prefill(model, cache, prompt, start, frozenset({MARK}), EVERY, marked)


def decode(model, cache, logits):
    return cutback.decode(model, cache, logits, ANSWER)


@pytest.fixture(scope="module")
def went_on(model):
    """The first prompt prefilled with a checkpoint at each stop, then answered: the caches past them all."""
    cache, marked = model.make_cache(), {}
    decode(model, cache, prefill(model, cache, FIRST, 0, marked))
    return cache, marked


SECONDS = {"marker": (150, FIRST[:151] + tokens(3, 40)),  # the next message after the same first ones
           "chunk": (192, FIRST[:192] + tokens(3, 40)),  # a prompt sharing three chunks
           "resent": (299, FIRST)}  # the same prompt again


@pytest.mark.parametrize("case", SECONDS)
def test_a_v4_cache_cut_back_to_a_checkpoint_answers_as_a_fresh_prefill(model, went_on, case):
    cache, marked = went_on
    at, second = SECONDS[case]
    assert at in stops(second, frozenset({MARK}), EVERY)  # where the second prompt's prefill stops too
    ours = copy.deepcopy(cache)
    cut(ours, marked[at])
    said, logprobs = decode(model, ours, prefill(model, ours, second, at))
    fresh = model.make_cache()
    plain, plain_logprobs = decode(model, fresh, prefill(model, fresh, second, 0))
    assert said == plain
    assert logprobs == pytest.approx(plain_logprobs, abs=1e-5)


def test_a_cut_that_leaves_the_windows_as_they_are_answers_otherwise(model, went_on):
    cache, marked = went_on
    second = SECONDS["marker"][1]
    ours = copy.deepcopy(cache)
    past = [dict(vars(leaf)) for leaf in leaves(ours)]  # what the windows hold past the checkpoint
    point = marked[150]
    cut(ours, point)
    for leaf, part, was in zip(leaves(ours), point.parts, past):
        if isinstance(part, Held):
            leaf.__dict__.update({k: v for k, v in was.items() if k not in ("offset", "_idx")})
    wrong = decode(model, ours, prefill(model, ours, second, 150))
    fresh = model.make_cache()
    assert wrong != decode(model, fresh, prefill(model, fresh, second, 0))


def test_a_v4_tape_restored_from_its_snapshot_is_cut_back_to_the_checkpoints_it_kept(model, went_on, tmp_path):
    """The checkpoints go to disk with the tape's last segment (its windows and open pools as they were at
    each, beside the whole state at its end): a restored cache cut back to them answers every second prompt as
    a fresh prefill does, as the cache in memory did above."""
    cache, marked = went_on
    held = tuple(FIRST) + tuple(range(ANSWER))  # the ids of what the cache holds: the prompt, then its answer's
    me = Identity("v4", 1, 0, "layout")
    snaps = Snapshots(tmp_path, me, 1 << 30, every=EVERY)
    snaps.stage(held, cache, ("", 0), final=True, checkpoints=tuple(marked.values()))
    snaps.close()
    again = Snapshots(tmp_path, me, 1 << 30, every=EVERY)
    [sid] = again.held()
    read = again.read(sid, leaf_types(model.make_cache()))
    (_, restored, _), points = again.build(read, model.make_cache), again.checkpoints(read)
    assert [p.at for p in points] == sorted(marked) and again.skipped == {}
    for case, (at, second) in SECONDS.items():
        ours = copy.deepcopy(restored)
        cut(ours, next(p for p in points if p.at == at))
        said, logprobs = decode(model, ours, prefill(model, ours, second, at))
        fresh = model.make_cache()
        plain, plain_logprobs = decode(model, fresh, prefill(model, fresh, second, 0))
        assert said == plain, case
        assert logprobs == pytest.approx(plain_logprobs, abs=1e-5)
    again.close()
