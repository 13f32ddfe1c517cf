"""A drafted step's undo on omlx's own DeepSeek-V4 (flyto-mlx's code, at its pins): compressed layers whose
CacheList holds a sliding window and one or two PoolingCaches that write in place, the sparse path (an
Indexer past `index_topk`). Greedy decoding that feeds three rejected drafts and undoes them every five
tokens, or whose verify is refused halfway through the layers, is the plain decoding token for token and
logprob for logprob; a shallow copy's restore (what meshd did before) is not, which shows the model's
answer depends on its caches. So is greedy decoding whose verifies keep some of their drafts and are cut back
to them by writing the kept places' recorded writes again (one forward a step); cut back by a trim, it is not.
A verify of five drafts is one forward with each window pooled alone (pools.pool_alone); as omlx pools a forward's
windows (overlapping those after its first), it is not the plain answer."""

import copy

import mlx.core as mx
import omlx.patches.deepseek_v4 as omlx_v4
import pytest
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

from pinned.dsv4 import tiny_v4
from runtime.models import pools
from runtime.prefix import rollback

omlx_v4.apply_deepseek_v4_patch()  # what follows is omlx's, registered by its patch
from mlx_lm.models.cache import PoolingCache

REJECTED = [7, 8, 9]


@pytest.fixture(scope="module")
def model():
    return tiny_v4()


@pytest.fixture(scope="module")
def prompt():
    return mx.random.randint(0, 500, (1, 300), key=mx.random.key(1))  # 75 pooled rows at ratio 4: past index_topk


def decode(model, prompt, n: int, undo=None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log probabilities; every fifth step, `undo(model, cache, token)` feeds that
    token and three rejected drafts and takes them back."""
    cache = model.make_cache()
    logits = model(prompt, cache)[:, -1]
    tokens, logprobs = [], []
    for i in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(lp, axis=-1)
        tokens.append(int(token.item()))
        logprobs.append(round(float(lp[0, tokens[-1]].item()), 4))
        if undo is not None and i % 5 == 2:
            undo(model, cache, tokens[-1])
        logits = model(token[None], cache)[:, -1]
    return tokens, logprobs


def checkpointed(model, cache, token):
    saved = rollback.checkpoint(cache, 1 + len(REJECTED))
    model(mx.array([[token, *REJECTED]]), cache)
    saved.undo()


def refused_midway(model, cache, token):
    """The verify raises in the fourth layer, after three layers (a pooled one among them) wrote."""
    saved = rollback.checkpoint(cache, 1 + len(REJECTED))
    layer = model.model.layers[3]
    call = type(layer).__call__

    def refuse(self, *args):
        if self is layer:
            raise ValueError("refused")
        return call(self, *args)

    type(layer).__call__ = refuse
    try:
        with pytest.raises(ValueError):
            mx.eval(model(mx.array([[token, *REJECTED]]), cache))
    finally:
        type(layer).__call__ = call
    saved.undo()


def shallow(model, cache, token):
    saved = [copy.copy(c) for c in cache]
    model(mx.array([[token, *REJECTED]]), cache)
    cache[:] = saved


@pytest.fixture(scope="module")
def plain(model, prompt):
    return decode(model, prompt, 40)


def in_pieces(model, places, cache, at: int):
    """The places in the pieces decoding gives (pools.pieces): each completes one ratio-4 window at most."""
    outs = []
    for n in pools.pieces(at, places.shape[1], pools.overlap_windows(model)):
        outs.append(model(places[:, sum(o.shape[1] for o in outs):][:, :n], cache))
    return mx.concatenate(outs, axis=1)


def alone(model, places, cache, at: int):
    """The places in one forward, each window it completes pooled alone, as decoding pools it."""
    assert pools.pool_alone(model)
    with pools.decoding():
        return model(places, cache)


def as_omlx_pools(model, places, cache, at: int):
    """The places in one forward, the windows after its first pooled over the one before (omlx's prompt path)."""
    return model(places, cache)


def drafted(model, prompt, plain: list[int], cut, feed=in_pieces, logprobs: list | None = None) -> list[int]:
    """Greedy tokens from verifies of five drafts, of which the first 0, 1, ... 5 (in turn) are right (the plain
    answer's): each verify fed by `feed`, its caches then `cut` back to the pending token and the drafts the
    target kept; each token's log probability into `logprobs`."""
    cache = model.make_cache()
    logits, at, tokens = model(prompt, cache)[:, -1], prompt.shape[1], []
    while len(tokens) < len(plain) - 6:
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        if logprobs is not None:
            logprobs.append(float((logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0, tokens[-1]].item()))
        good = len(tokens) % 6
        drafts = plain[len(tokens):len(tokens) + good] + [(t + 1) % 500 for t in plain[len(tokens) + good:][:5 - good]]
        saved = rollback.checkpoint(cache, 6, recording=True)
        verified = feed(model, mx.array([[tokens[-1], *drafts]]), cache, at)
        sampled = mx.argmax(verified[0], axis=-1).tolist()
        kept = next((i for i, (d, s) in enumerate(zip(drafts, sampled)) if d != s), 5)
        if logprobs is not None:
            lp = verified[0, :kept] - mx.logsumexp(verified[0, :kept], axis=-1, keepdims=True)
            logprobs += [float(lp[i, d].item()) for i, d in enumerate(drafts[:kept])]
        tokens += drafts[:kept]
        cut(saved, cache, kept + 1)
        logits, at = verified[:, kept], at + kept + 1
    return tokens[:len(plain) - 6]


def replayed(saved, cache, places):
    if places == 6:
        saved.release()
    else:
        assert saved.cut(places)


def trimmed(saved, cache, places):
    saved.release()
    for leaf in rollback.leaves(cache):
        leaf.trim(6 - places)


def test_a_verify_cut_back_to_the_drafts_it_kept_by_replaying_its_writes_leaves_the_answer_the_plain_one(
        model, prompt, plain):
    assert drafted(model, prompt, plain[0], replayed) == plain[0][:-6]
    assert drafted(model, prompt, plain[0], trimmed) != plain[0][:-6]  # pools and windows trimmed keep what was cut


def test_a_verify_of_the_whole_block_in_one_forward_with_its_windows_pooled_alone_answers_plainly(model, prompt, plain):
    ours = []
    assert drafted(model, prompt, plain[0], replayed, alone, ours) == plain[0][:-6]
    assert ours[:len(plain[1]) - 6] == pytest.approx(plain[1][:-6], abs=1e-4)


def pooled_after(model, prompt, feed) -> tuple[mx.array, list]:
    """Eight places after the prompt (they complete two ratio-4 windows) fed by `feed`: their logits and the
    pools' rows."""
    cache = model.make_cache()
    model(prompt, cache)
    logits = feed(model, mx.arange(5, 13)[None], cache, prompt.shape[1])
    return logits, [leaf.pooled for leaf in rollback.leaves(cache) if type(leaf) is PoolingCache]


def one_at_a_time(model, places, cache, at: int):
    return mx.concatenate([model(places[:, i:i + 1], cache) for i in range(places.shape[1])], axis=1)


def test_a_forward_that_completes_two_windows_pools_them_as_decoding_only_when_each_pools_alone(model, prompt):
    logits, pooled = pooled_after(model, prompt, one_at_a_time)
    ours, ours_pooled = pooled_after(model, prompt, alone)
    assert mx.allclose(ours, logits, atol=1e-5) and all(mx.allclose(a, b, atol=1e-5) for a, b in zip(ours_pooled, pooled))
    _, overlapped = pooled_after(model, prompt, as_omlx_pools)
    assert sum(not mx.allclose(a, b, atol=1e-2) for a, b in zip(overlapped, pooled)) == 4  # every ratio-4 pool


def test_the_caches_are_omlxs_compressed_ones(model):
    kinds = [[type(c).__name__ for c in (x.caches if isinstance(x, CacheList) else [x])] for x in model.make_cache()]
    assert kinds == [["RotatingKVCache"], ["RotatingKVCache", "PoolingCache", "PoolingCache"],
                     ["RotatingKVCache", "PoolingCache"], ["RotatingKVCache", "PoolingCache", "PoolingCache"],
                     ["RotatingKVCache"]]


@pytest.mark.parametrize("undo", [checkpointed, refused_midway], ids=["rejected", "refused-midway"])
def test_an_undone_step_leaves_the_answer_the_plain_one(model, prompt, plain, undo):
    assert decode(model, prompt, 40, undo) == plain


def test_a_shallow_copys_restore_keeps_the_rejected_drafts(model, prompt, plain):
    tokens, _ = decode(model, prompt, 40, shallow)
    assert tokens != plain[0]  # the pooled layers kept what was rejected: the answer goes elsewhere


@pytest.mark.parametrize("cache, ahead, exact", [
    (KVCache(), 6, True),
    (RotatingKVCache(max_size=16), 6, True),  # empty: six positions stay inside the window
    (RotatingKVCache(max_size=4), 6, False),  # the window rotates over what a trim would give back
    (PoolingCache(4), 1, False),  # a pool has no trim that undoes its windows
])
def test_a_trim_undoes_a_step_only_where_it_is_exact(cache, ahead, exact):
    assert rollback.trims_exactly(cache, ahead) is exact


def test_a_checkpoint_of_a_window_past_its_size_holds_it_and_trims_the_rest():
    grown, window = KVCache(), RotatingKVCache(max_size=4)
    for c in (grown, window):
        c.update_and_fetch(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)))
    saved = rollback.checkpoint([grown, CacheList(window, PoolingCache(4))], 1)
    assert [leaf for leaf, _ in saved.trimmed] == [grown] and not saved.trims
    assert [type(leaf) for leaf, *_ in saved.held] == [RotatingKVCache, PoolingCache]
    for c in (grown, window):
        c.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
    saved.undo()
    assert grown.offset == window.offset == 6 and float(window.keys.sum()) == 0.0
