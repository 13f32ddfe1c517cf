"""Generation engines behind one small interface, stepped in lockstep.

Every rank owns an engine and calls the same methods in the same order (the
lockstep loop guarantees it), so each decision here must be a deterministic
function of those calls: uids, batch composition, tape hits and evictions are
then identical on every rank without further talk.

- `BatchEngine`: continuous batching over mlx-lm's BatchGenerator, with the
  token-tape prefix cache; a request alone runs in `SoloDecode` (the plain
  loop's speed) until a second one arrives and it joins the batch.
- `MTPEngine`: one request at a time, drafted by the model's own MTP head
  (sharded with it), verified by the target.
- `SpeculativeEngine`: one request at a time, a draft model loaded whole on
  every rank proposing tokens the sharded target verifies.
"""

from __future__ import annotations

import copy
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream, speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors


@dataclass(frozen=True)
class Job:
    """One request as every rank sees it (broadcast by rank 0)."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int
    sampling: dict  # SamplingParams.sampling(): temperature, top_p, top_k, min_p, penalties, logit_bias
    offset: int = 0  # the index of the answer's first token this job samples (a resumed answer's is > 0)
    logprobs: int = -1  # -1: none; k >= 0: each token's log probability and its k most likely alternatives


@dataclass(frozen=True)
class Emission:
    rid: str
    token: int | None
    finish_reason: str | None
    logprob: float | None = None  # when the job asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # its k most likely tokens, most likely first


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


def processors_for(job: Job) -> list:
    """mlx-lm's logits processors for the job's logit_bias and penalties (none when all are off)."""
    s = job.sampling
    return make_logits_processors(logit_bias={int(t): b for t, b in s["logit_bias"]} or None,
                                  repetition_penalty=s["repetition_penalty"] if s["repetition_penalty"] != 1.0 else None,
                                  presence_penalty=s["presence_penalty"] or None,
                                  frequency_penalty=s["frequency_penalty"] or None)


class Engine(Protocol):
    def insert(self, job: Job) -> int:
        """Queue a job; returns how many prompt tokens came from the cache."""

    def cancel(self, rid: str) -> None: ...

    def step(self) -> list[Emission]:
        """One prefill chunk or decode step; the tokens it produced."""

    @property
    def busy(self) -> bool: ...

    def prompt_tokens_in_flight(self) -> int: ...

    def close(self) -> None: ...


class TokenTape:
    """Append-only tapes of post-template token ids with their KV caches.

    A follow-up turn whose prompt extends a stored tape prefills only the new
    tokens. Entries are kept in LRU order up to `capacity`."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: deque[tuple[tuple[int, ...], list]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt: tuple[int, ...]) -> tuple[list | None, int]:
        """The cache for the longest stored prefix of `prompt` (a copy, trimmed
        to the shared prefix) and that prefix length; at least one prompt token
        is always left to process."""
        best, best_len = None, 0
        for i, (tape, _) in enumerate(self._entries):
            n = _common_prefix(tape, prompt)
            if n > best_len:
                best, best_len = i, n
        best_len = min(best_len, len(prompt) - 1)
        if best is None or best_len <= 0:
            return None, 0
        tape, cache = self._entries[best]
        del self._entries[best]
        self._entries.append((tape, cache))
        cache = copy.deepcopy(cache)
        trim_prompt_cache(cache, len(tape) - best_len)
        return cache, best_len

    def store(self, tape: tuple[int, ...], cache: list) -> None:
        self._entries = deque((t, c) for t, c in self._entries if _common_prefix(t, tape) < len(t))
        self._entries.append((tape, cache))
        while len(self._entries) > self.capacity:
            self._entries.popleft()


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SoloDecode:
    """One job decoded by its own loop with the next step already queued on the
    device when a token is read back (mlx-lm's generate_step does the same):
    at batch one this is the plain loop's speed, which BatchGenerator's
    per-step bookkeeping does not reach. Each `step` is one prefill chunk or
    one token."""

    def __init__(self, model, job: Job, cache: list, cached: int, eos_ids: set[int], prefill_step_size: int):
        self.job = job
        self.cache = cache
        self._model = model
        self._eos = eos_ids
        self._chunk = prefill_step_size
        self._sampler = sampler_for(job)
        self._processors = processors_for(job)
        self._seen = mx.array(job.prompt[:cached], dtype=mx.uint32)  # what the logits processors see
        self.fed = list(job.prompt[:cached])  # the tokens whose keys and values the cache holds
        self.todo = list(job.prompt[cached:])
        self.emitted = 0
        self._next: tuple[mx.array, mx.array] | None = None  # sampled on the device, not yet read back

    def _forward(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """The next token and the log probabilities it was drawn from."""
        with mx.stream(generation_stream):
            logits = self._model(tokens[None], cache=self.cache)[:, -1, :]
            if self._processors:
                self._seen = mx.concatenate([self._seen, tokens.astype(mx.uint32)])
                for processor in self._processors:
                    logits = processor(self._seen, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return self._sampler(logprobs), logprobs

    def step(self) -> Emission | None:
        if len(self.todo) > 1:
            n = min(self._chunk, len(self.todo) - 1)
            chunk = mx.array(self.todo[:n], dtype=mx.uint32)
            with mx.stream(generation_stream):
                self._model(chunk[None], cache=self.cache)
            if self._processors:
                self._seen = mx.concatenate([self._seen, chunk])
            mx.eval([c.state for c in self.cache])
            self.fed += self.todo[:n]
            self.todo = self.todo[n:]
            return None
        if self.todo:
            self._next = self._forward(mx.array(self.todo, dtype=mx.uint32))
            self.fed += self.todo
            self.todo = []
        (sampled, logprobs), self._next = self._next, None
        self.emitted += 1
        if self.emitted < self.job.max_tokens:
            self._next = self._forward(sampled)
            mx.async_eval(self._next)
        token = sampled.item()
        if self._next is not None:
            self.fed.append(token)
        reason = finish_reason(token, self.emitted, self.job.max_tokens, self._eos)
        return emission(self.job.rid, token, reason, logprobs, self.job.logprobs)

    def handover(self) -> tuple[Job, list, int]:
        """The rest of this job for a batch: a job from the next token on (its prompt the answer so
        far), the cache, and how much of that prompt the cache holds. The token queued on the device
        is dropped and the last one read back leaves the cache, so the batch samples that next token
        itself, with the same key."""
        job = self.job
        if self.emitted == 0:
            return job, self.cache, len(self.fed)
        rest = Job(job.rid, tuple(self.fed), job.max_tokens - self.emitted, job.seed, job.sampling,
                   job.offset + self.emitted, job.logprobs)
        trim_prompt_cache(self.cache, 1)
        return rest, self.cache, len(self.fed) - 1


class BatchEngine:
    def __init__(self, model, eos_ids: set[int], *, prefill_step_size: int = 512,
                 completion_batch_size: int = 16, tape_capacity: int = 8):
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in sorted(eos_ids)],
            sampler=greedy,
            prefill_step_size=prefill_step_size,
            completion_batch_size=completion_batch_size,
        )
        self._model = model
        self._eos = eos_ids
        self._prefill_step_size = prefill_step_size
        # A job alone runs solo only when its cache can give back a token at the handover.
        self._solo_ok = can_trim_prompt_cache(make_prompt_cache(model))
        self._solo: SoloDecode | None = None
        self._rid_by_uid: dict[int, str] = {}
        self._uid_by_rid: dict[str, int] = {}
        self._prompt_left: dict[str, int] = {}
        self._logprobs: dict[str, int] = {}  # what each job asked for (Job.logprobs)
        self.tape = TokenTape(tape_capacity)

    def insert(self, job: Job) -> int:
        cache, cached = self.tape.take(job.prompt)
        cache = cache if cache is not None else make_prompt_cache(self._model)
        if self._solo_ok and not self.busy:
            self._solo = SoloDecode(self._model, job, cache, cached, self._eos, self._prefill_step_size)
            return cached
        if self._solo is not None:
            self._join_batch(*self._solo.handover())
            self._solo = None
        self._join_batch(job, cache, cached)
        return cached

    def _join_batch(self, job: Job, cache: list, cached: int) -> None:
        (uid,) = self._gen.insert(
            [list(job.prompt[cached:])],
            max_tokens=[job.max_tokens],
            caches=[cache],
            all_tokens=[list(job.prompt[:cached])],
            samplers=[sampler_for(job)],
            logits_processors=[processors_for(job)],
        )
        self._rid_by_uid[uid] = job.rid
        self._uid_by_rid[job.rid] = uid
        self._prompt_left[job.rid] = len(job.prompt) - cached
        self._logprobs[job.rid] = job.logprobs

    def _forget(self, rid: str) -> None:
        uid = self._uid_by_rid.pop(rid)
        del self._rid_by_uid[uid]
        self._prompt_left.pop(rid, None)
        self._logprobs.pop(rid, None)

    def cancel(self, rid: str) -> None:
        if self._solo is not None and self._solo.job.rid == rid:
            self._solo = None
        if rid in self._uid_by_rid:
            self._gen.remove([self._uid_by_rid[rid]])
            self._forget(rid)

    def step(self) -> list[Emission]:
        if self._solo is not None:
            return self._solo_step()
        prompt_responses, gen_responses = self._gen.next()
        for p in prompt_responses:
            rid = self._rid_by_uid.get(p.uid)
            if rid is not None:
                self._prompt_left[rid] = p.progress[1] - p.progress[0]
        out = []
        for r in gen_responses:
            rid = self._rid_by_uid.get(r.uid)
            if rid is None:
                continue
            out.append(emission(rid, r.token, r.finish_reason, r.logprobs, self._logprobs[rid]))
            if r.finish_reason is not None:
                self.tape.store(tuple(r.all_tokens), r.prompt_cache)
                self._forget(rid)
        return out

    def _solo_step(self) -> list[Emission]:
        solo = self._solo
        e = solo.step()
        if e is None:
            return []
        if e.finish_reason is not None:
            self.tape.store(tuple(solo.fed), solo.cache)
            self._solo = None
        return [e]

    @property
    def busy(self) -> bool:
        return self._solo is not None or bool(self._uid_by_rid)

    def prompt_tokens_in_flight(self) -> int:
        return sum(self._prompt_left.values()) + (len(self._solo.todo) if self._solo is not None else 0)

    def close(self) -> None:
        mx.synchronize()
        self._gen.close()


class SpeculativeEngine:
    """One request at a time (speculation is singleton-only); others wait FIFO."""

    def __init__(self, model, draft_model, eos_ids: set[int], *, num_draft_tokens: int = 3,
                 prefill_step_size: int = 512):
        self._model = model
        self._draft = draft_model
        self._eos = eos_ids
        self._num_draft = num_draft_tokens
        self._prefill_step_size = prefill_step_size
        self._queue: deque[Job] = deque()
        self._active: Job | None = None
        self._stream = None
        self._count = 0

    def insert(self, job: Job) -> int:
        self._queue.append(job)
        return 0

    def cancel(self, rid: str) -> None:
        if self._active is not None and self._active.rid == rid:
            self._finish()
        else:
            self._queue = deque(j for j in self._queue if j.rid != rid)

    def _finish(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._active, self._stream = None, None

    def step(self) -> list[Emission]:
        if self._active is None:
            if not self._queue:
                return []
            self._active = self._queue.popleft()
            self._count = 0
            self._stream = speculative_generate_step(
                mx.array(self._active.prompt),
                self._model,
                self._draft,
                num_draft_tokens=self._num_draft,
                max_tokens=self._active.max_tokens,
                sampler=sampler_for(self._active),
                logits_processors=processors_for(self._active),
                prefill_step_size=self._prefill_step_size,
            )
        job = self._active
        try:
            token, logprobs, _ = next(self._stream)
        except StopIteration:
            self._finish()
            return [Emission(job.rid, None, "length")]
        token = int(token)
        self._count += 1
        reason = finish_reason(token, self._count, job.max_tokens, self._eos)
        if reason is not None:
            self._finish()
        return [emission(job.rid, token, reason, logprobs, job.logprobs)]

    @property
    def busy(self) -> bool:
        return self._active is not None or bool(self._queue)

    def prompt_tokens_in_flight(self) -> int:
        active = len(self._active.prompt) if self._active is not None and self._count == 0 else 0
        return active + sum(len(j.prompt) for j in self._queue)

    def close(self) -> None:
        mx.synchronize()
        self._finish()


def sample_at(job: Job, i: int, logprobs: mx.array) -> mx.array:
    """The job's token i from `logprobs` (one row, [1, vocab], as plain decoding holds it), drawn as plain
    decoding draws it: greedy, or with token_key(seed, i)."""
    return greedy(logprobs) if job.sampling["temperature"] == 0.0 else \
        SeededSampler(job.seed, job.sampling, job.offset + i)(logprobs)


def trim_to(cache: list, length: int) -> None:
    trim_prompt_cache(cache, cache[0].offset - length)


class MTPEngine:
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

    A drafter that refuses a shape (a kernel's layout limit past some prompt length) ends drafting for
    that request: plain decoding from there, said in the log and counted, the rank alive."""

    def __init__(self, model, eos_ids: set[int], *, num_draft_tokens: int = 1, prefill_step_size: int = 512,
                 log=print):
        self._model = model
        self._eos = eos_ids
        self.num_draft_tokens = num_draft_tokens
        self._chunk = prefill_step_size
        self._log = log
        self._queue: deque[Job] = deque()
        self._active: Job | None = None
        self.proposed = self.accepted = self.fallbacks = 0

    # --- the Engine protocol ------------------------------------------------------
    def insert(self, job: Job) -> int:
        self._queue.append(job)
        return 0

    def cancel(self, rid: str) -> None:
        if self._active is not None and self._active.rid == rid:
            self._active = None
        else:
            self._queue = deque(j for j in self._queue if j.rid != rid)

    @property
    def busy(self) -> bool:
        return self._active is not None or bool(self._queue)

    def prompt_tokens_in_flight(self) -> int:
        return (len(self._todo) if self._active is not None else 0) + sum(len(j.prompt) for j in self._queue)

    def close(self) -> None:
        mx.synchronize()
        self._active = None

    def draft_stats(self) -> dict:
        return {"drafter": "mtp", "draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "draft_fallbacks": self.fallbacks}

    def step(self) -> list[Emission]:
        if self._active is None:
            if not self._queue:
                return []
            self._begin(self._queue.popleft())
        if len(self._todo) > self._chunk:
            self._prefill()
            return []
        return self._verify()

    # --- one request ----------------------------------------------------------------
    def _begin(self, job: Job) -> None:
        self._active = job
        self._cache = make_prompt_cache(self._model)
        self._mtp_cache = self._model.make_mtp_cache()
        self._todo = list(job.prompt)  # the prompt not yet through the target
        self._base = 0  # positions both caches hold for good
        self._count = 0  # tokens emitted
        self._pending: int | None = None  # the last emitted token, not yet through the target
        self._drafts: mx.array | None = None  # the head's drafts after it (on the device)
        self._drafting = True
        self._processors = processors_for(job)
        self._said = mx.array(job.prompt, dtype=mx.uint32) if self._processors else None  # what they see

    def _prefill(self) -> None:
        """A chunk of the prompt that is not its last through the target; the head learns its positions."""
        chunk, self._todo = self._todo[:self._chunk], self._todo[self._chunk:]
        with mx.stream(generation_stream):
            hidden = self._model.hidden(mx.array(chunk, dtype=mx.uint32)[None], self._cache)
        self._learn(hidden, mx.array(chunk[1:] + self._todo[:1], dtype=mx.uint32))
        mx.eval([c.state for c in self._cache] + ([c.state for c in self._mtp_cache] if self._drafting else []))
        self._base += len(chunk)

    def _verify(self) -> list[Emission]:
        """The places (the prompt's last chunk, or the pending token and the drafts) through the target,
        sampled from `first` on: the drafts it agrees with and its own next token come out."""
        job = self._active
        if self._todo:
            inputs, first, self._todo = mx.array(self._todo, dtype=mx.uint32), len(self._todo) - 1, []
        else:
            inputs, first = mx.array([self._pending], dtype=mx.uint32), 0
            if self._drafts is not None:
                inputs = mx.concatenate([inputs, self._drafts])
        with mx.stream(generation_stream):
            hidden = self._model.hidden(inputs[None], self._cache)
            logprobs = self._logprobs(self._model.head(hidden[0, first:]), inputs[first + 1:])
            sampled = mx.concatenate([sample_at(job, self._count + p, logprobs[p:p + 1])
                                      for p in range(logprobs.shape[0])]).astype(mx.uint32)
        learned = self._learn(hidden, mx.concatenate([inputs[1:first + 1], sampled]))
        mx.eval([sampled, logprobs, *(learned or ())])
        tokens, guessed = sampled.tolist(), inputs[first + 1:].tolist()
        kept = 0
        while kept < len(guessed) and guessed[kept] == tokens[kept]:
            kept += 1
        self.proposed += len(guessed)
        self.accepted += kept
        out = self._emit(tokens[:kept + 1], logprobs)
        if self._active is not None:
            at = first + kept  # the place of the last token kept
            self._base += at + 1
            trim_to(self._cache, self._base)
            if self._said is not None:
                self._said = mx.concatenate([self._said, sampled[:kept + 1]])
            self._pending = tokens[kept]
            self._drafts = self._chain(*learned, at) if learned and self._drafting else None
        return out

    def _logprobs(self, logits: mx.array, drafts: mx.array) -> mx.array:
        """Log probabilities at each place, the request's processors run with what precedes that place:
        what was said, then the drafts before it."""
        if self._processors:
            rows = []
            for p in range(logits.shape[0]):
                row = logits[p:p + 1]
                seen = mx.concatenate([self._said, drafts[:p]])
                for processor in self._processors:
                    row = processor(seen, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _learn(self, hidden: mx.array, next_tokens: mx.array) -> tuple[mx.array, mx.array] | None:
        """The head's cache, cut back to the kept positions, learns (hidden state at p, token at p+1) for
        these places: its states and logits at each. None once drafting has ended for the request."""
        if not self._drafting:
            return None
        with self._refusals():
            trim_to(self._mtp_cache, self._base)
            return self._model.mtp_draft(hidden, next_tokens[None], self._mtp_cache)
        return None

    def _chain(self, h: mx.array, logits: mx.array, at: int) -> mx.array | None:
        """num_draft_tokens drafts after place `at` of the head's last learning: its guess there, then
        each from the one before (on the device: they go into the next verify's graph)."""
        with self._refusals():
            trim_to(self._mtp_cache, self._base)
            guesses = [mx.argmax(logits[:, at], axis=-1)]
            h = h[:, at:at + 1]
            while len(guesses) < self.num_draft_tokens:
                h, logits = self._model.mtp_draft(h, guesses[-1][None], self._mtp_cache)
                guesses.append(mx.argmax(logits[:, -1], axis=-1))
            return mx.concatenate(guesses).astype(mx.uint32)
        return None

    @contextmanager
    def _refusals(self):
        """A kernel's refusal of a shape: the same on every rank, so all go on plainly."""
        try:
            with mx.stream(generation_stream):
                yield
        except Exception as e:
            self._drafting = False
            self.fallbacks += 1
            self._log(f"drafter refused ({type(e).__name__}: {str(e)[:200]}); request {self._active.rid} "
                      "goes on without drafts")

    def _emit(self, tokens: list[int], logprobs: mx.array) -> list[Emission]:
        job, out = self._active, []
        for i, token in enumerate(tokens):
            self._count += 1
            reason = finish_reason(token, self._count, job.max_tokens, self._eos)
            out.append(emission(job.rid, token, reason, logprobs[i], job.logprobs))
            if reason is not None:
                self._active = None
                break
        return out
