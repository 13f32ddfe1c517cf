"""What every drafter shares (each place of a verify sampled with its request's key and processors, drafts
held to its grammar, how many tokens a step keeps, the ranks' agreement on it), and the drafters of one
request at a time (a draft model, the model's MTP head: the others wait FIFO). `SingleRequestEngine` is
their shared Engine; a drafter subclasses it with how one request begins and advances. DSpark drafts every
request, row by row (runtime/engine/rowwise.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from contextlib import contextmanager
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from common.prefills import Position
from runtime.prefix import rollback
from runtime.prefix.checkpoints import Taken
from runtime.prefix.store import NO_SNAPSHOT, Prefix
from runtime.engine.jobs import Divergence, Emission, Job, emission, finish_reason
from runtime.engine.request import Request
from runtime.engine.sampling import GrammarMask, processors_for, sample_at, sampler_for


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
            seen = mx.concatenate([said, drafts[:p]])
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


class SingleRequestEngine(ABC):
    """The Engine of a drafter: the queue, the active request and how it ends. A subclass decodes the active
    request (its three abstract methods)."""

    prefixes = None  # a single-request engine keeps no prefix store: its caches are its request's alone

    def __init__(self, eos_ids: set[int], log=print):
        self._eos = eos_ids
        self._queue: deque[Job] = deque()
        self._active: Request | None = None
        self._log = log
        self.fallbacks = 0  # requests whose drafted steps were refused, decoded plainly from there
        self.proposed = self.accepted = 0  # the drafts of every step, as its emissions say them

    def insert(self, job: Job) -> None:
        """Queued: how much of its prompt a cache holds is known when it begins, and goes out with its first
        token."""
        self._queue.append(job)

    def cancel(self, rid: str) -> None:
        if self._active is not None and self._active.rid == rid:
            self._finish()
        else:
            self._queue = deque(j for j in self._queue if j.rid != rid)

    def step(self) -> list[Emission]:
        if self._active is None:
            if not self._queue:
                return []
            self._active = self._begin(self._queue.popleft())
        return self._advance()

    @property
    def busy(self) -> bool:
        return self._active is not None or bool(self._queue)

    def prompt_tokens_in_flight(self) -> int:
        return (self._prompt_left() if self._active is not None else 0) + sum(len(j.prompt) for j in self._queue)

    def prefilling(self) -> list[Position]:
        """The active request's prompt while it goes in (a draft model's stream takes it in its first step)."""
        if self._active is None or not (left := self._prompt_left()):
            return []
        total = len(self._active.job.prompt)
        return [Position(self._active.rid, total - left, total)]

    def close(self) -> None:
        mx.synchronize()
        self._finish()

    def stats(self) -> dict:
        return {}

    def _finish(self) -> None:
        self._active = None

    def _ends_after(self, tokens: list[int]) -> int:
        return ends_after(tokens, self._active.count, self._active.job.max_tokens, self._eos)

    def _refused(self, who: str, e: Exception) -> None:
        """A kernel's refusal of a shape (the same on every rank, so all go on plainly), said and counted."""
        self.fallbacks += 1
        self._log(f"{who} refused ({type(e).__name__}: {str(e)[:200]}); request {self._active.rid} "
                  "goes on without drafts")

    def _emit(self, tokens: list[int], logprobs, drafts: tuple[int, int]) -> list[Emission]:
        """The active job's next tokens (`logprobs[i]` what token i was drawn from), up to where it ends; the
        first says the step's `drafts` (proposed, accepted), which the engine's totals count."""
        r, out = self._active, []
        self.proposed += drafts[0]
        self.accepted += drafts[1]
        for i, token in enumerate(tokens):
            r.count += 1
            reason = finish_reason(token, r.count, r.job.max_tokens, self._eos)
            e = emission(r.rid, token, reason, logprobs[i], r.job.logprobs)
            out.append(replace(e, cached=r.cached if r.count == 1 else None, drafts=None if i else drafts))
            if reason is not None:
                self._finish()
                break
        return out

    @abstractmethod
    def _begin(self, job: Job) -> Request:
        """The request of the job made active, decoding started."""

    @abstractmethod
    def _advance(self) -> list[Emission]:
        """One prefill chunk or decode step of the active job; its tokens go out through `_emit`."""

    @abstractmethod
    def _prompt_left(self) -> int:
        """How much of the active job's prompt is not yet prefilled."""


class SpeculativeEngine(SingleRequestEngine):
    """A draft model loaded whole on every rank proposes tokens the sharded target verifies. A drafted step
    that raises (the target refusing a verify's shape) ends drafting for that request: what it said so
    far goes through the target plainly and it goes on from there."""

    def __init__(self, model, draft_model, eos_ids: set[int], *, num_draft_tokens: int = 3,
                 prefill_step_size: int = 512, log=print):
        super().__init__(eos_ids, log)
        self._model = model
        self._draft = draft_model
        self._num_draft = num_draft_tokens
        self._prefill_step_size = prefill_step_size
        self._stream = None

    def stats(self) -> dict:
        return {"drafter": "draft_model", "draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "draft_fallbacks": self.fallbacks}

    def _finish(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = None
        super()._finish()

    def _begin(self, job: Job) -> Request:
        """The job's stream: drafted with its width of drafts, plain when it asked for none."""
        r = Request.begin(job, Prefix(None, 0, NO_SNAPSHOT, Taken(())), width=self._num_draft)
        self._stream = speculative_generate_step(
            mx.array(job.prompt),
            self._model,
            self._draft,
            num_draft_tokens=r.width,
            max_tokens=job.max_tokens,
            sampler=sampler_for(job),
            logits_processors=r.processors,
            prefill_step_size=self._prefill_step_size,
        ) if r.drafting else self._plain(r)
        return r

    def _advance(self) -> list[Emission]:
        """One verify's tokens (mlx-lm's step yields them one by one: those of the drafts it kept, then the
        target's own, which ends it), or a plain step's token."""
        r = self._active
        try:
            said = [next(self._stream)]
        except StopIteration:
            rid = self._active.rid
            self._finish()
            return [Emission(rid, None, "length")]
        except Exception as e:
            if not self._active.drafting:
                raise
            self._active.drafting = False
            self._refused("a drafted step", e)
            self._stream = self._plain(self._active)
            return []
        kept = [s[2:3] == (True,) for s in said]  # (token, logprobs, from a draft); a plain step's has no third
        while kept[-1] and r.count + len(said) < r.job.max_tokens:
            said.append(next(self._stream))
            kept.append(said[-1][2])
        tokens = [int(token) for token, *_ in said]
        n = self._ends_after(tokens)
        r.tape += tokens[:n]
        # a verify proposes as many drafts as the answer has room for, up to the width (mlx-lm's num_draft)
        proposed = min(r.job.max_tokens - r.count, r.width) if r.drafting else 0
        return self._emit(tokens[:n], [logprobs for _, logprobs, *_ in said], (proposed, sum(kept[:n])))

    def _plain(self, r: Request):
        """Plain decoding of the request from what it said, each token drawn with the key of its place."""
        job = r.job
        return generate_step(mx.array(r.tape), self._model, max_tokens=job.max_tokens - r.count,
                             sampler=sampler_for(replace(job, offset=job.offset + r.count)),
                             logits_processors=processors_for(job), prefill_step_size=self._prefill_step_size)

    def _prompt_left(self) -> int:
        return len(self._active.job.prompt) if self._active.count == 0 else 0


def trim_to(cache: list, length: int) -> None:
    """Cut the cache back to `length` tokens. A cache that cannot give tokens back (a sliding window past its
    size, a recurrent state) is refused drafting at load (runtime/models/families.py); one that still trims short
    here is an error, never a draft kept on top of rejected tokens."""
    cut = cache[0].offset - length
    if trim_prompt_cache(cache, cut) != cut:
        raise RuntimeError(f"the draft cache gave back fewer than the {cut} rejected tokens: drafting over this "
                           "cache would change answers")


class MTPEngine(SingleRequestEngine):
    """One request at a time, drafted by the loaded model's own multi-token-prediction head (DeepSeek's
    layout: the head takes the last hidden state and the next token's embedding). Each verify step feeds
    the last token and the drafts through the sharded target and keeps the drafts the target itself
    samples at their places (logit bias and penalties applied at each place as if the drafts before it
    were already said), so the answer is the target's, token for token.

    One graph and one read back a step: the head learns every place of the verify in the same graph,
    paired with the token the target sampled there (right up to the first rejected draft, which is all
    that is kept), so its draft after whichever place turns out last is already computed; the caches are
    cut back to that place when the samples are read. Every step runs the same collectives whatever it
    keeps, so ranks that disagree meet at the next lockstep exchange, which names the divergence.

    A refusal of a shape anywhere in a drafted step (the target's verify of the drafts, the head: a
    kernel's layout limit past some prompt length) ends drafting for that request, the target's caches
    back where the step began: plain decoding from there, said in the log and counted, the rank alive."""

    def __init__(self, model, eos_ids: set[int], *, num_draft_tokens: int = 1, prefill_step_size: int = 512,
                 log=print):
        super().__init__(eos_ids, log)
        self._model = model
        self.num_draft_tokens = num_draft_tokens
        self._chunk = prefill_step_size

    def stats(self) -> dict:
        return {"drafter": "mtp", "draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "draft_fallbacks": self.fallbacks}

    def _prompt_left(self) -> int:
        return len(self._active.todo)

    def _advance(self) -> list[Emission]:
        if len(self._active.todo) > self._chunk:
            self._prefill()
            return []
        return self._verify()

    def _begin(self, job: Job) -> Request:
        """The request with a fresh cache and the MTP head's; the target's caches (and the head's) hold its
        tape[:base] for good."""
        return Request.begin(job, Prefix(make_prompt_cache(self._model), 0, NO_SNAPSHOT, Taken(())),
                             context=self._model.make_mtp_cache(), width=self.num_draft_tokens)

    def _prefill(self) -> None:
        """A chunk of the prompt that is not its last through the target; the head learns its positions."""
        r = self._active
        chunk, r.todo = r.todo[:self._chunk], r.todo[self._chunk:]
        with mx.stream(generation_stream):
            hidden = self._model.hidden(mx.array(chunk, dtype=mx.uint32)[None], r.cache)
        self._learn(hidden, mx.array(chunk[1:] + r.todo[:1], dtype=mx.uint32))
        mx.eval([c.state for c in r.cache] + ([c.state for c in r.context] if r.drafting else []))
        r.base += len(chunk)

    def _verify(self) -> list[Emission]:
        """The places (the prompt's last chunk, or the pending token and the drafts) through the target,
        sampled from `first` on: the drafts it agrees with and its own next token come out. A target that
        refuses the drafts gets the step again without them, its caches as the step found them."""
        r = self._active
        job = r.job
        if r.todo:
            inputs, first, r.todo = mx.array(r.todo, dtype=mx.uint32), len(r.todo) - 1, []
        else:
            inputs, first = mx.array([r.pending], dtype=mx.uint32), 0
        ahead = inputs.shape[0] + (0 if r.drafts is None else r.drafts.shape[0])
        saved = rollback.checkpoint(r.cache, ahead)
        verified = None
        if r.drafts is not None:
            with self._refusals("the target's verify"):
                verified = self._target(job, mx.concatenate([inputs, r.drafts]), first)
                inputs = mx.concatenate([inputs, r.drafts])
            if verified is None:
                saved.undo()
        if verified is None:
            verified = self._target(job, inputs, first)
        learned, logprobs, sampled = verified
        tokens, guessed = sampled.tolist(), inputs[first + 1:].tolist()
        kept = next((i for i, (g, t) in enumerate(zip(guessed, tokens)) if g != t), len(guessed))
        n = self._ends_after(tokens[:kept + 1])  # the tokens that go out; the last of them is not fed
        at = first + n - 1  # the place of the last token kept (what the head learned of it is in its cache)
        trim_to(r.cache, r.base + at + 1)
        r.base += at + 1
        r.tape += tokens[:n]
        out = self._emit(tokens[:n], logprobs, (len(guessed), min(kept, n)))
        if self._active is not None:
            if r.said is not None:
                r.said = mx.concatenate([r.said, sampled[:n]])
            r.pending = tokens[n - 1]
            r.drafts = self._chain(*learned, at) if r.drafting and learned else None
        return out

    def _target(self, job: Job, inputs: mx.array, first: int):
        """The places through the target, sampled from `first` on, and the head's learning of them: what
        it learned, the log probabilities and the samples, evaluated."""
        with mx.stream(generation_stream):
            hidden = self._model.hidden(inputs[None], self._active.cache)
            logprobs = place_logprobs(self._model.head(hidden[0, first:]), self._active.processors,
                                      self._active.said, inputs[first + 1:])
            sampled = sample_places(job, self._active.count, logprobs)
        learned = self._learn(hidden, mx.concatenate([inputs[1:first + 1], sampled]))
        mx.eval([sampled, logprobs, *(learned or ())])
        return learned, logprobs, sampled

    def _learn(self, hidden: mx.array, next_tokens: mx.array) -> tuple[mx.array, mx.array] | None:
        """The head's cache, cut back to the kept positions, learns (hidden state at p, token at p+1) for
        these places: its states and logits at each. None once drafting has ended for the request."""
        r = self._active
        if not r.drafting:
            return None
        with self._refusals():
            trim_to(r.context, r.base)
            return self._model.mtp_draft(hidden, next_tokens[None], r.context)
        return None

    def _chain(self, h: mx.array, logits: mx.array, at: int) -> mx.array | None:
        """The request's width of drafts after place `at` of the head's last learning: its guess there, then
        each from the one before (on the device: they go into the next verify's graph)."""
        r = self._active
        with self._refusals():
            trim_to(r.context, r.base)
            guesses = [mx.argmax(self._allowed([], logits[:, at]), axis=-1)]
            h = h[:, at:at + 1]
            while len(guesses) < r.width:
                h, logits = self._model.mtp_draft(h, guesses[-1][None], r.context)
                guesses.append(mx.argmax(self._allowed(guesses, logits[:, -1]), axis=-1))
            return mx.concatenate(guesses).astype(mx.uint32)
        return None

    def _allowed(self, drafts: list[mx.array], row: mx.array) -> mx.array:
        return allowed_by(self._active.grammar, self._active.said, drafts, row)

    @contextmanager
    def _refusals(self, who: str = "drafter"):
        """A refusal inside: drafting ends for the request, on every rank alike."""
        try:
            with mx.stream(generation_stream):
                yield
        except Exception as e:
            self._active.drafting = False
            self._refused(who, e)
