"""Decode tokens/s and time to first token: meshd-rank against stock
mlx_lm.server, same random model, same 2-rank ring mesh on loopback, runs
alternating in one invocation. Prints a Markdown table; --write appends it to
docs/BENCHMARKS.md.

    python bench/rank_vs_mlx_lm_server.py --rounds 5 --write
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from benchkit import ROOT, report

from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports
from runtime.models.demo_model import DemoModelSpec, build_demo_model  # noqa: E402


def launch(kind: str, model: Path, world: int, workdir: Path) -> tuple[list[subprocess.Popen], int]:
    *ring, port = free_ports(world + 1)
    hostfile = workdir / f"{kind}-ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
    procs = []
    for rank in range(world):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        if kind == "meshd-rank":
            cmd = [sys.executable, "-m", "runtime.rank", "--model", str(model), "--port", str(port),
                   "--status-file", str(workdir / f"status-{rank}.json")]
        else:
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)]
        log = open(workdir / f"{kind}-{rank}.log", "wb")
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    # mlx_lm.server has no readiness route: its port answering is all it says.
    route = "/internal/ready" if kind == "meshd-rank" else "/v1/models"
    url = f"http://127.0.0.1:{port}{route}"

    def up():
        try:
            return requests.get(url, timeout=2).ok
        except requests.RequestException:
            return False
    wait_for(up, 300, f"{kind} to serve", interval=0.2)
    return procs, port


def measure(port: int, max_tokens: int, prompt: str) -> tuple[float, float, int]:
    """One streamed greedy request: (ttft seconds, decode tokens/s, tokens)."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, stream=True,
                       timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = first or now
                last = now
    return first - t0, (tokens - 1) / (last - first) if last > first else 0.0, tokens


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="append the result to docs/BENCHMARKS.md")
    args = ap.parse_args()
    spec = DemoModelSpec(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, vocab_size=512,
                         num_attention_heads=16, num_key_value_heads=8, seed=11)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_demo_model(tmp / "bench-model", spec)
        prompt = "The ranks step in lockstep. " * 20
        results: dict[str, list[tuple[float, float, int]]] = {"meshd-rank": [], "mlx_lm.server": []}
        for rnd in range(args.rounds):
            order = ["meshd-rank", "mlx_lm.server"] if rnd % 2 == 0 else ["mlx_lm.server", "meshd-rank"]
            for kind in order:
                procs, port = launch(kind, model, args.world, tmp)
                try:
                    measure(port, 8, prompt)  # warm-up
                    results[kind].append(measure(port, args.max_tokens, prompt))
                finally:
                    stop(procs)
                print(f"round {rnd} {kind}: ttft {results[kind][-1][0]:.3f}s "
                      f"decode {results[kind][-1][1]:.1f} tok/s", file=sys.stderr)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in results.items()}
    ratio_decode = med["meshd-rank"][1] / med["mlx_lm.server"][1]
    ratio_ttft = med["meshd-rank"][0] / med["mlx_lm.server"][0]
    report([
        f"### meshd-rank vs mlx_lm.server ({time.strftime('%Y-%m-%d')}, {args.world}-rank ring on loopback, "
        f"{os.cpu_count()} CPUs, {args.rounds} alternating rounds, {args.max_tokens} tokens, median)",
        "",
        f"Model: random llama, hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, "
        f"intermediate {spec.intermediate_size}, float32.",
        "",
        "| server | TTFT s | decode tok/s |",
        "|---|---|---|",
        *(f"| {k} | {v[0]:.3f} | {v[1]:.1f} |" for k, v in med.items()),
        "",
        f"Decode ratio meshd-rank / mlx_lm.server: **{ratio_decode:.2f}x** (goal >= 1.0x). "
        f"TTFT ratio: {ratio_ttft:.2f}x (lower is better).",
        "",
        f"Command: `python bench/rank_vs_mlx_lm_server.py --rounds {args.rounds} --max-tokens {args.max_tokens} "
        f"--world {args.world} --write`",
        "",
    ], args.write)


if __name__ == "__main__":
    main()
