"""The restart a client does not pay for, on one GPU: world 1, an 8B-shaped bf16 model of random weights,
a long prompt (12k tokens by default), the rank started by a real agent.

- Time to first token of the prompt cold, again from the token tape (cached), and after a SIGKILL of the
  rank on the next generation: from the restored prefix snapshots, against a generation with snapshots off
  (its cache gone, the prompt prefilled again), in alternating rounds.
- The restart itself: the next generation's start -> ready on the agent's standby rank (imports and device
  init done), against the round's first generation spawned cold (the standby held from the last round killed
  first; the agent keeps a standby only once a rank of its node serves).

    python bench/gpu_restart.py --out DIR [--prompt-tokens 12288] [--rounds 4]
    python bench/gpu_restart.py --out DIR --hidden 64 --layers 2 --intermediate 128 --heads 4 --kv-heads 2 \
        --vocab 512 --prompt-tokens 600 --rounds 2      (a CPU try-out)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import time
from pathlib import Path

from benchkit import add_gpu_run_args, say

from kit.agents import make_agents, pid_of, stop_generation
from kit.snapshots import Gen
from kit.waiting import wait_for
from mlx_lm.utils import load_tokenizer
from runtime.models.demo_model import DemoModelSpec, build_demo_model

SENTENCE = "The quick brown fox jumps over the lazy dog. "


def build(args, path: Path) -> Path:
    return build_demo_model(path, DemoModelSpec(
        hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, model_vocab=args.vocab,
        max_position_embeddings=max(8192, 2 * args.prompt_tokens), dtype="bfloat16", seed=1))


def ready_standby(agent) -> int | None:
    """The pid of the standby the agent holds, once it reported ready."""
    ranks = agent.get("/v1/ranks").json()
    return ranks["standby"] if ranks["standby_ready"] else None


def first_token(g: Gen, messages: list[dict]) -> tuple[float, int]:
    """Seconds to the first token of a greedy answer, and the prompt tokens served from a cache."""
    _, _, _, cached, _ = g.stream({"messages": messages, "max_tokens": 2, "temperature": 0})
    return g.times[1] - g.times[0], cached or 0


def start(agents, model, generation: int, snapshots: str) -> tuple[Gen, float]:
    t0 = time.perf_counter()
    g = Gen(agents, model, generation, snapshots=snapshots)
    return g, time.perf_counter() - t0


def written(g: Gen, kv_bytes: int):
    """The prompt's snapshot whole on disk: at least its keys and values, and no segment written for a second."""
    before = g.status(0)["snapshots_written"]
    time.sleep(1.0)
    now = g.status(0)
    return now["snapshot_bytes"] >= kv_bytes and now["snapshots_written"] == before


def one_round(agents, model, prompt: list[dict], generation: int, snapshots: str, kv_bytes: int) -> dict:
    agent = agents[0]
    if generation > 1:  # the round's first generation spawns cold: the agent finds its standby dead
        os.kill(wait_for(lambda: ready_standby(agent), 600, "the last round's standby", 0.2), signal.SIGKILL)
    shutil.rmtree(agent.dir / "state" / "snapshots", ignore_errors=True)  # nothing of the last round restored
    g, cold_start = start(agents, model, generation, snapshots)
    wait_for(lambda: ready_standby(agent), 600, "a ready standby rank", 0.2)  # before timing: it starts now
    first_token(g, [{"role": "user", "content": "warm up"}])
    cold, _ = first_token(g, prompt)
    cached, cached_tokens = first_token(g, prompt)
    if snapshots == "on":
        wait_for(lambda: written(g, kv_bytes), 300, "the prompt's snapshot on disk", 0.2)
    os.kill(pid_of(agent, generation), signal.SIGKILL)
    wait_for(lambda: next(r for r in agent.ranks() if r["generation"] == generation)["state"] == "exited", 60,
             "the rank's death seen", 0.05)
    stop_generation(agents, generation)
    g2, restart = start(agents, model, generation + 1, snapshots)
    warm = [e["warm"] for e in agent.events() if e["kind"] == "RankStarted" and e["generation"] == generation + 1]
    after, after_tokens = first_token(g2, prompt)
    restored = g2.status(0)["snapshots_restored"]
    g2.stop()
    return {"snapshots": snapshots, "cold_start_s": cold_start, "restart_s": restart, "restart_on_standby": warm,
            "ttft_cold_s": cold, "ttft_cached_s": cached, "ttft_after_restart_s": after,
            "cached_tokens": cached_tokens, "after_restart_cached_tokens": after_tokens, "tapes_restored": restored}


def summary(rounds: list[dict]) -> dict:
    def spread(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    out = {}
    for mode in ("on", "off"):
        rs = [r for r in rounds if r["snapshots"] == mode]
        if rs:
            out[f"snapshots_{mode}"] = {k: spread([r[k] for r in rs]) for k in (
                "ttft_cold_s", "ttft_cached_s", "ttft_after_restart_s", "cold_start_s", "restart_s")}
            out[f"snapshots_{mode}"]["after_restart_over_cached"] = spread(
                [r["ttft_after_restart_s"] / r["ttft_cached_s"] for r in rs])
            out[f"snapshots_{mode}"]["after_restart_over_cold"] = spread(
                [r["ttft_after_restart_s"] / r["ttft_cold_s"] for r in rs])
    out["restart_over_cold_start"] = spread([r["restart_s"] / r["cold_start_s"] for r in rounds])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpu_run_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=12288)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build(args, work / "model")
    say(f"model built in {time.perf_counter() - t0:.1f}s")
    tok = load_tokenizer(model)
    per = len(tok.encode(SENTENCE * 8)) / 8
    agents = make_agents(work, 1, extra={"standby": True})
    for a in agents:
        a.start()
    result = {"shape": {k: v for k, v in vars(args).items() if k != "out"}, "rounds": []}
    try:
        for n in range(args.rounds):
            mode = ("on", "off")[(n + n // 2) % 2]  # on off off on on off ...: each mode first as often
            prompt = [{"role": "user", "content": f"Round {n}. " + SENTENCE * int(args.prompt_tokens / per)}]
            tokens = len(tok.apply_chat_template(prompt, add_generation_prompt=True))
            kv_bytes = tokens * args.layers * args.kv_heads * (args.hidden // args.heads) * 2 * 2  # k and v, bf16
            r = one_round(agents, model, prompt, 2 * n + 1, mode, kv_bytes)
            r["prompt_tokens"] = tokens
            result["rounds"].append(r)
            say(json.dumps(r))
            result["summary"] = summary(result["rounds"])
            (args.out / "gpu_restart.json").write_text(json.dumps(result, indent=2))
    finally:
        for a in agents:
            a.kill()
    say(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
