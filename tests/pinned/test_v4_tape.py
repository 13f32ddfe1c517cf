"""The token tape serves omlx's own DeepSeek-V4 what a conversation shares (issue 46's table), through its
checkpoints: the same prompt again, the next turn, the next turn whose last answer renders otherwise in its last
three tokens, and the same messages with a new one but without the answer. Each reuses at least 90% of what
it shares with the tape, greedy and seeded, plain and drafted (DSpark). Where a checkpoint served it, the answer
is a fresh engine's; the next turn extends the whole tape (the answer as it was decoded, which a prefill of the
same tokens pools otherwise on V4) and answers as the plain decoder does from that tape.
The prompts are rendered as a chat template renders them: each message opened by its role's marker and
closed by an end marker, the generation prompt an assistant marker (the template's special tokens, which
meshd reads off the model's template at load)."""

import mlx.core as mx
import pytest

from common.openai_api import SamplingParams
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.engine.proposers import Stages
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.tape import common_prefix
from runtime.prefix.store import PrefixStore

SYSTEM, USER, ASSISTANT, END = 3, 4, 5, 6
MARKERS = frozenset({SYSTEM, USER, ASSISTANT, END})
CHUNK = 64
ANSWER = 24
SAMPLINGS = {"greedy": SamplingParams(max_tokens=1).sampling(),
             "seeded": SamplingParams(max_tokens=1, temperature=0.9, seed=7).sampling()}


def words(seed: int, n: int) -> list[int]:
    return [16 + t for t in mx.random.randint(0, 480, (n,), key=mx.random.key(seed)).tolist()]


def message(role: int, content: list[int]) -> list[int]:
    return [role, *content, END]


FIRST = message(SYSTEM, words(1, 190)) + message(USER, words(2, 80)) + [ASSISTANT]  # 275 tokens


def engine(model, drafted: bool):
    prefixes = PrefixStore(model, prefill_step_size=CHUNK, markers=MARKERS)
    if drafted:
        return RowwiseEngine(model, {1}, Stages(model), prefixes=prefixes, prefill_step_size=CHUNK)
    return undrafted(model, {1}, prefill_step_size=CHUNK, prefixes=prefixes)


def ask(engine, rid: str, prompt: list[int], sampling: dict) -> tuple[list[int], int]:
    """The answer's tokens and how much of the prompt the tape served."""
    cached, said = engine.insert(Job(rid, tuple(prompt), ANSWER, 11, sampling)), []
    while engine.busy:
        for e in engine.step():
            cached = e.cached if e.cached is not None else cached
            if e.token is not None:
                said.append(e.token)
    return said, cached


def turns(answer: list[int]) -> dict[str, tuple[list[int], int, bool]]:
    """Issue 46's rows after FIRST and its answer: each prompt, how much of it the tape holds (its ideal), and
    whether a checkpoint serves it (else the whole tape)."""
    nxt = message(USER, words(3, 12)) + [ASSISTANT]
    return {
        "the same prompt again": (FIRST, len(FIRST) - 1, True),
        "the next turn": (FIRST + answer + [END] + nxt, len(FIRST) + len(answer) - 1, False),
        "the next turn, its answer rendered otherwise in its last 3 tokens":
            (FIRST + answer[:-3] + [7, 8, 9, END] + nxt, len(FIRST) + len(answer) - 3, True),
        "a new message, the answer not passed back": (FIRST[:-1] + nxt, len(FIRST) - 1, True),
    }


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafted"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=list(SAMPLINGS))
def test_a_conversations_turns_reuse_what_they_share_and_answer_as_a_fresh_engine(model, drafted, sampling):
    ours, plain = engine(model, drafted), engine(model, False)
    sampled = SAMPLINGS[sampling]
    first, _ = ask(ours, "first", FIRST, sampled)
    assert first == ask(plain, "first", FIRST, sampled)[0] and len(first) == ANSWER
    served = {}
    for i, (row, (prompt, ideal, cut)) in enumerate(turns(first).items()):
        said, cached = ask(ours, f"turn{i}", prompt, sampled)
        assert said == ask(plain, f"turn{i}", prompt, sampled)[0], row
        if cut:
            assert said == ask(engine(model, False), f"fresh{i}", prompt, sampled)[0], row
        served[row] = cached / ideal
        for e in (ours, plain):
            ask(e, f"again{i}", FIRST, sampled)  # the first prompt's tape the most recent again
    assert all(share >= 0.9 for share in served.values()), served
    stats = ours.stats()
    assert stats["tape_checkpoint_hits"] >= 3 and stats["tape_checkpoint_bytes"] > 0, stats


def test_a_long_conversations_turns_served_from_checkpoints_answer_as_a_fresh_engine(model):
    """Eight turns, each answer's reasoning dropped from the history (so no turn extends a whole tape), the
    history growing past many markers: every turn the tape serves from a checkpoint a marker or two short of
    what it shares with an earlier turn, and answers as a fresh prefill of the whole prompt does."""
    ours, history, tapes = engine(model, False), list(FIRST[:-1]), []
    for turn in range(8):
        prompt = history + message(USER, words(40 + turn, 20 + 7 * turn)) + [ASSISTANT]
        said, cached = ask(ours, f"t{turn}", prompt, SAMPLINGS["greedy"])
        if turn:
            shared = max(common_prefix(t, prompt) for t in tapes)
            assert shared - 3 <= cached <= shared, (turn, cached, shared)
            assert said == ask(engine(model, False), f"fresh{turn}", prompt, SAMPLINGS["greedy"])[0], turn
        tapes.append(prompt + said[:-1])
        history = prompt[:-1] + [ASSISTANT, *said[ANSWER // 2:], END]
