"""The engine as a rank builds it, with a prefix store of its own: drafting (`drafting(model, eos, Head(model))`)
or not (`undrafted(model, eos)`, what `--drafter off` runs); and a model whose forwards are counted."""

from runtime.engine.proposers import Proposer, Undrafted
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore


def drafting(model, eos: set[int], proposer: Proposer, *, num_draft_tokens: int = 0, prefill_step_size: int = 512,
             completion_batch_size: int = 16, prefixes: PrefixStore | None = None,
             log=lambda line: None) -> RowwiseEngine:
    return RowwiseEngine(model, eos, proposer,
                         prefixes=prefixes or PrefixStore(model, prefill_step_size=prefill_step_size),
                         num_draft_tokens=num_draft_tokens, prefill_step_size=prefill_step_size,
                         completion_batch_size=completion_batch_size, log=log)


def undrafted(model, eos: set[int], *, prefill_step_size: int = 512, completion_batch_size: int = 16,
              prefixes: PrefixStore | None = None) -> RowwiseEngine:
    return drafting(model, eos, Undrafted(model), prefill_step_size=prefill_step_size,
                    completion_batch_size=completion_batch_size, prefixes=prefixes)


class Counted:
    """The model, its forwards counted."""

    def __init__(self, model):
        self.model, self.forwards = model, 0

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)
