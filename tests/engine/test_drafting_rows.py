"""The drafting engine's rows with the model's MTP head and with a draft model (DSpark's stages: tests/pinned, on
omlx's V4): requests that come while others decode join them (one while the first's prompt goes in, one
mid-answer), each answer is plain decoding's token for token, greedy and seeded, the rows verified together;
and a prompt sent again takes its prefix from the tape."""

from dataclasses import replace

import pytest
from mlx_lm.utils import load_model

from common.openai_api import SamplingParams
import runtime.models.overlays.demo_mtp  # noqa: F401  (registers model type demo_mtp)
from kit.drafters import drafting, undrafted
from runtime.engine.jobs import Job
from runtime.engine.proposers import DraftModel, Head
from runtime.engine.rowwise import RowwiseEngine
from runtime.models.demo_model import DemoModelSpec, build_demo_model
from runtime.prefix.store import PrefixStore

GREEDY = SamplingParams(max_tokens=1).sampling()
SEEDED = SamplingParams(max_tokens=1, temperature=0.9, top_k=2, seed=5).sampling()  # drafts land at times
PROMPTS = {"a": tuple(range(5, 45)), "b": tuple(range(60, 83)), "c": tuple(range(100, 151))}
ARRIVALS = {0: ["a"], 2: ["b"], 9: ["c"]}  # b while a's prompt goes in (16 a step), c mid-answer


@pytest.fixture(scope="module")
def mtp_demo(tmp_path_factory):
    model, config = load_model(build_demo_model(tmp_path_factory.mktemp("models") / "mtp",
                                                DemoModelSpec(mtp=True, mtp_train_steps=30)))
    return model, set()  # no end of sequence: every answer runs its 40 tokens


def answers(engine, jobs: dict[str, Job], arrivals: dict[int, list[str]]) -> dict[str, list[int]]:
    """Each job's tokens, each inserted at its step."""
    out: dict[str, list[int]] = {}
    step, waiting = 0, dict(arrivals)
    while engine.busy or waiting:
        for rid in waiting.pop(step, []):
            engine.insert(jobs[rid])
        for e in engine.step():
            out.setdefault(e.rid, []).append(e.token)
        step += 1
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("proposer", ["mtp", "draft model"])
def test_requests_that_come_join_the_rows_and_each_answer_is_plain_decodings(mtp_demo, proposer, sampling):
    model, eos = mtp_demo
    jobs = {rid: Job(rid, prompt, 40, i, sampling) for i, (rid, prompt) in enumerate(PROMPTS.items())}
    plain = {rid: answers(undrafted(model, eos, prefill_step_size=16), jobs, {0: [rid]})[rid] for rid in jobs}
    # the model reads its context: a's prompt without its middle is answered otherwise (a cache that lost those
    # positions would show in the answer)
    cut = replace(jobs["a"], prompt=PROMPTS["a"][:10] + PROMPTS["a"][30:])
    assert answers(undrafted(model, eos), {"a": cut}, {0: ["a"]})["a"] != plain["a"]
    # the draft model is the target itself: greedy, every draft lands; seeded, the rows keep different counts
    engine = drafting(model, eos, Head(model) if proposer == "mtp" else DraftModel(model, model, 16),
                      num_draft_tokens=3, prefill_step_size=16)
    assert answers(engine, jobs, ARRIVALS) == plain
    stats = engine.stats()
    assert stats["drafter"] == ("mtp" if proposer == "mtp" else "draft_model")
    assert stats["draft_batched_steps"] > 0 and stats["draft_accepted"] > 0 and stats["draft_fallbacks"] == 0, stats
    # a's prompt again: its prefix from the tape (all but its last token), the same answer
    assert engine.insert(replace(jobs["a"], rid="again")) == len(PROMPTS["a"]) - 1
    assert answers(engine, {}, {}) == {"again": plain["a"]}


def test_a_batch_of_one_row_takes_the_next_request_when_the_first_ends(mtp_demo):
    """--completion-batch-size 1 (what a family that reads the padding is served with): the second request's
    prompt goes in while the first decodes, and it joins once the first has ended; no verify holds two rows."""
    model, eos = mtp_demo
    jobs = {rid: Job(rid, prompt, 24, i, GREEDY) for i, (rid, prompt) in enumerate(PROMPTS.items()) if rid != "c"}
    plain = {rid: answers(undrafted(model, eos, prefill_step_size=16), jobs, {0: [rid]})[rid] for rid in jobs}
    engine = RowwiseEngine(model, eos, Head(model), prefixes=PrefixStore(model, prefill_step_size=16),
                           num_draft_tokens=3, prefill_step_size=16, completion_batch_size=1, log=lambda line: None)
    said = []  # (rid, token) in the order they came out
    engine.insert(jobs["a"])
    engine.insert(jobs["b"])
    while engine.busy:
        said += [(e.rid, e.token) for e in engine.step() if e.token is not None]
    assert said == [("a", t) for t in plain["a"]] + [("b", t) for t in plain["b"]]
    assert engine.stats()["draft_batched_steps"] == 0 and engine.stats()["draft_accepted"] > 0


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_rows_that_ask_for_no_drafts_are_each_stepped_ahead_and_answer_as_plain_decoding(mtp_demo, sampling):
    """Requests with draft_tokens 0 in a drafting engine: while no row drafts and none waits to join, each step
    is queued on the device before the last one is read back. Rows joining mid-answer, one ending while the
    next step was already queued, one cancelled while queued: every answer is plain decoding's, and the row
    that ended with its last token fed keeps a tape that serves its next turn, all of it, the same answer."""
    model, eos = mtp_demo
    limits = {"a": 40, "b": 12, "c": 30, "d": 30}
    prompts = {**PROMPTS, "d": tuple(range(160, 180))}
    jobs = {rid: Job(rid, prompt, limits[rid], i, sampling, draft_tokens=0) for i, (rid, prompt) in
            enumerate(prompts.items())}
    plain = {rid: answers(undrafted(model, eos, prefill_step_size=16), jobs, {0: [rid]})[rid] for rid in jobs}
    engine = drafting(model, eos, Head(model), num_draft_tokens=3, prefill_step_size=16)
    out: dict[str, list[int]] = {}
    ahead = []  # of each step that emitted tokens: whether the step after it was on the device when it returned
    step, waiting = 0, {0: ["a"], 2: ["b"], 9: ["c", "d"]}
    while engine.busy or waiting:
        for rid in waiting.pop(step, []):
            engine.insert(jobs[rid])
        if step == 30:
            engine.cancel("d")
        for e in (emitted := engine.step()):
            out.setdefault(e.rid, []).append(e.token)
        if emitted:
            ahead.append(engine._queued is not None)
        step += 1
    assert {rid: out[rid] for rid in "abc"} == {rid: plain[rid] for rid in "abc"}
    assert out["d"] == plain["d"][:len(out["d"])] and len(out["d"]) < limits["d"]
    assert engine.stats()["draft_proposed"] == 0
    assert sum(ahead) > 0.8 * len(ahead), ahead  # all but the steps a prompt waited to join at
    # b's next turn: its prompt, its answer and a new message, every token of the first turn from its tape
    turn = replace(jobs["b"], rid="b2", prompt=prompts["b"] + tuple(plain["b"]) + (7, 8, 9))
    assert engine.insert(turn) == len(prompts["b"]) + limits["b"]
    assert answers(engine, {}, {}) == answers(undrafted(model, eos, prefill_step_size=16), {"b2": turn},
                                                {0: ["b2"]})
