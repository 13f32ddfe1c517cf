"""Recovery against cold start on the demo mesh as a user meets it (default
`meshctl up`, warm model), with and without the agents' standby ranks, in
alternating rounds; then detection.

- Recovery rounds: each round is `meshctl up` (cold start: up -> first
  successful request), a wait until every agent holds a ready standby rank, a
  SIGKILL of a random rank (in the rounds without standby, of every standby
  first: the agents then spawn the next ranks cold, as with none), the time
  from the kill to the first successful request through the proxy (a client
  that sends a request right after the kill and retries on errors, as an
  application would), then `meshctl down`. Every death is the first of its
  failure window, as a single death is in production. The incident's timeline
  (detected, stopped, swept, started, loaded, ready, served) says where each
  second went.
- SIGKILL detection: kill a rank -> the controller has the event (the store's
  `received_at` of the first death event minus the kill time).
- SIGSTOP detection: stop a busy rank -> the controller has the stall event,
  reported against the configured window.

    python bench/detection_recovery.py --rounds 8 --trials 20 --write   (--trials 0: recovery only)
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
from benchkit import meshctl, parser, report, say

from kit.demo_answers import endless
from kit.waiting import wait_for
from meshd.config import load

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


def agent_get(node, path: str) -> dict:
    return requests.get(f"{node.agent}{path}", timeout=10,
                        headers={"Authorization": f"Bearer {node.token_file.read_text().strip()}"}).json()


def ready_standby(node) -> int | None:
    """The pid of the standby `node`'s agent holds, once it reported ready."""
    ranks = agent_get(node, "/v1/ranks")
    return ranks["standby"] if ranks["standby_ready"] else None


def recovery_rounds(home: Path, rounds: int, rng: random.Random) -> list[dict]:
    """Alternating rounds, with the standbys and without; each round's cold start, recovery, the steps of its
    incident and how many of the next generation's ranks the standbys took."""
    out = []
    for n in range(rounds):
        standby = n % 2 == 0
        t0 = time.time()
        meshctl(home, "up")
        proxy = status(home)["urls"]["proxy"]
        wait(lambda: chat_ok(proxy), 300)
        cold = time.time() - t0
        nodes = load(home / "demo" / "mesh.toml").nodes
        standbys = wait(lambda: all(pids := [ready_standby(node) for node in nodes]) and pids, 300, 0.2)
        s = status(home)
        pid = s["nodes"][rng.randrange(4)]["rank"]["pid"]
        if not standby:
            for p in standbys:
                os.kill(p, signal.SIGKILL)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        wait(lambda: chat_ok(proxy), 300)
        recover = time.time() - killed
        incident = wait(lambda: (i := json.loads(meshctl(home, "events", "--json"))["incidents"][0])
                        and "served" in [t["step"] for t in i["timeline"]] and i, 30, 0.1)
        warm = sum(e["warm"] for node in nodes for e in agent_get(node, "/v1/events?stream=0&since=0")["events"]
                   if e["kind"] == "RankStarted" and e["generation"] == s["generation"] + 1)
        out.append({"standby": standby, "cold": cold, "recover": recover, "warm": warm,
                    "steps": step_durations(incident["timeline"])})
        say(f"round {n + 1}: {'standby' if standby else 'cold'}: cold start {cold:.2f} s, recovery {recover:.2f} s, "
            f"{warm}/4 ranks on standbys")
        meshctl(home, "down")
    return out


def step_medians(rounds: list[dict], names: list[str]) -> list[str]:
    """The median of each named step of the rounds' incidents ("-" where none had it)."""
    return [f"{statistics.median(xs):.2f}" if (xs := [r["steps"][s] for r in rounds if s in r["steps"]]) else "-"
            for s in names]


def main() -> None:
    ap = parser(trials=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--stall-window", type=float, default=3.0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    db = home / "demo" / "state" / "meshd.sqlite"
    kill_detect, stall_detect = [], []
    try:
        rounds = recovery_rounds(home, args.rounds, rng)
        if args.trials:
            kill_detect, stall_detect = detection(home, db, args.trials, args.stall_window, rng)
    finally:
        meshctl(home, "down", "--force", check=False)

    by = {True: [r for r in rounds if r["standby"]], False: [r for r in rounds if not r["standby"]]}
    ratio = {k: [r["recover"] / r["cold"] for r in v] for k, v in by.items()}
    lines = [f"### Recovery against cold start, with and without the standby ranks ({time.strftime('%Y-%m-%d')}, "
             f"demo mesh as `meshctl up` starts it: 4 ranks on the ring backend, default config, {os.cpu_count()} "
             f"CPUs, {args.rounds} alternating rounds, seed {args.seed})", "",
             "| round | standby | cold start s (up -> first answer) | SIGKILL -> first answer s | ratio | ranks the "
             "standbys took |", "|---|---|---|---|---|---|"]
    lines += [f"| {i + 1} | {'yes' if r['standby'] else 'no'} | {r['cold']:.2f} | {r['recover']:.2f} | "
              f"{r['recover'] / r['cold']:.2f} | {r['warm']}/4 |" for i, r in enumerate(rounds)]
    lines += [""]
    for standby, name in ((True, "With the standbys"), (False, "Without (each standby killed with the rank)")):
        if ratio[standby]:
            xs = ratio[standby]
            lines.append(f"{name}: median ratio **{statistics.median(xs):.2f}x** (spread {min(xs):.2f}-"
                         f"{max(xs):.2f}), recovery {statistics.median([r['recover'] for r in by[standby]]):.2f} s "
                         f"against a cold start of {statistics.median([r['cold'] for r in by[standby]]):.2f} s.")
    lines += ["", "Where the recovery's seconds go (median of each step of the incident's timeline, from the step "
              "before):", ""]
    names = [s for s in STEPS if any(s in r["steps"] for r in rounds)]
    lines += [f"| standby | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    lines += [f"| {'yes' if standby else 'no'} | {' | '.join(step_medians(by[standby], names))} |"
              for standby in (True, False) if by[standby]]
    lines += [""]
    if args.trials:
        rows = [("SIGKILL -> controller has the event", kill_detect, "target p99 <= 0.2 s"),
                (f"SIGSTOP -> stall event (window {args.stall_window:.0f} s)", stall_detect,
                 f"target <= window + 1 s = {args.stall_window + 1:.0f} s")]
        lines += [f"Detection ({args.trials} trials each; at {args.trials} samples the p99 is their maximum):", "",
                  "| measure | p50 s | p99 s | max s | target |", "|---|---|---|---|---|"]
        for name, xs, target in rows:
            lines.append(f"| {name} | {statistics.median(xs):.3f} | {pct(xs, 99):.3f} | {max(xs):.3f} | {target} |")
        lines.append("")
    lines += [f"Command: `python bench/detection_recovery.py --rounds {args.rounds} --trials {args.trials} "
              f"--stall-window {args.stall_window:g} --seed {args.seed} --write`", ""]
    report(lines, args.write)


def detection(home: Path, db: Path, trials: int, stall_window: float, rng: random.Random):
    """SIGKILL and SIGSTOP detection, on a mesh that backs off not at all: each kill is measured alone."""
    meshctl(home, "up", "--stall-window", str(stall_window), "--max-failures", "1000", "--backoff-max", "0")
    proxy = status(home)["urls"]["proxy"]
    kill_detect = []
    for _ in range(trials):
        s = wait(lambda: (x := status(home))["phase"] == "ready" and x, 300, 0.1)
        pid = s["nodes"][rng.randrange(4)]["rank"]["pid"]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        got = wait(lambda: first_death_received(db, killed, ("RankExited",)), 30)
        kill_detect.append(got - killed)
        wait(lambda: chat_ok(proxy), 300)

    stall_detect = []
    for _ in range(trials):
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
            got = wait(lambda: first_death_received(db, stopped, ("RankStalled",)), stall_window + 30)
            stall_detect.append(got - stopped)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        wait(lambda: status(home)["generation"] > s["generation"] and status(home)["phase"] == "ready", 300, 0.2)
    return kill_detect, stall_detect


if __name__ == "__main__":
    main()
