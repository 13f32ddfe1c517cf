"""What the agent's staleness check of its standby costs at each hand-over (agents/standby.py): a real
standby (`runtime.standby`) reports the identity of every file its code came from; the agent reads that
report and stats each path again. Baseline in the same run, alternating rounds: the check it replaced
(the newest ctime under the package roots runtime, common, mlx, mlx_lm and transformers' dist-info, a
walk of every file there). And the question the standby answers before it is handed a rank.

    .venv/bin/python bench/standby_check.py [--rounds 6] [--repeat 20] [--write]"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from benchkit import ROOT, report, say

from agents.standby import answered, changed_code, read_json
from common.buildinfo import identities
from kit.waiting import wait_for


def identity_check(report_path: Path) -> list[str]:
    """The check as the agent runs it at a hand-over."""
    code = read_json(report_path)["code"]
    return changed_code(code, identities(list(code)))


def roots_walk(_: Path) -> float:
    """The check it replaced: the newest ctime of any file under a few package roots."""
    roots = [p for name in ("runtime", "common", "mlx", "mlx_lm")
             for p in importlib.util.find_spec(name).submodule_search_locations]
    roots.append(str(metadata.distribution("transformers")._path))
    return max(p.stat().st_ctime for root in roots for p in (Path(root), *Path(root).rglob("*"))
               if "__pycache__" not in p.parts)


def ask(standby: subprocess.Popen, answer: Path, n: int) -> None:
    standby.stdin.write(json.dumps({"ask": str(n)}).encode() + b"\n")
    standby.stdin.flush()
    while not answered(str(n), read_json(answer)):
        time.sleep(0.0005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=20, help="checks a round, timed one by one (median)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-standby-check-"))
    report_path, answer = work / "report.json", work / "answer.json"
    standby = subprocess.Popen([sys.executable, "-m", "runtime.standby", "--report", str(report_path),
                                "--answer", str(answer), "--meshd-standby"], stdin=subprocess.PIPE, cwd=ROOT)
    try:
        wait_for(report_path.exists, 120, "the standby's report")
        code = read_json(report_path)["code"]
        ways = {"identity of every imported file (now)": identity_check, "ctime walk of the roots (before)": roots_walk}
        ms: dict[str, list[float]] = {name: [] for name in ways}
        for n in range(args.rounds):
            for name in (list(ways) if n % 2 == 0 else list(ways)[::-1]):
                times = []
                for _ in range(args.repeat):
                    began = time.perf_counter()
                    ways[name](report_path)
                    times.append(1000 * (time.perf_counter() - began))
                ms[name].append(statistics.median(times))
                say(f"round {n}: {name} {ms[name][-1]:.2f} ms")
        asks = []
        for n in range(args.rounds * args.repeat):
            began = time.perf_counter()
            ask(standby, answer, n)
            asks.append(1000 * (time.perf_counter() - began))
    finally:
        standby.kill()
        standby.wait()
    now, before = list(ways)
    ratios = [a / b for a, b in zip(ms[now], ms[before])]
    lines = ["", f"### The standby's staleness check at a hand-over (`bench/standby_check.py`, "
             f"{time.strftime('%Y-%m-%d')})", "",
             f"A real standby's report: {len(code)} paths ({sum(p.endswith('.dist-info') for p in code)} of them "
             f"dist-info directories). {args.rounds} alternating rounds, the median of {args.repeat} checks each.", "",
             "| check | ms (median of rounds) | spread (min-max) |", "|---|---|---|",
             *(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f}-{max(v):.2f} |" for name, v in ms.items()),
             "", f"Now / before: **{statistics.median(ratios):.2f}x** (spread {min(ratios):.2f}-{max(ratios):.2f}). "
             f"The question the standby answers before it takes a rank: {statistics.median(asks):.2f} ms "
             f"(median of {len(asks)}, max {max(asks):.2f}), against the 1 s it is given.",
             "", f"Command: `.venv/bin/python bench/standby_check.py {' '.join(sys.argv[1:])}`"]
    report(lines, args.write)


if __name__ == "__main__":
    main()
