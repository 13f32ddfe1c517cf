"""The drafting engine's rows with the model's MTP head and with a draft model (DSpark's stages: tests/pinned, on
omlx's V4): requests that come while others decode join them (one while the first's prompt goes in, one
mid-answer), each answer is plain decoding's token for token, greedy and seeded, the rows verified together;
and a prompt sent again takes its prefix from the tape."""

from dataclasses import replace

import pytest
from mlx_lm.utils import load_model

from common.openai_api import SamplingParams
import runtime.models.overlays.demo_mtp  # noqa: F401  (registers model type demo_mtp)
from kit.drafters import drafting
from runtime.engine.batch import BatchEngine
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
    plain = {rid: answers(BatchEngine(model, eos, prefill_step_size=16), jobs, {0: [rid]})[rid] for rid in jobs}
    # the model reads its context: a's prompt without its middle is answered otherwise (a cache that lost those
    # positions would show in the answer)
    cut = replace(jobs["a"], prompt=PROMPTS["a"][:10] + PROMPTS["a"][30:])
    assert answers(BatchEngine(model, eos), {"a": cut}, {0: ["a"]})["a"] != plain["a"]
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
    plain = {rid: answers(BatchEngine(model, eos, prefill_step_size=16), jobs, {0: [rid]})[rid] for rid in jobs}
    engine = RowwiseEngine(model, eos, Head(model), prefixes=PrefixStore(model, prefill_step_size=16),
                           num_draft_tokens=3, prefill_step_size=16, completion_batch_size=1, log=lambda line: None)
    said = []  # (rid, token) in the order they came out
    engine.insert(jobs["a"])
    engine.insert(jobs["b"])
    while engine.busy:
        said += [(e.rid, e.token) for e in engine.step() if e.token is not None]
    assert said == [("a", t) for t in plain["a"]] + [("b", t) for t in plain["b"]]
    assert engine.stats()["draft_batched_steps"] == 0 and engine.stats()["draft_accepted"] > 0
