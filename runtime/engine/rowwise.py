"""The engine: every request a row of one batch, a lone one as a batch of one, its drafts proposed by the
engine's proposer (runtime/engine/proposers.py: DSpark's stages, the model's MTP head, a draft model; or
nobody), one batched verify a step.

A request's prompt goes through the target in its own caches, as the plain decoder takes it (in chunks, a
resumed answer's tokens in the pieces decoding gives: pools.prompt_piece), its drafter learning it as it goes;
prompts at the same place whose pieces are as long go in in one forward, their caches merged for it and taken
back out (one shape, no pads: each row's caches are those it would have alone); once only its last token is
left a prompt joins the batch (`scheduler.plan` says each step). A row alone decodes in
its own caches (DSpark's verify armed as omlx arms a lone request's: `set_dspark_verify_armed`); they merge
into a batch's when a second row joins, and the row left alone takes its own back out. Each step every row
feeds its pending token and its drafts (a row without drafts, its first step or its drafting refused, feeds
its pending token in their places: a guess like any other, kept only where the target samples it) in one
forward of `1 + width` places, `width` the most drafts a row has (each row its request's `draft_tokens`, at
most the engine's; a row that takes fewer fills the rest with guesses, never kept); each row's places are
sampled with its own keys and processors and each keeps its drafts up to its first miss, at most its own
width of them. Every rank agrees on every row's count (`drafting.agree`). Where a row kept fewer than it fed,
the batch's caches go back to where the step began (runtime/prefix/rollback.py: a trim where that is exact;
omlx's pooled and windowed caches cannot be trimmed) and the step's recorded writes of every row's kept places
are written again, the shorter rows right-padded (mlx-lm's `prepare`/`finalize`: the pads leave no trace):
one target forward a step. Each pooled window a row's places complete is pooled alone in the verify
(`pools.pool_alone`: omlx overlaps a forward's windows after its first, decoding none), so a row drafts the
whole block whatever its offset (where a model's pools cannot be pooled alone, the verify's width stays under
its smallest overlapping window): each row's caches then hold what decoding it alone, one position at a time,
would hold, and its answer is that decoding's, token for token.

A row that ends leaves the batch at once, its caches taken out of it into the prefix store's token tape (so
the next turn of its conversation prefills only its new tokens); a row that comes joins once its prompt is in,
while the others go on: no answer waits for another, and none is handed over.

While no row drafts (each asked for none, or its drafting was refused, or nobody drafts: `--drafter off`) and
no prompt waits to join, a step is plain: each row's pending token alone. Then the next step is queued on the
device, fed the tokens this one sampled there, before this one is read back (as mlx-lm's generate_step and
BatchGenerator go a step ahead): the host's work of a step (a grammar's mask among it) runs while the device
computes the next. A row that ends meanwhile leaves with its last token in its caches (its tape says so), and
the queued step's place for it is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.generate import generation_stream

from common.prefills import Position
from runtime.models import pools
from runtime.prefix import rollback
from runtime.engine.drafting import agree, ends_after, place_logprobs, sample_places
from runtime.engine.jobs import Emission, Job, emission, finish_reason
from runtime.engine.proposers import Proposer
from runtime.engine.request import Request
from runtime.engine.scheduler import Row, ahead, plan
from runtime.prefix.store import PrefixStore


def in_order(caches: list) -> None:
    """Each rotated window of a batch's caches put back in the order of its positions, before a forward of more
    than one place. mlx-lm's BatchRotatingKVCache masks such a forward from where a rotated window writes
    next, though the forward first puts the window in order (`_update_concat`): a row with left padding
    would then attend to a pad or miss one of its own keys. In order, the mask and the forward agree."""
    for leaf in rollback.leaves(caches):
        if getattr(leaf, "rotated", False):
            leaf._temporal_order()


def padding(lengths: list[int]) -> list[int]:
    """The pads after each row's places in a forward of the longest."""
    return [max(lengths) - n for n in lengths]


@dataclass
class Queued:
    """A plain step on the device, not read back yet: the rows it fed (the batch's, in their order then) and
    what the target made of them."""

    rows: list[Request]
    states: mx.array | None
    logprobs: list[mx.array]
    sampled: mx.array


class RowwiseEngine:
    """The Engine that drafts every request row by row, its drafts `proposer`'s; caches and tapes come from and
    go to the prefix store `prefixes`."""

    def __init__(self, model, eos_ids: set[int], proposer: Proposer, *, prefixes: PrefixStore,
                 num_draft_tokens: int = 0, prefill_step_size: int = 512, completion_batch_size: int = 16,
                 log=print):
        self._model = model
        self.proposer = proposer
        self._eos = eos_ids
        self.prefixes = prefixes
        self._chunk = prefill_step_size
        self._room = completion_batch_size  # the most rows the batch takes
        self._windows = pools.overlap_windows(model)
        self.width = proposer.width(num_draft_tokens)
        self._log = log
        self._joining: deque[Request] = deque()  # prompts going in (in their own caches), first come first
        self._rows: list[Request] = []  # the batch, in the order of its caches' rows
        self._cache: list | None = None  # the batch's caches: a lone row's own until a second row joins
        self._merged = False  # whether they are merged (a batch's rows), else the one row's own
        self._queued: Queued | None = None  # a plain step on the device, not read back yet
        self.proposed = self.accepted = self.fallbacks = self.batched_steps = self.refeeds = 0

    # --- Engine -------------------------------------------------------------------------------------------
    def insert(self, job: Job) -> int:
        prefix = self.prefixes.take(job)
        row = Request.begin(job, prefix, context=self.proposer.context(prefix), width=self.width)
        self._joining.append(row)
        return row.cached

    def cancel(self, rid: str) -> None:
        self._joining = deque(r for r in self._joining if r.job.rid != rid)
        self._leave([r for r in self._rows if r.job.rid == rid], ended=False)

    def step(self) -> list[Emission]:
        """The step `scheduler.plan` makes of the rows and the prompts going in, carried out; or, while the batch
        decodes plainly, the step queued on the device a step ago read back, the next queued behind it first."""
        if self._queued is not None:
            return self._read(self._queued, go_on=self._plain())
        joining = [self._seen(r) for r in self._joining]
        step = plan(joining, [self._seen(r) for r in self._rows], self._room)
        if step.prefill:
            self._prefill([r for r in self._joining if r.rid in step.prefill], joining[0].piece)
        for _ in step.join:
            self._join(self._joining.popleft())
        if step.verify and self._plain():  # no row drafts: the step's width is 0
            pending = mx.array([[r.pending] for r in self._rows], dtype=mx.uint32)
            return self._read(self._queue(pending, unread=0), go_on=True)
        return self._verify(step.width) if step.verify else []

    @property
    def busy(self) -> bool:
        return bool(self._rows or self._joining)

    def prompt_tokens_in_flight(self) -> int:
        return sum(len(r.todo) for r in self._joining)

    def prefilling(self) -> list[Position]:
        """The joining rows' prompts, the first going in a chunk a step, the others queued behind it."""
        return [r.position() for r in self._joining]

    def close(self) -> None:
        mx.synchronize()
        self.prefixes.close()

    def stats(self) -> dict:
        return {**self.prefixes.stats(), "drafter": self.proposer.drafter, "draft_proposed": self.proposed,
                "draft_accepted": self.accepted, "draft_fallbacks": self.fallbacks,
                "draft_batched_steps": self.batched_steps, "draft_refeeds": self.refeeds}

    def _seen(self, row: Request) -> Row:
        """The row as the scheduler weighs it."""
        left = len(row.todo)
        return Row(row.rid, left, self._piece(row) if left > 1 else 0, 0 if row.drafts is None else row.width,
                   row.base)

    # --- a prompt going in --------------------------------------------------------------------------------
    def _piece(self, row: Request) -> int:
        """How much of the row's prompt its next prefill feeds: as the plain decoder takes it (pools.prompt_piece)."""
        return pools.prompt_piece(row.base, len(row.job.prompt), row.job.offset, self._chunk, self._windows,
                                  row.taken.stops)

    def _prefill(self, rows: list[Request], n: int) -> None:
        """The next `n` of each row's prompt (rows at one place) through its own caches, in one forward: several
        rows' caches merged for it (of one length, they need no pads) and taken back out after; each row's
        drafter learning its own; its rate noted for the restores to weigh."""
        began = time.perf_counter()
        chunks = [r.todo[:n] for r in rows]
        for r in rows:
            r.todo = r.todo[n:]
        cache = rows[0].cache if len(rows) == 1 else [c.merge([r.cache[i] for r in rows])
                                                      for i, c in enumerate(rows[0].cache)]
        with mx.stream(generation_stream):
            _, states = self.proposer.forward(mx.array(chunks, dtype=mx.uint32), cache)
            if len(rows) > 1:
                for i, r in enumerate(rows):
                    r.cache = [c.extract(i) for c in cache]
        for i, (r, chunk) in enumerate(zip(rows, chunks)):
            r.base += n
            mine = None if states is None else states[i:i + 1]
            self.proposer.committed(r, mine)
            if r.drafting:
                with self._refusals(r):
                    self.proposer.prefilled(r, mine, mx.array(chunk[1:] + r.todo[:1], dtype=mx.uint32))
        mx.eval([c.state for r in rows for c in r.cache])
        self.prefixes.prefilled(n * len(rows), time.perf_counter() - began)
        self.prefixes.pump()
        for r in rows:
            r.taken.reached(r.cache, r.base)
            r.since = self.prefixes.keep(r.job.tenant, r.since, r.tape, r.cache, False)

    def _join(self, row: Request) -> None:
        """The row's caches into the batch's: its last prompt token is its first pending one."""
        (row.pending,), row.todo = row.todo, []
        if self._cache is None:
            self._cache = row.cache
        else:
            if not self._merged:
                self._cache, self._merged = [c.merge([c]) for c in self._cache], True
            for batch, one in zip(self._cache, row.cache):
                batch.extend(one.merge([one]))
        row.cache = None
        self._rows.append(row)

    # --- a step of the batch ------------------------------------------------------------------------------
    def _verify(self, width: int) -> list[Emission]:
        """Every row's pending token and `width` places after it through the target in one forward; each row
        keeps its drafts up to its first miss."""
        rows = self._rows
        inputs = mx.stack([self._places(r, width) for r in rows])
        if width:
            in_order(self._cache)
        saved = rollback.checkpoint(self._cache, 1 + width, recording=True)
        try:
            states, logprobs, sampled = self._target(rows, inputs)
        except Exception as e:
            if not width:
                raise
            saved.undo()  # a kernel refusing the batched verify's shape: every row plainly from here
            for r in rows:
                self._refused(r, "the target's verify", e)
            return self._verify(0)
        kept = []
        drafts = []  # each row's (proposed, accepted) this step
        for r, tokens, places in zip(rows, sampled.tolist(), inputs.tolist()):
            guessed = places[1:r.width + 1]
            k = next((i for i, (g, t) in enumerate(zip(guessed, tokens)) if g != t), len(guessed))
            kept.append(k)
            r.kept = tokens[:ends_after(tokens[:k + 1], r.count, r.job.max_tokens, self._eos)]
            drafts.append((0, 0) if r.drafts is None else (len(guessed), min(k, len(r.kept))))
        if width:
            agree(kept)
            self.batched_steps += sum(r.drafts is not None for r in rows) > 1
        fed = [len(r.kept) for r in rows]
        if min(fed) < 1 + width:
            self._cut(saved, inputs, fed)
        else:
            saved.release()
        out, ended = [], []
        for i, r in enumerate(rows):
            mine = self._emit(r, logprobs[i], drafts[i])
            r.base += len(r.kept)
            committed = None if states is None else states[i:i + 1, :len(r.kept)]
            self.proposer.committed(r, committed)
            out += mine
            if mine[-1].finish_reason is not None:
                ended.append(r)
                continue
            if r.said is not None:
                r.said = mx.concatenate([r.said, sampled[i, :len(r.kept)]])
            r.pending = r.kept[-1]
            r.drafts = self._draft(r, committed) if r.drafting else None
        if ended:
            self._leave(ended)
        self._snapshot_rows()
        return out

    # --- plain steps, each queued a step ahead ----------------------------------------------------------------
    def _plain(self) -> bool:
        """Whether the batch's next step is queued before this one is read back (`scheduler.ahead`)."""
        return ahead(len(self._joining), [not r.drafting for r in self._rows])

    def _queue(self, pending: mx.array, unread: int) -> Queued:
        """Every row's `pending` token (on the device: [rows, 1]) through the target, queued and not waited for;
        each row's token is its answer's token `count + unread` (`unread` tokens still to be read back before
        it), its processors shown what it said up to its pending token. Its caches hold the pending token from
        here (`base` counts it)."""
        rows = list(self._rows)
        with mx.stream(generation_stream), pools.decoding():
            logits, states = self.proposer.forward(pending, self._cache)
            logprobs = [place_logprobs(logits[i], r.processors, r.said, pending[i, 1:]) for i, r in enumerate(rows)]
            sampled = mx.stack([sample_places(r.job, r.count + unread, lp) for r, lp in zip(rows, logprobs)])
        mx.async_eval([a for a in (states, sampled, *logprobs) if a is not None])
        for r in rows:
            r.base += 1
        return Queued(rows, states, logprobs, sampled)

    def _read(self, queued: Queued, go_on: bool) -> list[Emission]:
        """The `queued` step read back, its rows' tokens emitted; with `go_on`, the next step is queued first,
        from its tokens still on the device. A row cancelled since it was queued is passed over; one that ended
        leaves with its last token in its caches (the next step fed it). What a row with processors said takes
        its token on the device, so that the next step's processors run while this one is read (a grammar's
        mask is built on the host while the device computes the forward: GrammarMask)."""
        self._queued = None
        for i, r in enumerate(queued.rows):
            if r.said is not None and r in self._rows:
                r.said = mx.concatenate([r.said, queued.sampled[i]])
        if go_on:
            where = [queued.rows.index(r) for r in self._rows]
            self._queued = self._queue(queued.sampled if where == list(range(len(queued.rows))) else
                                       queued.sampled[mx.array(where)], unread=1)
        out, ended = [], []
        for i, (r, tokens) in enumerate(zip(queued.rows, queued.sampled.tolist())):
            if r not in self._rows:
                continue
            r.kept = tokens
            mine = self._emit(r, queued.logprobs[i], (0, 0))
            self.proposer.committed(r, None if queued.states is None else queued.states[i:i + 1])
            out += mine
            if mine[-1].finish_reason is not None:
                ended.append(r)
            r.pending = tokens[-1]
        self._leave(ended)
        self._snapshot_rows()
        return out

    def _snapshot_rows(self) -> None:
        """The rows' answers in flight, snapshotted when due as a request alone's are: each row's caches taken
        out of the batch's (a copy of its row)."""
        self.prefixes.pump()  # what was staged a step ago, evaluated by now
        for i, r in enumerate(self._rows):
            if self.prefixes.due(r.since, r.base):  # len(r.fed), without copying the tape
                r.since = self.prefixes.keep(r.job.tenant, r.since, r.fed, self._own(i), False, taps=r.recent)

    def _places(self, row: Request, width: int) -> mx.array:
        """The row's pending token and `width` places after it: its own drafts, its pending token in the others."""
        drafts = [] if row.drafts is None else [row.drafts[:width]]
        return mx.concatenate([mx.array([row.pending], dtype=mx.uint32), *drafts,
                               mx.full((width - sum(d.shape[0] for d in drafts),), row.pending, dtype=mx.uint32)])

    def _target(self, rows: list[Request], inputs: mx.array):
        """Every row's places through the target (a lone row's drafts through its armed verify): the states its
        drafter drafts from, and each row's log probabilities and samples."""
        with mx.stream(generation_stream), pools.decoding():
            self.proposer.arm(not self._merged and inputs.shape[1] > 1)
            try:
                logits, states = self.proposer.forward(inputs, self._cache)
            finally:
                self.proposer.arm(False)
            logprobs = [place_logprobs(logits[i], r.processors, r.said, inputs[i, 1:]) for i, r in enumerate(rows)]
            sampled = mx.stack([sample_places(r.job, r.count, lp) for r, lp in zip(rows, logprobs)])
        mx.eval(states, logprobs, sampled)
        return states, logprobs, sampled

    def _cut(self, saved: rollback.Checkpoint, inputs: mx.array, lengths: list[int]) -> None:
        """The batch's caches back to each row's first `lengths[i]` places of the step: its recorded writes of
        them written again (no second forward); only where some layer's writes could not be recorded, undone and
        those places fed again in one forward of the longest, counted."""
        with mx.stream(generation_stream):
            if not saved.cut(max(lengths), around=self._padded(lengths)):
                self.refeeds += 1
                saved.undo()
                with self._padded(lengths), pools.decoding():
                    self._model(inputs[:, :max(lengths)], cache=self._cache)
        mx.eval([c.state for c in self._cache])

    @contextmanager
    def _padded(self, lengths: list[int]):
        """The writes inside as a forward of the longest row's places, the shorter rows right-padded (mlx-lm's
        `prepare`/`finalize`: the pads leave no trace)."""
        pads = padding(lengths)
        padded = max(pads) > 0
        if padded:
            for c in self._cache:
                c.prepare(lengths=lengths, right_padding=pads)
        yield
        if padded:
            for c in self._cache:
                c.finalize()

    def _emit(self, row: Request, logprobs: mx.array, drafts: tuple[int, int]) -> list[Emission]:
        """The row's kept tokens, the first saying the step's `drafts` (proposed, accepted) where the engine
        drafts, which its totals count."""
        self.proposed += drafts[0]
        self.accepted += drafts[1]
        out = []
        for i, token in enumerate(row.kept):
            row.count += 1
            reason = finish_reason(token, row.count, row.job.max_tokens, self._eos)
            e = emission(row.job.rid, token, reason, logprobs[i], row.job.logprobs)
            out.append(e if i or not self.width else replace(e, drafts=drafts))
        row.tape += row.kept
        return out

    def _leave(self, leaving: list[Request], ended: bool = True) -> None:
        """The `leaving` rows out of the batch: those that `ended` take their caches out of the batch's, into
        the token tape (a cancelled one's are dropped)."""
        if not leaving:
            return
        keep = [i for i, r in enumerate(self._rows) if r not in leaving]
        if ended:
            for i, r in enumerate(self._rows):
                if r in leaving:
                    self.prefixes.pump()
                    r.since = self.prefixes.keep(r.job.tenant, r.since, r.fed, self._own(i), True, r.taken, r.recent)
        self._rows = [self._rows[i] for i in keep]
        if not keep:  # a step queued for them is not read back
            self._cache, self._merged, self._queued = None, False, None
        elif self._merged:
            for c in self._cache:
                c.filter(keep)
            if len(keep) == 1:  # the row left alone goes on in caches of its own
                self._cache, self._merged = self._own(0), False

    def _own(self, i: int) -> list:
        """Row `i`'s caches: taken out of the batch's (a copy of its row), or the lone row's own."""
        return [c.extract(i) for c in self._cache] if self._merged else self._cache

    # --- drafts -------------------------------------------------------------------------------------------
    def _draft(self, row: Request, committed) -> mx.array | None:
        """The row's next drafts after its pending token, from the target's states at its committed places."""
        with self._refusals(row):
            return self.proposer.draft(row, committed)
        return None

    @contextmanager
    def _refusals(self, row: Request):
        try:
            with mx.stream(generation_stream):
                yield
        except Exception as e:
            self._refused(row, self.proposer.who, e)

    def _refused(self, row: Request, who: str, e: Exception) -> None:
        """A kernel's refusal of a shape (the same on every rank): the row goes on without drafts."""
        row.drafting, row.drafts = False, None
        self.fallbacks += 1
        self._log(f"{who} refused ({type(e).__name__}: {str(e)[:200]}); request {row.job.rid} goes on "
                  "without drafts")
