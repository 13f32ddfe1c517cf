"""The yardstick for meshd-rank on GPUs: a plain mlx tensor-parallel generate
loop, what a user writes by hand (`load(lazy=True)`, `model.shard()`,
`stream_generate`), or with `--engine batch` the same loop on mlx-lm's
BatchGenerator (the engine meshd-rank and mlx_lm.server batch requests with),
which separates the engine's cost from meshd's own. Run one process per rank
with the env mlx.launch would give it; rank 0 prints one JSON line per
measurement.

It loads, decodes once to warm up (printing when that first token came, as a
wall-clock time, so the driver can compare process start -> first token with
meshd's cold start), then waits for `go-N` files in --signals (N = 1, 2, ...)
and decodes `--tokens` greedy tokens after each, so a driver can alternate it
with other measurements in the same run; a `stop` file ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_logits_processors

from benchkit import pace
from common.hostfile import distributed_backend


def stream_tokens(model, tokenizer, prompt, tokens: int, processors):
    for r in stream_generate(model, tokenizer, prompt, max_tokens=tokens, logits_processors=processors):
        yield r.token


def batch_tokens(model, tokenizer, prompt, tokens: int, processors):
    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert([prompt], max_tokens=[tokens], logits_processors=[processors])
    try:
        while True:
            _, responses = gen.next()
            for r in responses:
                yield r.token
                if r.finish_reason is not None:
                    return
    finally:
        gen.close()


ENGINES = {"stream": stream_tokens, "batch": batch_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="stream")
    ap.add_argument("--signals", required=True, help="directory the driver writes go-N / stop files into")
    args = ap.parse_args()
    group = mx.distributed.init(strict=True, backend=distributed_backend("any"))
    rank = group.rank()
    t0 = time.perf_counter()
    model, tokenizer = load(args.model, lazy=True)
    model.shard(group)
    mx.eval(model.parameters())
    loaded = time.perf_counter() - t0
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "a long answer"}], add_generation_prompt=True)
    # every token up to --tokens (random weights end a turn anywhere), on every rank alike
    no_end = make_logits_processors(logit_bias={t: -100.0 for t in tokenizer.eos_token_ids})

    def decode() -> tuple[float, dict]:
        """(wall-clock time of the first token, decode tok/s after it)."""
        times = [time.perf_counter() for _ in ENGINES[args.engine](model, tokenizer, prompt, args.tokens, no_end)]
        first_at = time.time() - (times[-1] - times[0])
        return first_at, pace(times)

    first_token_at, _ = decode()  # warm, as meshd-rank is once ready
    if rank == 0:
        print(json.dumps({"loaded_s": loaded, "first_token_at": first_token_at}), flush=True)
    signals = Path(args.signals)
    n = 1
    while not (signals / "stop").exists():
        if (signals / f"go-{n}").exists():
            _, result = decode()
            if rank == 0:
                print(json.dumps({"round": n, **result}), flush=True)
                (signals / f"done-{n}").write_text(json.dumps(result))
            n += 1
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
