"""meshd-rank's decode pace over a long run of requests, on one or more meshes
side by side (each with its own environment for its ranks): does a rank slow
down as it serves?

On 2xH200 (2026-11-30) the median step of meshd-rank's decode grew from about
10 ms to 30-60 ms after some 20-30 requests in 3 of 4 runs, while the plain
loop beside it kept its pace. This runs the same traffic against meshes that
differ only in their ranks' environment (MLX's CUDA graph cache, say), so the
cause can be found and the fix shown.

Each round asks every mesh, in alternating order, one answer alone (the solo
path) and two at once (the batch), and reads rank 0's memory from its status
file and the CPU time each of its threads spent in the round (a thread that
spins, or more threads every round, is the first suspect: rank 0 was seen busy
on its CPU while it waited for the next step). At the end, with py-spy
installed, each rank's stacks go to OUT/work/MESH/stacks-rankN.txt, which name
the thread ids. The summary compares each mesh's median step in the first and
the last quarter of its rounds.

    python bench/rank_soak.py --out DIR [--backend nccl] [--rounds 20]
        [--mesh NAME[:VAR=VALUE,...] ...]   (default: one mesh, "default", as shipped)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import psutil
from benchkit import add_gpu_run_args, build_llama_shape, say
from gpu_tp import decode, paired
from kit.ranks import start_mesh


def mesh_spec(text: str) -> tuple[str, dict]:
    """NAME[:VAR=VALUE,...] -> (name, env)."""
    name, _, pairs = text.partition(":")
    env = {}
    for pair in filter(None, pairs.split(",")):
        var, eq, value = pair.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: {pair!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def drift(steps: list[float]) -> dict:
    """The median step of the first and the last quarter of the rounds, and last / first (None when the
    first is 0: tokens that reached the client in bursts have no step to compare)."""
    q = max(1, len(steps) // 4)
    first, last = statistics.median(steps[:q]), statistics.median(steps[-q:])
    return {"first_quarter_step_ms": first, "last_quarter_step_ms": last,
            "last_vs_first": last / first if first else None}


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of `pid`, by "name/tid" (the name the OS knows it by)."""
    out = {}
    for t in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            name = "?"
        out[f"{name}/{t.id}"] = t.user_time + t.system_time
    return out


def dump_stacks(mesh, out: Path) -> None:
    """Every rank's threads as py-spy sees them (Python names, native ids and native frames), when
    py-spy is installed: what maps the busiest thread ids of the rounds to code."""
    if shutil.which("py-spy") is None:
        return
    for rank, proc in enumerate(mesh.procs):
        dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(proc.pid)], capture_output=True,
                              text=True, timeout=120)
        (out / f"stacks-rank{rank}.txt").write_text(dump.stdout + dump.stderr)


def busiest(before: dict[str, float], after: dict[str, float], n: int = 4) -> dict[str, float]:
    """The `n` threads that spent the most CPU between two readings of thread_cpu, in seconds."""
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])[:n]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpu_run_args(ap)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--mesh", dest="meshes", type=mesh_spec, action="append",
                    help="a mesh and its ranks' environment, NAME[:VAR=VALUE,...]; repeat for more")
    args = ap.parse_args()
    meshes_env = dict(args.meshes or [("default", {})])
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_llama_shape(args, work / "model")
    say(f"built the model in {time.time() - t0:.0f} s")
    meshes = {name: start_mesh(model, 2, work / name, backend=args.backend, env=env)
              for name, env in meshes_env.items()}
    result: dict = {"shape": vars(args) | {"out": str(args.out)}, "meshes": meshes_env, "rounds": []}
    try:
        for name, mesh in meshes.items():
            mesh.wait_ready(900)
        say("ready: " + ", ".join(meshes))
        cpu = {name: thread_cpu(mesh.procs[0].pid) for name, mesh in meshes.items()}
        for n in range(1, args.rounds + 1):
            row = {}
            for name in list(meshes) if n % 2 else list(meshes)[::-1]:
                url = meshes[name].url + "/v1"
                solo = decode(url, model, args.tokens)
                pair = paired(url, url, model, args.tokens, {})
                status = meshes[name].status(0) or {}
                before, cpu[name] = cpu[name], thread_cpu(meshes[name].procs[0].pid)
                row[name] = {"solo_step_ms": solo["step_ms_median"], "solo_tok_s": solo["tok_s"],
                             "ttft_s": solo["ttft_s"], "paired_tok_s": pair.get("tok_s"),
                             "active_gb": status.get("mlx_active_bytes", 0) / 1e9,
                             "cache_gb": status.get("mlx_cache_bytes", 0) / 1e9,
                             "rank0_threads": len(cpu[name]), "rank0_busiest_threads_s": busiest(before, cpu[name])}
            result["rounds"].append(row)
            say(f"round {n}: " + "; ".join(f"{k} step {v['solo_step_ms']:.1f} ms, {v['solo_tok_s']:.1f} tok/s alone, "
                                           f"{v['paired_tok_s'] or 0:.1f} paired" for k, v in row.items()))
            (args.out / "rank_soak.json").write_text(json.dumps(result, indent=2))
        for name, mesh in meshes.items():
            dump_stacks(mesh, work / name)
    finally:
        for mesh in meshes.values():
            mesh.kill()
    result["summary"] = {name: drift([r[name]["solo_step_ms"] for r in result["rounds"]]) for name in meshes}
    (args.out / "rank_soak.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
