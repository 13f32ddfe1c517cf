"""Drafted requests keep the token tape, on omlx's own DeepSeek-V4 (its compressed layers' caches cannot be cut
back, so a tape serves only a prompt that extends it, as DeepSeek Harness's next turn does): the next turn
after a drafted answer prefills only its new tokens, drafted or not, says how many came from the tape, and
answers as the plain decoder does from the same tape. The engines run in this process on one rank."""

import mlx.core as mx
import pytest

from common.openai_api import SamplingParams
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.engine.proposers import Stages
from runtime.engine.rowwise import RowwiseEngine
from runtime.models import dspark
from runtime.prefix.store import PrefixStore

GREEDY = SamplingParams(max_tokens=1).sampling()
SEEDED = SamplingParams(max_tokens=1, temperature=0.9, seed=7).sampling()
PROMPT = tuple(int(t) for t in mx.random.randint(0, 500, (90,), key=mx.random.key(3)).tolist())
NEW = (17, 23, 42, 99, 5, 61, 7, 300)  # the next turn's own tokens (a tool's result, say)


class Fed:
    """Counts the positions the target is fed while in force."""

    def __init__(self, model):
        self.model, self.positions = model, 0

    def __enter__(self):
        cls, self._call = type(self.model), type(self.model).__call__

        def call(model, inputs, *args, **kwargs):
            self.positions += inputs.shape[1]
            return self._call(model, inputs, *args, **kwargs)

        cls.__call__ = call
        return self

    def __exit__(self, *exc):
        type(self.model).__call__ = self._call


def answer(engine, job: Job, fed: Fed | None = None) -> tuple[list[int], int | None, int]:
    """The job's tokens, the cached count its engine said (with its insert, else with its first token) and
    the positions fed (by `fed`) until its first token came out."""
    cached, tokens, before_first = engine.insert(job), [], 0
    while engine.busy:
        for e in engine.step():
            cached = e.cached if e.cached is not None else cached
            if e.token is not None:
                before_first = before_first or (fed.positions if fed else 0)
                tokens.append(e.token)
    return tokens, cached, before_first


def engines(model, drafted: bool):
    if not drafted:
        return undrafted(model, {1}, prefill_step_size=32)
    return RowwiseEngine(model, {1}, Stages(model), prefixes=PrefixStore(model, prefill_step_size=32), prefill_step_size=32)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_turn_after_a_drafted_answer_prefills_only_its_new_tokens_and_answers_plainly(model, sampling):
    said = {}
    for drafted in (False, True):
        engine = engines(model, drafted)
        first, _, _ = answer(engine, Job("t1", PROMPT, 48, 3, sampling))
        turn = Job("t2", PROMPT + tuple(first) + NEW, 48, 4, sampling)
        with Fed(model) as fed:
            second, cached, prefilled = answer(engine, turn, fed)
        said[drafted] = (first, second, cached, prefilled, engine.stats())
    (p1, p2, p_cached, p_prefilled, _), (d1, d2, d_cached, d_prefilled, stats) = said[False], said[True]
    assert (d1, d2) == (p1, p2) and len(d2) == 48  # drafted answers are the plain ones, the tape reused
    assert stats["draft_accepted"] > 0 and stats["tape_hits"] == 1
    # the tape held the first turn but its last token, which the drafter never fed (the plain loop, which
    # queues a step ahead, fed it when that token was its end of sequence); the next turn prefills the rest
    assert d_cached == len(PROMPT) + len(first) - 1 and d_cached <= p_cached <= d_cached + 1
    assert d_prefilled == len(turn.prompt) - d_cached == len(NEW) + 1
    assert p_prefilled == len(turn.prompt) - p_cached + 1  # and the next token's step, queued before it reads



def test_the_turn_after_a_drafted_answer_drafts_its_first_block_with_the_stages_context_of_the_turn_before(
        model, monkeypatch):
    """The tape keeps the target's taps at its last positions: the next turn, served from it, enters them into
    the stages' context at their own positions, so its first block is drafted from the rows the first turn's
    stages held there, not from its new tokens alone."""
    seen = []  # at each draft: where the stages' context stood and the rows it held
    real = dspark.draft

    def draft(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((args[1][0].offset, [mx.array(c.keys) for c in args[1]]))
        return out

    monkeypatch.setattr(dspark, "draft", draft)
    store = PrefixStore(model, prefill_step_size=32)
    engine = RowwiseEngine(model, {1}, Stages(model), prefixes=store, prefill_step_size=32, log=lambda m: None)
    first, _, _ = answer(engine, Job("t1", PROMPT, 48, 3, GREEDY))
    width = len(model.args.dspark_target_layer_ids) * model.args.hidden_size  # the taps' width a position
    assert store.stats()["tape_taps_bytes"] == dspark.window(model) * width * 4, "said in the status file"
    before, before_rows = seen[-1]  # the first turn's last block
    seen.clear()
    turn = Job("t2", PROMPT + tuple(first) + NEW, 8, 4, GREEDY)
    _, cached, _ = answer(engine, turn)
    at, rows = seen[0]
    window = dspark.window(model)
    assert store.stats()["tape_hits"] == 1 and at == len(turn.prompt)
    assert [r.shape[-2] for r in rows] == [window] * len(rows)
    assert at - window < cached, "rows from before the new tokens: without the tape's taps only those would be there"
    shared = range(max(at, before) - window, min(before, cached))  # positions both turns' stages held
    assert len(shared) >= 4
    for mine, theirs in zip(rows, before_rows):
        assert mx.allclose(mine[..., [p - (at - window) for p in shared], :],
                           theirs[..., [p - (before - window) for p in shared], :], atol=1e-5).item()
