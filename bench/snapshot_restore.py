"""Time to first token after a SIGKILL, from the prefix snapshots, against the cold prefill of the same run;
and the decode pace with snapshots on against off.

Two ranks on the ring over loopback, each started by its agent (snapshots in the agents' state_dir), the
demo model and a prompt long enough to prefill for many seconds. Each round: a new long conversation's first turn
(cold: the whole prompt prefilled), then its next turn streamed and cut by a SIGKILL of rank 1 once the
answer in flight is snapshotted; the next generation restores the snapshots and answers, in alternating
order, the cut stream resumed as the proxy resends it (the conversation and the answer so far) and the
conversation's next turn. Then generations with snapshots on (an answer written every 16 tokens) and off
alternate, decoding the same seeded answer.

    .venv/bin/python bench/snapshot_restore.py [--rounds 3] [--repeat 300] [--write]"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from mlx_lm import load
from mlx_lm.utils import load_tokenizer

from benchkit import ROOT, report, say, spread

from common.openai_api import SamplingParams
from kit.agents import make_agents
from kit.demo_answers import endless
from kit.snapshots import EVERY, Gen, answer_in_flight
from kit.waiting import wait_for
from runtime.models.demo_model import DemoModelSpec, build_demo_model
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.prefix.snapshot import Identity, Snapshots
from runtime.prefix.store import PrefixStore

SENTENCE = "The quick brown fox jumps over the lazy dog. "


def ttft(g: Gen) -> float:
    return g.times[1] - g.times[0]


def kill_round(agents, model, tok, folders, n: int, gen: int, repeat: int) -> dict:
    convo = [{"role": "user", "content": f"Round {n}: " + SENTENCE * repeat}]
    g = Gen(agents, model, gen)
    try:
        first = g.stream({"messages": convo, "max_tokens": 8, "temperature": 0})[1]
        cold, prompt = ttft(g), len(tok.apply_chat_template(convo, add_generation_prompt=True))
        turn = convo + [{"role": "assistant", "content": tok.decode(first)}]
        cut = {"messages": turn + [{"role": "user", "content": "Go on."}], "max_tokens": 8 * EVERY,
               "temperature": 1.0, "seed": n, **endless(model)}
        head, ids, chars, _, r = g.stream(cut, stop_after=2 * EVERY)
        cut_ids = tok.apply_chat_template(cut["messages"], add_generation_prompt=True)
        wait_for(lambda: all(answer_in_flight(next(f.glob("*-w2-r*")), cut_ids) for f in folders), 120,
                 "the answer in flight to be snapshotted on both ranks")
        g.sigkill(1)
        r.close()
    finally:
        g.stop()
    g = Gen(agents, model, gen + 1)
    try:
        out = {"cold_s": cold, "prompt_tokens": prompt}
        resume = {"ids": ids, "chars": chars, "id": head["id"], "created": head["created"], "seed": head["seed"]}
        for kind in (("next", "resumed") if n % 2 else ("resumed", "next")):
            if kind == "next":
                got = g.stream({"messages": turn + [{"role": "user", "content": "And?"}], "max_tokens": 8,
                                "temperature": 0})
            else:
                got = g.stream(cut, resume=resume)
            out[f"{kind}_s"], out[f"{kind}_cached"] = ttft(g), got[3]
        out["restored"] = [g.status(r)["snapshots_restored"] for r in range(2)]
    finally:
        g.stop()
    say(f"round {n}: cold {out['cold_s']:.2f} s, next turn {out['next_s']:.2f} s, resumed {out['resumed_s']:.2f} s")
    return out


def decode_round(agents, model, gen: int, snapshots: str) -> dict:
    g = Gen(agents, model, gen, snapshots=snapshots)
    try:
        g.stream({"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 256,
                  "temperature": 1.0, "seed": 1, **endless(model)})
        # from the first token on: the answer's tokens past it over the time they took
        return {"tok_s": sum(g.counts[2:]) / (g.times[-1] - g.times[1]), "tokens": sum(g.counts)}
    finally:
        g.stop()


class TimedSnapshots(Snapshots):
    """Snapshots that keep the time the loop spends staging and handing slices to the writer."""

    spent = 0.0

    def stage(self, *args, **kw):
        t = time.perf_counter()
        try:
            return super().stage(*args, **kw)
        finally:
            self.spent += time.perf_counter() - t

    def pump(self) -> None:
        t = time.perf_counter()
        super().pump()
        self.spent += time.perf_counter() - t


def loop_share(model: Path, work: Path, tokens: int = 512) -> dict:
    """One rank's engine in this process decoding a request alone with snapshots every EVERY tokens: the
    share of the loop's time spent in the snapshots' part of it (the writer thread runs beside it)."""
    loaded, tok = load(str(model))
    snaps = TimedSnapshots(work / "loop", Identity("bench", 1, 0, "bench"), 1 << 30, EVERY, log=lambda m: None)
    engine = undrafted(loaded, set(tok.eos_token_ids), prefixes=PrefixStore(loaded, snapshots=snaps))
    bias = endless(model)["logit_bias"]
    engine.insert(Job("bench", tuple(tok.encode(SENTENCE * 4)), tokens, 1,
                      SamplingParams(max_tokens=tokens, temperature=1.0,
                                     logit_bias=tuple((int(k), v) for k, v in bias.items())).sampling()))
    t = time.perf_counter()
    while engine.busy:
        engine.step()
    total = time.perf_counter() - t
    engine.close()
    return {"tokens": tokens, "loop_s": total, "snapshots_s": snaps.spent, "written": snaps.written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=300, help="sentences in the long prompt (~11 tokens each)")
    ap.add_argument("--decode-rounds", type=int, default=4)
    ap.add_argument("--write", action="store_true", help="append to docs/BENCHMARKS.md, write the json in docs/")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshd-snapshot-restore-"))
    spec = DemoModelSpec(max_position_embeddings=8192)
    model = build_demo_model(work / "model", spec)
    tok = load_tokenizer(model)
    agents = make_agents(work, 2)
    for agent in agents:
        agent.start()
    folders = [a.dir / "state" / "snapshots" for a in agents]
    share = [loop_share(model, work / f"share{n}") for n in range(args.rounds)]
    say("the loop's share in the snapshots: " + ", ".join(f"{s['snapshots_s'] / s['loop_s']:.2%}" for s in share))
    try:
        rounds = [kill_round(agents, model, tok, folders, n, 1 + 2 * n, args.repeat) for n in range(args.rounds)]
        gen = 1 + 2 * args.rounds
        paces = {"on": [], "off": []}
        for n in range(args.decode_rounds):
            for snapshots in (("on", "off") if n % 2 else ("off", "on")):
                paces[snapshots].append(decode_round(agents, model, gen, snapshots))
                gen += 1
                say(f"decode, snapshots {snapshots}: {paces[snapshots][-1]['tok_s']:.1f} tok/s")
    finally:
        for agent in agents:
            agent.kill()
    ratio = {k: [r[f"{k}_s"] / r["cold_s"] for r in rounds] for k in ("next", "resumed")}
    result = {"date": time.strftime("%Y-%m-%d"), "model": spec.__dict__, "rounds": rounds, "decode": paces,
              "loop_share": share, "snapshot_every": EVERY}
    lines = ["", f"### Time to first token after a SIGKILL, from prefix snapshots (`bench/snapshot_restore.py`, "
             f"{result['date']})", "",
             f"Two ranks on the ring over loopback, each started by its agent, 2 CPUs (shared with other work: "
             f"the load average was {os.getloadavg()[0]:.0f}); the demo model; a {rounds[0]['prompt_tokens']}-token "
             f"prompt, {args.rounds} rounds (a new conversation "
             "each, the two measures after the restart in alternating order). Cold: the first turn's time to first "
             "token (its whole prompt prefilled). After rank 1 was SIGKILLed mid-stream and the next generation "
             "restored the snapshots: the next turn's, and the cut stream's resumed as the proxy resends it. "
             "Median (min-max).", "",
             "| request | TTFT s | / cold | prompt tokens from the snapshots |", "|---|---|---|---|",
             f"| cold first turn | {spread([r['cold_s'] for r in rounds])} | 1 | 0 |",
             f"| next turn after the restart | {spread([r['next_s'] for r in rounds])} | "
             f"{spread(ratio['next'], '{:.3f}')} | {spread([r['next_cached'] for r in rounds], '{:.0f}')} |",
             f"| cut stream resumed | {spread([r['resumed_s'] for r in rounds])} | "
             f"{spread(ratio['resumed'], '{:.3f}')} | {spread([r['resumed_cached'] for r in rounds], '{:.0f}')} |",
             "", f"Decoding a 256-token seeded answer, snapshots on (written every {EVERY} tokens) against off, "
             f"{args.decode_rounds} rounds of alternating generations:", "",
             "| snapshots | tok/s |", "|---|---|",
             *(f"| {k} | {spread([p['tok_s'] for p in v], '{:.1f}')} |" for k, v in paces.items()),
             "", f"The loop's own part (one rank's engine in one process, {share[0]['tokens']} tokens decoded alone, "
             f"{args.rounds} runs): staging the slices and handing them to the writer took "
             f"{spread([100 * s['snapshots_s'] / s['loop_s'] for s in share], '{:.2f}')} % of the loop's time "
             f"({spread([s['written'] for s in share], '{:.0f}')} segments written)."]
    report(lines, args.write)
    if args.write:
        (ROOT / "docs" / "snapshot_restore.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
