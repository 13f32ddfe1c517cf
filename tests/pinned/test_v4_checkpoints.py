"""omlx's own DeepSeek-V4 (flyto-mlx's code, at its pins) cut back to checkpoints (runtime/prefix/checkpoints.py):
its compressed layers' CacheLists hold a 16-token sliding window and pools of ratio 4 (overlapping windows, the
sparse Indexer past index_topk) and 128, all written in place. A cache that went on past a checkpoint (its
window rotated, pools completed, open windows overwritten) and is cut back there answers a second prompt that
shares that prefix as a fresh prefill of the second prompt does, token for token and logprob for logprob, at
every kind of stop: a chunk's end, a message marker mid-window, the first prompt's end. A cut that leaves the
windows as they are answers otherwise: the model's answer depends on its caches."""

import copy

import mlx.core as mx
import omlx.patches.deepseek_v4 as omlx_v4
import pytest

from pinned.dsv4 import CONFIG
from runtime.prefix.checkpoints import Held, checkpoint, cut, stops
from runtime.prefix.rollback import leaves

omlx_v4.apply_deepseek_v4_patch()
from mlx_lm.models import deepseek_v4 as v4  # noqa: E402  (registered by omlx's patch above)

MARK = 7
EVERY = 64
ANSWER = 24  # greedy tokens: the window rotates and ratio-4 pools complete while they are said


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    m = v4.Model(v4.ModelArgs.from_dict(CONFIG))
    m.model.embed_tokens.weight = m.model.embed_tokens.weight * 4.0
    mx.eval(m.parameters())
    return m


def tokens(seed: int, n: int) -> list[int]:
    return [8 + t for t in mx.random.randint(0, 490, (n,), key=mx.random.key(seed)).tolist()]


FIRST = tokens(1, 150) + [MARK] + tokens(2, 149)  # 300 tokens: two ratio-128 pools, 75 ratio-4 rows


def prefill(model, cache, prompt, start, marked=None):
    at = start
    for stop in [s for s in stops(prompt, frozenset({MARK}), EVERY) if s > start]:
        model(mx.array(prompt[at:stop])[None], cache)
        mx.eval([c.state for c in cache])
        at = stop
        if marked is not None:
            marked[stop] = checkpoint(cache, stop)
    return model(mx.array(prompt[at:])[None], cache)[:, -1]


def decode(model, cache, logits, n=ANSWER):
    said, logprobs = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(lp, axis=-1)
        said.append(token.item())
        logprobs.append(lp[0, said[-1]].item())
        logits = model(token[None], cache)[:, -1]
    return said, logprobs


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
