"""One controller in front of many agents on loopback: how long `meshctl
status` takes, and SIGKILL detection latency at N nodes against 4 nodes in
the same run. The ranks run a trivial profile (bench/standin_rank.py: rank 0
answers readiness and chat, the others wait for their signal), so what is
measured is the controller and the agents, not a model.

    python bench/scale.py --nodes 64 --trials 20 --write
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchkit import ROOT, parser, report, standin_model
from benchkit import meshctl_for as meshctl
from detection_recovery import first_death_received, pct, wait

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import stop_controller

PROFILE = {"standin": {"command": ["{python}", str(ROOT / "bench" / "standin_rank.py"), "--host", "{host}",
                                   "--port", "{port}", "--rank", "{rank}", "--meshd-generation", "{generation}"],
                       "status_file": False}}


def measure(n: int, trials: int, rng: random.Random) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"meshd-scale-{n}-"))
    agents = make_agents(tmp, n, extra={"profiles": PROFILE})
    t0 = time.time()
    for a in agents:
        a.spawn()
    for a in agents:
        a.wait_healthy(timeout=300)
    print(f"{n} agents answer after {time.time() - t0:.1f} s", file=sys.stderr)
    mesh = write_mesh(tmp, agents, standin_model(tmp / "model"), runtime={"profile": "standin"},
                      recovery={"max_failures": 1000, "backoff_max": 0.0, "start_deadline": 300.0})
    db = tmp / "state" / "meshd.sqlite"
    try:
        t0 = time.time()
        meshctl(mesh, "up", "--skip-preflight")  # the trivial profile loads no model: no memory to check
        up = time.time() - t0
        status_cmd, status_api, detect = [], [], []
        for _ in range(10):
            t0 = time.perf_counter()
            meshctl(mesh, "status")
            status_cmd.append(time.perf_counter() - t0)
        for _ in range(trials):
            s = wait(lambda: (x := json.loads(meshctl(mesh, "status", "--json")))["phase"] == "ready" and x, 300)
            t0 = time.perf_counter()
            meshctl(mesh, "status", "--json")
            status_api.append(time.perf_counter() - t0)
            pid = s["nodes"][rng.randrange(n)]["rank"]["pid"]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            got = wait(lambda: first_death_received(db, killed, ("RankExited",)), 30)
            detect.append(got - killed)
        return {"up": up, "status": status_cmd + status_api, "detect": detect}
    finally:
        stop_controller(mesh)
        for a in agents:
            a.kill()


def main() -> None:
    ap = parser(trials=20)
    ap.add_argument("--nodes", type=int, default=64)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    small, big = measure(4, args.trials, rng), measure(args.nodes, args.trials, rng)
    ratio = statistics.median(big["detect"]) / statistics.median(small["detect"])
    p99_ratio = pct(big["detect"], 99) / pct(small["detect"], 99)
    lines = [f"### Scale ({time.strftime('%Y-%m-%d')}, one controller, agents on loopback, trivial rank profile, "
             f"{os.cpu_count()} CPUs, {args.trials} kills each, seed {args.seed})", "",
             "| nodes | meshctl up s | meshctl status p50 s | status p99 s | SIGKILL -> event p50 s | p99 s |",
             "|---|---|---|---|---|---|"]
    for n, r in ((4, small), (args.nodes, big)):
        lines.append(f"| {n} | {r['up']:.1f} | {statistics.median(r['status']):.3f} | {pct(r['status'], 99):.3f} | "
                     f"{statistics.median(r['detect']):.3f} | {pct(r['detect'], 99):.3f} |")
    lines += ["", f"Detection at {args.nodes} nodes / 4 nodes: **{ratio:.2f}x** at p50, {p99_ratio:.2f}x at p99 "
              f"(target within 1.5x). `meshctl status` is the whole command, Python start-up included "
              f"(target under 0.5 s at {args.nodes} nodes).", "",
              f"Command: `python bench/scale.py --nodes {args.nodes} --trials {args.trials} --seed {args.seed} "
              f"--write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
