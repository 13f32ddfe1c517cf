"""Structured output's cost: decode held to a JSON schema against the same decode unheld (one process, the
runtime's engine; the demo model, or with --hidden/--layers/... a Llama shape of random bf16 weights, the
GPU run), in alternating rounds, as tok/s and the time a token gains, each with its spread over the rounds (with
`--base DIR`, the same for the batch engine of a checkout that has one, in the same rounds); where a held
token's time goes, over one more answer (the engine's step, of it the mask's wait for the answer's newest token
and the rest of the mask's host work); the compile time of a schema (a cold compile, the cache emptied each time); and the mask's share that grows with
the vocabulary, applied to a row as wide as Qwen's (151,936 logits).

    .venv/bin/python bench/grammar.py [--rounds 7] [--tokens 256] [--base DIR] [--write]
    python bench/grammar.py --llama --rounds 7 --tokens 256 [--base DIR]     (one GPU: an 8B shape, 16 GB)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchkit  # puts the checkout and tests/ on sys.path
import mlx.core as mx
import mlx.utils
import numpy as np
from mlx_lm import load

from common.openai_api import SamplingParams
from runtime.engine import grammar
from runtime.models.demo_model import build_demo_model
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.engine.sampling import GrammarMask

# A document that cannot end before the answer's tokens do: every token is held, none is free text.
ENDLESS = {"type": "object", "additionalProperties": False, "required": ["rows"], "properties": {"rows": {
    "type": "array", "minItems": 100000, "items": {
        "type": "object", "additionalProperties": False, "required": ["k", "n"],
        "properties": {"k": {"enum": ["up", "down", "left"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "rush"], "properties": {
    "customer": {"type": "object", "additionalProperties": False, "required": ["name", "tier"],
                 "properties": {"name": {"type": "string", "maxLength": 10}, "tier": {"enum": ["gold", "silver"]}}},
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"$ref": "#/$defs/item"}},
    "rush": {"type": "boolean"}},
    "$defs": {"item": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                       "properties": {"sku": {"enum": ["a1", "b2", "c3"]},
                                      "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}}


def decode(engine, eos: set[int], prompt: list[int], tokens: int, text: str | None) -> float:
    """tok/s of one answer of exactly `tokens` tokens by a fresh `engine` (the end biased away when unheld)."""
    sampling = SamplingParams(max_tokens=tokens, logit_bias=tuple((t, -100.0) for t in sorted(eos))).sampling()
    sampling["grammar"] = text
    engine.insert(Job("bench", tuple(prompt), tokens, 0, sampling))
    began, n = time.perf_counter(), 0
    while engine.busy:
        n += len(engine.step())
    assert n == tokens, n
    return tokens / (time.perf_counter() - began)


def held_step_us(engine, eos: set[int], masks: list[type], prompt: list[int], tokens: int,
                 text: str) -> tuple[float, float, float]:
    """A held answer's mean time a token (us): the engine's step, of it the time its GrammarMask (each class of
    `masks` timed) waited reading the answer's newest tokens from the device, and the rest of the mask's work."""
    spent = {"read": 0.0, "call": 0.0}
    kept = [(cls, cls.__call__, cls._read) for cls in masks]

    def timed(method, key):
        def run(self, *args):
            began = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                spent[key] += time.perf_counter() - began
        return run

    for cls, call, read in kept:
        cls.__call__, cls._read = timed(call, "call"), timed(read, "read")
    try:
        seconds = tokens / decode(engine, eos, prompt, tokens, text)
    finally:
        for cls, call, read in kept:
            cls.__call__, cls._read = call, read
    return tuple(1e6 * x / tokens for x in (seconds, spent["read"], spent["call"] - spent["read"]))


def mask_steps_us(text: str, prompt: list[int], width: int, tokens: int) -> list[float]:
    """The host's time of each step of a held answer's mask (GrammarMask on a `width`-wide row, its result
    evaluated), the answer growing by the first token the mask allows."""
    mask = GrammarMask(text, prompt, len(prompt))
    logits = mx.zeros((1, width))
    said, times = list(prompt), []
    for _ in range(tokens):
        began = time.perf_counter()
        masked = mask(mx.array(said, dtype=mx.uint32), logits)
        mx.eval(masked)
        times.append(1e6 * (time.perf_counter() - began))
        said.append(int(mx.argmax(masked, axis=-1).item()))
    return times


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} (min {min(values):.3g}, max {max(values):.3g})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--write", action="store_true", help="append the result table to docs/BENCHMARKS.md")
    ap.add_argument("--base", type=Path, help="a checkout whose batch engine decodes too (e.g. 0b5531f's)")
    ap.add_argument("--llama", action="store_true", help="a Llama shape of random bf16 weights (--hidden ...)")
    for flag, default in (("hidden", 4096), ("layers", 32), ("intermediate", 14336), ("heads", 32),
                          ("kv-heads", 8), ("vocab", 128256)):
        ap.add_argument(f"--{flag}", type=int, default=default, help="with --llama (the defaults are 8B's)")
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp()) / "model"
    path = benchkit.build_llama_shape(args, where) if args.llama else build_demo_model(where)
    model, tokenizer = load(str(path))
    params = sum(v.size for _, v in mlx.utils.tree_flatten(model.parameters()))
    what = (f"a Llama shape of random bf16 weights ({params / 1e9:.1f}B parameters, vocabulary {args.vocab:,}) on "
            f"{mx.default_device()}" if args.llama else f"the demo model (vocabulary 512) on {mx.default_device()}")
    grammar.serve(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    held = grammar.builder().json(ENDLESS)
    engines, masks = {"": lambda: undrafted(model, eos)}, {"": [GrammarMask]}
    if args.base:
        before, commit = benchkit.batch_engine_at(args.base)
        engines[f", the batch engine at {commit}"] = lambda: before.BatchEngine(model, eos)
        masks[f", the batch engine at {commit}"] = [sys.modules["base_sampling"].GrammarMask]
    rates: dict[str, list[float]] = {f"{kind}{engine}": [] for engine in engines for kind in ("unheld", "held")}
    for n in range(args.rounds + 1):
        order = list(rates) if n % 2 else list(rates)[::-1]
        row = {name: decode(engines[name.removeprefix("unheld").removeprefix("held")](), eos, prompt, args.tokens,
                            held if name.startswith("held") else None) for name in order}
        benchkit.say(f"round {n}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in row.items()))
        if n:  # round 0 warms both up
            for name, rate in row.items():
                rates[name].append(rate)
    # a held token's time over a free one's, and the time it adds
    cost = {e: [u / h for h, u in zip(rates[f"held{e}"], rates[f"unheld{e}"])] for e in engines}
    added_us = {e: [1e6 * (1 / h - 1 / u) for h, u in zip(rates[f"held{e}"], rates[f"unheld{e}"])] for e in engines}
    steps = {e: held_step_us(engines[e](), eos, masks[e], prompt, args.tokens, held) for e in engines}

    compile_ms = []
    for _ in range(20):
        grammar.serve(tokenizer)  # a cache of none
        began = time.perf_counter()
        grammar.prepare(grammar.builder().json(ORDER)).result()
        compile_ms.append(1000 * (time.perf_counter() - began))

    wide = 151936
    steps_us = mask_steps_us(held, prompt, wide, args.tokens)
    mask = GrammarMask(held, prompt, len(prompt))
    logits = mx.zeros((1, wide))
    said = mx.array(prompt, dtype=mx.uint32)
    mx.eval(mask(said, logits))
    bits = np.random.default_rng(0).bytes(wide // 8)
    apply_us: dict[str, list[float]] = {"host": [], "device": []}  # where the bits are unpacked
    for n in range(400):
        where = ("host", "device")[n % 2]
        began = time.perf_counter()
        mx.eval(mx.where(grammar.allowed_tokens(bits, wide, [0], on_host=where == "host"), logits, -mx.inf))
        apply_us[where].append(1e6 * (time.perf_counter() - began))
    ours, here = "host" if grammar.unpack_on_host(mx.default_device()) else "device", " (the engine's way here)"

    benchkit.report([
        "",
        f"## Structured output: the grammar's cost (bench/grammar.py, {time.strftime('%Y-%m-%d')})",
        "",
        f"One process, the runtime's engine decoding {what} alone, {args.tokens} tokens an answer, {args.rounds} alternating rounds after a warm-up; held: every token held to a JSON "
        "schema (an endless array of objects with an enum and a bounded integer), unheld: the same decode free. "
        "Median (min, max) over the rounds.",
        "",
        "| measure | value |",
        "|---|---|",
        *(line for e in engines for line in (
            f"| unheld decode{e}, tok/s | {spread(rates[f'unheld{e}'])} |",
            f"| held decode{e}, tok/s | {spread(rates[f'held{e}'])} |",
            f"| a held token's time / an unheld one's{e}, per round | {spread(cost[e])} |",
            f"| time a held token adds{e}, us | {spread(added_us[e])} |",
            f"| a held token{e}, one more answer: its step, us; of it the mask's wait for the newest token; the rest of "
            f"the mask | {steps[e][0]:.0f}; {steps[e][1]:.0f}; {steps[e][2]:.0f} |")),
        f"| compile of a nested schema with $ref, enums and arrays (cold), ms | {spread(compile_ms)} |",
        f"| a held step's mask on a {wide:,}-logit row (GrammarMask: read the answer, the matcher, the mask "
        f"applied), us, over {args.tokens} steps | {spread(steps_us)} |",
        *(f"| the mask applied to a {wide:,}-logit row (bits unpacked on the {where}, mx.where)"
          f"{here if where == ours else ''}, us | {spread(us)} |" for where, us in apply_us.items()),
        "",
        "The mask is computed on the host while the step's forward runs (GrammarMask queues its read of the "
        "answer, then the forward); the time a held token adds is what of the host's share the forward does not "
        "hide."
        + ("" if args.llama else " The demo model's step is a fraction of a millisecond, so its ratio is the "
           "worst case."),
    ], args.write)


if __name__ == "__main__":
    main()
