"""meshd on NVIDIA GPUs (mlx[cuda13], the nccl backend), against a plain mlx
tensor-parallel loop of the same model in the same run. For the device
machine (nvidia-h200-x2): one rank per GPU, two agents on one host.

- Cold start: `meshctl up` -> first answer, against the plain loop's load and
  its process start -> first token.
- Decode (greedy, batch 1, --tokens tokens) in alternating rounds: the plain
  loop on stream_generate and on BatchGenerator, meshd through the proxy,
  meshd direct to rank 0, each round in the other order.
- The proxy's own cost with the GPU's noise taken out: the same answer asked
  through the proxy and direct at once (rank 0 decodes both in one batch),
  their tok/s over the same steps and what the proxy adds to each token.
- Recovery: SIGKILL of rank 1, SIGSTOP of rank 0 -> first answer again.
- `meshctl down` leaves no rank process holding GPU memory.
- The stock mlx_lm.server profile on the same mesh: served, or the reason.

    python bench/gpu_tp.py --out DIR [--hidden 4096 --layers 32 ...] [--decode-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
from benchkit import ROOT, add_gpu_run_args, build_llama_shape, meshctl_for, pace, say

from common.hostfile import MLX_BACKEND, launch_env
from common.tomlcheck import write_toml
from kit.agents import make_agents
from kit.demo_answers import endless
from kit.meshctl import stop_controller
from kit.waiting import wait_for
from meshd.seam import rank_key, rank_secret
from meshd.meshctl.ports import free_ports


def status(mesh: Path) -> dict:
    return json.loads(meshctl_for(mesh, "status", "--json"))


def arrivals(url: str, model: Path, tokens: int, headers: dict | None = None) -> tuple[float, list[float]]:
    """One greedy streamed answer of `tokens` tokens: when it was asked and when each token came."""
    t0 = time.perf_counter()
    times = []
    r = requests.post(f"{url}/chat/completions", stream=True, timeout=600, headers=headers,
                      json={"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": tokens,
                            "temperature": 0, "stream": True, **endless(model)})
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and '"content"' in line:
            times.append(time.perf_counter())
    return t0, times


def decode(url: str, model: Path, tokens: int, headers: dict | None = None) -> dict:
    """Decode pace after the first token, and TTFT."""
    t0, times = arrivals(url, model, tokens, headers)
    return {"ttft_s": times[0] - t0, **pace(times)}


def paired(proxy: str, rank0: str, model: Path, tokens: int, headers: dict) -> dict:
    """The same answer asked through the proxy and direct at once: rank 0 decodes both in one batch, a
    token of each per step, so the GPU's noise is common to both. Over the steps both streams span, the
    proxied stream's tok/s against the direct one's, and what the proxy adds to each token's arrival
    (from the direct token of the same step: the last direct arrival before it)."""
    out: dict = {}
    start = threading.Barrier(2)

    def ask(name, url, hdrs):
        start.wait()
        out[name] = arrivals(url, model, tokens, hdrs)[1]
    threads = [threading.Thread(target=ask, args=a) for a in (("proxy", proxy, None), ("direct", rank0, headers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lo, hi = max(out["proxy"][0], out["direct"][0]), min(out["proxy"][-1], out["direct"][-1])
    window = {k: [t for t in v if lo <= t <= hi] for k, v in out.items()}
    if min(len(v) for v in window.values()) < 2:
        return {"steps": 0}  # not decoded side by side (one was admitted after the other ended)
    rate = {k: (len(v) - 1) / (v[-1] - v[0]) for k, v in window.items()}
    added = [p - max(d for d in window["direct"] if d <= p) for p in window["proxy"][1:]
             if any(d <= p for d in window["direct"])]
    return {"steps": len(window["direct"]), "ratio": rate["proxy"] / rate["direct"], "tok_s": rate["direct"],
            "added_ms_median": 1000 * statistics.median(added), "added_ms_max": 1000 * max(added)}


def first_answer(mesh: Path, after: float, timeout: float = 600) -> float:
    proxy = status(mesh)["urls"]["proxy"]

    def ok():
        try:
            return requests.post(f"{proxy}/chat/completions", timeout=300,
                                 json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).ok
        except requests.RequestException:
            return False
    wait_for(ok, timeout, "an answer", 0.05)
    return time.time() - after


def start_steps(db: Path, t0: float) -> dict:
    """Where generation 1's start went, from the agents' events in the store: seconds after `meshctl up`
    at which the first rank was spawned, the last reported loading, armed, ready."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("SELECT kind, at, data FROM events WHERE generation = 1 ORDER BY at").fetchall()
    con.close()
    steps: dict[str, float] = {}
    for kind, at, data in rows:
        step = "spawned" if kind == "RankStarted" else json.loads(data).get("state") if kind == "RankStateChanged" \
            else None
        if step:
            steps[step] = round(max(steps.get(step, 0.0), at - t0), 2)
    return steps


def gpu_memory() -> dict:
    """MiB in use on each GPU, and by each process that holds any (nothing without nvidia-smi: the CPU try-out)."""
    if shutil.which("nvidia-smi") is None:
        return {}

    def query(*args: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]
    return {"gpus_mib": [int(used) for (used,) in query("--query-gpu=memory.used")],
            "processes": [{"pid": int(pid), "mib": int(mib), "bench": int(pid) == os.getpid()}
                          for pid, mib in query("--query-compute-apps=pid,used_memory")]}


class PlainLoop:
    """bench/plain_tp.py on two ranks (one per GPU), started with the env mlx.launch gives; rounds on demand."""

    ENGINES = ("stream", "batch")

    def __init__(self, work: Path, engine: str, model: Path, args, tag: str = ""):
        tag = tag or engine
        self.signals = work / f"signals-{tag}"
        self.signals.mkdir()
        hostfile = {"backend": args.backend, "hosts": [{"ssh": f"r{r}", "ips": ["127.0.0.1"]} for r in range(2)]}
        first = free_ports(2)[0]
        envs = []
        for r in range(2):
            le = launch_env(hostfile, r, starting_port=first, nccl_port=first)
            for var, content in le.files.items():
                (work / f"plain-{tag}-{r}-{var}").write_text(content)
                le.env[var] = str(work / f"plain-{tag}-{r}-{var}")
            envs.append({**os.environ, **le.env, "MESHD_BACKEND": MLX_BACKEND[args.backend], "PYTHONUNBUFFERED": "1"})
        t0 = time.time()
        self.procs = [subprocess.Popen([sys.executable, str(ROOT / "bench" / "plain_tp.py"), "--model", str(model),
                                        "--tokens", str(args.tokens), "--engine", engine,
                                        "--signals", str(self.signals)],
                                       env=envs[r], stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                       text=True)
                      for r in range(2)]
        line = json.loads(self.procs[0].stdout.readline())
        self.started = {"loaded_s": line["loaded_s"], "cold_start_s": line["first_token_at"] - t0}

    def decode(self, n: int) -> dict:
        (self.signals / f"go-{n}").touch()
        done = self.signals / f"done-{n}"
        wait_for(done.exists, 600, "the plain loop", 0.05)
        return json.loads(done.read_text())

    def stop(self) -> None:
        (self.signals / "stop").touch()
        for p in self.procs:
            p.wait(60)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpu_run_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loops", nargs="+", choices=PlainLoop.ENGINES, default=list(PlainLoop.ENGINES),
                    help="the plain loops to run beside meshd (batch: on BatchGenerator)")
    ap.add_argument("--decode-only", action="store_true",
                    help="cold start and decode rounds only: no recovery, no stock profile (a shorter device run)")
    args = ap.parse_args()
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpus": gpu_memory(), "shape": vars(args) | {"out": str(args.out)}}

    def save():
        (args.out / "gpu_tp.json").write_text(json.dumps(result, indent=2, default=str))

    t0 = time.time()
    model = build_llama_shape(args, work / "model")
    result["model_bytes"] = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    say(f"built the model: {result['model_bytes'] / 1e9:.1f} GB in {time.time() - t0:.0f} s")

    agents = make_agents(work, 2, stall={"load_deadline": 900})
    for a in agents:
        a.start()
    ring = free_ports(1)[0]
    mesh = work / "mesh.toml"
    proxy_port, control_port, rank_port = free_ports(3)
    conf = {"name": "gpu", "backend": args.backend, "state_dir": "state",
        "nodes": [{"name": a.node, "agent": a.url, "token_file": str(a.dir / "token")} for a in agents],
        "runtime": {"model": str(model), "port": rank_port, "ring_port": ring,
                    "args": {"max_tokens_limit": 8192}},
        "proxy": {"listen": f"127.0.0.1:{proxy_port}"},
        "recovery": {"backoff_base": 0.2, "stop_grace": 5.0, "start_deadline": 900.0},
        "control": {"listen": f"127.0.0.1:{control_port}"}}
    write_toml(mesh, conf)
    plain: dict = {}
    try:
        # The first mlx process on a machine compiles its GPU kernels (cached on disk for the next): one
        # throwaway start of the plain loop, so what follows compares starts with the same warm cache.
        plain["warm"] = PlainLoop(work, "stream", model, args, tag="kernel-warm")
        result["first_start_on_this_machine_s"] = plain["warm"].started["cold_start_s"]
        say(f"first mlx start on this machine (plain loop, cold kernel cache): process start -> first token "
            f"{result['first_start_on_this_machine_s']:.1f} s")
        plain.pop("warm").stop()

        t0 = time.time()
        meshctl_for(mesh, "up")
        result["cold_start_s"] = first_answer(mesh, t0)
        result["cold_start_steps"] = start_steps(work / "state" / "meshd.sqlite", t0)
        say(f"meshd cold start (up -> first answer): {result['cold_start_s']:.1f} s; "
            f"steps {result['cold_start_steps']}")
        s = status(mesh)
        rank0 = f"http://127.0.0.1:{rank_port}/v1"
        secret = rank_secret(rank_key(work / "state"), s["generation"])
        rank0_auth = {"Authorization": f"Bearer {secret}"}  # what the proxy sends

        plain = {engine: PlainLoop(work, engine, model, args) for engine in args.loops}
        for engine, loop in plain.items():
            result[f"plain_{engine}"] = loop.started
            say(f"plain TP2 ({engine}): load {loop.started['loaded_s']:.1f} s, "
                f"process start -> first token {loop.started['cold_start_s']:.1f} s")

        rounds, pairs = [], []
        asks = {**{f"plain_{engine}": loop.decode for engine, loop in plain.items()},
                "proxy": lambda n: decode(s["urls"]["proxy"], model, args.tokens),
                "direct": lambda n: decode(rank0, model, args.tokens, rank0_auth)}
        for n in range(1, args.rounds + 1):  # each round in the other order: a drift favours no one
            row = {name: asks[name](n) for name in (list(asks) if n % 2 else list(asks)[::-1])}
            rounds.append(row)
            pairs.append(paired(s["urls"]["proxy"], rank0, model, args.tokens, rank0_auth))
            say(f"round {n}: " + ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in row.items()) + " tok/s; paired: "
                + (f"proxy/direct {pairs[-1]['ratio']:.4f}, adds {pairs[-1]['added_ms_median']:.2f} ms a token"
                   if pairs[-1]["steps"] else "not side by side"))
            result["rounds"], result["paired"] = rounds, pairs
            save()
        save()

        for fault, rank in () if args.decode_only else (("SIGKILL", 1), ("SIGSTOP", 0)):
            pid = status(mesh)["nodes"][rank]["rank"]["pid"]
            t0 = time.time()
            os.kill(pid, getattr(signal, fault))
            result[f"recovery_{fault.lower()}_rank{rank}_s"] = first_answer(mesh, t0)
            if fault == "SIGSTOP":
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            incident = json.loads(meshctl_for(mesh, "events", "--json"))["incidents"][0]
            result[f"timeline_{fault.lower()}"] = incident["timeline"]
            say(f"{fault} rank {rank} -> first answer {result[f'recovery_{fault.lower()}_rank{rank}_s']:.1f} s")
        save()

        meshctl_for(mesh, "down")
        time.sleep(2)
        ours = {p.pid for loop in plain.values() for p in loop.procs} | {os.getpid()}
        result["gpu_memory_after_down"] = gpu_memory()
        result["gpu_holders_left"] = [p for p in result["gpu_memory_after_down"].get("processes", [])
                                      if p["pid"] not in ours]
        result["processes_left"] = subprocess.run(["pgrep", "-f", "runtime.rank"], capture_output=True,
                                                  text=True, check=False).stdout.split()
        say(f"after down: GPU memory held by anything but the bench and its plain loops: "
            f"{result['gpu_holders_left']}; rank processes left {result['processes_left']}")

        if not args.decode_only:
            stock = work / "stock.toml"
            runtime = {k: v for k, v in conf["runtime"].items() if k != "args"} | {"profile": "mlx-lm-server"}
            write_toml(stock, conf | {"runtime": runtime, "recovery": conf["recovery"] | {"max_failures": 1}})
            t0 = time.time()
            up = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "--config", str(stock), "up", "--timeout", "240"],
                                capture_output=True, text=True, timeout=300, check=False)
            result["stock"] = {"up_exit": up.returncode, "seconds": time.time() - t0, "said": up.stdout[-1500:],
                               "incidents": json.loads(meshctl_for(stock, "events", "--json"))["incidents"][:2]}
            say(f"stock mlx_lm.server: exit {up.returncode}; {up.stdout.strip().splitlines()[-1:]}")
            if up.returncode == 0:
                result["stock"]["first_answer_s"] = first_answer(stock, t0, 120)
                stock_rounds = []
                for n in range(args.rounds + 1, 2 * args.rounds + 1):
                    row = {"plain_stream": plain["stream"].decode(n), "stock_direct": decode(rank0, model, args.tokens)}
                    stock_rounds.append(row)
                    say(f"stock round {n}: " + ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in row.items()) + " tok/s")
                result["stock_rounds"] = stock_rounds
            meshctl_for(stock, "down", "--force", check=False)
        for loop in plain.values():
            loop.stop()
    finally:
        for loop in plain.values():
            loop.kill()
        stop_controller(mesh)
        for a in agents:
            a.kill()
        save()

    rounds = {k: [r[k]["tok_s"] for r in result["rounds"]] for k in result["rounds"][0]}
    beside = result.get("stock_rounds", [])
    rounds["plain_stream_beside_stock"] = [r["plain_stream"]["tok_s"] for r in beside]
    rounds["stock_direct"] = [r["stock_direct"]["tok_s"] for r in beside]
    rounds = {k: v for k, v in rounds.items() if v}

    def median(key: str) -> float:
        return statistics.median(rounds[key])

    def spread(key: str) -> list[float]:
        return [round(min(rounds[key]), 1), round(max(rounds[key]), 1)]

    keys = list(rounds)
    per_round = [r["direct"]["tok_s"] / r["plain_stream"]["tok_s"] for r in result["rounds"]]
    by_step = [r["plain_stream"]["step_ms_median"] / r["direct"]["step_ms_median"] for r in result["rounds"]]
    side_by_side = [p for p in result["paired"] if p["steps"]]
    paired_ratios = [p["ratio"] for p in side_by_side]
    result["summary"] = {
        "decode_median_tok_s": {k: round(median(k), 1) for k in keys},
        "decode_spread_tok_s": {k: spread(k) for k in keys},
        "decode_ratio_direct_vs_plain_stream": median("direct") / median("plain_stream"),
        "decode_ratio_direct_vs_plain_stream_per_round": {"median": statistics.median(per_round),
                                                          "spread": [min(per_round), max(per_round)]},
        "decode_ratio_direct_vs_plain_stream_by_median_step_per_round": {
            "median": statistics.median(by_step), "spread": [min(by_step), max(by_step)]},
        **({"decode_ratio_direct_vs_plain_batch": median("direct") / median("plain_batch")}
           if "plain_batch" in rounds else {}),
        "proxy_cost": 1 - median("proxy") / median("direct"),
        "proxy_cost_paired": {"median": 1 - statistics.median(paired_ratios),
                              "spread": [1 - max(paired_ratios), 1 - min(paired_ratios)],
                              "added_ms_median": statistics.median(p["added_ms_median"] for p in side_by_side),
                              "added_ms_max": max(p["added_ms_max"] for p in side_by_side),
                              "rounds": f"{len(side_by_side)} of {len(result['paired'])}"},
        "cold_start_vs_plain_load": result["cold_start_s"] / result["plain_stream"]["loaded_s"],
        "cold_start_vs_plain_cold_start": result["cold_start_s"] / result["plain_stream"]["cold_start_s"]}
    if "recovery_sigkill_rank1_s" in result:
        result["summary"]["recovery_sigkill_vs_cold_start"] = result["recovery_sigkill_rank1_s"] / result["cold_start_s"]
    if "stock_direct" in rounds:
        result["summary"]["decode_ratio_stock_vs_plain_stream"] = median("stock_direct") / median(
            "plain_stream_beside_stock")
    save()
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
