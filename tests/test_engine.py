"""The token tape, the seeded sampler, the batch engine's solo path and the lockstep exchange's judgement, on
real mlx caches, arrays and the demo model."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from runtime.demo_model import DemoModelSpec, build_demo_model
from runtime.drafting import MTPEngine
from runtime.engine import BatchEngine, Job
from runtime.lockstep import Divergence, Lockstep, PeerLost, fold
from runtime.openai_api import SamplingParams
from runtime.sampling import SeededSampler
from runtime.tape import TokenTape


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


SAMPLING = SamplingParams(max_tokens=1, temperature=1.0).sampling()


def test_seeded_sampler_replays_and_differs_by_seed():
    logits = mx.zeros((1, 50))

    def draw(seed):
        sampler = SeededSampler(seed, SAMPLING)
        return [sampler(logits).item() for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    resumed = SeededSampler(1, SAMPLING, start=12)
    assert [resumed(logits).item() for _ in range(8)] == draw(1)[12:]


SAMPLINGS = pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.8, "top_k": 20, "repetition_penalty": 1.3, "logit_bias": ((2, -100.0),)},
], ids=["greedy", "seeded", "seeded with penalties and bias"])


@pytest.fixture(scope="module")
def demo(demo_model):
    from mlx_lm import load
    return load(str(demo_model))


def answers(model, eos, jobs: list[Job], join_at: int | None = None, prefill_step_size: int = 512) -> dict:
    """Every job's tokens: the first alone from the start, the others inserted after `join_at` steps."""
    engine = BatchEngine(model, eos, prefill_step_size=prefill_step_size)
    out = {j.rid: [] for j in jobs}
    engine.insert(jobs[0])
    waiting, steps = list(jobs[1:]), 0
    while engine.busy or waiting:
        if waiting and steps == join_at:
            for j in waiting:
                engine.insert(j)
            waiting = []
        out.update({e.rid: out[e.rid] + [e.token] for e in engine.step() if e.token is not None})
        steps += 1
    return out


@SAMPLINGS
@pytest.mark.parametrize("join_at", [2, 5, 20], ids=["in prefill", "at the first tokens", "mid-answer"])
def test_a_request_alone_then_joined_answers_as_it_would_alone(demo, sampling, join_at):
    """A request alone decodes solo; a second one moves it into the batch mid-answer. Neither
    answer may change by it (the same tokens as each request alone, its seed's draws included)."""
    model, tokenizer = demo
    eos = set(tokenizer.eos_token_ids)
    s = {**SAMPLING, **sampling}
    prompt = tuple(tokenizer.encode("a long answer about the mesh, " * 2))
    first, second = Job("a", prompt, 40, 7, s), Job("b", prompt[:9], 16, 3, s)
    alone = {**answers(model, eos, [first], prefill_step_size=8), **answers(model, eos, [second])}
    assert len(alone["a"]) > join_at
    joined = answers(model, eos, [first, second], join_at, prefill_step_size=8)
    assert joined == alone


def test_a_solo_answer_is_the_reference_greedy_answer_and_feeds_the_tape(demo, reference):
    model, tokenizer = demo
    greedy = {**SAMPLING, "temperature": 0.0}
    prompt = tuple(tokenizer.encode("hello"))
    engine = BatchEngine(model, set(tokenizer.eos_token_ids))
    engine.insert(Job("a", prompt, 24, 0, greedy))
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step()]
    assert tokenizer.decode(tokens) == reference(list(prompt), 24)
    # a follow-up that extends the answer prefills only what is new
    assert engine.insert(Job("b", prompt + tuple(tokens[:10]) + prompt, 4, 0, greedy)) == len(prompt) + 10


def two_rank_lockstep(peer_share):
    """Rank 0 of two, its collective summing in what the transport got from rank 1 (None: nothing, as
    a ring transport that gave up on a dead peer hands back the local buffer)."""
    lockstep = Lockstep.__new__(Lockstep)
    lockstep.rank, lockstep.size = 0, 2
    lockstep._all_sum = lambda x: x if peer_share is None else x + mx.array(peer_share, dtype=mx.int32)
    return lockstep


@pytest.mark.parametrize("peer_share,raises", [
    ([0, 0, 0, 2, 0, fold(0, 7)], None),              # rank 1 sampled the same token
    ([0, 0, 0, 2, 0, fold(0, 8)], Divergence),        # rank 1 sampled another
    (None, PeerLost),                                 # rank 1 is gone: its digest is 0, not a divergence
    ([0, 0, 0, 0, 0, fold(0, 7)], PeerLost),          # a share without rank 1's tally bit is no share
])
def test_an_exchange_is_judged_only_with_every_ranks_share(peer_share, raises):
    lockstep = two_rank_lockstep(peer_share)
    if raises is None:
        assert lockstep.exchange([], 0.5, 1, digest=fold(0, 7)) == ([], 0.5, 1)
    else:
        with pytest.raises(raises):
            lockstep.exchange([], 0.5, 1, digest=fold(0, 7))


@pytest.fixture(scope="module")
def mtp_demo(tmp_path_factory):
    import runtime.overlays.demo_mtp  # noqa: F401  registers model type demo_mtp
    from mlx_lm.utils import load_model

    path = build_demo_model(tmp_path_factory.mktemp("models") / "mtp", DemoModelSpec(mtp=True, mtp_train_steps=30))
    model, config = load_model(path)
    return model, {config["eos_token_id"]}


def drain(engine, job: Job, cancel_after: int | None = None) -> list[int]:
    engine.insert(job)
    out = []
    while engine.busy:
        out += [e.token for e in engine.step() if e.token is not None]
        if cancel_after is not None and len(out) >= cancel_after:
            engine.cancel(job.rid)
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_the_heads_drafts_do_not_depend_on_how_the_prompt_was_chunked(mtp_demo, k):
    """The head learns a prompt chunk by chunk as it would in one pass: the guesses it drafts after a
    chunk do not stay in its cache, so it proposes and hits the same drafts."""
    model, _ = mtp_demo
    job = Job("a", tuple(range(5, 45)), 48, 7, {**SAMPLING, "temperature": 0.0})
    runs = []
    for chunk in (16, 512):
        engine = MTPEngine(model, set(), num_draft_tokens=k, prefill_step_size=chunk, log=lambda line: None)
        runs.append((drain(engine, job), engine.draft_stats()))
    assert runs[0] == runs[1] and runs[0][1]["draft_accepted"] > 0


@SAMPLINGS
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafting_answers_what_plain_decoding_answers(mtp_demo, sampling, k):
    model, eos = mtp_demo
    s = {**SAMPLING, **sampling}
    job = Job("a", tuple(range(5, 45)), 48, 7, s)
    plain = drain(BatchEngine(model, eos, prefill_step_size=16), job)
    engine = MTPEngine(model, eos, num_draft_tokens=k, prefill_step_size=16, log=lambda line: None)
    assert drain(engine, job) == plain
    stats = engine.draft_stats()
    assert stats["draft_proposed"] > 0 and stats["draft_fallbacks"] == 0
    assert drain(engine, Job("b", job.prompt, 48, 7, s), cancel_after=5)[:5] == plain[:5]  # a cancel ends it
    assert not engine.busy
