"""Slow and many clients against every listener of a two-node demo mesh, the
faults of docs/RELIABILITY.md's listener rows:

- 300 connections to the proxy sending their headers a byte every 2 s: how many
  it closed within 90 s and when the last went, the chat requests served
  meanwhile, the proxy's descriptors at most;
- a body sent to the proxy a byte every 2 s: what it answered, and when;
- 1100 such connections to rank 0's HTTP port and 1000 to its wake channel:
  rank 0's threads and descriptors at most, and when the last was closed;
- a JSON body nested 5000 deep to the proxy, rank 0, the control API and an
  agent: each one's status and content type.

    python bench/slow_clients.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import psutil
import requests

from benchkit import meshctl, say
from kit.slowclients import HEAD, Chat, Trickle, allow_descriptors, deep
from meshd.config import load
from meshd.meshctl import demo
from meshd.seam import rank_key, rank_secret

WATCH = 90.0  # seconds each flood is watched


def watch(floods: list[Trickle], proc: psutil.Process) -> dict:
    """Sample `proc` until every connection of `floods` is closed, or WATCH passes."""
    peak_threads = peak_fds = 0
    deadline = time.monotonic() + WATCH
    while time.monotonic() < deadline and any(f.socks for f in floods):
        peak_threads, peak_fds = max(peak_threads, proc.num_threads()), max(peak_fds, proc.num_fds())
        time.sleep(0.5)
    closed = [t for f in floods for t in f.closed]
    for f in floods:
        f.close()
    return {"threads": peak_threads, "fds": peak_fds, "closed": len(closed),
            "last_closed": round(max(closed), 1) if closed else None}


def main() -> None:
    allow_descriptors(8192)
    home = Path(tempfile.mkdtemp(prefix="slow-clients-"))
    say("demo mesh of 2 nodes")
    meshctl(home, "up", "--nodes", "2")
    try:
        cfg = load(home / "demo" / "mesh.toml")
        status = json.loads(meshctl(home, "status", "--json"))
        proxy_url = status["urls"]["proxy"].removesuffix("/v1")
        proxy = psutil.Process(int((demo.run_dir(home / "demo") / "proxy.pid").read_text().split()[0]))
        rank0 = psutil.Process(status["nodes"][0]["rank"]["pid"])
        proxy_port, rank0_port = int(proxy_url.rsplit(":", 1)[1]), cfg.runtime.port
        (wake_port,) = {c.laddr.port for c in rank0.net_connections("tcp") if c.status == "LISTEN"} - {rank0_port}
        rows = {"before": {"proxy": (proxy.num_threads(), proxy.num_fds()),
                           "rank 0": (rank0.num_threads(), rank0.num_fds())}}

        say("300 connections trickling their headers to the proxy")
        chat = Chat(proxy_url)
        rows["proxy slowloris"] = watch([Trickle(proxy_port, 300)], proxy)
        statuses = chat.stop()
        rows["proxy slowloris"]["chat"] = f"{statuses.count(200)}/{len(statuses)} served"

        say("a body trickled to the proxy")
        body = Trickle(proxy_port, 1, first=HEAD.replace(b"X-Pad: " + b"a" * 500, b"Content-Length: 1000\r\n\r\n{"),
                       head=b" ")
        rows["proxy body trickle"] = {**watch([body], proxy), "answer": body.answers[0].split(b"\r\n")[0].decode()
                                      if body.answers else None}

        say("1100 connections trickling to rank 0, 1000 to its wake channel")
        rows["rank 0 flood"] = watch([Trickle(rank0_port, 1100), Trickle(wake_port, 1000, head=b"0" * 64)], rank0)

        say("JSON nested 5000 deep")
        secret = rank_secret(rank_key(cfg.state_dir), status["generation"])
        token = (cfg.state_dir / "control.token").read_text().strip()
        node = cfg.nodes[0]
        for name, url, auth in [("proxy", f"{proxy_url}/v1/chat/completions", ""),
                                ("rank 0", f"http://127.0.0.1:{rank0_port}/v1/chat/completions", secret),
                                ("control API", f"{status['urls']['control']}/v1/observations", token),
                                ("agent API", f"{node.agent}/v1/ranks", node.token_file.read_text().strip())]:
            r = requests.post(url, data=deep(5000), timeout=30, headers={
                "Content-Type": "application/json", **({"Authorization": f"Bearer {auth}"} if auth else {})})
            rows[f"deep JSON: {name}"] = f"{r.status_code} {r.headers.get('Content-Type', '').split(';')[0]}"
    finally:
        meshctl(home, "down", check=False)
    for what, measured in rows.items():
        print(f"{what}: {json.dumps(measured)}")


if __name__ == "__main__":
    main()
