"""A 10-turn agent conversation on omlx's own DeepSeek-V4, through the token tape with checkpoints against the
tape as it was before them (only a prompt that extends a whole tape reused), in one process, alternating rounds:
each turn's cached tokens over what it shares with the conversation so far (its ideal) and its time to first
token.

The conversation is rendered as V4's template renders one: a long system prompt, user turns, assistant turns
whose reasoning the next turn's history drops unless they called a tool, tool calls and their results, one turn
sent twice, one history truncated by the client. The model is the tiny checkpoint of tests/pinned/dsv4.py
(5 layers 64 wide, compress ratios [0, 4, 128, 4, 0], window 16), on this machine's CPU; "before" is the same
engine with no message markers and no checkpoint budget, which serves exactly what the tape served before.

    .venv-omlx/bin/python bench/v4_turns.py [--rounds 3] [--write]

--write appends the table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from benchkit import report, say, spread

from common.openai_api import SamplingParams
from pinned.dsv4 import build_v4_checkpoint, set_up_omlx
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.models.overlay import OMLX
from runtime.prefix.store import PrefixStore
from runtime.prefix.tape import common_prefix
from runtime.rank import load_sharded

SYSTEM, USER, ASSISTANT, END, THINK, THOUGHT, TOOL = 3, 4, 5, 6, 7, 8, 9  # the template's markers
MARKERS = frozenset({SYSTEM, USER, ASSISTANT, END, THINK, THOUGHT, TOOL})
CHUNK = 128
ANSWER = 24  # an assistant turn: 12 tokens of reasoning, then 12 of answer (or of its tool call)
GREEDY = SamplingParams(max_tokens=1).sampling()


def words(seed: int, n: int) -> list[int]:
    return [16 + t for t in mx.random.randint(0, 480, (n,), key=mx.random.key(seed)).tolist()]


class Conversation:
    """The client's side: the messages so far, rendered as V4's template renders them."""

    def __init__(self):
        self.system = [SYSTEM, *words(0, 1200), END]
        self.turns: list[tuple[list[int], list[int], list[int] | None]] = []  # (user, answer, tool result)

    def prompt(self, user: list[int], first: int = 0) -> list[int]:
        """The next prompt: the history from turn `first` on, then `user`'s message and the generation prompt
        (which opens the reasoning). An answer that called a tool comes back as it was said, its reasoning
        kept, the tool's result after it; another loses its reasoning (its first half), as V4's template
        drops it."""
        out = list(self.system)
        for said, answer, result in self.turns[first:]:
            out += [USER, *said, END, ASSISTANT]
            out += [THINK, *answer, END, TOOL, *result, END] if result else [THOUGHT, *answer[ANSWER // 2:], END]
        return out + [USER, *user, END, ASSISTANT, THINK]


def script() -> list[dict]:
    """Ten turns: what the user says, whether the answer calls a tool, a resend, a truncated history."""
    turns = [{"user": words(10 + i, 40), "tool": i in (1, 2, 5)} for i in range(8)]
    turns.insert(5, {"resend": True})
    turns.append({"user": words(30, 40), "tool": False, "first": 3})  # the client dropped the oldest turns
    return turns


def run(engine, conversation: Conversation) -> list[tuple[int, int, float, int]]:
    """Each turn's cached tokens, its ideal (the longest prefix it shares with a prompt or tape so far), its
    seconds to first token and its prompt's length."""
    seen: list[tuple[int, ...]] = []
    out, last = [], None
    for i, turn in enumerate(script()):
        prompt = last if turn.get("resend") else conversation.prompt(turn["user"], turn.get("first", 0))
        ideal = max((min(common_prefix(t, prompt), len(prompt) - 1) for t in seen), default=0)
        began = time.perf_counter()
        cached, first_at, answer = engine.insert(Job(f"t{i}", tuple(prompt), ANSWER, 0, GREEDY)), None, []
        while engine.busy:
            for e in engine.step():
                cached = e.cached if e.cached is not None else cached
                if e.token is not None:
                    first_at = first_at or time.perf_counter() - began
                    answer.append(e.token)
        out.append((cached, ideal, first_at, len(prompt)))
        seen += [tuple(prompt), tuple(prompt + answer[:-1])]
        if not turn.get("resend"):
            conversation.turns.append((turn["user"], answer, words(50 + i, 30) if turn["tool"] else None))
        last = prompt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    set_up_omlx()
    checkpoint = build_v4_checkpoint(Path(tempfile.mkdtemp(prefix="meshd-v4-turns-")) / "v4")
    model = load_sharded(checkpoint, mx.distributed.init(), lambda done, total: None, OMLX)
    arms = {"before": dict(markers=frozenset(), checkpoint_budget=0), "checkpoints": dict(markers=MARKERS)}
    runs: dict[str, list] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            engine = undrafted(model, set(), prefill_step_size=CHUNK,
                                 prefixes=PrefixStore(model, prefill_step_size=CHUNK, **arms[arm]))
            runs[arm].append(run(engine, Conversation()))
            say(f"round {r + 1} {arm}: {sum(one[0] for one in runs[arm][-1])} tokens cached over ten turns")
    rows = []
    for t, turn in enumerate(script()):
        kind = ("resent" if turn.get("resend") else "truncated history" if turn.get("first")
                else "tool call" if turn["tool"] else "plain")
        cells = []
        for arm in arms:
            cached, ideal, _, _ = runs[arm][0][t]
            ttft = [run_[t][2] * 1000 for run_ in runs[arm]]
            cells.append(f"{cached} of {ideal} | {spread(ttft, '{:.0f}')}")
        rows.append(f"| {t + 1} ({kind}) | {runs['before'][0][t][3]} | {' | '.join(cells)} |")
    total = {arm: sum(one[0] for one in runs[arm][0]) for arm in arms}
    ideal = sum(one[1] for one in runs["checkpoints"][0])
    ttft = {arm: [sum(turn[2] for turn in one) for one in runs[arm]] for arm in arms}
    report(["", f"## A 10-turn agent conversation on DeepSeek-V4, checkpoints against the tape before them "
            f"(`bench/v4_turns.py`, {time.strftime('%Y-%m-%d')})", "",
            "omlx's own DeepSeek-V4 (flyto-mlx 0.7.0 at mlx 0.32.3 / mlx-lm 0.31.3; the tiny checkpoint of "
            "tests/pinned/dsv4.py) on this machine's CPU, one process, plain decoding, prefill chunks of "
            f"{CHUNK}. A 1202-token system prompt, turns of 40 user tokens and {ANSWER}-token answers (reasoning "
            "dropped from the history unless the turn called a tool, whose 30-token result follows), turn 6 "
            f"the fifth sent again, turn 10 a history without its first three turns. {args.rounds} alternating "
            "rounds; time to first token median (min-max) in ms. Ideal: the longest prefix the prompt shares "
            "with an earlier prompt or tape, less its last token.", "",
            "| turn | prompt tokens | before: cached | ms to first token | checkpoints: cached | "
            "ms to first token |", "|---|---|---|---|---|---|", *rows, "",
            f"Over the ten turns: {total['before']} of {ideal} shareable tokens cached before, "
            f"{total['checkpoints']} with checkpoints ({total['checkpoints'] / ideal:.0%}); the turns' summed time "
            f"to first token {spread(ttft['before'], '{:.2f}')} s before, {spread(ttft['checkpoints'], '{:.2f}')} "
            f"s with checkpoints ({statistics.median(ttft['checkpoints']) / statistics.median(ttft['before']):.2f}x).",
            "", f"Command: `{Path(sys.executable).parent.parent.name}/bin/python bench/v4_turns.py --rounds "
            f"{args.rounds}`"], args.write)


if __name__ == "__main__":
    main()
