"""False alarms: what a healthy mesh does that must never be called a death.

Two 2-rank meshes of real agents and ranks (ring over loopback), with tight
windows so that each case outlasts them:
- meshd-rank (agents judge stalls from the status file, base window 2 s): a
  cold load of a slow-loading model, a prefill 10x the base window, a
  speculative request longer than the stock profile's probe_idle +
  probe_timeout, then idle;
- the stock mlx_lm.server profile beside it (no status file: the proxy
  probes it every --probe-idle seconds when no request runs), idle with the
  probe on for the same time.
The count that matters is incidents on either mesh: it must stay 0.

    python bench/false_alarms.py --idle-minutes 30 --write
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import requests
from benchkit import meshctl_for as meshctl
from benchkit import parser, report

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import stop_controller
from runtime.models.demo_model import DemoModelSpec, build_demo_model

BASE = 2.0  # the agents' base stall window, seconds
PROBE_TIMEOUT = 10.0


def incidents(mesh: Path) -> list[dict]:
    return json.loads(meshctl(mesh, "events", "--json"))["incidents"]


def timed(what: str, fn) -> tuple[str, float]:
    t0 = time.monotonic()
    fn()
    return what, time.monotonic() - t0


def probes(mesh: Path) -> dict[str, float]:
    text = requests.get(json.loads(meshctl(mesh, "status", "--json"))["urls"]["proxy_metrics"], timeout=5).text
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("meshd_proxy_probes_total{")}


def main() -> None:
    ap = parser()
    ap.add_argument("--idle-minutes", type=float, default=30.0)
    ap.add_argument("--probe-idle", type=float, default=5.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-false-alarms-"))
    slow = build_demo_model(tmp / "slow", DemoModelSpec(hidden_size=512, num_hidden_layers=48,
                                                        intermediate_size=1536, seed=5))
    small = build_demo_model(tmp / "small", DemoModelSpec(seed=6))
    draft = build_demo_model(tmp / "draft", DemoModelSpec(hidden_size=32, num_hidden_layers=1,
                                                          intermediate_size=64, seed=7))
    # min_prefill_rate: what the slowest prefill of this model reaches on this machine, as an operator
    # would set it (the table says what this run's prefill reached)
    agents = make_agents(tmp / "rank", 2, stall={"base": BASE, "min_prefill_rate": 7, "load_deadline": 300})
    stock_agents = make_agents(tmp / "stock", 2, stall={"base": BASE})
    for a in agents + stock_agents:
        a.start()
    mesh = write_mesh(tmp / "rank", agents, slow,
                      runtime={"draft_model": str(draft), "args": {"prefill_step_size": 16384,
                                                                   "max_context": 16384, "model_name": "slow"}})
    stock = write_mesh(tmp / "stock", stock_agents, small, runtime={"profile": "mlx-lm-server"},
                       proxy={"probe_idle": args.probe_idle, "probe_timeout": PROBE_TIMEOUT})
    rows = []
    try:
        rows.append(timed("cold load of a 48-layer model", lambda: meshctl(mesh, "up")))
        meshctl(stock, "up")
        proxy = json.loads(meshctl(mesh, "status", "--json"))["urls"]["proxy"]
        usage = {}

        def post(body):
            r = requests.post(f"{proxy}/completions", json=body, timeout=1800)
            assert r.status_code == 200, r.text
            usage.update(r.json()["usage"])

        words = "The ranks step in lockstep and every token needs an all-reduce across the ring. "
        rows.append(timed(f"prefill of a long prompt (base window {BASE:g} s)",
                          lambda: post({"prompt": words * 16, "max_tokens": 1})))
        prefill_tokens = usage["prompt_tokens"]
        rows.append(timed("speculative decode", lambda: post({"prompt": "hello", "max_tokens": 100})))
        idle = args.idle_minutes * 60
        rows.append(timed("both meshes idle", lambda: time.sleep(idle)))
        found = {"meshd-rank": incidents(mesh), "mlx-lm-server": incidents(stock)}
        sent = probes(stock)
    finally:
        for m, group in ((mesh, agents), (stock, stock_agents)):
            stop_controller(m)
            for a in group:
                a.kill()

    lines = [f"### False alarms ({time.strftime('%Y-%m-%d')}, two 2-rank meshes on the ring backend, "
             f"{os.cpu_count()} CPUs)", "", "| case | lasted s | outlasts |", "|---|---|---|"]
    outlasts = [f"base stall window {BASE:g} s",
                f"base stall window {BASE:g} s ({rows[1][1] / BASE:.0f}x); {prefill_tokens} tokens in one chunk, "
                f"{prefill_tokens / rows[1][1]:.1f} tokens/s",
                f"the stock mesh's probe_idle + probe_timeout = {args.probe_idle + PROBE_TIMEOUT:g} s",
                f"{idle / BASE:.0f} base stall windows; {idle / args.probe_idle:.0f} probe periods of the stock mesh"]
    lines += [f"| {what} | {took:.1f} | {o} |" for (what, took), o in zip(rows, outlasts)]
    lines += ["", "Incidents: " + ", ".join(f"{name} **{len(xs)}**" for name, xs in found.items()) +
              " (target 0)" + "".join(f"; {name}: {xs}" for name, xs in found.items() if xs) +
              f". The stock mesh's idle probes: {sent.get('ok', 0):.0f} answered, {sent.get('failed', 0):.0f} "
              "failed.", "",
              f"Command: `python bench/false_alarms.py --idle-minutes {args.idle_minutes:g} --probe-idle "
              f"{args.probe_idle:g} --write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
