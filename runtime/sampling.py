"""How a job's tokens are drawn: greedy, or seeded per token so that any rank,
any batch and any resumed answer draws the same; and the job's logits processors."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from runtime.jobs import Job


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


MASK64 = (1 << 64) - 1


def token_key(seed: int, i: int) -> mx.array:
    """The random key of an answer's token i: a function of the seed and i alone (splitmix64 of
    both), so an answer resumed at token i on another generation draws what it would have."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return mx.random.key((z ^ (z >> 31)) & ((1 << 63) - 1))


class SeededSampler:
    """Temperature sampling after top-k, min-p and top-p, with token i drawn from
    `token_key(seed, i)`: the same seed replays the same tokens, on every rank,
    whatever else shares the batch, and from any token on."""

    def __init__(self, seed: int, sampling: dict, start: int = 0):
        self._seed = seed
        self._i = start
        self._inv_temp = 1.0 / sampling["temperature"]
        self._top_p, self._top_k, self._min_p = sampling["top_p"], sampling["top_k"], sampling["min_p"]

    def __call__(self, logprobs: mx.array) -> mx.array:
        key = token_key(self._seed, self._i)
        self._i += 1
        if 0 < self._top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self._top_k)
        if self._min_p > 0.0:
            logprobs = apply_min_p(logprobs, self._min_p)
        if 0.0 < self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        return mx.random.categorical(logprobs * self._inv_temp, key=key)


def sampler_for(job: Job):
    return greedy if job.sampling["temperature"] == 0.0 else SeededSampler(job.seed, job.sampling, job.offset)


def sample_at(job: Job, i: int, logprobs: mx.array) -> mx.array:
    """The job's token i from `logprobs` (one row, [1, vocab], as plain decoding holds it), drawn as plain
    decoding draws it: greedy, or with token_key(seed, i)."""
    return greedy(logprobs) if job.sampling["temperature"] == 0.0 else \
        SeededSampler(job.seed, job.sampling, job.offset + i)(logprobs)


def processors_for(job: Job) -> list:
    """mlx-lm's logits processors for the job's logit_bias and penalties (none when all are off)."""
    s = job.sampling
    return make_logits_processors(logit_bias={int(t): b for t, b in s["logit_bias"]} or None,
                                  repetition_penalty=s["repetition_penalty"] if s["repetition_penalty"] != 1.0 else None,
                                  presence_penalty=s["presence_penalty"] or None,
                                  frequency_penalty=s["frequency_penalty"] or None)
