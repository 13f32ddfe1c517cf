"""What every engine takes and gives: a `Job` in, `Emission`s out, behind the `Engine` protocol; and
`Divergence`, how an engine says the ranks no longer agree.

Every rank owns an engine and calls the same methods in the same order (the
lockstep loop guarantees it), so each decision an engine makes must be a
deterministic function of those calls: uids, batch composition, tape hits and
evictions are then identical on every rank without further talk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from common.prefills import Position


@dataclass(frozen=True)
class Job:
    """One request as every rank sees it (broadcast by rank 0)."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int
    sampling: dict  # SamplingParams.sampling(): temperature, top_p, top_k, min_p, penalties, logit_bias, grammar
    offset: int = 0  # the index of the answer's first token this job samples (a resumed answer's is > 0)
    logprobs: int = -1  # -1: none; k >= 0: each token's log probability and its k most likely alternatives
    tenant: str = ""  # whose prefix cache it may use (the proxy's scope of its API key; "": the shared one)
    draft_tokens: int | None = None  # the most drafts a step it asked for (None: its engine's; 0: none)

    def drafts(self, width: int) -> int:
        """How many drafts a step it takes of an engine that drafts `width`."""
        return width if self.draft_tokens is None else min(self.draft_tokens, width)


@dataclass(frozen=True)
class Emission:
    rid: str
    token: int | None
    finish_reason: str | None
    logprob: float | None = None  # when the job asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # its k most likely tokens, most likely first
    cached: int | None = None  # on a job's first token: how much of its prompt its cache held, when its engine
    # took the job later than its insert (a drafter)
    drafts: tuple[int, int] | None = None  # a drafting engine's, on the first token of each of the job's steps:
    # the drafts it proposed for the job in that step and those of them that are tokens of the answer


def emission(rid: str, token: int, reason: str | None, logprobs: mx.array | None, k: int) -> Emission:
    """The token's emission, with its log probability and the k most likely tokens when the job asked."""
    if k < 0 or logprobs is None:
        return Emission(rid, token, reason)
    lp = logprobs.reshape(-1)
    top: tuple = ()
    if k > 0:
        ids = mx.argpartition(-lp, k - 1)[:k]
        top = tuple(sorted(zip(ids.tolist(), lp[ids].tolist()), key=lambda a: -a[1]))
    return Emission(rid, token, reason, lp[token].item(), top)


def finish_reason(token: int, count: int, max_tokens: int, eos_ids: set[int]) -> str | None:
    """Why an answer ends at its `count`th token (None: it goes on)."""
    return "stop" if token in eos_ids else ("length" if count >= max_tokens else None)


class Engine(Protocol):
    def insert(self, job: Job) -> int:
        """Queue a job; returns how many prompt tokens came from the cache."""

    def cancel(self, rid: str) -> None: ...

    def step(self) -> list[Emission]:
        """One prefill chunk or decode step; the tokens it produced."""

    @property
    def busy(self) -> bool: ...

    def prompt_tokens_in_flight(self) -> int: ...

    def prefilling(self) -> list[Position]:
        """The prompts going in: how much of each is through the target (common/prefills.py)."""

    def close(self) -> None: ...

    def stats(self) -> dict:
        """The engine's counters, as RankStatus fields."""


class Divergence(RuntimeError):
    """The ranks sampled different tokens or drafted different blocks: the generation cannot go on."""
