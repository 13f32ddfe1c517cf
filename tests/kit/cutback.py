"""Prompts fed to a model in forwards that end at their stops (runtime/prefix/checkpoints.py `stops`), a
checkpoint taken at each where asked, and greedy answers with their log probabilities: what the checkpoint
tests compare a cache cut back to a checkpoint with a fresh prefill by."""

from __future__ import annotations

import mlx.core as mx

from runtime.prefix.checkpoints import checkpoint, stops


def prefill(model, cache, prompt: list[int], start: int, markers: frozenset[int], every: int,
            marked: dict | None = None) -> mx.array:
    """`prompt` from `start` through `cache` in forwards that end at its stops (a checkpoint taken at each into
    `marked`); the logits after its last token."""
    at = start
    for stop in [s for s in stops(prompt, markers, every) if s > start]:
        model(mx.array(prompt[at:stop])[None], cache=cache)
        mx.eval([c.state for c in cache])
        at = stop
        if marked is not None:
            marked[stop] = checkpoint(cache, stop)
    return model(mx.array(prompt[at:])[None], cache=cache)[:, -1]


def decode(model, cache, logits: mx.array, n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens from `logits` on, and their log probabilities."""
    said, logprobs = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(lp, axis=-1)
        said.append(token.item())
        logprobs.append(lp[0, said[-1]].item())
        logits = model(token[None], cache=cache)[:, -1]
    return said, logprobs


def fresh(model, prompt: list[int], markers: frozenset[int], every: int, n: int) -> tuple[list[int], list[float]]:
    """A fresh prefill of `prompt` and its answer."""
    cache = model.make_cache()
    return decode(model, cache, prefill(model, cache, prompt, 0, markers, every), n)
