"""The prefix store: what a rank keeps of the prompts it served, built once by the rank process and handed to
the engine (runtime/engine/rowwise.py, drafting or not). It holds the token tape
(runtime/prefix/tape.py), the snapshots on disk (runtime/prefix/snapshot.py), the rates restores weigh
(runtime/prefix/rates.py) and where prompts stop for checkpoints (runtime/prefix/checkpoints.py). A request's
own part (its snapshot point, its checkpoints) stays with the request: the store is told it at each call."""

from __future__ import annotations

from typing import NamedTuple

from mlx_lm.models.cache import make_prompt_cache

from runtime.prefix.checkpoints import Stopping, Taken, needed
from runtime.prefix.rates import Rates
from runtime.prefix.snapshot import Snapshots, due, leaf_types, snapshot_kind
from runtime.prefix.tape import TokenTape

NO_SNAPSHOT = ("", 0)  # the snapshot point of a tape with nothing on disk: (its snapshot id, tokens written)


class Prefix(NamedTuple):
    """What the store gives a request as it begins."""

    cache: list  # the tape's longest reusable prefix of its prompt, cut back to it; else a fresh cache
    cached: int  # how much of its prompt that cache holds
    since: tuple[str, int]  # its snapshot point: the id and length of what its tape has on disk
    taken: Taken  # its checkpoints, to take as its prefill reaches the stops of its prompt
    taps: object = None  # the target's taps at the last positions its cache holds, kept with its tape, or None


class PrefixStore:
    def __init__(self, model, *, prefill_step_size: int = 512, tape_capacity: int = 8,
                 snapshots: Snapshots | None = None, rates: Rates | None = None,
                 markers: frozenset[int] = frozenset(), checkpoint_budget: int = 1 << 30):
        self._model = model
        self.tape = TokenTape(tape_capacity, checkpoint_budget)
        # where prompts stop and take checkpoints: for caches a trim cannot cut back, every fourth chunk's end
        # and before the template's message markers
        self.stopping = Stopping(markers, 4 * prefill_step_size, needed(self.fresh()))
        self.snapshots = snapshots
        self.rates = rates or Rates(None)  # the speed of prefills and reads (restores weigh it: runtime/restore.py)
        self._chunk = prefill_step_size
        self._prefilled = (0, 0.0)  # tokens prefilled in whole chunks and the seconds it took
        self._kind = snapshot_kind(leaf_types(self.fresh())) if snapshots else None

    def fresh(self) -> list:
        """An empty cache of the model's."""
        return make_prompt_cache(self._model)

    def take(self, job) -> Prefix:
        """A cache for `job` (its `prompt` and `tenant`) from the token tape, its snapshot point from it and its
        checkpoints (where its prompt stops, those its cache inherited)."""
        stops = self.stopping.stops(job.prompt)
        cache, cached, sid, inherited, taps = self.tape.take(job.prompt, job.tenant, stops)
        since = NO_SNAPSHOT
        if self.snapshots:
            since = self.snapshots.base(sid, cached)
            if sid:
                self.snapshots.used(sid)
        return Prefix(cache if cache is not None else self.fresh(), cached, since, Taken(stops, inherited), taps)

    def keep(self, tenant: str, since: tuple[str, int], tokens, cache: list, final: bool,
             taken: Taken | None = None, taps=None) -> tuple[str, int]:
        """A request's tape as it goes (`tokens` the ids its cache holds, or more): staged for its snapshot when
        due; at its end (`tokens` exactly what its cache holds, `taken` its checkpoints, `taps` the target's taps
        at its last positions) into the token tape. Returns the request's snapshot point from here."""
        points = tuple(taken.points) if final and taken else ()
        if final:
            tokens = tuple(tokens)
        if self.snapshots:
            since = self.snapshots.stage(tokens, cache, since, final, tenant, taps, points)
        if final:
            self.tape.store(tokens, cache, since[0], tenant, points, taps)
        return since

    def due(self, since: tuple[str, int], told: int) -> bool:
        """Whether a batched row whose tape holds `told` tokens is due for a snapshot in flight (its cache is
        then taken out of the batch: plain KV caches every `every` tokens, others whole once a quarter of their
        tape is new, as `snapshot.due` says for a request alone)."""
        return self._kind is not None and due(since[1], told, self.snapshots.every, False, self._kind == "whole")

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A piece of prompts gone in, noted in the rates restores weigh when it is a chunk at least: a
        restore is weighed against a long prompt's prefill, whose rate is its chunks'; a shorter piece's is
        mostly a forward's fixed cost (a turn's few new tokens), which would make prefilling look slower than
        it is and a request wait for a restore slower than its prefill."""
        if tokens < self._chunk:
            return
        self._prefilled = (self._prefilled[0] + tokens, self._prefilled[1] + seconds)
        self.rates.note(prefill_tps=self._prefilled[0] / self._prefilled[1])

    def pump(self) -> None:
        """What was staged for the snapshots a step ago, handed to their writer."""
        if self.snapshots:
            self.snapshots.pump()

    def close(self) -> None:
        if self.snapshots:
            self.snapshots.close()

    def stats(self) -> dict:
        tape = self.tape
        return {"tape_hits": tape.hits, "tape_hit_tokens": tape.hit_tokens, "tape_misses": tape.misses,
                "tape_not_reusable": tape.not_reusable, "tape_checkpoint_hits": tape.checkpoint_hits,
                "tape_checkpoints": tape.checkpoint_count, "tape_checkpoint_bytes": tape.checkpoint_bytes,
                "tape_taps_bytes": tape.taps_bytes,
                **(self.snapshots.stats() if self.snapshots else {})}
