"""Resident memory and idle CPU of the agents and the controller of the demo
mesh, measured over an idle window after a warm-up request. The rank
processes are listed beside them as the baseline: what the daemons cost next
to what they supervise.

    python bench/footprint.py --idle 30 --write
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import psutil
import requests
from benchkit import meshctl, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idle measurement")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="meshd-footprint-"))
    try:
        meshctl(home, "up")
        status = json.loads(meshctl(home, "status", "--json"))
        requests.post(f"{status['urls']['proxy']}/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
        run = home / "demo" / "run"
        procs = {name: psutil.Process(int((run / f"{name}.pid").read_text().split()[0]))
                 for name in ("controller", "proxy")}
        for i in range(4):
            procs[f"agent node{i}"] = psutil.Process(int((run / f"agent-node{i}.pid").read_text().split()[0]))
        for n in status["nodes"]:
            procs[f"rank {n['rank']['rank']} (baseline)"] = psutil.Process(n["rank"]["pid"])
        before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
        time.sleep(args.idle)
        rows = []
        for k, p in procs.items():
            cpu = (sum(p.cpu_times()[:2]) - before[k]) / args.idle * 100
            rows.append((k, p.memory_info().rss / 2**20, cpu))
    finally:
        meshctl(home, "down", "--force", check=False)
    lines = [f"### Footprint ({time.strftime('%Y-%m-%d')}, demo mesh idle for {args.idle:.0f} s after one request, "
             f"{os.cpu_count()} CPUs)", "",
             "| process | resident MB | idle CPU % | target |", "|---|---|---|---|"]
    for k, rss, cpu in rows:
        target = "<= 80 MB, <= 1%" if k.startswith("agent") else ("<= 150 MB" if k in ("controller", "proxy") else "-")
        lines.append(f"| {k} | {rss:.0f} | {cpu:.2f} | {target} |")
    lines += ["", f"Command: `python bench/footprint.py --idle {args.idle:g} --write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
