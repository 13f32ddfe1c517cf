"""What the weights' fingerprint costs against loading the weights: one safetensors file of --gib GiB (one uint8
tensor), in alternating rounds: MLX's load of it (mx.load, then eval: the baseline, what every rank start pays),
the fingerprint hashed on one thread, on every core, and read from its cache (a restart with the file
unchanged). The page cache holds the file throughout, so each figure is the CPU's part, not the disk's.

    .venv/bin/python bench/fingerprint.py [--gib 2] [--rounds 4] [--write]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

from benchkit import report, say

from common import fingerprint


def write_weights(path: Path, size: int) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [size >> 20, 1 << 20], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for offset in range(0, size, len(block)):
            f.write(block[:size - offset])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    import mlx.core as mx

    work = Path(tempfile.mkdtemp(prefix="meshd-fingerprint-bench-"))
    os.environ["XDG_CACHE_HOME"] = str(work / "cache")
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    size = int(args.gib * (1 << 30)) >> 20 << 20
    write_weights(model / "model.safetensors", size)
    gib = size / (1 << 30)

    def hash_with(threads: int):
        def run():
            with open(model / "model.safetensors", "rb") as f:
                fingerprint.content_digest(f.fileno(), os.fstat(f.fileno()).st_size, threads)
        return run

    def cached():
        fingerprint.weights_digest(model)

    ways = {"mx.load (the baseline)": lambda: mx.eval(mx.load(str(model / "model.safetensors"))),
            "hashed, 1 thread": hash_with(1),
            f"hashed, {os.cpu_count()} threads": hash_with(os.cpu_count()),
            "from the cache (unchanged file)": cached}
    time.sleep(fingerprint.RACY_NS / 1e9)  # the file is old enough to be cached
    cached()
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name, fn in (ways.items() if r % 2 == 0 else reversed(ways.items())):
            seconds[name].append(timed(fn))
        say(f"round {r + 1}: " + ", ".join(f"{n} {s[-1]:.3f}s" for n, s in seconds.items()))
    base = statistics.median(seconds["mx.load (the baseline)"])
    lines = [f"## The weights' fingerprint against the load (`bench/fingerprint.py`, {time.strftime('%Y-%m-%d')})",
             "", f"One {gib:g} GiB safetensors file in the page cache, {os.cpu_count()} cores, {args.rounds} "
             "alternating rounds.", "",
             "| | s per GiB (median) | spread (min-max) | against the load |", "|---|---|---|---|"]
    for name, s in seconds.items():
        lines.append(f"| {name} | {statistics.median(s) / gib:.3f} | {min(s) / gib:.3f}-{max(s) / gib:.3f} "
                     f"| {statistics.median(s) / base:.2f}x |")
    lines += ["", f"Command: `.venv/bin/python bench/fingerprint.py --gib {args.gib:g} --rounds {args.rounds}"
                  f"{' --write' if args.write else ''}`", ""]
    report(lines, args.write)
    for p in sorted(work.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    work.rmdir()


if __name__ == "__main__":
    main()
