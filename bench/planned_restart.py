"""What a planned restart costs the clients streaming through it: `[recovery] planned_restart = "drain"`
(the streams in flight finish on the ending generation, the next starts after them) against "cut" (the
proxy cuts them at once and resumes them on the next generation). Two 2-rank meshes of the demo model on
the ring over loopback, one per setting, each with its own agents (standby ranks on, as the demo's) and
controller; alternating rounds (the settings' order swaps each round). Each round: `streams` streams,
each a few chunks into its answer when `meshctl restart` goes out, and one request sent just after it.
Per stream, what its client sees: the time from its request to its last token, and the longest gap
between two of its tokens; for the late request, the time to its first token (its wait).

    python bench/planned_restart.py --rounds 5 --write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import requests
from benchkit import report, say

from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.waiting import wait_for
from runtime.models.demo_model import build_demo_model

SETTINGS = ("drain", "cut")
ARGS = {"model_name": "demo", "max_tokens_limit": 4096}


class Stream(threading.Thread):
    """One client's streamed answer: when each data chunk came, whether the proxy said it resumed."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.t0 = 0.0
        self.chunks: list[float] = []
        self.resumed = False
        self.done = False
        self.start()

    def run(self) -> None:
        self.t0 = time.monotonic()
        with requests.post(f"{self.url}/chat/completions", json={**self.body, "stream": True}, stream=True,
                           timeout=600) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines(chunk_size=None, decode_unicode=True):
                self.resumed |= line.startswith(": resuming on ")
                if not line.startswith("data: "):
                    continue
                assert '"error"' not in line, line
                if line == "data: [DONE]":
                    self.done = True
                    return
                self.chunks.append(time.monotonic())

    @property
    def total(self) -> float:
        return self.chunks[-1] - self.t0

    @property
    def longest_gap(self) -> float:
        return max(b - a for a, b in zip([self.t0] + self.chunks, self.chunks))


def generation(toml: Path) -> int:
    return json.loads(meshctl(toml, "status", "--json").stdout)["generation"]


def restart_round(toml: Path, url: str, model: Path, streams: int, tokens: int, rnd: int) -> dict:
    g = generation(toml)
    body = {"max_tokens": tokens, "temperature": 0, **endless(model)}
    running = [Stream(url, {**body, "messages": [{"role": "user", "content": f"round {rnd} stream {i}"}]})
               for i in range(streams)]
    wait_for(lambda: all(len(s.chunks) >= 4 for s in running), 300, "every stream's first chunks", interval=0.01)
    r = meshctl(toml, "restart")
    assert r.returncode == 0, r.stdout + r.stderr
    late = Stream(url, {**body, "messages": [{"role": "user", "content": f"round {rnd} sent at the restart"}]})
    for s in running + [late]:
        s.join(600)
        assert s.done, "a stream did not end with [DONE]"
    wait_for(lambda: generation(toml) > g and json.loads(meshctl(toml, "status", "--json").stdout)["phase"]
             == "ready", 300, "the next generation", interval=0.2)
    return {"total": statistics.median(s.total for s in running),
            "gap": max(s.longest_gap for s in running),
            "late": late.chunks[0] - late.t0,
            "resumed": sum(s.resumed for s in running)}


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} to {max(values):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-planned-restart-bench-"))
    model = build_demo_model(tmp / "model")
    rows: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with ExitStack() as stack:
        meshes = {s: stack.enter_context(mesh_up(tmp / s, model, agent={"standby": True}, runtime={"args": ARGS},
                                                 recovery={"planned_restart": s, "drain_grace": 60}))[0]
                  for s in SETTINGS}
        urls = {s: json.loads(meshctl(toml, "status", "--json").stdout)["urls"]["proxy"] for s, toml in meshes.items()}
        for rnd in range(args.rounds):
            for s in SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]:
                row = restart_round(meshes[s], urls[s], model, args.streams, args.tokens, rnd)
                rows[s].append(row)
                say(f"round {rnd + 1} {s}: streams {row['total']:.2f} s (median), longest gap {row['gap']:.2f} s, "
                    f"the request sent at the restart: first token {row['late']:.2f} s, {row['resumed']} resumed")
    today = time.strftime("%Y-%m-%d")
    med = {s: {k: statistics.median(r[k] for r in rows[s]) for k in ("total", "gap", "late")} for s in SETTINGS}
    ratios = {k: [d[k] / c[k] for d, c in zip(rows["drain"], rows["cut"])] for k in ("total", "gap", "late")}
    lines = [f"### Planned restarts: drain against cut (bench/planned_restart.py, {today}, two 2-rank demo meshes "
             f"on the ring over loopback, standby ranks, {os.cpu_count()} CPUs, {args.rounds} alternating rounds, "
             f"{args.streams} streams of {args.tokens} tokens each a few tokens in at `meshctl restart`)", "",
             "| what the client sees | drain, median s | spread | cut, median s | spread | drain / cut, median | "
             "spread |", "|---|---|---|---|---|---|---|"]
    for key, what in (("total", "a stream in flight: request to last token (median of the round's)"),
                      ("gap", "a stream in flight: longest gap between tokens (the round's longest)"),
                      ("late", "a request sent at the restart: request to first token")):
        lines.append(f"| {what} | {med['drain'][key]:.2f} | {spread([r[key] for r in rows['drain']])} | "
                     f"{med['cut'][key]:.2f} | {spread([r[key] for r in rows['cut']])} | "
                     f"{statistics.median(ratios[key]):.2f}x | {spread(ratios[key])} |")
    lines += ["", f"Streams resumed on the next generation: drain {sum(r['resumed'] for r in rows['drain'])}, cut "
              f"{sum(r['resumed'] for r in rows['cut'])} of {args.rounds * args.streams} each.", "",
              f"Command: `python bench/planned_restart.py --rounds {args.rounds} --streams {args.streams} --tokens "
              f"{args.tokens} --write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
