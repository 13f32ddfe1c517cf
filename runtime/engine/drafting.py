"""What drafting shares, whoever proposes the drafts: each place of a verify sampled with its request's key
and processors, drafts held to its grammar, how many tokens a step keeps, the ranks' agreement on it. The
engine that drafts is runtime/engine/rowwise.py; its proposers runtime/engine/proposers.py."""

from __future__ import annotations

import mlx.core as mx

from runtime.engine.jobs import Divergence, Job, finish_reason
from runtime.engine.sampling import GrammarMask, sample_at


def ends_after(tokens: list[int], count: int, max_tokens: int, eos_ids: set[int]) -> int:
    """How many of `tokens` an answer that said `count` tokens emits: up to the one that ends it."""
    return next((i + 1 for i, token in enumerate(tokens)
                 if finish_reason(token, count + i + 1, max_tokens, eos_ids) is not None), len(tokens))


def place_logprobs(logits: mx.array, processors: list, said: mx.array | None, drafts: mx.array) -> mx.array:
    """Log probabilities at each place of a verify, a request's processors run with what precedes that place:
    what was `said`, then the `drafts` before it."""
    if processors:
        rows = []
        for p in range(logits.shape[0]):
            row = logits[p:p + 1]
            seen = mx.concatenate([said, drafts[:p]]) if p else said
            for processor in processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample_places(job: Job, count: int, logprobs: mx.array) -> mx.array:
    """Each place's token, drawn with the key of its place in the answer (`count` tokens said before it)."""
    return mx.concatenate([sample_at(job, count + p, logprobs[p:p + 1])
                           for p in range(logprobs.shape[0])]).astype(mx.uint32)


def allowed_by(grammar: GrammarMask | None, said: mx.array | None, drafts: list[mx.array], row: mx.array) -> mx.array:
    """A draft's logits with what the request's grammar refuses after what was `said` and the `drafts` before
    it at -inf (the verify's mask at that place, so a draft is one the target can accept); the row as it is
    without a grammar."""
    if grammar is None:
        return row
    return grammar(mx.concatenate([said, *(d.astype(mx.uint32) for d in drafts)]), row)


def agree(kept: list[int]) -> None:
    """Every rank kept as many drafts of each row, or all stop here: what comes next (feeding the kept places
    again) runs collectives of that length, which ranks that disagree would not meet in."""
    by_rank = mx.distributed.all_gather(mx.array(kept, dtype=mx.int32)).reshape(-1, len(kept)).tolist()
    if any(row != by_rank[0] for row in by_rank):
        shown = [r[0] for r in by_rank] if len(kept) == 1 else by_rank
        raise Divergence(f"[meshd] divergence: the ranks sampled different tokens or drafted different blocks "
                         f"(drafts kept by rank: {shown})")
