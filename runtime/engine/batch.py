"""The batch engine: continuous batching over mlx-lm's BatchGenerator, its caches from and its tapes into the
prefix store (runtime/prefix/store.py). A request alone runs in `SoloDecode` (the plain loop's speed) until a
second one arrives and it joins the batch."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream

from common.prefills import Position
from runtime.models import pools
from runtime.engine.jobs import Emission, Job, emission, finish_reason
from runtime.engine.request import Request
from runtime.engine.sampling import greedy, sampler_for
from runtime.engine.scheduler import admit
from runtime.prefix.store import Prefix, PrefixStore


class SoloDecode:
    """One request decoded by its own loop with the next step already queued on the
    device when a token is read back (mlx-lm's generate_step does the same):
    at batch one this is the plain loop's speed, which BatchGenerator's
    per-step bookkeeping does not reach. Each `step` is one prefill chunk or
    one token; a resumed answer's tokens are prefilled in the pieces decoding
    gives (`pools.prompt_piece`), so that they answer as the decode that said
    them."""

    def __init__(self, model, request: Request, eos_ids: set[int], prefill_step_size: int, windows: tuple[int, ...]):
        self.request = request
        self._model = model
        self._eos = eos_ids
        self._chunk = prefill_step_size
        self._windows = windows
        self._sampler = sampler_for(request.job)
        self.prefill_s, self.prefilled = 0.0, 0  # time spent prefilling the prompt in chunks, and its tokens
        self._next: tuple[mx.array, mx.array] | None = None  # sampled on the device, not yet read back

    def _forward(self, tokens: mx.array, said: bool) -> tuple[mx.array, mx.array]:
        """The next token and the log probabilities it was drawn from; `said`: the tokens are the answer's (the
        processors see them from here)."""
        r = self.request
        with mx.stream(generation_stream):
            logits = self._model(tokens[None], cache=r.cache)[:, -1, :]
            if r.processors:
                if said:
                    r.said = mx.concatenate([r.said, tokens.astype(mx.uint32)])
                for processor in r.processors:
                    logits = processor(r.said, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return self._sampler(logprobs), logprobs

    def step(self) -> Emission | None:
        r = self.request
        if len(r.todo) > 1:
            n = pools.prompt_piece(r.base, len(r.job.prompt), r.job.offset, self._chunk, self._windows,
                                   r.taken.stops)
            began = time.perf_counter()
            chunk = mx.array(r.todo[:n], dtype=mx.uint32)
            with mx.stream(generation_stream):
                self._model(chunk[None], cache=r.cache)
            mx.eval([c.state for c in r.cache])
            self.prefill_s += time.perf_counter() - began
            self.prefilled += n
            r.base += n
            r.todo = r.todo[n:]
            r.taken.reached(r.cache, r.base)
            return None
        if r.todo:
            self._next = self._forward(mx.array(r.todo, dtype=mx.uint32), said=False)
            r.base += len(r.todo)
            r.todo = []
        return self._read(go_on=True)

    def _read(self, go_on: bool) -> Emission:
        """The token queued on the device, read back; with `go_on` the step after it is queued first."""
        r = self.request
        (sampled, logprobs), self._next = self._next, None
        r.count += 1
        if go_on and r.count < r.job.max_tokens:
            self._next = self._forward(sampled, said=True)
            mx.async_eval(self._next)
        token = sampled.item()
        r.tape.append(token)
        if self._next is not None:
            r.base += 1
        reason = finish_reason(token, r.count, r.job.max_tokens, self._eos)
        return emission(r.rid, token, reason, logprobs, r.job.logprobs)

    def handover(self) -> tuple[Job | None, int, Emission | None]:
        """The rest of this request for a batch, with the cache as it is (a sliding window past its size
        or SSM state cannot be cut back): the token queued on the device is read back as its
        next emission and the batch goes on from it. Returns the job from that token on (its prompt
        the answer so far; None when that token ends it), how much of its prompt the cache
        holds, and that token's emission (None while it is still in its prompt)."""
        r = self.request
        if r.count == 0:
            return r.job, r.base, None
        last = self._read(go_on=False)
        if last.finish_reason is not None:
            return None, r.base, last
        job = r.job
        rest = Job(job.rid, tuple(r.tape), job.max_tokens - r.count, job.seed, job.sampling, job.offset + r.count,
                   job.logprobs, job.tenant)
        return rest, r.base, last


class BatchEngine:
    def __init__(self, model, eos_ids: set[int], *, prefill_step_size: int = 512, completion_batch_size: int = 16,
                 prefixes: PrefixStore | None = None):
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in sorted(eos_ids)],
            sampler=greedy,
            prefill_step_size=prefill_step_size,
            # mlx-lm raises the completion batch to the prefill batch (8 by default): a batch of one is one.
            prefill_batch_size=min(8, completion_batch_size),
            completion_batch_size=completion_batch_size,
        )
        self._model = model
        self._eos = eos_ids
        self._prefill_step_size = prefill_step_size
        self._windows = pools.overlap_windows(model)
        self._solo: SoloDecode | None = None
        self._carried: list[Emission] = []  # a handed-over solo request's last token, out at the next step
        self._rows: dict[int, Request] = {}  # the batch's requests by their BatchGenerator uid
        self.prefixes = prefixes or PrefixStore(model, prefill_step_size=prefill_step_size)

    def insert(self, job: Job) -> int:
        request = Request.begin(job, self.prefixes.take(job))
        admission = admit(1, self._solo is not None, bool(self._rows))
        if admission.alone:
            self._solo = SoloDecode(self._model, request, self._eos, self._prefill_step_size, self._windows)
            return request.cached
        if admission.hand_over:
            self._hand_over()
        self._join_batch(request)
        return request.cached

    def _hand_over(self) -> None:
        solo, self._solo = self._solo, None
        r = solo.request
        rest, cached, last = solo.handover()
        if last is not None:
            self._carried.append(last)
        if rest is None:
            self._finished(r, r.fed, r.cache, r.taken)
        else:
            self._join_batch(Request.begin(rest, Prefix(r.cache, cached, r.since, r.taken)))

    def _join_batch(self, r: Request) -> None:
        (r.uid,) = self._gen.insert(
            [r.todo],
            max_tokens=[r.job.max_tokens],
            caches=[r.cache],
            all_tokens=[r.fed],
            samplers=[sampler_for(r.job)],
            logits_processors=[r.processors],
        )
        r.cache = None
        r.prompt_left = len(r.todo)
        self._rows[r.uid] = r

    def _finished(self, r: Request, tokens, cache: list, taken=None) -> None:
        r.since = self.prefixes.keep(r.job.tenant, r.since, tokens, cache, True, taken)

    def cancel(self, rid: str) -> None:
        self._carried = [e for e in self._carried if e.rid != rid]
        if self._solo is not None and self._solo.request.rid == rid:
            self._solo = None
        for uid in [uid for uid, r in self._rows.items() if r.rid == rid]:
            self._gen.remove([uid])
            del self._rows[uid]

    def step(self) -> list[Emission]:
        out, self._carried = self._carried, []
        if self._solo is not None:
            return out + self._solo_step()
        prompt_responses, gen_responses = self._gen.next()
        self.prefixes.pump()
        for p in prompt_responses:
            if p.uid in self._rows:
                self._rows[p.uid].prompt_left = p.progress[1] - p.progress[0]
        for g in gen_responses:
            r = self._rows.get(g.uid)
            if r is None:
                continue
            out.append(emission(r.rid, g.token, g.finish_reason, g.logprobs, r.job.logprobs))
            if g.finish_reason is not None:
                self._finished(r, g.all_tokens, g.prompt_cache)
                del self._rows[g.uid]
            else:
                r.count += 1
        self._snapshot_rows()
        return out

    def _snapshot_rows(self) -> None:
        """The batched requests' answers in flight, snapshotted as a solo one's are: each row's cache taken out of
        the batch when it is due (`PrefixStore.due`)."""
        due = [uid for uid, r in self._rows.items() if self.prefixes.due(r.since, len(r.job.prompt) + r.count)]
        if due:
            for uid, (cache, tokens) in self._gen.extract_cache(due).items():
                r = self._rows[uid]
                r.since = self.prefixes.keep(r.job.tenant, r.since, tokens, cache, False)

    def _solo_step(self) -> list[Emission]:
        solo = self._solo
        r = solo.request
        e = solo.step()
        self.prefixes.pump()  # what was staged a step ago: on the device before the step just queued
        if e is None:  # a prefill chunk: its tape snapshotted when due, so a death loses one chunk at most
            r.since = self.prefixes.keep(r.job.tenant, r.since, r.tape, r.cache, False)
            if len(r.todo) == 1:
                self.prefixes.prefilled(solo.prefilled, solo.prefill_s)
            return []
        if e.finish_reason is not None:
            self._finished(r, r.fed, r.cache, r.taken)
            self._solo = None
        else:
            r.since = self.prefixes.keep(r.job.tenant, r.since, r.tape, r.cache, False)
        return [e]

    @property
    def busy(self) -> bool:
        return self._solo is not None or bool(self._rows) or bool(self._carried)

    def prompt_tokens_in_flight(self) -> int:
        return sum(r.prompt_left for r in self._rows.values()) + (len(self._solo.request.todo) if self._solo else 0)

    def prefilling(self) -> list[Position]:
        """The prompts going in: the solo request's, a chunk a step; the batch's rows', as far as BatchGenerator
        says (a chunk of each row a step, its rows queued behind the prefill batch at their cached part)."""
        solo = [self._solo.request.position()] if self._solo and self._solo.request.todo else []
        return solo + [Position(r.rid, len(r.job.prompt) - r.prompt_left, len(r.job.prompt))
                       for r in self._rows.values() if r.prompt_left]

    def close(self) -> None:
        mx.synchronize()
        self._gen.close()
        self.prefixes.close()

    def stats(self) -> dict:
        return self.prefixes.stats()
