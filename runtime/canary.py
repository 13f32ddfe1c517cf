"""The model-free canary: `all_sum` of growing sizes across the mesh for a
few seconds, checking every result, before anyone waits ten minutes for a
model to load. Started by the agents like a rank (same hostfile, same env);
prints one `canary ok` or `canary FAILED` line and exits 0 or 1.

    meshd-canary --seconds 3   (as the agents' meshd-canary profile runs it)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from runtime.join import join_mesh


def sizes(largest: int) -> list[int]:
    """Element counts from 1 Ki up to `largest`, x4 each step."""
    out, n = [], 1024
    while n <= largest:
        out.append(n)
        n *= 4
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meshd-generation", dest="generation", type=int, default=0)
    p.add_argument("--seconds", type=float, default=3.0, help="how long to keep sending")
    p.add_argument("--largest", type=int, default=1 << 22, help="largest all_sum, in float32 elements")
    p.add_argument("--backend", default="any")
    args = p.parse_args(argv)

    group = join_mesh(args.backend)
    rank, world = group.rank(), group.size()
    expected_sum = world * (world + 1) / 2
    done, moved, rounds = 0, 0, 0
    t0 = time.perf_counter()
    try:
        while True:
            for n in sizes(args.largest):
                x = mx.full((n,), float(rank + 1), dtype=mx.float32)
                y = mx.distributed.all_sum(x, group=group)
                mx.eval(y)
                lo, hi = mx.min(y).item(), mx.max(y).item()
                if lo != expected_sum or hi != expected_sum:
                    raise RuntimeError(f"all_sum of {n} floats gave {lo}..{hi}, expected {expected_sum}")
                done += 1
                moved += 4 * n
            rounds += 1
            # Every rank must run the same collectives: they stop together once any has run long enough.
            stop = mx.distributed.all_sum(mx.array([1.0 if time.perf_counter() - t0 >= args.seconds else 0.0]),
                                          group=group)
            if stop.item() > 0:
                break
    except Exception as e:  # the transport failed: that is the answer the canary exists to give
        print(f"canary FAILED rank {rank}/{world}: {type(e).__name__}: {e}", flush=True)
        return 1
    elapsed = time.perf_counter() - t0
    print("canary ok " + json.dumps({"rank": rank, "world": world, "collectives": done, "rounds": rounds,
                                     "bytes": moved, "seconds": round(elapsed, 3),
                                     "gb_per_s": round(moved / elapsed / 1e9, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
