"""Where a rank's start goes: one meshd-rank (world 1, no agent) on a Llama shape of random bf16 weights, each
line it logs stamped with the seconds since its spawn, from the spawn to its warm-up. Every --dump seconds the
rank writes every thread's stack to its log (faulthandler), so a start that stalls says where it waits.

Issue 51: on an H100 an 8B rank once sat 480 s between `joined as rank 0 of 1` and its first `loading 0/N`.

    python bench/rank_start.py --out DIR [--rounds 2]             (the device machine; 8B by default)
    .venv/bin/python bench/rank_start.py --out DIR --hidden 64 --layers 2 --intermediate 128 --heads 4 \\
        --kv-heads 2 --vocab 512                                 (a CPU try-out)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchkit import ROOT, add_gpu_run_args, build_llama_shape, say, spread

# the rank's start in the lines it logs, in order
MILESTONES = {"joined": r"joined as rank", "loading": r"loading 0/", "loaded": r"loaded in ",
              "warm": r"warmed up"}
WRAPPER = ("import faulthandler, sys; faulthandler.dump_traceback_later(float(sys.argv.pop(1)), repeat=True); "
           "from runtime.rank import main; main()")


def one_start(model: Path, out: Path, n: int, dump: float, ceiling: float) -> dict:
    log = out / f"rank-start-{n}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", WRAPPER, str(dump), "--model", str(model), "--status-file", str(out / "status.json"),
           "--port", str(18400 + n), "--snapshots", "off"]
    t0 = time.perf_counter()
    seen: dict[str, float] = {}
    with log.open("w") as f:
        rank = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            for line in rank.stdout:
                at = time.perf_counter() - t0
                f.write(f"{at:8.2f} {line}")
                f.flush()
                for name, pattern in MILESTONES.items():
                    if name not in seen and re.search(pattern, line):
                        seen[name] = at
                        say(f"start {n}: {name} at {at:.1f}s")
                if "warm" in seen or at > ceiling:
                    break
        finally:
            rank.kill()
            rank.wait()
    return {"log": log.name, **{k: round(v, 2) for k, v in seen.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpu_run_args(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dump", type=float, default=60.0, help="seconds between two dumps of the rank's stacks")
    ap.add_argument("--ceiling", type=float, default=540.0, help="seconds a start may take before it is given up")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = build_llama_shape(args, args.out / "model")
    say(f"model built in {time.perf_counter() - t:.0f}s")
    starts = [one_start(model, args.out, n, args.dump, args.ceiling) for n in range(args.rounds)]
    for name in MILESTONES:
        got = [s[name] for s in starts if name in s]
        say(f"{name}: {spread(got, '{:.1f}') + ' s' if got else 'never'} ({len(got)} of {len(starts)} starts)")
    (args.out / "rank_start.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                          "starts": starts}, indent=1))


if __name__ == "__main__":
    main()
