"""Plain batching on the row-wise engine (what `--drafter off` runs: every row's pending token alone through the
target a step, the next step queued before the last is read back) against the batch engine it replaced (mlx-lm's
BatchGenerator, SoloDecode for a request alone), in one process on one device: B requests at once (B = 1, 2, 4, 8),
greedy, no drafts, in alternating rounds. The batch engine is `--base`'s: a checkout that still has it (a git
worktree of 0b5531f, or a folder holding that commit's runtime/engine/{batch,request,sampling,scheduler}.py). The
model is benchkit's Llama shape of random bf16 weights (the defaults are 8B's: a GPU run); on CPUs, a small one;
or, with `--v4`, omlx's own DeepSeek-V4 (the tiny checkpoint of tests/pinned/dsv4.py, in .venv-omlx). The
prompts are 40 tokens each, or with `--varied` 24, 40, 56, ... tokens (a burst of prompts of different lengths,
which the row-wise engine takes in apart and BatchGenerator left-padded together); beside tok/s, the median time
to an answer's first token.

    python3 bench/plain_rows.py --out DIR --base DIR [--rounds 5] [--tokens 128] [--varied] [--write]
    .venv/bin/python bench/plain_rows.py --out /tmp/pr --base DIR --hidden 256 --layers 4 --intermediate 512 \\
        --heads 4 --kv-heads 2 --vocab 4096       # on CPUs
    .venv-omlx/bin/python bench/plain_rows.py --out /tmp/pr --base DIR --v4

--write appends the table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
from benchkit import add_gpu_run_args, batch_engine_at, build_llama_shape, report, say, spread
from rowwise import jobs, run

from kit.drafters import Counted, undrafted
from pinned.dsv4 import build_v4_checkpoint, set_up_omlx
from runtime.engine.jobs import Job
from runtime.models.overlay import OMLX
from runtime.rank import load_sharded


def parts_at(want: list[int], got: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))


def departures(want: dict[str, list[int]], got: dict[str, list[int]]) -> str:
    """Which answers of `got` are not `want`'s, and the token where each first parts from it ("" if none)."""
    parted = sorted(parts_at(want[rid], got[rid]) for rid in want if want[rid] != got[rid])
    return f"{len(parted)} of {len(want)} answers part at token(s) {', '.join(map(str, parted))}" if parted else ""


def varied(batch: int, tokens: int) -> list[Job]:
    """`jobs`, prompt i of 24 + 16 i tokens."""
    return [replace(job, prompt=tuple(range(job.prompt[0], job.prompt[0] + 24 + 16 * i)))
            for i, job in enumerate(jobs(batch, tokens))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpu_run_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--base", type=Path, required=True, help="a checkout whose batch engine is the baseline")
    ap.add_argument("--v4", action="store_true", help="omlx's DeepSeek-V4 of tests/pinned, not the Llama shape")
    ap.add_argument("--varied", action="store_true", help="prompts of 24, 40, 56, ... tokens, not 40 each")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    say("building the model")
    if args.v4:
        set_up_omlx()
        model = f"omlx's DeepSeek-V4 (tests/pinned/dsv4.py's checkpoint, {version('flyto-mlx')} of flyto-mlx)"
        path, overlay = build_v4_checkpoint(args.out / "v4"), OMLX
    else:
        model = (f"A Llama shape of random bf16 weights (hidden {args.hidden}, {args.layers} layers, {args.heads} "
                 f"heads, {args.kv_heads} KV heads, vocab {args.vocab})")
        path, overlay = build_llama_shape(args, args.out / "model"), None
    counted = Counted(load_sharded(path, mx.distributed.init(), lambda done, total: None, overlay))

    before, commit = batch_engine_at(args.base)
    engines = {"batch engine": lambda: before.BatchEngine(counted, set()), "row-wise": lambda: undrafted(counted, set())}
    sent = varied if args.varied else jobs
    names, lines, apart = list(engines), [], []
    for batch in (int(b) for b in args.batches.split(",")):
        rate: dict[str, list[float]] = {name: [] for name in names}
        first: dict[str, list[float]] = {name: [] for name in names}
        answers = {}
        run(engines["batch engine"](), counted, sent(batch, 8))  # warm: the shapes of this batch compiled once
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                firsts: dict[str, float] = {}
                seconds, forwards, said = run(engines[name](), counted, sent(batch, args.tokens), firsts)
                rate[name].append(batch * args.tokens / seconds)
                first[name].append(1000 * statistics.median(firsts.values()))
                answers.setdefault(name, said)
                say(f"B={batch} round {r + 1} {name}: {rate[name][-1]:.1f} tok/s, first tokens at "
                    f"{first[name][-1]:.0f} ms, {forwards} forwards")
        apart += [f"B = {batch}, {name}: {differs}" for name in names[1:]
                  if (differs := departures(answers["batch engine"], answers[name]))]
        base = {"rate": statistics.median(rate["batch engine"]), "first": statistics.median(first["batch engine"])}
        lines.append(f"| {batch} | " + " | ".join(
            f"{spread(rate[name], '{:.1f}')}" + ("" if name == "batch engine" else
                                                 f" ({statistics.median(rate[name]) / base['rate']:.2f}x)")
            + f" | {spread(first[name], '{:.0f}')}" + ("" if name == "batch engine" else
                                                        f" ({statistics.median(first[name]) / base['first']:.2f}x)")
            for name in names) + " |")
    report(["", f"## Plain batching on the row-wise engine (`bench/plain_rows.py`, {time.strftime('%Y-%m-%d')})", "",
            f"{model} on {mx.default_device()}. The batch engine at {commit}, the row-wise engine of this tree. "
            f"B requests of {'24, 40, 56, ...' if args.varied else '40'} prompt tokens "
            f"sent at once, {args.tokens} greedy tokens each, no drafts; {args.rounds} alternating rounds: tok/s "
            "over the answers (prompts included) and the median of the B answers' times to their first token, each "
            "as the median (min-max) of the rounds, and its ratio to the batch engine's median.", "",
            "| B | " + " | ".join(f"{name} tok/s | {name} first token, ms" for name in names) + " |",
            "|---|" + "---|" * 2 * len(names), *lines, "",
            *(["Answers that are not the batch engine's, token for token:", "", *(f"- {a}" for a in apart)] if apart
              else ["Every answer was the batch engine's, token for token."]), "",
            f"Command: `{Path(sys.executable).parent.parent.name}/bin/python bench/plain_rows.py --out DIR --rounds "
            f"{args.rounds} --tokens {args.tokens} " + ("--varied " if args.varied else "") + ("--v4" if args.v4 else
                                                        f"--hidden {args.hidden} --layers {args.layers} --intermediate "
                                                        f"{args.intermediate} --heads {args.heads} --kv-heads "
                                                        f"{args.kv_heads} --vocab {args.vocab}")
            + f" --base {args.base}`"], args.write)


if __name__ == "__main__":
    main()
