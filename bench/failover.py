"""A mesh's death to the cut stream's next token, two ways in one run: through meshd-proxy fronting two
meshes (the stream resumes on the other mesh) and through the first mesh's own proxy (it waits for
that mesh's next generation). Two 2-rank meshes of the demo model on the ring over loopback, each with
its own agents and controller; alternating rounds (the paths' order swaps each round), each trial a
new stream cut by SIGKILL of a rank of mesh a after its first chunks; the gap from the kill to the
first data chunk after the resumption.

    python bench/failover.py --rounds 5 --write
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
from contextlib import ExitStack
from pathlib import Path

import requests
from benchkit import report, say

from common.tomlcheck import write_toml
from kit.demo_answers import endless
from kit.meshctl import mesh_up, meshctl
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports
from runtime.models.demo_model import build_demo_model

PATHS = ("two meshes", "one mesh")
ARGS = {"model_name": "demo", "max_tokens_limit": 4096}
RECOVERY = {"max_failures": 1000, "backoff_max": 0.5}  # a death every trial is the benchmark, not a fault


def healthy(front: str, generation: int) -> bool:
    try:
        a = requests.get(f"{front}/v1/meshes", timeout=10).json()["meshes"][0]
    except (requests.ConnectionError, ValueError):
        return False
    return a["healthy"] and a["generation"] > generation


def cut_gap(url: str, rank_pid, body: dict) -> tuple[float, str]:
    """Seconds from SIGKILL of mesh a's rank, four chunks into a stream, to the first data chunk after
    the proxy's comment saying where the stream resumes (chunks rank 0 sent before it died may still
    be on their way); and that comment."""
    with requests.post(f"{url}/chat/completions", json={**body, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        chunks, killed, where = 0, 0.0, ""
        for line in r.iter_lines(chunk_size=None, decode_unicode=True):
            if line.startswith(": resuming on "):
                where = line[2:]
            if not line.startswith("data: "):
                continue
            assert line != "data: [DONE]" and '"error"' not in line, line
            if where:
                return time.monotonic() - killed, where
            chunks += 1
            if chunks == 4:
                os.kill(rank_pid(), signal.SIGKILL)
                killed = time.monotonic()
    raise AssertionError("the stream ended before it resumed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-failover-bench-"))
    model = build_demo_model(tmp / "model")
    gaps: dict[str, list[float]] = {p: [] for p in PATHS}
    with ExitStack() as stack:
        meshes = {name: stack.enter_context(mesh_up(tmp / name, model, runtime={"args": ARGS}, recovery=RECOVERY))
                  for name in "ab"}
        (port,) = free_ports(1)
        config = write_toml(tmp / "proxy.toml", {"proxy": {"listen": f"127.0.0.1:{port}"}, "meshes": [
            {"name": name, "config": str(path)} for name, (path, _) in meshes.items()]})
        proc = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(proc.wait, 30)
        stack.callback(proc.terminate)
        front = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(front, 0), 120, "the front proxy to see mesh a serve")
        a_toml, agents = meshes["a"]
        own = json.loads(meshctl(a_toml, "status", "--json").stdout)["urls"]["proxy"]
        urls = {"two meshes": f"{front}/v1", "one mesh": own}
        for rnd in range(args.rounds):
            for path in PATHS if rnd % 2 == 0 else PATHS[::-1]:
                generation = requests.get(f"{front}/v1/meshes", timeout=10).json()["meshes"][0]["generation"]
                body = {"messages": [{"role": "user", "content": f"round {rnd} by {path}"}], "max_tokens": 2000,
                        **endless(model)}
                gap, where = cut_gap(urls[path], lambda: agents[-1].ranks()[-1]["pid"], body)
                gaps[path].append(gap)
                say(f"round {rnd + 1} {path}: next token {gap:.3f}s after the kill ({where})")
                wait_for(lambda: healthy(front, generation), 120, "mesh a's next generation")
    today = time.strftime("%Y-%m-%d")
    med = {p: statistics.median(g) for p, g in gaps.items()}
    lines = [f"### Failover (bench/failover.py, {today}, two 2-rank demo meshes on the ring over loopback, "
             f"{os.cpu_count()} CPUs, {args.rounds} alternating rounds)", "",
             "| path | kill to the next token, median s | spread s |", "|---|---|---|"]
    for p in PATHS:
        lines.append(f"| {'resumed on the other mesh' if p == 'two meshes' else 'waits for the same mesh'} "
                     f"({p}) | {med[p]:.3f} | {min(gaps[p]):.3f} to {max(gaps[p]):.3f} |")
    lines += ["", f"The other mesh's next token comes {med['one mesh'] / med['two meshes']:.1f}x sooner than the "
              "same mesh's next generation's.", "", f"Command: `python bench/failover.py --rounds {args.rounds} "
              "--write`", ""]
    report(lines, args.write)


if __name__ == "__main__":
    main()
