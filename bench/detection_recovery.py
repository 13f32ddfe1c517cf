"""Recovery against cold start on the demo mesh as a user meets it (default
`meshctl up`, warm model), in alternating rounds; then detection.

- Recovery rounds: each round is `meshctl up` (cold start: up -> first
  successful request), a SIGKILL of a random rank, the time from the kill to
  the first successful request through the proxy (a client that sends a request
  right after the kill and retries on errors, as an application would), then
  `meshctl down`. Every death is the first of its failure window, as a single
  death is in production. The incident's timeline (detected, stopped, swept,
  started, loaded, ready, served) says where each second went.
- SIGKILL detection: kill a rank -> the controller has the event (the store's
  `received_at` of the first death event minus the kill time).
- SIGSTOP detection: stop a busy rank -> the controller has the stall event,
  reported against the configured window.

    python bench/detection_recovery.py --rounds 8 --trials 20 --write
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
from benchkit import meshctl, parser, report

from kit.demo_answers import endless
from kit.waiting import wait_for

STEPS = ("detected", "stopped", "swept", "backoff", "started", "loaded", "ready", "served")


def status(home: Path) -> dict:
    return json.loads(meshctl(home, "status", "--json"))


LONG = {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 3000, "temperature": 1.0, "seed": 23}


def chat_ok(proxy: str, body: dict | None = None, timeout: float = 300) -> bool:
    try:
        r = requests.post(f"{proxy}/chat/completions", timeout=timeout,
                          json=body or {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        return r.status_code == 200
    except requests.RequestException:
        return False


def first_death_received(db: Path, after: float, kinds: tuple[str, ...]) -> float | None:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        q = f"SELECT MIN(received_at) FROM events WHERE received_at > ? AND kind IN ({','.join('?' * len(kinds))})"
        row = con.execute(q, (after, *kinds)).fetchone()
        return row[0]
    finally:
        con.close()


def wait(pred, timeout: float, interval: float = 0.01):
    return wait_for(pred, timeout, "the mesh", interval)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def step_durations(timeline: list[dict]) -> dict[str, float]:
    """Seconds each step took after the one before it."""
    return {b["step"]: b["at"] - a["at"] for a, b in zip(timeline, timeline[1:])}


def recovery_rounds(home: Path, rounds: int, rng: random.Random) -> tuple[list[float], list[float], list[dict]]:
    cold, recover, steps = [], [], []
    for _ in range(rounds):
        t0 = time.time()
        meshctl(home, "up")
        proxy = status(home)["urls"]["proxy"]
        wait(lambda: chat_ok(proxy), 300)
        cold.append(time.time() - t0)
        s = status(home)
        pid = s["nodes"][rng.randrange(4)]["rank"]["pid"]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        wait(lambda: chat_ok(proxy), 300)
        recover.append(time.time() - killed)
        incident = wait(lambda: (i := json.loads(meshctl(home, "events", "--json"))["incidents"][0])
                        and "served" in [t["step"] for t in i["timeline"]] and i, 30, 0.1)
        steps.append(step_durations(incident["timeline"]))
        meshctl(home, "down")
    return cold, recover, steps


def main() -> None:
    ap = parser(trials=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--stall-window", type=float, default=3.0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    db = home / "demo" / "state" / "meshd.sqlite"
    try:
        cold, recover, steps = recovery_rounds(home, args.rounds, rng)

        # Detection, on a mesh that backs off not at all: each kill below is measured alone.
        meshctl(home, "up", "--stall-window", str(args.stall_window), "--max-failures", "1000", "--backoff-max", "0")
        proxy = status(home)["urls"]["proxy"]
        kill_detect = []
        for _ in range(args.trials):
            s = wait(lambda: (x := status(home))["phase"] == "ready" and x, 300, 0.1)
            pid = s["nodes"][rng.randrange(4)]["rank"]["pid"]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            got = wait(lambda: first_death_received(db, killed, ("RankExited",)), 30)
            kill_detect.append(got - killed)
            wait(lambda: chat_ok(proxy), 300)

        stall_detect = []
        for _ in range(args.trials):
            s = wait(lambda: (x := status(home))["phase"] == "ready" and x, 300, 0.1)
            node = 1 + rng.randrange(3)
            pid = s["nodes"][node]["rank"]["pid"]
            # A new request each time: one in flight at two deaths would be quarantined.
            body = {**LONG, **endless(home / "demo" / "model"),
                    "messages": [{"role": "user", "content": f"a long answer {len(stall_detect)}"}]}
            threading.Thread(target=chat_ok, args=(proxy, body, 60), daemon=True).start()
            wait(lambda: (status(home)["nodes"][node]["rank"]["status"] or {}).get("state") == "busy", 30, 0.05)
            stopped = time.time()
            os.kill(pid, signal.SIGSTOP)
            try:
                got = wait(lambda: first_death_received(db, stopped, ("RankStalled",)), args.stall_window + 30)
                stall_detect.append(got - stopped)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            wait(lambda: status(home)["generation"] > s["generation"] and status(home)["phase"] == "ready", 300, 0.2)
    finally:
        meshctl(home, "down", "--force", check=False)

    ratios = [r / c for r, c in zip(recover, cold)]
    lines = [f"### Recovery against cold start ({time.strftime('%Y-%m-%d')}, demo mesh as `meshctl up` starts it: "
             f"4 ranks on the ring backend, default config, {os.cpu_count()} CPUs, {args.rounds} alternating rounds, "
             f"seed {args.seed})", "",
             "| round | cold start s (up -> first answer) | SIGKILL -> first answer s | ratio |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {c:.2f} | {r:.2f} | {r / c:.2f} |" for i, (c, r) in enumerate(zip(cold, recover))]
    lines += ["", f"Median ratio **{statistics.median(ratios):.2f}x** (spread {min(ratios):.2f}-{max(ratios):.2f}; "
              f"target <= 1.2x). Medians: cold start {statistics.median(cold):.2f} s, recovery "
              f"{statistics.median(recover):.2f} s.", "",
              "Where the recovery's seconds go (median of each step of the incident's timeline, from the step before):",
              "", "| " + " | ".join(s for s in STEPS if any(s in d for d in steps)) + " |",
              "|" + "---|" * len([s for s in STEPS if any(s in d for d in steps)]),
              "| " + " | ".join(f"{statistics.median([d[s] for d in steps if s in d]):.2f}"
                                for s in STEPS if any(s in d for d in steps)) + " |", ""]
    rows = [("SIGKILL -> controller has the event", kill_detect, "target p99 <= 0.2 s"),
            (f"SIGSTOP -> stall event (window {args.stall_window:.0f} s)", stall_detect,
             f"target <= window + 1 s = {args.stall_window + 1:.0f} s")]
    lines += [f"Detection ({args.trials} trials each; at {args.trials} samples the p99 is their maximum):", "",
              "| measure | p50 s | p99 s | max s | target |", "|---|---|---|---|---|"]
    for name, xs, target in rows:
        lines.append(f"| {name} | {statistics.median(xs):.3f} | {pct(xs, 99):.3f} | {max(xs):.3f} | {target} |")
    lines += ["", f"Command: `python bench/detection_recovery.py --rounds {args.rounds} --trials {args.trials} "
              f"--stall-window {args.stall_window:g} --seed {args.seed} --write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
