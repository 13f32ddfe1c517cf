"""What a restart costs a client when the mesh keeps conversations in prefix snapshots: serve first, restore
behind, and snapshots that land while the answer streams (issue 37).

- Tapes kept: a generation serves 0, 1 or 8 long conversations (their snapshots on disk), its rank is
  SIGKILLed, the next generation starts (on the agent's standby rank): its start -> ready, and the kill -> the
  first token of a new conversation, with 0 / 1 / 8 tapes kept in alternating order. Restoring is behind
  serving now, so 8 tapes should cost what none do.
- A death soon after an answer: a long conversation's answer ends, its rank is SIGKILLed 0, 0.5, 1, 2 or 5 s
  later (in alternating order), and the next generation answers the conversation's next turn: its time to
  first token and the prompt tokens it had from a cache, against a twin conversation of the same length
  on the live generation: its first turn (cold) and its next turn (cached).

World 1 by default (one GPU), the rank started by a real agent with its standby; snapshots as their defaults
give them (a segment every 256 tokens). On the device machine (mlx[cuda13]):

    python bench/restart_tapes.py --out DIR [--part tapes|delays] [--delays 0,0.5,1,2,5] [--prompt-tokens 12288] \\
        [--rounds 2]

and on CPUs, a small shape:

    .venv/bin/python bench/restart_tapes.py --out DIR --hidden 64 --layers 2 --intermediate 128 --heads 4 \\
        --kv-heads 2 --vocab 512 --prompt-tokens 3000 --answer 256 --rounds 3 [--nodes 2] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import time

from benchkit import add_gpu_run_args, report, say, spread
from gpu_restart import SENTENCE, build, first_token, ready_standby

from kit.agents import make_agents, pid_of, stop_generation
from kit.snapshots import Gen
from kit.waiting import wait_for
from mlx_lm.utils import load_tokenizer

DELAYS = (0.0, 0.5, 1.0, 2.0, 5.0)
# seconds a generation may take to be ready: the kit's 120 s ran out twice for an 8B model on an H100
READY_WITHIN = 600


def conversation(tok, tag: str, tokens: int) -> list[dict]:
    per = len(tok.encode(SENTENCE * 8)) / 8
    return [{"role": "user", "content": f"{tag}. " + SENTENCE * int(tokens / per)}]


def landed(g: Gen, nodes: int) -> bool:
    """Every rank's snapshots on disk: nothing staged or queued, and nothing written for half a second."""
    before = [g.status(r)["snapshots_written"] for r in range(nodes)]
    time.sleep(0.5)
    now = [g.status(r) for r in range(nodes)]
    return all(s["snapshots_pending"] == 0 and s["snapshots_written"] == b for s, b in zip(now, before))


def kill(agents, g: Gen) -> float:
    """SIGKILL every rank of `g` (a whole mesh lost at once) once every agent holds a ready standby for the next
    one, its death seen; returns when it was sent."""
    wait_for(lambda: all(ready_standby(a) for a in agents), 600, "a ready standby on every node", 0.2)
    t = time.perf_counter()
    for a in agents:
        with contextlib.suppress(ProcessLookupError):  # a peer may have left on its own already
            os.kill(pid_of(a, g.generation), signal.SIGKILL)
    for a in agents:
        wait_for(lambda: next(r for r in a.ranks() if r["generation"] == g.generation)["state"] == "exited", 60,
                 "the rank's death seen", 0.05)
    stop_generation(agents, g.generation)
    return t


def tapes_round(agents, model, tok, args, generation: int, kept: int, n: int) -> dict:
    for a in agents:
        shutil.rmtree(a.dir / "state" / "snapshots", ignore_errors=True)  # only this round's tapes
    g = Gen(agents, model, generation, snapshot_every=256, ready_within=READY_WITHIN)
    for i in range(kept):
        first_token(g, conversation(tok, f"Round {n}, conversation {i}", args.prompt_tokens))
    wait_for(lambda: landed(g, len(agents)), 600, "the snapshots on disk", 0.2)
    killed = kill(agents, g)
    g2 = Gen(agents, model, generation + 1, snapshot_every=256, ready_within=READY_WITHIN)
    ready = time.perf_counter() - killed
    ttft, _ = first_token(g2, [{"role": "user", "content": f"Round {n}: a new conversation, {kept} kept."}])
    answered = time.perf_counter() - killed
    restored = wait_for(lambda: (s := g2.status(0))["snapshot_restores_pending"] == 0 and s, 600,
                        "the restores behind serving", 0.2)
    g2.stop()
    return {"kept": kept, "kill_to_ready_s": ready, "kill_to_first_token_s": answered, "new_ttft_s": ttft,
            "restored": restored["snapshots_restored"], "restores_done_s": time.perf_counter() - killed}


def delay_round(agents, model, tok, args, generation: int, delay: float, n: int) -> dict:
    g = Gen(agents, model, generation, snapshot_every=256, ready_within=READY_WITHIN)
    convo = conversation(tok, f"Round {n}, delay {delay}", args.prompt_tokens)
    twin = conversation(tok, f"Twin {n}, delay {delay}", args.prompt_tokens)
    body = {"max_tokens": args.answer, "temperature": 0, "logit_bias": {str(t): -100 for t in tok.eos_token_ids}}
    cold, _ = first_token(g, twin)
    twin_answer = g.stream({"messages": twin, **body})[1]
    twin_turn = twin + [{"role": "assistant", "content": tok.decode(twin_answer)}, {"role": "user", "content": "And?"}]
    cached, cached_tokens = first_token(g, twin_turn)  # a next turn from the live tape
    answer = g.stream({"messages": convo, **body})[1]  # the conversation's long turn: it ends now
    time.sleep(delay)
    kill(agents, g)
    turn = convo + [{"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "And?"}]
    g2 = Gen(agents, model, generation + 1, snapshot_every=256, ready_within=READY_WITHIN)
    after, after_tokens = first_token(g2, turn)
    g2.stop()
    prompt = len(tok.apply_chat_template(turn, add_generation_prompt=True))
    return {"delay_s": delay, "ttft_cold_s": cold, "ttft_cached_s": cached, "ttft_after_s": after,
            "cached_tokens": cached_tokens, "after_cached_tokens": after_tokens, "turn_tokens": prompt}


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def by(rs: list[dict], key: str) -> list[tuple]:
    """The rounds grouped by `key`'s value, in its order."""
    return [(k, [r for r in rs if r[key] == k]) for k in sorted({r[key] for r in rs})]


def tables(result: dict) -> list[str]:
    lines, tapes, delays = [], result["tapes"], result["delays"]
    if tapes:
        lines += table(["tapes kept", "kill -> ready s", "kill -> first token of a new conversation s",
                        "restored (behind)", "kill -> restores done s"],
                       [[str(k), spread([r["kill_to_ready_s"] for r in got]),
                         spread([r["kill_to_first_token_s"] for r in got]),
                         spread([r["restored"] for r in got], "{:.0f}"), spread([r["restores_done_s"] for r in got])]
                        for k, got in by(tapes, "kept")])
    if delays:
        lines += table(["SIGKILL after the answer ended", "next turn's TTFT s", "/ cached", "/ cold",
                        "prompt tokens from a cache"],
                       [[f"{d:g} s", spread([r["ttft_after_s"] for r in got], "{:.3f}"),
                         spread([r["ttft_after_s"] / r["ttft_cached_s"] for r in got]),
                         spread([r["ttft_after_s"] / r["ttft_cold_s"] for r in got]),
                         f"{spread([r['after_cached_tokens'] for r in got], '{:.0f}')} of "
                         f"{spread([r['turn_tokens'] for r in got], '{:.0f}')}"] for d, got in by(delays, "delay_s")]
                       + [["(cached, same generation)", spread([r["ttft_cached_s"] for r in delays], "{:.3f}"), "1", "",
                           spread([r["cached_tokens"] for r in delays], "{:.0f}")],
                          ["(cold, first turn)", spread([r["ttft_cold_s"] for r in delays], "{:.3f}"), "", "1", "0"]])
    return lines


def keep(args, result: dict) -> None:
    """The rounds so far on disk, so that a run cut short keeps what it measured."""
    (args.out / f"restart_tapes-{args.part}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpu_run_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=12288)
    ap.add_argument("--answer", type=int, default=256, help="tokens of the answer a death follows")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1, help="ranks (agents), on the ring beyond one")
    ap.add_argument("--part", choices=["tapes", "delays", "both"], default="both")
    ap.add_argument("--delays", type=lambda v: tuple(float(d) for d in v.split(",")), default=DELAYS,
                    help=f"seconds between an answer's end and the SIGKILL, comma-separated (default {DELAYS})")
    ap.add_argument("--write", action="store_true", help="append the tables to docs/BENCHMARKS.md")
    args = ap.parse_args()
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():  # a second part's run on the same machine takes the first's
        build(args, model)
    tok = load_tokenizer(model)
    agents = make_agents(work, args.nodes, extra={"standby": True})
    for a in agents:
        a.start()
    result = {"shape": {k: str(v) for k, v in vars(args).items()}, "date": time.strftime("%Y-%m-%d"),
              "tapes": [], "delays": []}
    generation = 1
    try:
        for n in range(args.rounds):
            if args.part in ("tapes", "both"):
                for kept in ((0, 1, 8) if n % 2 == 0 else (8, 1, 0)):
                    result["tapes"].append(tapes_round(agents, model, tok, args, generation, kept, n))
                    generation += 2
                    say(json.dumps(result["tapes"][-1]))
                    keep(args, result)
            if args.part in ("delays", "both"):
                for delay in (args.delays if n % 2 == 0 else args.delays[::-1]):
                    result["delays"].append(delay_round(agents, model, tok, args, generation, delay, n))
                    generation += 2
                    say(json.dumps(result["delays"][-1]))
                    keep(args, result)
    finally:
        for a in agents:
            a.kill()
    head = [f"### Restarts with conversations kept (`bench/restart_tapes.py`, {result['date']})", "",
            f"{args.nodes} rank(s), each started by its agent with a standby; a Llama shape of random bf16 weights "
            f"(hidden {args.hidden}, {args.layers} layers, {args.kv_heads} KV heads); conversations of "
            f"{args.prompt_tokens} prompt tokens, answers of {args.answer}; {args.rounds} rounds in alternating "
            "order. Median (min-max) over the rounds."]
    report(head + tables(result), args.write)


if __name__ == "__main__":
    main()
