"""Detection and recovery on the demo mesh, with the cold start of the same
mesh measured in the same run as the baseline.

- SIGKILL detection: kill a rank -> the controller has the event (the store's
  `received_at` of the first death event minus the kill time).
- SIGSTOP detection: stop a busy rank -> the controller has the stall event,
  reported against the configured window.
- Recovery: kill -> first successful request through the proxy, against the
  mesh's cold start (`meshctl up` -> first successful request).

    python bench/detection_recovery.py --trials 20 --write
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

from kit.waiting import wait_for


def status(home: Path) -> dict:
    return json.loads(meshctl(home, "status", "--json"))


def chat_ok(proxy: str, max_tokens: int = 2, timeout: float = 300) -> bool:
    try:
        r = requests.post(f"{proxy}/chat/completions", timeout=timeout,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
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


def main() -> None:
    ap = parser(trials=20)
    ap.add_argument("--stall-window", type=float, default=3.0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    db = home / "demo" / "state" / "meshd.sqlite"
    try:
        t0 = time.time()
        # Each trial is an isolated death: no backoff carried over from the trial before.
        meshctl(home, "up", "--stall-window", str(args.stall_window), "--max-failures", "1000", "--backoff-max", "0")
        proxy = status(home)["urls"]["proxy"]
        wait(lambda: chat_ok(proxy), 300)
        cold = time.time() - t0

        kill_detect, recover = [], []
        for _ in range(args.trials):
            s = wait(lambda: (x := status(home))["phase"] == "ready" and x, 300, 0.1)
            node = rng.randrange(4)
            pid = s["nodes"][node]["rank"]["pid"]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            got = wait(lambda: first_death_received(db, killed, ("RankExited",)), 30)
            kill_detect.append(got - killed)
            wait(lambda: chat_ok(proxy), 300)
            recover.append(time.time() - killed)

        stall_detect = []
        for _ in range(args.trials):
            s = wait(lambda: (x := status(home))["phase"] == "ready" and x, 300, 0.1)
            node = 1 + rng.randrange(3)
            pid = s["nodes"][node]["rank"]["pid"]
            threading.Thread(target=chat_ok, args=(proxy, 3000, 60), daemon=True).start()
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

    rows = [
        ("SIGKILL -> controller has the event", kill_detect, "target p99 <= 0.2 s"),
        (f"SIGSTOP -> stall event (window {args.stall_window:.0f} s)", stall_detect,
         f"target <= window + 1 s = {args.stall_window + 1:.0f} s"),
        ("death -> first successful request", recover, f"target <= cold start + 1 s = {cold + 1:.1f} s"),
    ]
    lines = [f"### Detection and recovery ({time.strftime('%Y-%m-%d')}, demo mesh: 4 ranks on the ring backend, "
             f"{os.cpu_count()} CPUs, {args.trials} trials each, seed {args.seed})", "",
             "| measure | p50 s | p99 s | max s | target |", "|---|---|---|---|---|"]
    for name, xs, target in rows:
        lines.append(f"| {name} | {statistics.median(xs):.3f} | {pct(xs, 99):.3f} | {max(xs):.3f} | {target} |")
    lines += ["", f"Cold start of the same mesh (meshctl up -> first successful request): {cold:.2f} s. "
              f"Recovery / cold start (median): **{statistics.median(recover) / cold:.2f}x**.", "",
              f"Command: `python bench/detection_recovery.py --trials {args.trials} --stall-window "
              f"{args.stall_window:g} --seed {args.seed} --write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
