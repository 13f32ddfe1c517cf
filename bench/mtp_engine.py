"""The MTP drafter's engine alone, in one process on one device: what a
verify step costs against a plain step, with no mesh around it. Plain
decoding (the solo path) and the drafting engine with the MTP head at each --draft-tokens in alternating
rounds, decode tokens/s after the first token and the acceptance rate; then
the shapes a verify runs, timed apart (one token through the target, k+1
tokens, the head's block beside them), each evaluated alone, the median of
--repeat.

    .venv/bin/python bench/mtp_engine.py [--hidden 64 --layers 2] [--json OUT]
    python3 bench/mtp_engine.py --hidden 4096 --layers 16 --train-steps 100 --tokens 128   # a GPU"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from benchkit import report
from mtp import mtp_spec
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model

from common.openai_api import SamplingParams
import runtime.models.overlays.demo_mtp  # noqa: F401  registers model type demo_mtp
from runtime.models.demo_model import build_demo_model
from kit.drafters import drafting, undrafted
from runtime.engine.proposers import Head
from runtime.engine.jobs import Job

PROMPT = tuple(range(5, 45))


def decode(engine, tokens: int) -> tuple[float, list[int]]:
    """Greedy tokens/s after the first token, and the answer."""
    engine.insert(Job("bench", PROMPT, tokens, 0, SamplingParams(max_tokens=1, temperature=0.0).sampling()))
    out, t0 = [], None
    while engine.busy:
        out += [e.token for e in engine.step()]
        if out and t0 is None:
            t0, first = time.perf_counter(), len(out)
    return (len(out) - first) / (time.perf_counter() - t0), out


def shape_costs(model, places: list[int], repeat: int) -> dict[str, float]:
    """Milliseconds to run `n` tokens through the target (and the head's block beside them) at a
    40-token context, each evaluated before the next starts: the median of `repeat`."""
    cache, head_cache = make_prompt_cache(model), model.make_mtp_cache()
    with mx.stream(generation_stream):
        hidden = model.hidden(mx.array(PROMPT)[None], cache)
        model.mtp_draft(hidden, mx.array(PROMPT[1:] + (7,))[None], head_cache)
        mx.eval([c.state for c in cache + head_cache])
    costs = {}
    for n in places:
        for head in (False, True):
            times = []
            for _ in range(repeat + 5):  # the first five compile and warm
                t0 = time.perf_counter()
                with mx.stream(generation_stream):
                    h = model.hidden(mx.array([7] * n)[None], cache)
                    out = [mx.argmax(model.head(h[0]), axis=-1)]
                    if head:
                        out.append(model.mtp_draft(h, mx.array([8] * n)[None], head_cache)[1])
                mx.eval(out)
                times.append(time.perf_counter() - t0)
                trim_prompt_cache(cache, n)
                if head:
                    trim_prompt_cache(head_cache, n)
            costs[f"{n} token{'s' * (n > 1)}{' + head' * head}"] = 1000 * statistics.median(times[5:])
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=200, help="distillation steps of the demo's head")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    spec = mtp_spec(args.hidden, args.layers, args.train_steps)
    model, _ = load_model(build_demo_model(Path(tempfile.mkdtemp(prefix="meshd-mtp-engine-")) / "model", spec))
    kinds = {"plain": lambda: undrafted(model, set()),
             **{f"drafted k={k}": (lambda k=k: drafting(model, set(), Head(model), num_draft_tokens=k))
                for k in args.draft_tokens}}
    rates, stats, answers = {name: [] for name in kinds}, {}, {}
    for n in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name in (list(kinds) if n % 2 else list(kinds)[::-1]):
            engine = kinds[name]()
            rate, answers[name] = decode(engine, args.tokens)
            if n:
                rates[name].append(rate)
            stats[name] = engine.stats()
    costs = shape_costs(model, sorted({1, *(k + 1 for k in args.draft_tokens)}), args.repeat)
    med = {name: statistics.median(v) for name, v in rates.items()}
    lines = ["", f"### The MTP engine alone, one device (`bench/mtp_engine.py`, {time.strftime('%Y-%m-%d')}, "
             f"{mx.default_device()})", "",
             f"Demo model (llama, {args.layers} layers, {args.hidden} wide), head distilled {args.train_steps} steps; "
             f"{args.rounds} alternating rounds of {args.tokens} greedy tokens.", "",
             "| engine | decode tok/s (median) | spread (min-max) | / plain | acceptance |", "|---|---|---|---|---|"]
    for name, v in rates.items():
        s = stats[name]
        acc = f"{s['draft_accepted'] / max(1, s['draft_proposed']):.0%}" if "draft_proposed" in s else "-"
        lines.append(f"| {name} | {med[name]:.1f} | {min(v):.1f}-{max(v):.1f} | {med[name] / med['plain']:.2f}x | {acc} |")
    lines += ["", "What one step's shapes cost, each evaluated alone (ms, median of "
              f"{args.repeat}): " + ", ".join(f"{k} {v:.3f}" for k, v in costs.items()) + ".",
              "The answers were " + ("the same token for token." if len({tuple(a) for a in answers.values()}) == 1
                                     else "NOT the same.")]
    report(lines, False)
    if args.json:
        args.json.write_text(json.dumps({"rates": rates, "median": med, "stats": stats, "costs_ms": costs,
                                         "model": {"hidden": args.hidden, "layers": args.layers},
                                         "tokens": args.tokens, "train_steps": args.train_steps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
