"""The model's own MTP drafter against plain decoding, TP4 on the ring over
loopback, in one run: two four-rank meshes of the same demo model (its head
distilled on the model's own greedy text), one with `--drafter off`, one
drafting, both up at once and asked in alternating rounds (the one not asked
idles). Decode tokens/s (after the first token) and the acceptance rate from
the ranks' status files.

    .venv/bin/python bench/mtp.py [--rounds 7] [--tokens 96] [--write]
    python3 bench/mtp.py --backend nccl --world 2 --hidden 1024 --layers 8 --json OUT.json   # GPUs

--write appends the table to docs/BENCHMARKS.md and the raw numbers to
docs/mtp-demo-tp4.json; --json writes the raw numbers there instead."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import requests
from benchkit import ROOT, alternate, pace, report

from kit.demo_answers import endless
from kit.ranks import start_mesh
from runtime.models.demo_model import DemoModelSpec, build_demo_model

OVERLAY = ("--model-package", "runtime.models.overlays.demo_mtp")
PROMPT = "When one rank dies the generation ends on every node and a new one starts."


def mtp_spec(hidden: int, layers: int, train_steps: int) -> DemoModelSpec:
    """The demo model at this width and depth, with an MTP head distilled `train_steps` steps."""
    heads = max(8, hidden // 64)
    return DemoModelSpec(mtp=True, mtp_train_steps=train_steps, hidden_size=hidden, num_hidden_layers=layers,
                         intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=heads)


def decode(url: str, model: Path, tokens: int, k: int) -> dict:
    """One greedy streamed answer: its decode pace after the first token, and the time to it."""
    t0 = time.perf_counter()
    times = []
    r = requests.post(f"{url}/v1/chat/completions", stream=True, timeout=600,
                      json={"messages": [{"role": "user", "content": f"{PROMPT} ({k})"}], "max_tokens": tokens,
                            "stream": True, **endless(model)})
    text = []
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and '"content"' in line:
            times.append(time.perf_counter())
            text.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))
    return {"ttft_s": times[0] - t0, **pace(times), "text": "".join(text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--train-steps", type=int, default=200, help="distillation steps of the demo's head")
    ap.add_argument("--backend", choices=["ring", "nccl"], default="ring")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64, help="the demo model's width")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=1, help="the drafted mesh's --num-draft-tokens")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-mtp-bench-"))
    model = build_demo_model(work / "model", mtp_spec(args.hidden, args.layers, args.train_steps))
    mesh = {"backend": args.backend}
    with start_mesh(model, args.world, work / "plain", *OVERLAY, "--drafter", "off", **mesh) as plain, \
            start_mesh(model, args.world, work / "drafted", *OVERLAY, "--num-draft-tokens", str(args.draft_tokens),
                       **mesh) as drafted:
        plain.wait_ready()
        drafted.wait_ready()
        rows, texts, rate, med = alternate({"plain": plain, "drafted": drafted}, args.rounds,
                                           lambda url, n: decode(url, model, args.tokens, n))
        stats = drafted.status(0)
    spread = {name: (min(v), max(v)) for name, v in rate.items()}
    acceptance = stats["draft_accepted"] / max(1, stats["draft_proposed"])
    result = {"rounds": rows, "median_tok_s": med, "spread_tok_s": spread, "ratio": med["drafted"] / med["plain"],
              "draft_proposed": stats["draft_proposed"], "draft_accepted": stats["draft_accepted"],
              "acceptance": acceptance, "tokens": args.tokens, "train_steps": args.train_steps,
              "same_answers": texts["plain"] == texts["drafted"],
              "differing": {n: {"plain": p, "drafted": d} for n, (p, d) in enumerate(zip(texts["plain"], texts["drafted"]))
                            if p != d},
              "draft_tokens": args.draft_tokens, "backend": args.backend, "world": args.world,
              "model": {"hidden": args.hidden, "layers": args.layers}}
    inside = spread["drafted"][0] <= spread["plain"][1] and spread["plain"][0] <= spread["drafted"][1]
    where = "the ring" if args.backend == "ring" else f"{args.world} GPUs over NCCL"
    lines = ["", f"## The model's own MTP drafter, TP{args.world} on {where} (`bench/mtp.py`, "
             f"{time.strftime('%Y-%m-%d')})",
             "", f"Demo model (llama, {args.layers} layers, {args.hidden} wide) with a DeepSeek-layout MTP head distilled "
             f"{args.train_steps} steps on its own greedy text; {args.world} ranks "
             + (f"on loopback sharing this machine's {os.cpu_count()} cores" if args.backend == "ring" else
                "a GPU each") + f" (the other mesh idling beside them). {args.rounds} alternating rounds of "
             f"{args.tokens} greedy tokens.", "",
             "| | decode tok/s (median) | spread (min-max) |", "|---|---|---|",
             *(f"| {name} | {med[name]:.1f} | {spread[name][0]:.1f}-{spread[name][1]:.1f} |"
               for name in ("plain", "drafted")),
             "", f"Drafted / plain: **{result['ratio']:.2f}x**"
             + (" (inside the spread: parity)" if inside else "") + f"; acceptance {acceptance:.0%} "
             f"({stats['draft_accepted']} of {stats['draft_proposed']} drafts, {args.draft_tokens} a step). The answers were "
             + ("the same token for token in every round." if result["same_answers"] else "NOT the same.")]
    report(lines, args.write)
    if args.write or args.json:
        (args.json or ROOT / "docs" / "mtp-demo-tp4.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
