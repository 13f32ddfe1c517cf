"""Where the suite's CPU goes: the command (by default the suite as scripts/test runs it) under Linux process
accounting, then the CPU seconds of every process that exited, grouped by its title (a rank, a standby, a
controller, an agent, a process the kit forked), untitled Python processes by their parent's title. On two
cores the suite keeps both busy, so what it costs in CPU is what it costs in time.

Needs root and the acct package (accton, dump-acct). A process still running at the end is not counted.

    sudo .venv/bin/python bench/ci_cpu.py [--write] [-- scripts/test -k something]
    .venv/bin/python bench/ci_cpu.py --pacct FILE     (a file accton already wrote)"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchkit import report, say

ROOT = Path(__file__).resolve().parent.parent


def records(pacct: Path) -> list[dict]:
    """dump-acct's records: command (the title's first 15 characters), CPU seconds, pid and parent pid."""
    out = subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split("|")]
        rows.append({"comm": f[0], "cpu": (float(f[2]) + float(f[3])) / 100, "pid": int(f[9]), "ppid": int(f[10])})
    return rows


def kind(comm: str) -> str:
    """A title's kind: its first word (meshd-rank, meshd-agent...), `meshd` the controller."""
    word = comm.split(" ")[0].rstrip("*")
    return "meshd (controller)" if word == "meshd" else word


def grouped(rows: list[dict]) -> list[tuple[str, int, float]]:
    """(group, processes, CPU seconds), the costliest first."""
    by_pid = {r["pid"]: r for r in rows}
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        name = kind(r["comm"])
        if name == "python":
            parent = by_pid.get(r["ppid"])
            name = f"python, child of {kind(parent['comm']) if parent else 'a process that outlived it'}"
        groups[name][0] += 1
        groups[name][1] += r["cpu"]
    return sorted(((g, int(n), s) for g, (n, s) in groups.items()), key=lambda t: -t[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pacct", type=Path, help="summarise this accounting file instead of running a command")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--write", action="store_true", help="append the table to docs/BENCHMARKS.md")
    ap.add_argument("command", nargs="*", default=["scripts/test", "-n", "2"])
    args = ap.parse_args()
    wall = None
    if args.pacct is None:
        args.pacct = Path(tempfile.mkdtemp()) / "pacct"
        args.pacct.touch()
        subprocess.run(["accton", str(args.pacct)], check=True)
        say(f"accounting on; running {' '.join(args.command)}")
        t0 = time.monotonic()
        try:
            code = subprocess.run(args.command, cwd=ROOT).returncode
        finally:
            subprocess.run(["accton", "off"], check=True)
        wall = time.monotonic() - t0
        say(f"the command exited {code} after {wall:.0f} s")
    groups = grouped(records(args.pacct))
    total = sum(s for _, _, s in groups)
    lines = [f"\n## Where the suite's CPU goes (bench/ci_cpu.py, {time.strftime('%Y-%m-%d')})\n",
             f"{' '.join(args.command) if wall else args.pacct}: {total:.0f} CPU seconds in exited processes"
             + (f" over {wall:.0f} s wall ({total / wall:.2f} cores busy on average)" if wall else "") + "\n",
             "| processes of | count | CPU s | share | CPU s each |", "|---|---|---|---|---|"]
    lines += [f"| {g} | {n} | {s:.0f} | {s / total:.0%} | {s / n:.2f} |" for g, n, s in groups[:args.top]]
    report(lines, args.write)
    sys.exit(0)


if __name__ == "__main__":
    main()
