"""Row-wise DSpark against undrafted batching, in one process on one device: B requests at once (B = 1, 2, 4, 8),
greedy, decoded by the engine a DSpark mesh runs (DSpark's stages drafting every request row by row, a lone one
as a batch of one) and by the same engine with nobody drafting (what `--drafter off` runs), in alternating rounds.
For each: aggregate tokens/s over the answers (prompts included, as a client meets them), target forwards
(counted at the model's call) and tokens per forward per row, the acceptance, the verifies whose kept places
were fed again (none, where every cache's writes replay: one target forward a step); whether every answer was the
undrafted one, token for token; and the acceptance of each request's next turn (served from the tape) against its first.

The target is omlx's own DeepSeek-V4 (flyto-mlx's, in .venv-omlx) with the DSpark stages of
tests/standins/dspark_v4, the tiny checkpoint of tests/pinned/dsv4.py: ratio-4 layers with pooled caches, a
window of 16, blocks of 5 (all 5 fed a step, alone or in rows: the windows a verify completes pooled alone).

    .venv-omlx/bin/python bench/rowwise.py [--rounds 3] [--tokens 64] [--write]

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
from runtime.engine.jobs import Job
from runtime.models.overlay import OMLX
from runtime.rank import load_sharded
from kit.drafters import Counted, drafting, undrafted
from runtime.engine.proposers import Stages

GREEDY = SamplingParams(max_tokens=1).sampling()


def jobs(batch: int, tokens: int) -> list[Job]:
    return [Job(f"r{i}", tuple(range(20 + 40 * i, 60 + 40 * i)), tokens, i, GREEDY) for i in range(batch)]


def next_turns(batch: int, tokens: int, said: dict[str, list[int]]) -> list[Job]:
    """Each request's next turn: its prompt, its answer and a new message, which the token tape serves."""
    return [Job(f"{j.rid}-next", j.prompt + tuple(said[j.rid]) + tuple(range(300, 308)), tokens, j.seed, GREEDY)
            for j in jobs(batch, tokens)]


def next_acceptance(engine, counted: Counted, batch: int, tokens: int, said: dict[str, list[int]],
                    blind: bool) -> float:
    """The acceptance of each request's next turn, served from the token tape with its stages' context, or
    `blind`: the taps its tape kept dropped first (what a tape hit drafted with before they were kept)."""
    if blind:
        for entry in engine.prefixes.tape._entries:
            entry.taps = None
    s = engine.stats()
    assert (s["tape_taps_bytes"] == 0) == blind, "the tapes hold the taps unless dropped"
    run(engine, counted, next_turns(batch, tokens, said))
    t = engine.stats()
    assert t["tape_hits"] - s["tape_hits"] == batch, "each next turn is served from its tape"
    return (t["draft_accepted"] - s["draft_accepted"]) / max(1, t["draft_proposed"] - s["draft_proposed"])


def run(engine, counted: Counted, sent: list[Job], firsts: dict[str, float] | None = None
        ) -> tuple[float, int, dict[str, list[int]]]:
    """Seconds to answer the requests `sent` at once, the target's forwards, and the answers; into `firsts`, the
    seconds to each answer's first token."""
    counted.forwards = 0
    said: dict[str, list[int]] = {}
    began = time.perf_counter()
    for job in sent:
        engine.insert(job)
    while engine.busy:
        for e in engine.step():
            said.setdefault(e.rid, []).append(e.token)
            if firsts is not None:
                firsts.setdefault(e.rid, time.perf_counter() - began)
    mx.synchronize()
    return time.perf_counter() - began, counted.forwards, said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    set_up_omlx()
    checkpoint = build_v4_checkpoint(Path(tempfile.mkdtemp(prefix="meshd-rowwise-bench-")) / "v4")
    counted = Counted(load_sharded(checkpoint, mx.distributed.init(), lambda done, total: None, OMLX))
    engines = {"undrafted": lambda: undrafted(counted, set(), prefill_step_size=128),
               "drafted": lambda: drafting(counted, set(), Stages(counted), prefill_step_size=128)}
    rows, same = [], True
    for batch in (int(b) for b in args.batches.split(",")):
        rate = {name: [] for name in engines}
        per_forward, answers, acceptance, refeeds = {name: [] for name in engines}, {}, [], []
        follow: dict[bool, list[float]] = {False: [], True: []}
        names = list(engines)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                engine = engines[name]()
                seconds, forwards, said = run(engine, counted, jobs(batch, args.tokens))
                rate[name].append(batch * args.tokens / seconds)
                per_forward[name].append(args.tokens / forwards)
                answers.setdefault(name, said)
                if name == "drafted":
                    s = engine.stats()
                    acceptance.append(s["draft_accepted"] / max(1, s["draft_proposed"]))
                    refeeds.append(s["draft_refeeds"])
                    for blind in (False, True):  # untimed: the next turns' acceptance, with context and blind
                        if blind:
                            engine = engines[name]()
                            run(engine, counted, jobs(batch, args.tokens))
                        follow[blind].append(next_acceptance(engine, counted, batch, args.tokens, said, blind))
                say(f"B={batch} round {r + 1} {name}: {rate[name][-1]:.1f} tok/s, {forwards} forwards")
        same &= all(answers[name] == answers["undrafted"] for name in names)
        rows.append(f"| {batch} | {spread(rate['undrafted'], '{:.1f}')} | {spread(rate['drafted'], '{:.1f}')} | "
                    f"{statistics.median(rate['drafted']) / statistics.median(rate['undrafted']):.2f}x | "
                    f"{statistics.median(per_forward['undrafted']):.2f} | {statistics.median(per_forward['drafted']):.2f} | "
                    f"{statistics.median(acceptance):.0%} | {statistics.median(follow[False]):.0%} | "
                    f"{statistics.median(follow[True]):.0%} | {max(refeeds)} |")
    report(["", f"## Row-wise DSpark against undrafted batching, one process (`bench/rowwise.py`, "
            f"{time.strftime('%Y-%m-%d')})", "",
            "omlx's own DeepSeek-V4 (flyto-mlx 0.7.0 at mlx 0.32.3 / mlx-lm 0.31.3; 5 layers 64 wide, compress "
            "ratios [0, 4, 128, 4, 0], window 16) with the DSpark stand-in's 3 stages (blocks of 5, all of which a verify "
            "feeds, alone or in rows), on this machine's CPU. B requests of 40 prompt tokens sent at "
            f"once, {args.tokens} greedy tokens each; {args.rounds} alternating rounds, median (min-max). "
            "Forwards are the target's, prompts' included; re-fed steps are verifies whose kept places went through the "
            "target again (a cache whose writes could not be replayed), the most of any round. Acceptance on next "
            "turns: each request's next turn (its prompt, its answer, a new message: served from the token tape), "
            "sent after the timed round, untimed; with its stages' context kept with the tape, and blind (the "
            "tape's taps dropped first, in an engine of its own that answered the same first turns).", "",
            "| B | undrafted tok/s | drafted tok/s | drafted / undrafted | tokens a forward a row, undrafted | "
            "drafted | acceptance | next turns, with context | next turns, blind | re-fed steps |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows, "",
            "Every drafted answer was the undrafted one, token for token." if same
            else "The answers were NOT the same.", "",
            f"Command: `{Path(sys.executable).parent.parent.name}/bin/python bench/rowwise.py --rounds {args.rounds} "
            f"--tokens {args.tokens}`"], args.write)


if __name__ == "__main__":
    main()
