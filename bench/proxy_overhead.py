"""Latency meshd-proxy adds: the same fast stand-in rank 0 (bench/standin_rank.py,
started by a real agent under a real controller) reached directly, through
meshd-proxy, and through nginx as a plain reverse proxy, in one run, in
alternating rounds (the paths' order rotates each round), at 1 and 32 clients.

Back to back (default): per request (whole answers) and per chunk (streams of
--chunks chunks sent at once). A round's added latency is that round's median
through a path minus its median direct; the table gives the median over rounds
and their spread.

Paced (--pace-ms 20: 50 tokens/s a stream): every token's delivery latency, from
the moment the stand-in sent it (the time is in its text; one clock) to its
arrival at the client; a round's p50 and p99 over all its tokens, minus
direct's.

--two-meshes adds a path to the rounds: meshd-proxy with a proxy config fronting
two meshes (the first and another stand-in mesh beside it), and a table of its
added latency against the proxy of one mesh.

    python bench/proxy_overhead.py --rounds 5 --requests 200 --write
    python bench/proxy_overhead.py --rounds 5 --requests 64 --pace-ms 20 --write
    python bench/proxy_overhead.py --rounds 5 --requests 64 --pace-ms 20 --two-meshes --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from benchkit import ROOT, meshctl_for, report, standin_model

from common.tomlcheck import write_toml
from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import stop_controller
from kit.waiting import wait_for
from meshd import config as mesh_config
from meshd.meshctl.ports import free_ports

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SENT_AT = re.compile(rb'"content": "t\d+ ([0-9.]+) ')
PATHS = ("direct", "meshd-proxy", "nginx")
TWO = "two meshes"


async def one(session: aiohttp.ClientSession, url: str, stream: bool, latencies: list[float] | None) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json={**BODY, "stream": stream}) as r:
        assert r.status == 200, await r.text()
        if latencies is None:
            async for _ in r.content.iter_any():
                pass
        else:
            async for line in r.content:
                if m := SENT_AT.search(line):
                    latencies.append(time.time() - float(m.group(1)))
    return time.perf_counter() - t0


async def load(url: str, n: int, concurrency: int, stream: bool, paced: bool) -> tuple[list[float], list[float]]:
    """Request times and (paced) token latencies of `n` requests from `concurrency` clients."""
    times: list[float] = []
    latencies: list[float] = []
    queue = list(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(min(4 if paced else 20, n)):  # warm-up, not counted
            await one(session, url, stream, None)

        async def worker():
            while queue:
                queue.pop()
                times.append(await one(session, url, stream, latencies if paced else None))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times, latencies


def nginx_conf(d: Path, listen: int, upstream: int) -> Path:
    conf = d / "nginx.conf"
    conf.write_text(f"""
pid {d}/nginx.pid;
error_log {d}/error.log;
worker_processes 1;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  upstream rank0 {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{listen};
    location / {{
      proxy_pass http://rank0;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
    return conf


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cell(rounds: list[dict[str, float]], path: str) -> tuple[float, float, float]:
    """Median over rounds of `path` minus direct in the same round, and the spread (min, max), in ms."""
    added = [(r[path] - r["direct"]) * 1000 for r in rounds]
    return statistics.median(added), min(added), max(added)


def ratio(meshd: float, nginx: float) -> str:
    return f"{meshd / nginx:.1f}x" if nginx > 0 else "n/a (nginx <= 0)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pace-ms", type=float, default=0.0)
    ap.add_argument("--two-meshes", action="store_true", help="also through meshd-proxy fronting two meshes")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    paths = PATHS + ((TWO,) if args.two_meshes else ())
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed: apt-get install nginx")
    paced = args.pace_ms > 0
    tmp = Path(tempfile.mkdtemp(prefix="meshd-proxy-bench-"))
    def standin_mesh(d: Path):
        (agent,) = make_agents(d, 1, extra={"profiles": {"standin": {
            "command": ["{python}", str(ROOT / "bench" / "standin_rank.py"), "--host", "{host}", "--port", "{port}",
                        "--meshd-generation", "{generation}", "--chunks", str(args.chunks),
                        "--pace-ms", str(args.pace_ms)], "status_file": False}}})
        agent.start()
        return agent, write_mesh(d, [agent], standin_model(tmp / "model"), runtime={"profile": "standin"},
                                 proxy={"concurrency": 64, "queue_limit": 256})

    agent, mesh = standin_mesh(tmp)
    other = standin_mesh(tmp / "other") if args.two_meshes else None
    front = None
    (nginx_port, front_port) = free_ports(2)
    for sub in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        (tmp / sub).mkdir()
    rank_port = mesh_config.load(mesh).runtime.port
    ng = None
    cells = [(c, s) for c in (1, 32) for s in ((True,) if paced else (False, True))]
    # (clients, stream) -> statistic ("p50"/"p99" of the tokens paced, else "median") -> a {path: s} per round
    results: dict[tuple, dict[str, list[dict[str, float]]]] = {k: {} for k in cells}

    def requests_for(concurrency: int) -> int:
        return args.requests if concurrency > 1 or not paced else max(4, args.requests // 8)

    try:
        meshctl_for(mesh, "up", "--skip-preflight")  # the stand-in rank loads no model: no memory to check
        status = json.loads(meshctl_for(mesh, "status", "--json"))
        if other is not None:
            meshctl_for(other[1], "up", "--skip-preflight")
            front = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(write_toml(
                tmp / "proxy.toml", {"proxy": {"listen": f"127.0.0.1:{front_port}", "concurrency": 64,
                                               "queue_limit": 256},
                                     "meshes": [{"name": "a", "config": str(mesh)},
                                                {"name": "b", "config": str(other[1])}]}))])
        ng = subprocess.Popen([nginx, "-c", str(nginx_conf(tmp, nginx_port, rank_port)), "-g", "daemon off;"])
        urls = {"direct": f"http://127.0.0.1:{rank_port}/v1/chat/completions",
                "meshd-proxy": f"{status['urls']['proxy']}/chat/completions",
                "nginx": f"http://127.0.0.1:{nginx_port}/v1/chat/completions",
                TWO: f"http://127.0.0.1:{front_port}/v1/chat/completions"}
        wait_for(lambda: subprocess.run(["curl", "-sf", f"http://127.0.0.1:{nginx_port}/internal/ready"],
                                        capture_output=True).returncode == 0, 30, "nginx")
        if front is not None:
            wait_for(lambda: subprocess.run(["curl", "-sf", f"http://127.0.0.1:{front_port}/health"],
                                            capture_output=True).returncode == 0, 60, "the proxy of two meshes")
        for concurrency, stream in cells:
            for rnd in range(args.rounds):
                order = paths[rnd % len(paths):] + paths[:rnd % len(paths)]
                got: dict[str, dict[str, float]] = {}
                for path in order:
                    times, latencies = asyncio.run(load(urls[path], requests_for(concurrency), concurrency, stream,
                                                        paced))
                    if paced:
                        got.setdefault("p50", {})[path] = percentile(latencies, 0.5)
                        got.setdefault("p99", {})[path] = percentile(latencies, 0.99)
                    else:
                        per = args.chunks + 2 if stream else 1  # a stream's chunks, its end and [DONE]
                        got.setdefault("median", {})[path] = statistics.median(times) / per
                for stat, by_path in got.items():
                    results[(concurrency, stream)].setdefault(stat, []).append(by_path)
                print(f"c={concurrency} stream={stream} round {rnd + 1}: " + ", ".join(
                    f"{path} {stat} {v * 1000:.3f} ms" for stat, by_path in got.items() for path, v in by_path.items()),
                    file=sys.stderr)
    finally:
        for proc in (ng, front):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        for a, m in (agent, mesh), *((other,) if other else ()):
            stop_controller(m)
            a.kill()

    today = time.strftime("%Y-%m-%d")
    if paced:
        lines = [f"### Proxy latency per token, paced streams ({today}, stand-in rank 0 at {1000 / args.pace_ms:.0f} "
                 f"tokens/s a stream, {os.cpu_count()} CPUs, {args.rounds} alternating rounds, {args.chunks}-token "
                 "streams)", "",
                 "| streams | tokens a round | direct p50 / p99 ms | meshd-proxy added p50 ms | added p99 ms "
                 "(spread) | nginx added p50 / p99 ms | meshd / nginx (p99) | target |",
                 "|---|---|---|---|---|---|---|---|"]
        for concurrency, stream in cells:
            rounds, tails = results[(concurrency, stream)]["p50"], results[(concurrency, stream)]["p99"]
            m50, _, _ = cell(rounds, "meshd-proxy")
            m99, lo, hi = cell(tails, "meshd-proxy")
            n50, _, _ = cell(rounds, "nginx")
            n99, _, _ = cell(tails, "nginx")
            d50 = statistics.median(r["direct"] for r in rounds) * 1000
            d99 = statistics.median(r["direct"] for r in tails) * 1000
            lines.append(f"| {concurrency} | {requests_for(concurrency) * args.chunks} | {d50:.3f} / {d99:.3f} | "
                         f"{m50:.3f} | {m99:.3f} ({lo:.3f} to {hi:.3f}) | {n50:.3f} / {n99:.3f} | {ratio(m99, n99)} | "
                         f"{'<= 1 ms p99' if concurrency == 32 else '-'} |")
        lines += ["", "p99 is the 99th percentile of every token a round delivered; the added figures are the "
                  "median over rounds of (path - direct) in the same round, with the spread of those rounds."]
    else:
        lines = [f"### Proxy overhead ({today}, stand-in rank 0, {os.cpu_count()} CPUs, {args.rounds} alternating "
                 f"rounds of {args.requests} requests a cell, streams of {args.chunks} chunks)", "",
                 "| clients | kind | direct ms | meshd-proxy added ms (spread) | nginx added ms | meshd / nginx | "
                 "target |", "|---|---|---|---|---|---|---|"]
        targets = {(1, False): "<= 0.3 ms", (1, True): "<= 0.02 ms", (32, True): "<= 0.15 ms", (32, False): "-"}
        for concurrency, stream in cells:
            rounds = results[(concurrency, stream)]["median"]
            m, lo, hi = cell(rounds, "meshd-proxy")
            n, _, _ = cell(rounds, "nginx")
            d = statistics.median(r["direct"] for r in rounds) * 1000
            lines.append(f"| {concurrency} | {'per chunk' if stream else 'per request'} | {d:.3f} | {m:.3f} "
                         f"({lo:.3f} to {hi:.3f}) | {n:.3f} | {ratio(m, n)} | {targets[(concurrency, stream)]} |")
        lines += ["", "A round's added latency is its median through the path minus its median direct, divided by "
                  "the chunks of a stream (plus its end and [DONE]) for the per-chunk rows; the table gives the "
                  "median over rounds and their spread."]
    if args.two_meshes:
        lines += ["", *two_meshes_table(results, cells, paced)]
    lines += ["", f"Command: `python bench/proxy_overhead.py --rounds {args.rounds} --requests {args.requests} "
              f"--chunks {args.chunks}{f' --pace-ms {args.pace_ms:g}' if paced else ''}"
              f"{' --two-meshes' if args.two_meshes else ''} --write`", ""]
    report(lines, args.write)


def two_meshes_table(results: dict, cells: list[tuple], paced: bool) -> list[str]:
    """meshd-proxy fronting two meshes against meshd-proxy of one, each over direct in the same round."""
    stat = "p99" if paced else "median"
    unit = "per token, p99" if paced else "per request or chunk, median"
    lines = [f"meshd-proxy over two meshes against one mesh ({unit}, added over direct in the same round):", "",
             "| clients | kind | one mesh added ms (spread) | two meshes added ms (spread) | two - one ms |",
             "|---|---|---|---|---|"]
    for concurrency, stream in cells:
        rounds = results[(concurrency, stream)][stat]
        one, lo1, hi1 = cell(rounds, "meshd-proxy")
        two, lo2, hi2 = cell(rounds, TWO)
        kind = "per token" if paced else ("per chunk" if stream else "per request")
        lines.append(f"| {concurrency} | {kind} | {one:.3f} ({lo1:.3f} to {hi1:.3f}) | {two:.3f} ({lo2:.3f} to "
                     f"{hi2:.3f}) | {two - one:.3f} |")
    return lines


if __name__ == "__main__":
    main()
