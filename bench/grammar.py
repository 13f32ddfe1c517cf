"""Structured output's cost: decode held to a JSON schema against the same decode unheld (one process, the
runtime's batch engine, the demo model), in alternating rounds, as tok/s and the time a token gains; the
compile time of a schema (a cold compile, the cache emptied each time); and the mask's share that grows with
the vocabulary, applied to a row as wide as Qwen's (151,936 logits).

    .venv/bin/python bench/grammar.py [--rounds 7] [--tokens 256] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import benchkit  # noqa: F401  (puts the checkout on sys.path)
import mlx.core as mx
import numpy as np
from mlx_lm import load

from common.openai_api import SamplingParams
from runtime.engine import grammar
from runtime.models.demo_model import build_demo_model
from runtime.engine.batch import BatchEngine
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


def decode(model, eos: set[int], prompt: list[int], tokens: int, text: str | None) -> float:
    """tok/s of one answer of exactly `tokens` tokens (the end biased away when unheld)."""
    sampling = SamplingParams(max_tokens=tokens, logit_bias=tuple((t, -100.0) for t in sorted(eos))).sampling()
    sampling["grammar"] = text
    engine = BatchEngine(model, eos)
    engine.insert(Job("bench", tuple(prompt), tokens, 0, sampling))
    began, n = time.perf_counter(), 0
    while engine.busy:
        n += len(engine.step())
    assert n == tokens, n
    return tokens / (time.perf_counter() - began)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} (min {min(values):.3g}, max {max(values):.3g})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--write", action="store_true", help="append the result table to docs/BENCHMARKS.md")
    args = ap.parse_args()
    path = build_demo_model(Path(tempfile.mkdtemp()) / "demo")
    model, tokenizer = load(str(path))
    grammar.serve(tokenizer)
    eos = set(tokenizer.eos_token_ids)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    held = grammar.builder().json(ENDLESS)
    rates: dict[str, list[float]] = {"unheld": [], "held": []}
    for n in range(args.rounds + 1):
        order = ["unheld", "held"] if n % 2 else ["held", "unheld"]
        row = {name: decode(model, eos, prompt, args.tokens, held if name == "held" else None) for name in order}
        benchkit.say(f"round {n}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in row.items()))
        if n:  # round 0 warms both up
            for name, rate in row.items():
                rates[name].append(rate)
    ratio = [h / u for h, u in zip(rates["held"], rates["unheld"])]
    added_us = [1e6 * (1 / h - 1 / u) for h, u in zip(rates["held"], rates["unheld"])]

    compile_ms = []
    for _ in range(20):
        grammar._served.compiled.clear()
        began = time.perf_counter()
        grammar.builder().json(ORDER)
        compile_ms.append(1000 * (time.perf_counter() - began))

    wide = 151936
    mask = GrammarMask(held, prompt, len(prompt))
    logits = mx.zeros((1, wide))
    said = mx.array(prompt, dtype=mx.uint32)
    mx.eval(mask(said, logits))
    bits = np.frombuffer(np.random.default_rng(0).bytes(wide // 8), dtype=np.uint8).tobytes()
    apply_us = []
    for _ in range(200):
        began = time.perf_counter()
        mx.eval(mx.where(mx.array(grammar.allowed_tokens(bits, wide, [0])), logits, -mx.inf))
        apply_us.append(1e6 * (time.perf_counter() - began))

    benchkit.report([
        "",
        f"## Structured output: the grammar's cost (bench/grammar.py, {time.strftime('%Y-%m-%d')})",
        "",
        f"One process, the runtime's batch engine decoding the demo model (vocabulary 512) alone, {args.tokens} "
        f"tokens an answer, {args.rounds} alternating rounds after a warm-up; held: every token held to a JSON "
        "schema (an endless array of objects with an enum and a bounded integer), unheld: the same decode free. "
        "Median (min, max) over the rounds.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| unheld decode, tok/s | {spread(rates['unheld'])} |",
        f"| held decode, tok/s | {spread(rates['held'])} |",
        f"| held / unheld, per round | {spread(ratio)} |",
        f"| time a held token adds, us | {spread(added_us)} |",
        f"| compile of a nested schema with $ref, enums and arrays (cold), ms | {spread(compile_ms)} |",
        f"| the mask applied to a {wide:,}-logit row (bits to bools, mx.where), us | {spread(apply_us)} |",
        "",
        "The demo model's step is a fraction of a millisecond, so the ratio is the worst case; on a real model the "
        "added microseconds are what to weigh against its step (a 151,936-wide vocabulary adds the last row's "
        "cost, and the matcher's own time grows with how many tokens a state allows).",
    ], args.write)


if __name__ == "__main__":
    main()
