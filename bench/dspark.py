"""DeepSeek-V4's DSpark drafter against plain decoding, TP4 on the ring over loopback, in one run: the tiny
DSpark-layout checkpoint (tests/kit/dspark.py, omlx's overlay played by tests/standins/omlx) in two
four-rank meshes, one with `--drafter off`, one drafting, both up at once and asked in alternating rounds
(bench/mtp.py's greedy streamed answer). Decode tokens/s after the first token, its spread, and the
acceptance from the drafted ranks' status files.

    .venv/bin/python bench/dspark.py [--rounds 5] [--tokens 48] [--write]

--write appends the table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchkit import alternate, report
from mtp import decode

from kit.dspark import build_dspark_model, standin_env
from kit.ranks import start_mesh

OVERLAY = ("--model-package", "omlx")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-dspark-bench-"))
    model = build_dspark_model(work / "model")
    with start_mesh(model, 4, work / "plain", *OVERLAY, "--drafter", "off", env=standin_env()) as plain, \
            start_mesh(model, 4, work / "drafted", *OVERLAY, env=standin_env()) as drafted:
        plain.wait_ready(300)
        drafted.wait_ready(300)
        rows, texts, rate, med = alternate({"plain": plain, "drafted": drafted}, args.rounds,
                                           lambda url, n: decode(url, model, args.tokens, n))
        stats = drafted.status(0)
    acceptance = stats["draft_accepted"] / max(1, stats["draft_proposed"])
    lines = ["", f"## DeepSeek-V4's DSpark drafter, TP4 on the ring (`bench/dspark.py`, {time.strftime('%Y-%m-%d')})",
             "", "The tiny DSpark-layout checkpoint (4 deepseek_v41 layers 64 wide, 3 stages, blocks of 5, its Markov "
             "head fitted to the model's own bigrams) under the stand-in omlx; 4 ranks a mesh on loopback, both "
             f"meshes on this machine's cores (the one not asked idles). {args.rounds} alternating rounds of "
             f"{args.tokens} greedy tokens.", "",
             "| | decode tok/s (median) | spread (min-max) |", "|---|---|---|",
             *(f"| {name} | {med[name]:.2f} | {min(rate[name]):.2f}-{max(rate[name]):.2f} |"
               for name in ("plain", "drafted")),
             "", f"Drafted / plain: **{med['drafted'] / med['plain']:.2f}x**; acceptance {acceptance:.0%} "
             f"({stats['draft_accepted']} of {stats['draft_proposed']} drafts). The answers were "
             + ("the same token for token in every round." if texts["plain"] == texts["drafted"] else "NOT the same."),
             "", "Command: `.venv/bin/python bench/dspark.py " + " ".join(sys.argv[1:]) + "`"]
    report(lines, args.write)


if __name__ == "__main__":
    main()
