"""The drafting engine as a rank builds it, with a prefix store of its own: `drafting(model, eos, Head(model))`."""

from runtime.engine.proposers import Proposer
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore


def drafting(model, eos: set[int], proposer: Proposer, *, num_draft_tokens: int = 0, prefill_step_size: int = 512,
             log=lambda line: None) -> RowwiseEngine:
    return RowwiseEngine(model, eos, proposer, prefixes=PrefixStore(model, prefill_step_size=prefill_step_size),
                         num_draft_tokens=num_draft_tokens, prefill_step_size=prefill_step_size, log=log)
