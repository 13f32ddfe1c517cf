"""How far the snapshot writer is behind a prefill: a segment's arrays written side by side (the default
WRITERS threads, and any other counts `--writers` names) against one by one, and against the writer of
another checkout of meshd (`--base`), in alternating rounds.

A tape of `--tokens` tokens in the KV shape of an 8B model (32 layers, 8 KV heads of 128, bf16: 128 KiB a
token) is prefilled `--chunk` tokens at a time at `--prefill-tps`: real mlx-lm KVCaches whose keys and values
were made beforehand grow by a chunk a step (no model runs: the writer alone is measured), a segment staged
and pumped after each, as the engine does. When the last chunk is
staged (the answer's end: what a SIGKILL then would lose) the bench counts the segments not yet landed,
then times how long the writer takes to land them. Each round writes to a fresh folder.

    git worktree add --detach /tmp/meshd-base a561907    # or another commit
    .venv/bin/python bench/snapshot_writer.py [--rounds 3] [--tokens 12288] [--prefill-tps 6800] [--writers 8 4 1]
        [--base /tmp/meshd-base] [--write]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from benchkit import base_module, report, say, spread

from runtime.prefix.snapshot import WRITERS, Identity, Snapshots


def prefill(folder: Path, args, way: tuple, kv: list[mx.array]) -> dict:
    """One tape prefilled and snapshotted as it goes by `way` (a writer's class and its threads): the
    segments behind at its end, the seconds to land them, the writer's rate over the whole tape."""
    me = Identity("bench", 1, 0, "bench")
    writer, writers = way
    snaps = writer(folder, me, 1 << 40, every=args.chunk, log=lambda m: None, writers=writers)
    cache = [KVCache() for _ in range(args.layers)]
    for c, a in zip(cache, kv):
        c.keys, c.values = a, a
    tokens = tuple(range(args.tokens))
    since, began = ("", 0), time.monotonic()
    for at in range(0, args.tokens, args.chunk):
        n = min(args.chunk, args.tokens - at)
        for c in cache:
            c.offset = at + n
        final = at + n == args.tokens
        since = snaps.stage(tokens[:at + n], cache, since, final=final)
        snaps.pump()
        time.sleep(max(0.0, began + (at + n) / args.prefill_tps - time.monotonic()))
    ended = time.monotonic()
    behind = snaps.stats()["snapshots_pending"]
    while snaps.stats()["snapshots_pending"]:  # landed: renamed into place, whatever is still flushing
        time.sleep(0.002)
    landed = time.monotonic()
    snaps.close(timeout=600)
    written = sum(p.stat().st_size for p in snaps.folder.glob("*.safetensors"))
    return {"behind": behind, "drain_s": landed - ended, "mb_s": written / 1e6 / (landed - began),
            "segments": snaps.written}


def backlog(first: str, fast: float, last: str, slow: float) -> str:
    """The two writers' medians of the seconds to land what was behind at the end, as a sentence."""
    if not slow:
        return f"Nothing was behind {last} at the end."
    if not fast:
        return (f"Nothing was behind {first} at the end of the median round; {last} took {slow:.2f} s to land its "
                "backlog.")
    return f"Landing the backlog: {fast / slow:.2f}x the time {last} takes."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--chunk", type=int, default=256, help="tokens a prefill chunk, a segment each")
    ap.add_argument("--prefill-tps", type=float, default=6800.0,
                    help="the prefill's pace (an 8B model's on one H100: 12,288 tokens in about 1.8 s)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dir", type=Path, default=None, help="where the segments go (a temporary folder)")
    ap.add_argument("--writers", type=int, nargs="+", default=[WRITERS, 1],
                    help="the writer threads of each way compared, the first against the last")
    ap.add_argument("--base", type=Path, default=None,
                    help="a checkout of meshd whose writer (its runtime/prefix/snapshot.py, its WRITERS) is compared")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    ways = {f"{n} side by side" if n > 1 else "one by one": (Snapshots, n) for n in args.writers}
    if args.base:
        ways.update(base_way(args.base))
    kv = [mx.random.normal((1, args.kv_heads, args.tokens, args.head_dim)).astype(mx.bfloat16)
          for _ in range(args.layers)]
    mx.eval(kv)
    got: dict[str, list[dict]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            with tempfile.TemporaryDirectory(prefix="meshd-writer-bench-", dir=args.dir) as folder:
                got[name].append(one := prefill(Path(folder), args, ways[name], kv))
            say(f"round {r + 1} {name}: {one['behind']} of {one['segments']} segments behind at the end, "
                f"landed {one['drain_s']:.2f} s later, {one['mb_s']:.0f} MB/s")
    rows = [f"| {name} | {spread([g['behind'] for g in got[name]], '{:.0f}')} | "
            f"{spread([g['drain_s'] for g in got[name]])} | {spread([g['mb_s'] for g in got[name]], '{:.0f}')} |"
            for name in ways]
    fast, slow = (statistics.median(g["drain_s"] for g in got[name]) for name in (list(ways)[0], list(ways)[-1]))
    mb = args.tokens * args.layers * 2 * args.kv_heads * args.head_dim * 2 / 1e6
    day = time.strftime('%Y-%m-%d')
    report(["", f"## The snapshot writer behind a prefill (`bench/snapshot_writer.py`, {day})", "",
            f"A {args.tokens}-token tape ({mb:.0f} MB: {args.layers} layers, {args.kv_heads} KV heads of "
            f"{args.head_dim}, bf16) prefilled {args.chunk} tokens a chunk at {args.prefill_tps:.0f} tok/s, a segment "
            f"staged after each; {args.rounds} alternating rounds, median (min-max). Behind: segments not landed "
            "when the last was staged (what a SIGKILL at the answer's end loses).", "",
            "| a segment's arrays | segments behind at the end | seconds to land them | MB/s over the tape |",
            "|---|---|---|---|", *rows, "",
            backlog(list(ways)[0], fast, list(ways)[-1], slow), "",
            f"Command: `{Path(sys.executable).parent.parent.name}/bin/python bench/snapshot_writer.py --rounds "
            f"{args.rounds} --tokens {args.tokens} --prefill-tps {args.prefill_tps:.0f} --writers "
            f"{' '.join(map(str, args.writers))}{f' --base {args.base}' if args.base else ''}`"], args.write)


def base_way(base: Path) -> dict[str, tuple]:
    """The writer of the checkout `base`, named by its commit, with its default threads."""
    module, commit = base_module(base, "runtime/prefix/snapshot.py")
    return {f"{commit}: {module.WRITERS} side by side": (module.Snapshots, module.WRITERS)}


if __name__ == "__main__":
    main()
