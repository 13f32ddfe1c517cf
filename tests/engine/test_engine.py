"""The token tape, the seeded draws, the engine's plain rows and the lockstep exchange's judgement, on
real mlx caches, arrays and the demo model."""

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from common.openai_api import SamplingParams
from runtime.models.demo_model import DemoModelSpec, build_demo_model
from runtime.engine.proposers import DraftModel, Head
from runtime.engine.jobs import Job
from kit.drafters import drafting, undrafted
from runtime.engine.jobs import Divergence
from runtime.lockstep import Lockstep, PeerLost, fold
from runtime.engine.sampling import sample_at
from runtime.prefix.tape import TokenTape, replaces, reusable_prefix


def cache_of(n: int) -> list:
    c = KVCache()
    keys = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
    c.update_and_fetch(keys, keys)
    return [c]


def test_tape_returns_the_longest_stored_prefix_trimmed_to_what_is_shared():
    tape = TokenTape(capacity=4)
    tape.store((1, 2, 3, 4), cache_of(4))
    tape.store((9, 9), cache_of(2))
    cache, n, _, _, _ = tape.take((1, 2, 3, 7, 8))
    assert n == 3
    assert cache[0].offset == 3
    assert cache[0].state[0][0, 0, :3, 0].tolist() == [0, 1, 2]


def test_tape_leaves_at_least_one_token_to_prefill():
    tape = TokenTape()
    tape.store((1, 2, 3), cache_of(3))
    cache, n, _, _, _ = tape.take((1, 2, 3))
    assert n == 2 and cache[0].offset == 2


def test_tape_take_copies_so_the_stored_entry_survives():
    tape = TokenTape()
    tape.store((1, 2, 3, 4), cache_of(4))
    first, _, _, _, _ = tape.take((1, 2, 5))
    second, n, _, _, _ = tape.take((1, 2, 3, 4, 5))
    assert first[0].offset == 2 and n == 4 and second[0].offset == 4


def test_a_tape_gives_the_taps_it_kept_of_the_positions_before_the_prefix_it_serves():
    tape = TokenTape()
    taps = mx.arange(4, dtype=mx.float32).reshape(1, 4, 1) + 6  # a tape of 10 tokens keeps its last 4: 6, 7, 8, 9
    tape.store(tuple(range(10)), cache_of(10), taps=taps)
    assert tape.taps_bytes == 4 * 4  # said in the status file
    assert tape.take(tuple(range(10)) + (50,))[4][0, :, 0].tolist() == [6, 7, 8, 9]  # the next turn: all of them
    assert tape.take(tuple(range(8)) + (50,))[4][0, :, 0].tolist() == [6, 7]  # a history cut at 8: none after it
    assert tape.take(tuple(range(5)) + (50,))[4] is None  # before every position they hold: none
    tape.store((20, 21, 22), cache_of(3))
    assert tape.take((20, 21, 22, 23))[4] is None  # a tape kept without taps (a plain batch's)


def test_tape_miss_and_eviction():
    tape = TokenTape(capacity=2)
    assert tape.take((1, 2)) == (None, 0, "", (), None)
    tape.store((1, 1), cache_of(2))
    tape.store((2, 2), cache_of(2))
    tape.store((3, 3), cache_of(2))
    assert len(tape) == 2
    assert tape.take((1, 1, 1)) == (None, 0, "", (), None)


def test_extending_tape_replaces_its_prefix():
    tape = TokenTape()
    tape.store((1, 2), cache_of(2))
    tape.store((1, 2, 3, 4), cache_of(4))
    assert len(tape) == 1


def test_a_tape_whose_cache_cannot_be_cut_back_keeps_the_prefix_it_extends_for_a_prompt_that_branches_off():
    def window_of(n: int) -> list:  # a sliding window past its size: it cannot give tokens back
        c, keys = RotatingKVCache(max_size=2), mx.zeros((1, 1, n, 1))
        c.update_and_fetch(keys, keys)
        return [c]

    tape = TokenTape()
    tape.store((1, 2, 3), window_of(3))
    tape.store((1, 2, 3, 4, 5), window_of(5))
    assert len(tape) == 2
    assert tape.take((1, 2, 3, 9, 9))[1] == 3 and tape.take((1, 2, 3, 4, 5, 6))[1] == 5
    tape.store((1, 2, 3, 4, 5), window_of(5))  # the same tape again replaces it
    assert len(tape) == 2


@pytest.mark.parametrize("shared, stored, new, trimmable, replaced", [
    (2, 2, 4, True, True),  # extended, and cut back to it when asked
    (2, 2, 4, False, False),  # extended, but serving only prompts that extend it whole
    (3, 3, 3, False, True),  # the same tape
    (2, 3, 4, True, False),  # a branch off it
    (2, 4, 2, True, False),  # a prefix of it
])
def test_when_a_new_tape_replaces_a_stored_one(shared, stored, new, trimmable, replaced):
    assert replaces(shared, stored, new, trimmable) is replaced


SAMPLING = SamplingParams(max_tokens=1, temperature=1.0).sampling()


def test_seeded_draws_replay_and_differ_by_seed_and_a_resumed_answer_draws_what_it_would_have():
    logits = mx.zeros((1, 50))

    def draw(seed, offset=0, n=20):
        job = Job("a", (1,), n, seed, SAMPLING, offset=offset)
        return [sample_at(job, i, logits).item() for i in range(n)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert draw(1, offset=12, n=8) == draw(1)[12:]


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
    engine = undrafted(model, eos, prefill_step_size=prefill_step_size)
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
    engine = undrafted(model, set(tokenizer.eos_token_ids))
    engine.insert(Job("a", prompt, 24, 0, greedy))
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step()]
    assert tokenizer.decode(tokens) == reference(list(prompt), 24)
    # a follow-up that extends the answer prefills only what is new
    assert engine.insert(Job("b", prompt + tuple(tokens[:10]) + prompt, 4, 0, greedy)) == len(prompt) + 10


@pytest.mark.parametrize("join_at", [None, 6], ids=["alone", "joined mid-answer"])
def test_rows_with_penalties_and_a_bias_go_a_step_ahead_and_answer_as_mlx_lms_own_decoding(demo, join_at):
    """A row with logits processors (here a repetition penalty and a logit bias, as a grammar's mask is one) is
    stepped ahead like any plain row: its processors see what it said on the device, its last token among it.
    Its greedy answer is mlx-lm's generate_step's with the same processors, alone or with a row joining; a
    processor one token behind would repeat where the penalty forbids it."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = demo
    s = {**SAMPLING, "temperature": 0.0, "repetition_penalty": 2.0, "logit_bias": ((5, 3.0),)}
    prompt = tuple(tokenizer.encode("the mesh of ranks, the mesh of ranks, the mesh"))
    processors = make_logits_processors(logit_bias={5: 3.0}, repetition_penalty=2.0)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24, logits_processors=processors)]
    engine = undrafted(model, set())
    jobs, ahead, said, step = {0: [Job("a", prompt, 24, 0, s)], join_at: [Job("b", prompt[:9], 8, 0, s)]}, [], [], 0
    while engine.busy or step <= 6:
        for job in jobs.pop(step, []):
            engine.insert(job)
        emitted = [e.token for e in engine.step() if e.rid == "a"]
        said += emitted
        if emitted:
            ahead.append(engine._queued is not None)
        step += 1
    assert said == want
    assert sum(ahead) > 0.8 * len(ahead), ahead  # all but the step a prompt waited to join at, and the last


def tiny_model(family: str):
    """A tiny random model of an mlx-lm family whose cache cannot always be cut back: gemma3_text with a
    sliding window of 8 (RotatingKVCache layers beside KVCache ones) or qwen3_next (SSM state in
    ArraysCache layers beside KVCache ones)."""
    from mlx_lm.models import gemma3_text, qwen3_next

    mx.random.seed(0)
    if family == "gemma3_text":
        model = gemma3_text.Model(gemma3_text.ModelArgs(
            model_type="gemma3_text", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
            num_attention_heads=2, head_dim=16, num_key_value_heads=1, vocab_size=128, sliding_window=8,
            sliding_window_pattern=2, query_pre_attn_scalar=16))
    else:
        model = qwen3_next.Model(qwen3_next.ModelArgs(
            model_type="qwen3_next", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
            num_attention_heads=2, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=0,
            decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[0, 1],
            moe_intermediate_size=0, rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=1,
            rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=512, head_dim=16,
            full_attention_interval=2))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_next"],
                ids=["KVCache (llama)", "RotatingKVCache, window 8 (gemma3_text)", "ArraysCache (qwen3_next)"])
def family(request, demo):
    """A model and whether its tape cuts back to any shared prefix (only plain KV caches do)."""
    if request.param == "llama":
        return demo[0], True
    return tiny_model(request.param), False


GREEDY = {**SAMPLING, "temperature": 0.0}


def ask(engine, rid: str, prompt: tuple[int, ...]) -> tuple[int, list[int]]:
    """How many prompt tokens came from the tape, and the greedy answer."""
    cached = engine.insert(Job(rid, prompt, 16, 0, GREEDY))
    out = []
    while engine.busy:
        out += [e.token for e in engine.step() if e.token is not None]
    return cached, out


def test_a_repeated_prompt_and_a_partial_prefix_answer_as_a_fresh_engine_whatever_the_cache(family):
    """The tape reuses a cache only where that is exact: cut back to the shared prefix where the cache
    can be trimmed; else for a prompt that extends its tape, or back to a checkpoint where the new prompt's
    prefill stops too (here the repeated prompt's end); otherwise the prompt is prefilled afresh."""
    model, trimmable = family
    engine = undrafted(model, set())
    prompt = tuple(range(5, 45))
    _, first = ask(engine, "a", prompt)
    assert ask(engine, "b", prompt) == (len(prompt) - 1, first)
    partial = prompt[:30] + tuple(range(60, 70))
    assert ask(engine, "c", partial) == ((30 if trimmable else 0), ask(undrafted(model, set()), "c", partial)[1])
    turn = prompt + tuple(first) + (7, 8, 9)  # the tape holds the prompt and the whole answer: the step queued
    # ahead of the answer's last read fed its last token
    assert ask(engine, "d", turn) == (len(prompt) + len(first), ask(undrafted(model, set()), "d", turn)[1])
    served = len(prompt) - 1 + len(prompt) + len(first) + (30 if trimmable else 0)
    stats = engine.stats()
    assert {k: stats[k] for k in ("tape_hits", "tape_hit_tokens", "tape_misses", "tape_not_reusable",
                                  "tape_checkpoint_hits")} == {
        "tape_hits": 3 if trimmable else 2, "tape_hit_tokens": served, "tape_misses": 1,
        "tape_not_reusable": 0 if trimmable else 1, "tape_checkpoint_hits": 0 if trimmable else 1}
    assert (stats["tape_checkpoints"] > 0) is not trimmable


@pytest.mark.parametrize("join_at,length", [(2, 40), (20, 40), (20, 16)],
                         ids=["in prefill", "mid-answer", "at its last token"])
def test_a_request_alone_then_joined_answers_as_it_would_alone_whatever_the_cache(family, join_at, length):
    """The solo request joins the batch without cutting its cache back, which a sliding window past its
    size or SSM state cannot do. (Its prompt takes 5 steps in chunks of 8, so at step 20 it has 15
    tokens out and the 16th on the device.)"""
    model, _ = family
    s = {**SAMPLING, "temperature": 0.8, "repetition_penalty": 1.3}
    first, second = Job("a", tuple(range(5, 45)), length, 7, s), Job("b", tuple(range(5, 14)), 16, 3, s)
    alone = {**answers(model, set(), [first], prefill_step_size=8), **answers(model, set(), [second])}
    assert answers(model, set(), [first, second], join_at, prefill_step_size=8) == alone


@pytest.mark.parametrize("shared,stored,prompt,trimmable,reused", [
    (0, 10, 20, True, 0),      # nothing shared
    (6, 10, 20, True, 6),      # cut back to the shared prefix
    (10, 10, 10, True, 9),     # the same prompt again: its last token is left to process
    (6, 10, 20, False, 0),     # cannot be cut back
    (10, 10, 20, False, 10),   # extends its tape: nothing to cut
    (10, 10, 10, False, 0),    # the same prompt again would need its last token cut off
])
def test_how_much_of_a_tape_a_prompt_reuses(shared, stored, prompt, trimmable, reused):
    assert reusable_prefix(shared, stored, prompt, trimmable) == reused


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
    import runtime.models.overlays.demo_mtp  # noqa: F401  registers model type demo_mtp
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
        engine = drafting(model, set(), Head(model), num_draft_tokens=k, prefill_step_size=chunk)
        runs.append((drain(engine, job), engine.stats()))
    assert runs[0] == runs[1] and runs[0][1]["draft_accepted"] > 0


@SAMPLINGS
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafting_answers_what_plain_decoding_answers(mtp_demo, sampling, k):
    model, eos = mtp_demo
    s = {**SAMPLING, **sampling}
    job = Job("a", tuple(range(5, 45)), 48, 7, s)
    plain = drain(undrafted(model, eos, prefill_step_size=16), job)
    engine = drafting(model, eos, Head(model), num_draft_tokens=k, prefill_step_size=16)
    assert drain(engine, job) == plain
    stats = engine.stats()
    assert stats["draft_proposed"] > 0 and stats["draft_fallbacks"] == 0
    assert drain(engine, Job("b", job.prompt, 48, 7, s), cancel_after=5)[:5] == plain[:5]  # a cancel ends it
    assert not engine.busy


def steps(engine, job: Job) -> list[tuple[list[int], tuple[int, int] | None]]:
    """Each step's tokens of the job and the drafts its first said (proposed, accepted)."""
    engine.insert(job)
    out = []
    while engine.busy:
        if said := [e for e in engine.step() if e.token is not None]:
            out.append(([e.token for e in said], said[0].drafts))
    return out


@pytest.mark.parametrize("kind", ["mtp", "draft model"])
def test_a_request_that_asks_for_fewer_drafts_or_none_gets_them_and_the_same_answer(mtp_demo, kind):
    """draft_tokens caps a request's drafts a step below its engine's 3 (0: none at all); each step says what it
    proposed and how many of those the answer kept, and the answer is plain decoding's whatever it asked. The
    draft model is the target itself: every draft it proposes is kept."""
    model, eos = mtp_demo
    draft = model if kind == "draft model" else None
    job = Job("a", tuple(range(5, 45)), 48, 7, {**SAMPLING, "temperature": 0.0})
    plain = drain(undrafted(model, eos, prefill_step_size=16), job)
    for asked, width in ((None, 3), (1, 1), (0, 0), (9, 3)):
        engine = drafting(model, eos, Head(model) if draft is None else DraftModel(model, draft), num_draft_tokens=3,
                          prefill_step_size=16)
        said = steps(engine, replace(job, draft_tokens=asked))
        assert [t for tokens, _ in said for t in tokens] == plain, asked
        drafts = [d for _, d in said]
        assert all(d is not None and d[1] <= d[0] <= width for d in drafts), (asked, drafts)
        proposed, accepted = map(sum, zip(*drafts))
        assert (proposed > 0 and accepted > 0) if width else proposed == 0, (asked, drafts)
        if draft is None:  # the engine's own counts, the same drafts
            assert engine.stats()["draft_proposed"] == proposed, asked
        else:
            assert accepted == proposed, (asked, drafts)
