"""The batch engine: continuous batching over mlx-lm's BatchGenerator, with the
token tape (runtime/prefix/tape.py) as its prefix cache, snapshotted to disk when
given `snapshots` (runtime/prefix/snapshot.py). A request alone runs in `SoloDecode`
(the plain loop's speed) until a second one arrives and it joins the batch."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from runtime.models import pools
from runtime.engine.jobs import Emission, Job, emission, finish_reason
from runtime.engine.sampling import greedy, processors_for, sampler_for
from runtime.prefix.rates import Rates
from runtime.prefix.snapshot import Snapshots, leaf_types, snapshot_kind
from runtime.prefix.tape import TokenTape


class SoloDecode:
    """One job decoded by its own loop with the next step already queued on the
    device when a token is read back (mlx-lm's generate_step does the same):
    at batch one this is the plain loop's speed, which BatchGenerator's
    per-step bookkeeping does not reach. Each `step` is one prefill chunk or
    one token; a resumed answer's tokens are prefilled in the pieces decoding
    gives (`pools.prompt_piece`), so that they answer as the decode that said
    them."""

    def __init__(self, model, job: Job, cache: list, cached: int, eos_ids: set[int], prefill_step_size: int,
                 windows: tuple[int, ...]):
        self.job = job
        self.cache = cache
        self._model = model
        self._eos = eos_ids
        self._chunk = prefill_step_size
        self._windows = windows
        self._sampler = sampler_for(job)
        self._processors = processors_for(job)
        self._seen = mx.array(job.prompt[:cached], dtype=mx.uint32)  # what the logits processors see
        self.fed = list(job.prompt[:cached])  # the tokens whose keys and values the cache holds
        self.todo = list(job.prompt[cached:])
        self.emitted = 0
        self.prefill_s, self.prefilled = 0.0, 0  # time spent prefilling the prompt in chunks, and its tokens
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
            n = pools.prompt_piece(len(self.fed), len(self.job.prompt), self.job.offset, self._chunk,
                                    self._windows)
            began = time.perf_counter()
            chunk = mx.array(self.todo[:n], dtype=mx.uint32)
            with mx.stream(generation_stream):
                self._model(chunk[None], cache=self.cache)
            if self._processors:
                self._seen = mx.concatenate([self._seen, chunk])
            mx.eval([c.state for c in self.cache])
            self.prefill_s += time.perf_counter() - began
            self.prefilled += n
            self.fed += self.todo[:n]
            self.todo = self.todo[n:]
            return None
        if self.todo:
            self._next = self._forward(mx.array(self.todo, dtype=mx.uint32))
            self.fed += self.todo
            self.todo = []
        return self._read(go_on=True)

    def _read(self, go_on: bool) -> Emission:
        """The token queued on the device, read back; with `go_on` the step after it is queued first."""
        (sampled, logprobs), self._next = self._next, None
        self.emitted += 1
        if go_on and self.emitted < self.job.max_tokens:
            self._next = self._forward(sampled)
            mx.async_eval(self._next)
        token = sampled.item()
        if self._next is not None:
            self.fed.append(token)
        reason = finish_reason(token, self.emitted, self.job.max_tokens, self._eos)
        return emission(self.job.rid, token, reason, logprobs, self.job.logprobs)

    def handover(self) -> tuple[Job | None, int, Emission | None]:
        """The rest of this job for a batch, with the cache as it is (a sliding window past its size
        or SSM state cannot be cut back): the token queued on the device is read back as the job's
        next emission and the batch goes on from it. Returns the job from that token on (its prompt
        the answer so far; None when that token ends the job), how much of its prompt the cache
        holds, and that token's emission (None while the job is still in its prompt)."""
        job = self.job
        if self.emitted == 0:
            return job, len(self.fed), None
        last = self._read(go_on=False)
        if last.finish_reason is not None:
            return None, len(self.fed), last
        rest = Job(job.rid, tuple(self.fed) + (last.token,), job.max_tokens - self.emitted, job.seed,
                   job.sampling, job.offset + self.emitted, job.logprobs, job.tenant)
        return rest, len(self.fed), last


class BatchEngine:
    def __init__(self, model, eos_ids: set[int], *, prefill_step_size: int = 512,
                 completion_batch_size: int = 16, tape_capacity: int = 8, snapshots: Snapshots | None = None,
                 rates: Rates | None = None):
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
        self._carried: list[Emission] = []  # a handed-over solo job's last token, out at the next step
        self._rid_by_uid: dict[int, str] = {}
        self._uid_by_rid: dict[str, int] = {}
        self._prompt_left: dict[str, int] = {}
        self._logprobs: dict[str, int] = {}  # what each job asked for (Job.logprobs)
        self._told: dict[str, int] = {}  # a batched job's tokens so far: its prompt and what it emitted
        self.tape = TokenTape(tape_capacity)
        self.snapshots = snapshots
        self.rates = rates  # where the speed of prefills is noted (restores weigh it: runtime/restore.py)
        self._prefilled = (0, 0.0)  # tokens prefilled by solo jobs and the seconds it took
        # each job's snapshot point: the id and length of what its tape has on disk (a solo job's long
        # prefill once it ends and its answer every `snapshots.every` tokens; a batched job's at its end)
        self._since: dict[str, tuple[str, int]] = {}
        self._tenant: dict[str, str] = {}  # each job's tenant (Job.tenant): whose tape it reads and writes
        self._rows_snapshot = bool(snapshots) and snapshot_kind(leaf_types(make_prompt_cache(model))) == "append"

    def take(self, job: Job) -> tuple[list, int]:
        """A cache for `job` and how much of its prompt it holds: the token tape's longest reusable prefix,
        else a fresh cache; the job's snapshot point set from it."""
        cache, cached, sid = self.tape.take(job.prompt, job.tenant)
        self._tenant[job.rid] = job.tenant
        if self.snapshots:
            self._since[job.rid] = self.snapshots.base(sid, cached)
            if sid:
                self.snapshots.used(sid)
        return (cache if cache is not None else make_prompt_cache(self._model)), cached

    def keep(self, rid: str, tokens, cache: list, final: bool) -> None:
        """A job another engine decodes (a drafter's, from `take`), as this engine keeps its own: staged for
        its snapshot when due (`tokens` the ids its cache holds, or more), and at its end (`tokens` exactly
        what its cache holds) into the token tape."""
        if self.snapshots:
            self.snapshots.pump()
        if final:
            self._finished(rid, tuple(tokens), cache)
        else:
            self._snapshot(rid, tokens, cache, final=False)

    def insert(self, job: Job) -> int:
        cache, cached = self.take(job)
        if self._solo is None and not self._uid_by_rid:
            self._solo = SoloDecode(self._model, job, cache, cached, self._eos, self._prefill_step_size,
                                    self._windows)
            return cached
        if self._solo is not None:
            self._hand_over()
        self._join_batch(job, cache, cached)
        return cached

    def _hand_over(self) -> None:
        solo, self._solo = self._solo, None
        rest, cached, last = solo.handover()
        if last is not None:
            self._carried.append(last)
        if rest is None:
            self._finished(solo.job.rid, tuple(solo.fed), solo.cache)
        else:
            self._join_batch(rest, solo.cache, cached)

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
        self._told[job.rid] = len(job.prompt)

    def _forget(self, rid: str) -> None:
        uid = self._uid_by_rid.pop(rid)
        del self._rid_by_uid[uid]
        self._prompt_left.pop(rid, None)
        self._logprobs.pop(rid, None)
        self._told.pop(rid, None)

    def _snapshot(self, rid: str, tokens, cache: list, final: bool) -> str:
        """Stage what is new of this job's tape when due; the id of its snapshot so far ("" without)."""
        if not self.snapshots:
            return ""
        self._since[rid] = self.snapshots.stage(tokens, cache, self._since[rid], final, self._tenant[rid])
        return self._since[rid][0]

    def _finished(self, rid: str, tokens: tuple, cache: list) -> None:
        self.tape.store(tokens, cache, self._snapshot(rid, tokens, cache, final=True), self._tenant[rid])
        self._since.pop(rid, None)
        self._tenant.pop(rid, None)

    def cancel(self, rid: str) -> None:
        self._since.pop(rid, None)
        self._tenant.pop(rid, None)
        self._carried = [e for e in self._carried if e.rid != rid]
        if self._solo is not None and self._solo.job.rid == rid:
            self._solo = None
        if rid in self._uid_by_rid:
            self._gen.remove([self._uid_by_rid[rid]])
            self._forget(rid)

    def step(self) -> list[Emission]:
        out, self._carried = self._carried, []
        if self._solo is not None:
            return out + self._solo_step()
        prompt_responses, gen_responses = self._gen.next()
        if self.snapshots:
            self.snapshots.pump()
        for p in prompt_responses:
            rid = self._rid_by_uid.get(p.uid)
            if rid is not None:
                self._prompt_left[rid] = p.progress[1] - p.progress[0]
        for r in gen_responses:
            rid = self._rid_by_uid.get(r.uid)
            if rid is None:
                continue
            out.append(emission(rid, r.token, r.finish_reason, r.logprobs, self._logprobs[rid]))
            if r.finish_reason is not None:
                self._finished(rid, tuple(r.all_tokens), r.prompt_cache)
                self._forget(rid)
            else:
                self._told[rid] += 1
        self._snapshot_rows()
        return out

    def _snapshot_rows(self) -> None:
        """The batched jobs' answers in flight, snapshotted every `snapshots.every` tokens as a solo job's
        are: each row's cache taken out of the batch (its new tokens sliced) when it is due. Only plain KV
        caches: a batch's rows of other caches are written at their end."""
        if not self._rows_snapshot:
            return
        due_ = [self._uid_by_rid[rid] for rid, told in self._told.items()
                if told - self._since[rid][1] > self.snapshots.every]
        if due_:
            for uid, (cache, tokens) in self._gen.extract_cache(due_).items():
                self._snapshot(self._rid_by_uid[uid], tokens, cache, final=False)

    def _solo_step(self) -> list[Emission]:
        solo = self._solo
        e = solo.step()
        if self.snapshots:
            self.snapshots.pump()  # what was staged a step ago: on the device before the step just queued
        if e is None:  # a prefill chunk: its tape snapshotted when due, so a death loses one chunk at most
            self._snapshot(solo.job.rid, solo.fed, solo.cache, final=False)
            if len(solo.todo) == 1 and self.rates:
                self._prefilled = (self._prefilled[0] + solo.prefilled, self._prefilled[1] + solo.prefill_s)
                self.rates.note(prefill_tps=self._prefilled[0] / self._prefilled[1])
            return []
        if e.finish_reason is not None:
            self._finished(solo.job.rid, tuple(solo.fed), solo.cache)
            self._solo = None
        else:
            self._snapshot(solo.job.rid, solo.fed, solo.cache, final=False)
        return [e]

    @property
    def busy(self) -> bool:
        return self._solo is not None or bool(self._uid_by_rid) or bool(self._carried)

    def prompt_tokens_in_flight(self) -> int:
        return sum(self._prompt_left.values()) + (len(self._solo.todo) if self._solo is not None else 0)

    def close(self) -> None:
        mx.synchronize()
        self._gen.close()
        if self.snapshots:
            self.snapshots.close()

    def stats(self) -> dict:
        return {"tape_hits": self.tape.hits, "tape_hit_tokens": self.tape.hit_tokens, "tape_misses": self.tape.misses,
                "tape_not_reusable": self.tape.not_reusable, **(self.snapshots.stats() if self.snapshots else {})}
