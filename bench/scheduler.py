"""The engines of this tree against those of another commit checked out beside it (the engines before the prefix
store, the request record and the scheduler: 590ba63, or any later one), in one process each on this machine's CPU,
for each drafter a request alone and B = 2, 4 requests at once: DSpark's stages (omlx's DeepSeek-V4 with the DSpark
stand-in's stages, tests/pinned/dsv4.py), the model's MTP head and a draft model (the demo model with its head
distilled, bench/mtp.py's; the draft model is the target itself, so every draft lands), each on the engine its tree
builds for it (today the drafting engine, every request row by row; before 2026-12-07 a request alone took DSpark's
single-request engine, and before 2026-12-08 the MTP head and a draft model decoded one request at a time, the
others waiting); and plain batching at B = 1, 2, 4 on V4 (the engine with nobody drafting; up to 0b5531f the batch
engine, mlx-lm's BatchGenerator, a lone request in SoloDecode). Each round runs both trees, one after the other in
a process of its own (the order alternating), each case once to warm and once timed; tokens/s over the answers
(prompts included), median (min-max), and whether both trees said the same tokens.

Run in .venv-omlx:

    git worktree add --detach /tmp/meshd-base 590ba63    # or another commit
    .venv-omlx/bin/python bench/scheduler.py [--base /tmp/meshd-base] [--rounds 3] [--tokens 48] [--write]

--write appends the table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import ROOT, report, say, spread

CASES = [(kind, b) for kind in ("dspark", "mtp", "draft model", "plain") for b in (1, 2, 4)]
# where the engine's parts live: this tree's rooms, and the flat runtime/ of the base commit
LAYOUTS = {
    "rooms": {"rowwise": "runtime.engine.rowwise", "jobs": "runtime.engine.jobs", "overlay": "runtime.models.overlay",
              "store": "runtime.prefix.store"},
    "flat": {"batch": "runtime.engine", "rowwise": "runtime.rowwise", "jobs": "runtime.jobs",
             "overlay": "runtime.overlay"},
}


def worker(root: Path, checkpoint: Path, tokens: int) -> dict:
    """Every case on the engines of the tree at `root`: the seconds of its timed run and its answers.
    `checkpoint` holds V4's (v4/) and the demo model with an MTP head (mtp/)."""
    sys.path[:0] = [str(root), str(root / "tests")]
    layout = dict(LAYOUTS["rooms" if (root / "runtime" / "engine").is_dir() else "flat"])
    if (root / "runtime" / "engine" / "batch.py").exists():  # plain batching up to 0b5531f
        layout["batch"] = "runtime.engine.batch"
    part = {name: importlib.import_module(module) for name, module in layout.items()}
    dsv4, rank = importlib.import_module("pinned.dsv4"), importlib.import_module("runtime.rank")
    mx = importlib.import_module("mlx.core")
    dsv4.set_up_omlx()
    model = rank.load_sharded(checkpoint / "v4", mx.distributed.init(), lambda done, total: None,
                              part["overlay"].OMLX)
    importlib.import_module("runtime.models.overlays.demo_mtp")
    mtp = importlib.import_module("mlx_lm.utils").load_model(checkpoint / "mtp")[0]
    rowwise = part["rowwise"]
    quiet = {"prefill_step_size": 128, "log": lambda m: None}

    def prefixes(target):  # the prefix store, or before it the batch engine that held the tape
        return part["store"].PrefixStore(target, prefill_step_size=128) if "store" in part else \
            part["batch"].BatchEngine(target, set(), prefill_step_size=128)

    def plain():  # the engine with nobody drafting, or before it the batch engine
        if "batch" in part:
            return part["batch"].BatchEngine(model, set(), prefill_step_size=128)
        nobody = importlib.import_module("runtime.engine.proposers").Undrafted(model)
        return rowwise.RowwiseEngine(model, set(), nobody, prefixes=prefixes(model), **quiet)

    def drafted(target, proposer: str, width: int, old):
        """The drafting engine with `proposer` (runtime/engine/proposers.py), or `old()` before it."""
        if not hasattr(rowwise, "RowwiseEngine"):
            return old()
        proposers = importlib.import_module("runtime.engine.proposers")
        made = {"dspark": lambda: proposers.Stages(target), "mtp": lambda: proposers.Head(target),
                "draft model": lambda: proposers.DraftModel(target, target, 128)}[proposer]()
        return rowwise.RowwiseEngine(target, set(), made, prefixes=prefixes(target), num_draft_tokens=width, **quiet)

    def dspark_before():  # a request alone on DSpark's own engine, more row by row; then every one row by row
        if hasattr(rowwise, "drafted_everywhere"):
            return rowwise.drafted_everywhere(model, set(), prefixes(model), **quiet)
        return rowwise.RowwiseDSpark(model, set(), prefixes=prefixes(model), **quiet)

    def one_at_a_time(name: str, width: int, *draft):  # the single-request drafters, before the drafting engine
        drafting = importlib.import_module("runtime.engine.drafting" if "store" in part else "runtime.drafting")
        return lambda: getattr(drafting, name)(mtp, *draft, set(), num_draft_tokens=width, **quiet)

    engines = {"plain": plain,
               "dspark": lambda: drafted(model, "dspark", 0, dspark_before),
               "mtp": lambda: drafted(mtp, "mtp", 2, one_at_a_time("MTPEngine", 2)),
               "draft model": lambda: drafted(mtp, "draft model", 3, one_at_a_time("SpeculativeEngine", 3, mtp))}
    greedy = importlib.import_module("common.openai_api").SamplingParams(max_tokens=1).sampling()
    out = {}
    for kind, b in CASES:
        for timed in (False, True):
            engine, said = engines[kind](), {}
            began = time.perf_counter()
            for i in range(b):
                engine.insert(part["jobs"].Job(f"r{i}", tuple(range(20 + 40 * i, 60 + 40 * i)), tokens, i, greedy))
            while engine.busy:
                for e in engine.step():
                    said.setdefault(e.rid, []).append(e.token)
            mx.synchronize()
            seconds = time.perf_counter() - began
            engine.close()
        out[f"{kind} {b}"] = {"seconds": seconds, "said": said}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=Path("/tmp/meshd-base"),
                    help="a checkout of the commit to compare with (590ba63: the engines before the scheduler)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.checkpoint, args.tokens)))
        return
    if not (args.base / "runtime").is_dir():
        sys.exit(f"{args.base} is not a checkout of meshd: git worktree add --detach {args.base} 590ba63")
    base = subprocess.run(["git", "-C", str(args.base), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    sys.path[:0] = [str(ROOT / "tests")]
    checkpoint = Path(tempfile.mkdtemp(prefix="meshd-scheduler-bench-"))
    importlib.import_module("pinned.dsv4").build_v4_checkpoint(checkpoint / "v4")
    # imported here, not at the top: a worker imports the tree it measures
    importlib.import_module("runtime.models.demo_model").build_demo_model(
        checkpoint / "mtp", importlib.import_module("mtp").mtp_spec(64, 2, 200))
    trees = {"today": ROOT, "before": args.base}
    rates = {(tree, case): [] for tree in trees for case in CASES}
    answers: dict = {}
    for r in range(args.rounds):
        for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            run = subprocess.run([sys.executable, __file__, "--worker", str(trees[tree]), "--checkpoint",
                                  str(checkpoint), "--tokens", str(args.tokens)],
                                 capture_output=True, text=True, check=True)
            got = json.loads(run.stdout.strip().splitlines()[-1])
            for kind, b in CASES:
                one = got[f"{kind} {b}"]
                rates[tree, (kind, b)].append(b * args.tokens / one["seconds"])
                answers.setdefault((tree, kind, b), one["said"])
            say(f"round {r + 1} {tree}: " + ", ".join(f"{k} {rates[tree, c][-1]:.0f} tok/s"
                                                       for c in CASES for k in [f"{c[0]} B={c[1]}"]))
    same = all(answers["today", kind, b] == answers["before", kind, b] for kind, b in CASES)
    rows = [f"| {kind} | {b} | {spread(rates['before', (kind, b)], '{:.1f}')} | "
            f"{spread(rates['today', (kind, b)], '{:.1f}')} | "
            f"{statistics.median(rates['today', (kind, b)]) / statistics.median(rates['before', (kind, b)]):.2f}x |"
            for kind, b in CASES]
    report(["", f"## The engines of this tree against commit {base}'s (`bench/scheduler.py`, "
            f"{time.strftime('%Y-%m-%d')})", "",
            f"This machine's CPU (2 cores, shared). B requests of 40 prompt tokens sent at once, {args.tokens} "
            "greedy tokens each. dspark: omlx's own DeepSeek-V4 (tests/pinned/dsv4.py's tiny checkpoint with the "
            "DSpark stand-in's stages) on each tree's DSpark engine; mtp (2 drafts a step) and draft model (3, the "
            "target drafting for itself): the demo model with an MTP head (hidden 64, 2 layers, head distilled 200 "
            "steps) on each tree's engine for that drafter (today every request row by row; before the drafting "
            "engine, one request at a time); plain: V4 undrafted (today the same engine with nobody drafting; "
            f"up to 0b5531f the batch engine, SoloDecode for B = 1). Before: commit {base}. {args.rounds} "
            "alternating rounds, each tree in a "
            "process of its own, each case warmed once; tokens/s, median (min-max).", "",
            "| engine | B | before tok/s | today tok/s | today / before |", "|---|---|---|---|---|", *rows, "",
            "Both trees said the same tokens in every case." if same else "The answers were NOT the same.", "",
            f"Command: `git worktree add --detach {args.base} {base}; {Path(sys.executable).parent.parent.name}"
            f"/bin/python bench/scheduler.py --base {args.base} --rounds "
            f"{args.rounds} --tokens {args.tokens}`"], args.write)


if __name__ == "__main__":
    main()
