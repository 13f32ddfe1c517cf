"""DeepSeek-V4's DSpark drafter against plain decoding on the ring over loopback, in one run: two meshes, one
with `--drafter off`, one drafting, both up at once and asked in alternating rounds (bench/mtp.py's greedy
streamed answer). Decode tokens/s after the first token, its spread, the acceptance and the tokens per verify
from the drafted ranks' status files. The target:

- `--target standin` (TP4 by default): the tiny DSpark-layout checkpoint of tests/kit/dspark.py under the
  stand-in omlx (tests/standins/omlx, over mlx-lm's deepseek_v41), in .venv;
- `--target omlx` (TP2 by default): omlx's own DeepSeek-V4 (flyto-mlx's, compress ratios [0, 4, 128, 4, 0],
  the sparse path) with the DSpark stages of tests/standins/dspark_v4 (tests/pinned/dsv4.py), in .venv-omlx.

    .venv/bin/python bench/dspark.py [--rounds 5] [--tokens 48] [--write]
    .venv-omlx/bin/python bench/dspark.py --target omlx [--rounds 5] [--tokens 96] [--write]

--write appends the table to docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchkit import alternate, report
from mtp import decode

from kit.ranks import start_mesh

OVERLAY = ("--model-package", "omlx")


def target(name: str, path: Path) -> tuple[Path, dict, str]:
    """The checkpoint, the ranks' environment and a line that says what it is."""
    if name == "omlx":
        from pinned.dsv4 import build_v4_checkpoint, pinned_env

        return (build_v4_checkpoint(path), pinned_env(),
                "omlx's own DeepSeek-V4 (flyto-mlx 0.7.0 at mlx 0.32.3 / mlx-lm 0.31.3: 5 layers 64 wide, compress "
                "ratios [0, 4, 128, 4, 0], index_topk 4) with the DSpark stand-in's 3 stages (tests/pinned/dsv4.py)")
    from kit.dspark import build_dspark_model, standin_env

    return (build_dspark_model(path), standin_env(),
            "the tiny DSpark-layout checkpoint (4 deepseek_v41 layers 64 wide, 3 stages) under the stand-in omlx")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=["standin", "omlx"], default="standin")
    ap.add_argument("--world", type=int, default=0, help="ranks a mesh (default: 4 on the stand-in, 2 on omlx)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    world = args.world or (2 if args.target == "omlx" else 4)
    work = Path(tempfile.mkdtemp(prefix="meshd-dspark-bench-"))
    model, env, what = target(args.target, work / "model")
    with start_mesh(model, world, work / "plain", *OVERLAY, "--drafter", "off", env=env) as plain, \
            start_mesh(model, world, work / "drafted", *OVERLAY, env=env) as drafted:
        plain.wait_ready(300)
        drafted.wait_ready(300)
        _, texts, rate, med = alternate({"plain": plain, "drafted": drafted}, args.rounds,
                                           lambda url, n: decode(url, model, args.tokens, n))
        stats = drafted.status(0)
    proposed, accepted = stats["draft_proposed"], stats["draft_accepted"]
    block = json.loads((model / "config.json").read_text())["dspark_block_size"]  # drafts a drafted verify proposes
    verifies = max(1, proposed // block)
    lines = ["", f"## DeepSeek-V4's DSpark drafter, TP{world} on the ring, {args.target} (`bench/dspark.py`, "
             f"{time.strftime('%Y-%m-%d')})", "",
             f"The target: {what}; blocks of {block}, the Markov head fitted to the model's own bigrams. {world} "
             f"ranks a mesh on loopback, both meshes on this machine's cores (the one not asked idles). "
             f"{args.rounds} alternating rounds of {args.tokens} greedy tokens.", "",
             "| | decode tok/s (median) | spread (min-max) |", "|---|---|---|",
             *(f"| {name} | {med[name]:.2f} | {min(rate[name]):.2f}-{max(rate[name]):.2f} |"
               for name in ("plain", "drafted")),
             "", f"Drafted / plain: **{med['drafted'] / med['plain']:.2f}x**; acceptance {accepted / max(1, proposed):.0%} "
             f"({accepted} of {proposed} drafts), {1 + accepted / verifies:.2f} tokens per drafted verify. The "
             "answers were " + ("the same token for token in every round." if texts["plain"] == texts["drafted"]
                                else "NOT the same."),
             "", f"Command: `{Path(sys.executable).parent.parent.name}/bin/python bench/dspark.py "
             + " ".join(sys.argv[1:]) + "`"]
    report(lines, args.write)


if __name__ == "__main__":
    main()
