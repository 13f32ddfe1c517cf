"""The request record: one request as an engine holds it from its first step to its end, through its prompt
going in, decoding or drafting, its grammar, its snapshots and its rows of the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from common.prefills import Position
from runtime.engine.jobs import Job
from runtime.engine.sampling import GrammarMask, processors_for
from runtime.prefix.checkpoints import Taken
from runtime.prefix.store import Prefix


@dataclass(eq=False)
class Request:
    job: Job
    cache: list | None  # its own caches; None once they are a batch's rows
    cached: int  # how much of its prompt its cache held when it began (said with its first token)
    since: tuple[str, int]  # its snapshot point (runtime/prefix/store.py)
    taken: Taken  # its checkpoints, at the stops of its prompt
    tape: list[int]  # the prompt and the tokens emitted: its caches hold tape[:base]
    todo: list[int]  # the prompt not yet through the target
    base: int
    processors: list
    grammar: GrammarMask | None
    said: mx.array | None  # what a drafter's processors see: the prompt and the tokens emitted (None without)
    count: int = 0  # tokens emitted
    # drafting: the last token (of the prompt, or emitted) not yet through the target, the drafts after it (on
    # the device), whether it is still drafted, its drafter's context (DSpark's stages' committed taps, or
    # the MTP head's cache) and this step's tokens that go out
    pending: int = 0
    drafts: mx.array | None = None
    drafting: bool = True
    width: int = 0  # the most drafts a step it takes (its job's draft_tokens, at most its engine's)
    context: list | None = None
    recent: mx.array | None = None  # the target's taps at the last positions its caches hold (DSpark's: its tape keeps them)
    kept: list[int] = field(default_factory=list)

    @classmethod
    def begin(cls, job: Job, prefix: Prefix, context: list | None = None, width: int = 0) -> "Request":
        """The request of `job` from what the prefix store gave it, drafted when its engine drafts `width` a step
        and it asked for some of them."""
        processors = processors_for(job)
        drafts = job.drafts(width)
        return cls(job, prefix.cache, prefix.cached, prefix.since, prefix.taken, list(job.prompt),
                   list(job.prompt[prefix.cached:]), prefix.cached, processors,
                   next((p for p in processors if isinstance(p, GrammarMask)), None),
                   mx.array(job.prompt, dtype=mx.uint32) if processors else None, context=context,
                   drafting=drafts > 0, width=drafts, recent=prefix.taps)

    @property
    def rid(self) -> str:
        return self.job.rid

    @property
    def fed(self) -> list[int]:
        """The tokens its caches hold."""
        return self.tape[:self.base]

    def position(self) -> Position:
        """Its prompt going in, through its own caches: they hold `base` of it."""
        return Position(self.rid, self.base, len(self.job.prompt))
