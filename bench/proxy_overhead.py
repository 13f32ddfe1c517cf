"""Latency the proxy adds, per request and per streamed chunk: the same fast
stand-in rank 0 (bench/standin_rank.py, started by a real agent under a real
controller) reached directly, through meshd's proxy, and through nginx as a
plain reverse proxy, in one run, at 1 and 32 concurrent clients.

    python bench/proxy_overhead.py --requests 400 --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from benchkit import ROOT, meshctl_for, report, standin_model

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.waiting import wait_for
from meshd import config as mesh_config
from meshd.ports import free_ports

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json={**BODY, "stream": stream}) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - t0


async def load(url: str, n: int, concurrency: int, stream: bool) -> list[float]:
    times: list[float] = []
    queue = list(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(min(20, n)):  # warm-up, not counted
            await one(session, url, stream)

        async def worker():
            while queue:
                queue.pop()
                times.append(await one(session, url, stream))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed: apt-get install nginx")
    tmp = Path(tempfile.mkdtemp(prefix="meshd-proxy-bench-"))
    (agent,) = make_agents(tmp, 1, extra={"profiles": {"standin": {
        "command": ["{python}", str(ROOT / "bench" / "standin_rank.py"), "--host", "{host}", "--port", "{port}",
                    "--meshd-generation", "{generation}", "--chunks", str(args.chunks)], "status_file": False}}})
    agent.start()
    mesh = write_mesh(tmp, [agent], standin_model(tmp / "model"), runtime={"profile": "standin"},
                      proxy={"concurrency": 64, "queue_limit": 256})
    (nginx_port,) = free_ports(1)
    for sub in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        (tmp / sub).mkdir()
    rank_port = mesh_config.load(mesh).runtime.port
    ng = None
    try:
        meshctl_for(mesh, "up", "--skip-preflight")  # the stand-in rank loads no model: no memory to check
        status = json.loads(meshctl_for(mesh, "status", "--json"))
        ng = subprocess.Popen([nginx, "-c", str(nginx_conf(tmp, nginx_port, rank_port)), "-g", "daemon off;"])
        paths = {"direct": f"http://127.0.0.1:{rank_port}/v1/chat/completions",
                 "meshd proxy": f"{status['urls']['proxy']}/chat/completions",
                 "nginx": f"http://127.0.0.1:{nginx_port}/v1/chat/completions"}
        wait_for(lambda: subprocess.run(["curl", "-sf", f"http://127.0.0.1:{nginx_port}/internal/ready"],
                                        capture_output=True).returncode == 0, 30, "nginx")
        results = {}
        for concurrency in (1, 32):
            for stream in (False, True):
                for name, url in paths.items():
                    t = asyncio.run(load(url, args.requests, concurrency, stream))
                    results[(concurrency, stream, name)] = statistics.median(t)
                    print(f"c={concurrency} stream={stream} {name}: p50 {statistics.median(t) * 1000:.2f} ms",
                          file=sys.stderr)
    finally:
        if ng is not None:
            ng.terminate()
            ng.wait(10)
        meshctl_for(mesh, "down", "--force", check=False)
        pidfile = tmp / "state" / "run" / "controller.pid"
        if pidfile.exists():
            os.kill(int(pidfile.read_text().split()[0]), 15)
        agent.kill()

    lines = [f"### Proxy overhead ({time.strftime('%Y-%m-%d')}, stand-in rank 0, {os.cpu_count()} CPUs, "
             f"{args.requests} requests per cell, streams of {args.chunks} chunks, medians)", "",
             "| clients | kind | direct ms | meshd added ms | nginx added ms | meshd / nginx | target (1 client) |",
             "|---|---|---|---|---|---|---|"]
    for concurrency in (1, 32):
        for stream in (False, True):
            d = results[(concurrency, stream, "direct")]
            m = results[(concurrency, stream, "meshd proxy")] - d
            n = results[(concurrency, stream, "nginx")] - d
            per = args.chunks + 2 if stream else 1
            unit = "per chunk" if stream else "per request"
            target = ("<= 0.1 ms per chunk" if stream else "<= 1 ms per request") if concurrency == 1 else "-"
            lines.append(f"| {concurrency} | {unit} | {d * 1000 / per:.3f} | {m * 1000 / per:.3f} | "
                         f"{n * 1000 / per:.3f} | {f'{m / n:.1f}x' if n > 0 else 'n/a'} | {target} |")
    lines += ["", "Added latency is the median of a path minus the direct median, divided by the chunks of a "
              "stream for the per-chunk rows.", "",
              f"Command: `python bench/proxy_overhead.py --requests {args.requests} --chunks {args.chunks} --write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
