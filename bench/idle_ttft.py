"""Time to first token of a request to an idle mesh against one that follows
another at once: the demo model on two ranks over the ring with a long
--idle-interval, in alternating rounds. Before rank 0 woke the dozing ranks
(runtime/wake.py), the idle request waited out their doze: a uniform share of
--idle-interval.

    .venv/bin/python bench/idle_ttft.py [--rounds 5] [--idle-interval 3]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchkit import report

from kit.ranks import start_mesh
from runtime.models.demo_model import build_demo_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle-interval", type=float, default=3.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-idle-ttft-"))
    model = build_demo_model(work / "model")
    ttft: dict[str, list[float]] = {"after another": [], "idle": []}
    with start_mesh(model, 2, work / "mesh", "--idle-interval", str(args.idle_interval)) as mesh:
        mesh.wait_ready()
        mesh.first_token()
        for n in range(args.rounds):
            for kind in (("after another", "idle") if n % 2 else ("idle", "after another")):
                if kind == "idle":
                    time.sleep(4 * args.idle_interval + 0.5)  # the doze has grown to --idle-interval
                else:
                    mesh.first_token()
                ttft[kind].append(mesh.first_token())
                print(f"round {n + 1}: {kind} {ttft[kind][-1] * 1000:.0f} ms", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    report(["", f"### Time to first token on an idle mesh (`bench/idle_ttft.py`, {time.strftime('%Y-%m-%d')})", "",
            f"Demo model, two ranks on the ring over loopback, `--idle-interval {args.idle_interval:g}`; "
            f"{args.rounds} alternating rounds. Idle: the request comes after {4 * args.idle_interval + 0.5:g} s "
            "without one (the other ranks doze the whole interval by then).", "",
            "| request | TTFT ms (median) | spread (min-max) |", "|---|---|---|",
            *(f"| {k} | {med[k] * 1000:.0f} | {min(v) * 1000:.0f}-{max(v) * 1000:.0f} |" for k, v in ttft.items()),
            "", f"Idle / after another: {med['idle'] / med['after another']:.2f}x by medians."], False)


if __name__ == "__main__":
    main()
