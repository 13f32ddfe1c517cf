"""DSpark over omlx's REAL DeepSeek-V4 (flyto-mlx's omlx.patches.deepseek_v4, in the pinned env .venv-omlx),
its stages as tests/standins/dspark_v4 gives the published omlx: real meshd-rank processes on the ring over
loopback at TP2 (TP4: test_dspark_tp4.py), a tiny checkpoint whose compressed layers run omlx's PoolingCache/CacheList and the
Indexer's sparse path (prompts past index_topk * ratio), greedy and seeded answers of 160 tokens, drafted
with the Markov head fitted (drafts often accepted) and not (often rejected): each drafted answer is plain
decoding's token for token and logprob for logprob. Plain decoding: one rank on the same checkpoint with
--drafter off (the stages loaded, never used).

The same prompt sent raw to /v1/completions (no chat template) at TP2, drafted, is TP2's plain decoding token
for token (a TP2 mesh with --drafter off); against one rank's plain decoding it differs, if at all, only where
two tokens were within a hair of each other (a sum across two ranks adds in another order): a report of a TP2
V4 mesh whose /v1/completions answer left one rank's near token 20, while its chat answer did not, is that.

Run: .venv-omlx/bin/python -m pytest tests/pinned/test_dspark_real.py"""

import pytest

from pinned.dsv4 import ASKS, COMPLETION, CONFIG, answers, build_v4_checkpoint, check_drafted, greedy, set_up_omlx

TOKENS = 160  # a 16-token window rotates ten times, a ratio-128 pool completes in any 128 of them


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4")
    return {True: build_v4_checkpoint(root / "fitted"), False: build_v4_checkpoint(root / "unfitted", markov_fitted=False)}


@pytest.fixture(scope="module")
def plain(checkpoints, tmp_path_factory):
    """Plain decoding's answers: one rank, the drafter off (the backbone is the same in both checkpoints)."""
    return answers(checkpoints[True], 1, tmp_path_factory.mktemp("plain"), TOKENS, "--drafter", "off",
                   asks={**ASKS, **COMPLETION})[0]


@pytest.mark.parametrize("fitted", [True, False], ids=["fitted", "unfitted"])
def test_drafted_answers_at_tp2_are_plain_decodings_token_for_token(checkpoints, plain, fitted, tmp_path):
    said, status, log = answers(checkpoints[fitted], 2, tmp_path, TOKENS, asks={**ASKS, **COMPLETION})
    check_drafted(said, status, log, plain, fitted, TOKENS)
    if not fitted:
        return  # the backbone is the same: one TP2 control does
    tp2_plain = answers(checkpoints[fitted], 2, tmp_path / "plain", TOKENS, "--drafter", "off", asks=COMPLETION)[0]
    drafted, tp2, one = said["completion"], tp2_plain["completion"], plain["completion"]
    assert drafted["tokens"] == tp2["tokens"]
    assert drafted["logprobs"] == pytest.approx(tp2["logprobs"], abs=1e-4)
    apart = next((i for i, (a, b) in enumerate(zip(tp2["tokens"], one["tokens"])) if a != b), None)
    if apart is not None:  # a near-tie at one rank's place: its two most likely tokens within a hair
        first, second = sorted(one["top"][apart].values(), reverse=True)[:2]
        assert first - second < 1e-3, (apart, one["top"][apart], tp2["top"][apart])


def test_the_checkpoints_answer_depends_on_omlxs_real_caches(checkpoints):
    """The model these tests serve: omlx's real class, its compressed layers' caches, the sparse path, an
    answer that changes when the cache is wrong."""
    import mlx.core as mx
    import mlx_lm.utils

    dsv4 = set_up_omlx()
    model, _ = mlx_lm.utils.load_model(checkpoints[True])
    assert type(model) is dsv4.Model and len(model.mtp) == 3 and model._omlx_dspark_decode_enabled
    kinds = [type(c).__name__ + ("" if not hasattr(c, "caches") else str(len(c.caches))) for c in model.make_cache()]
    assert kinds == ["RotatingKVCache", "CacheList3", "CacheList2", "CacheList3", "RotatingKVCache"], kinds
    assert type(model.layers[1].attn).__name__ == "SparseCompressedAttention"
    prompt = mx.random.randint(0, 500, (4 * CONFIG["index_topk"] * 8,), key=mx.random.key(1)).tolist()
    right, wrong = greedy(model, prompt, 32), greedy(model, prompt, 32, fresh_cache=True)
    assert len(set(right)) > 8 and sum(a != b for a, b in zip(right, wrong)) > 8, (right, wrong)


def test_omlxs_real_model_answers_a_verify_in_meshds_pieces_as_it_decodes_one_by_one(checkpoints):
    """omlx pools a ratio-4 window over the one before it only when both come in one forward: a block that
    completes two windows is not always what one-by-one decoding gives, the pieces meshd feeds it in are
    (runtime/models/pools.py `pieces`), wherever the block starts."""
    import mlx.core as mx
    import mlx_lm.utils

    from runtime.models import pools

    set_up_omlx()
    model, _ = mlx_lm.utils.load_model(checkpoints[True])
    windows = pools.overlap_windows(model)
    assert windows == (4,)
    whole = []
    for start in range(300, 304):
        for length in (6, 9):
            prompt = mx.random.randint(0, 500, (start,), key=mx.random.key(start))
            block = mx.random.randint(0, 500, (length,), key=mx.random.key(length))

            def logits(lengths, prompt=prompt, block=block):
                cache, at, out = model.make_cache(), 0, []
                model(prompt[None], cache)
                for n in lengths:
                    out.append(model(block[None, at:at + n], cache)[0])
                    at += n
                return mx.concatenate(out)

            one_by_one = logits([1] * length)
            assert mx.abs(logits(pools.pieces(start, length, windows)) - one_by_one).max().item() < 1e-4
            whole.append(mx.abs(logits([length]) - one_by_one).max().item())
    assert max(whole) > 1e-3, whole  # the whole block at once is not, somewhere
