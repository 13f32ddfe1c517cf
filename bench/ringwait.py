"""What agents/ringwait.c (which agents preload into ring ranks that share a host) does: a
4-rank demo mesh on the ring over loopback decoding with the library preloaded into its ranks and without, one
mesh up at a time (an idle mesh's ranks would take CPU from the other), in alternating rounds. Decode tokens/s
after the first token; the answers must be the same.

    .venv/bin/python bench/ringwait.py [--rounds 4] [--tokens 24] [--world 4] [--write]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchkit import report, say
from mtp import decode

from agents import ringwait
from kit.ranks import start_mesh
from runtime.models.demo_model import build_demo_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-ringwait-bench-"))
    model = build_demo_model(work / "model")
    shim = work / "ringwait.so"
    if (why := ringwait.build(shim)) is not None:
        sys.exit(f"ringwait.c: {why}")
    preloaded = ":".join(filter(None, [str(shim), os.environ.get("LD_PRELOAD")]))
    ways = {"spinning (MLX as shipped)": {}, "ringwait.c preloaded": {"LD_PRELOAD": preloaded}}
    rate, texts = {name: [] for name in ways}, {name: set() for name in ways}
    for n in range(args.rounds):
        for name in (list(ways) if n % 2 == 0 else list(ways)[::-1]):
            with start_mesh(model, args.world, work / f"{n}-{len(texts[name])}-{name[:4]}", env=ways[name]) as mesh:
                mesh.wait_ready(300)
                decode(mesh.url, model, 4, 0)  # warm
                got = decode(mesh.url, model, args.tokens, 1)
            rate[name].append(got["tok_s"])
            texts[name].add(got["text"])
            say(f"round {n}: {name} {got['tok_s']:.2f} tok/s")
    med = {name: statistics.median(v) for name, v in rate.items()}
    spin, shim_name = list(ways)
    same = len(texts[spin] | texts[shim_name]) == 1
    lines = ["", f"## Ring ranks that sleep while they wait: tests/ringwait.c (`bench/ringwait.py`, "
             f"{time.strftime('%Y-%m-%d')})", "",
             f"The demo model, {args.world} ranks on the ring over loopback on this machine's {len(os.sched_getaffinity(0))} cores, one "
             f"mesh up at a time, {args.rounds} alternating rounds of {args.tokens} greedy tokens each way.", "",
             "| ranks | decode tok/s (median) | spread (min-max) |", "|---|---|---|",
             *(f"| {name} | {med[name]:.2f} | {min(rate[name]):.2f}-{max(rate[name]):.2f} |" for name in ways),
             "", f"Preloaded / spinning: **{med[shim_name] / med[spin]:.1f}x**. The answers were "
             + ("the same in every round." if same else "NOT the same."),
             "", f"Command: `.venv/bin/python bench/ringwait.py {' '.join(sys.argv[1:])}`"]
    report(lines, args.write)


if __name__ == "__main__":
    main()
