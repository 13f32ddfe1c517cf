"""The drafting engine as a rank builds it, with a prefix store of its own: `drafting(model, eos, Head(model))`;
and a model whose forwards are counted."""

from runtime.engine.proposers import Proposer
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore


def drafting(model, eos: set[int], proposer: Proposer, *, num_draft_tokens: int = 0, prefill_step_size: int = 512,
             completion_batch_size: int = 16, log=lambda line: None) -> RowwiseEngine:
    return RowwiseEngine(model, eos, proposer, prefixes=PrefixStore(model, prefill_step_size=prefill_step_size),
                         num_draft_tokens=num_draft_tokens, prefill_step_size=prefill_step_size,
                         completion_batch_size=completion_batch_size, log=log)


class Counted:
    """The model, its forwards counted."""

    def __init__(self, model):
        self.model, self.forwards = model, 0

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)
