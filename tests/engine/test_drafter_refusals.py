"""A kernel that refuses a shape past some length (as omlx's ring GEMM refuses a layout), in the target's
verify or in the MTP head's draft, falls back for that request and the engine steps on, for the model's own
MTP head and for a draft model: the answer is the plain decoder's and the next request drafts again. The
engines run here on the real demo model with an MTP head (runtime.models.overlays.demo_mtp's faults); the same
fallback in lockstep on four ranks runs in tests/models/test_dspark.py."""

import pytest
from mlx_lm import load

from common.openai_api import SamplingParams
import runtime.models.overlays.demo_mtp  # noqa: F401  (registers model type demo_mtp)
from runtime.models.demo_model import DemoModelSpec, build_demo_model
from runtime.engine.proposers import DraftModel, Head
from runtime.engine.jobs import Job
from kit.drafters import drafting, undrafted

GREEDY = SamplingParams(max_tokens=1).sampling()
SEEDED = SamplingParams(max_tokens=1, temperature=0.9, seed=7).sampling()
PROMPT = tuple(range(40, 70))  # one prefill chunk, longer than a verify: only verifies can be refused
OTHER = tuple(range(140, 170))  # a prompt the tape holds nothing of: the head learns all of it
REFUSE_AT = len(PROMPT) + 6  # a few tokens in


@pytest.fixture(scope="module")
def models(tmp_path_factory, draft_model):
    target, tokenizer = load(str(build_demo_model(tmp_path_factory.mktemp("models") / "mtp",
                                                  DemoModelSpec(mtp=True))))
    return target, load(str(draft_model))[0], set(tokenizer.eos_token_ids)


def answer(engine, job: Job) -> list[int]:
    engine.insert(job)
    tokens = []
    while engine.busy:
        tokens += [e.token for e in engine.step() if e.token is not None]
    return tokens


def drafter(kind: str, models, log):
    target, draft, eos = models
    if kind == "mtp":
        return drafting(target, eos, Head(target), num_draft_tokens=2, log=log)
    return drafting(target, eos, DraftModel(target, draft), num_draft_tokens=3, log=log)


TARGET = ("MESHD_FAULT_TARGET_REFUSE_AT", "ValueError")  # the target refuses a verify's shape
HEAD = ("MESHD_FAULT_MTP_REFUSE_AFTER", "RuntimeError")  # the MTP head refuses to draft


@pytest.mark.parametrize("kind, sampling, fault", [("mtp", GREEDY, TARGET), ("mtp", SEEDED, TARGET),
                                                   ("draft model", GREEDY, TARGET), ("mtp", GREEDY, HEAD),
                                                   ("mtp", SEEDED, HEAD)],
                         ids=["mtp-greedy-target", "mtp-seeded-target", "draft-target", "mtp-greedy-head",
                              "mtp-seeded-head"])
def test_a_refusal_in_the_target_or_the_head_falls_back_for_that_request(models, kind, sampling, fault,
                                                                         monkeypatch):
    target, _, eos = models
    variable, error = fault
    plain = {p: answer(undrafted(target, eos), Job("x", p, 24, 7, sampling)) for p in (PROMPT, OTHER)}
    said = []
    engine = drafter(kind, models, said.append)
    unrefused = answer(engine, Job("a", PROMPT, 24, 7, sampling))
    monkeypatch.setenv(variable, str(REFUSE_AT))
    refused = answer(engine, Job("b", OTHER, 24, 7, sampling))
    assert len(plain[PROMPT]) == 24 and unrefused == plain[PROMPT] and refused == plain[OTHER]
    assert engine.fallbacks == 1 and len(said) == 1, said
    assert f"refused ({error}: Unsupported DSpark physical-ring GEMM layout" in said[0]
    assert "request b goes on without drafts" in said[0]
    monkeypatch.delenv(variable)
    proposed = engine.proposed
    assert answer(engine, Job("c", PROMPT, 24, 7, sampling)) == plain[PROMPT] and engine.fallbacks == 1
    assert engine.proposed > proposed  # drafted again, its prompt from the tape
