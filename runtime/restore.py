"""Serve first, restore behind: a restarted generation is ready as soon as its weights are, and the tapes
its ranks hold in their prefix snapshots (runtime/prefix/snapshot.py) join the token tape while it serves.

At load the ranks exchange what each holds whole and agree on a plan: the tapes every rank has, most
recently used first, as many as the token tape keeps. A thread on each rank reads and checks them in that
order (no MLX: the model runs meanwhile); at a loop iteration while any is pending, every rank builds a part
of a cache its thread finished (`build_some`: a request that arrives meanwhile waits for a part, never for a
whole tape) and the ranks exchange which they have, and a tape every rank has ready joins
the token tape at that same iteration on all of them (one that any rank could not restore is dropped by
all). Rank 0 holds back a request whose prompt a pending tape serves further than the token tape, and moves
that tape to the front of every rank's queue (and of its builds), only when what is left of reading it (and
of the tape the thread reads before it) and of building it takes well under prefilling what it adds
(`worth_waiting`, from the rates this mesh measured); a new conversation never waits for old ones.
"""

from __future__ import annotations

import json
import threading
import time

from runtime.lockstep import Cancel, Drain, Insert, Message, RestoreFirst
from runtime.prefix.rates import Rates
from runtime.prefix.snapshot import Snapshots, agree, ends, leaf_types, serving, snapshot_kind
from runtime.prefix.tape import TokenTape, common_prefix, reusable_prefix


BUILD_BYTES = 64 << 20  # of a restored tape's cache built at one iteration of the loop, at most (a leaf at least)
# of a prefill's time, what a restore may take for a request to wait for it: one H100 read the same 1.6 GB tape
# in 1.0-2.0 s within one run (bench/restart_tapes.py), and a wait that misjudges costs more than the prefill
MARGIN = 0.75


# --- the decisions -------------------------------------------------------------------------------------------

def plan(agreed: list[str], parents: dict[str, str], whole_states: bool, capacity: int) -> list[str]:
    """The tapes to restore, most recently used first: of those every rank holds (`agreed`, least recently
    used first), the ones that serve (`serving`), at most `capacity`."""
    return serving(agreed, parents, whole_states)[-capacity:][::-1] if capacity else []


def worth_waiting(extra: int, to_read: int, to_build: int, read_bps: float, build_bps: float,
                  prefill_tps: float) -> bool:
    """Whether a request should wait for a tape still being restored, which serves `extra` more tokens of
    its prompt than the token tape does, with `to_read` bytes still to read before it is read (its own, and
    what the thread is reading before it) and `to_build` of its cache still to build (a part an iteration,
    between the steps of what is served): when that takes at most MARGIN of prefilling those tokens, by the
    rates measured (read or prefill 0 where bytes are left to read: not measured yet, and it does not wait;
    a build not measured yet is taken to be as slow as the read)."""
    build_bps = build_bps or read_bps
    if extra <= 0 or prefill_tps <= 0 or (to_read and read_bps <= 0) or (to_build and build_bps <= 0):
        return False
    return (to_read and to_read / read_bps) + (to_build and to_build / build_bps) <= MARGIN * extra / prefill_tps


def settled(results: list[dict[str, bool]]) -> dict[str, bool]:
    """The tapes every rank is done with (`results` by rank: tape -> whether its part is ready), in rank 0's
    order, each with whether every rank's part is ready."""
    common = set(results[0]).intersection(*results[1:])
    return {sid: all(r[sid] for r in results) for sid in results[0] if sid in common}


# --- the mechanism -------------------------------------------------------------------------------------------

class Restorer:
    """One rank's restores behind serving. `pending` (the plan's tapes not yet joined or dropped) is the same
    on every rank: it changes only at `adopt`, from what every rank said."""

    def __init__(self, snaps: Snapshots | None, tape: TokenTape, plan_: list[str], fresh, rates: Rates, log,
                 rank: int = 0):
        self.snaps, self.tape, self.fresh, self.rates, self.log = snaps, tape, fresh, rates, log
        self.pending = list(plan_)
        self.awaited: set[str] = set()  # pending tapes a request waits for (every rank is told: RestoreFirst)
        self.tokens: dict[str, tuple[str, tuple]] = {}  # rank 0: each pending tape's tenant and tokens, read first
        self._rank = rank
        self.trimmable = bool(snaps) and snapshot_kind(leaf_types(fresh())) == "append"
        self.restored_tokens = 0
        self._began = time.monotonic()
        self._held: dict[str, list[Insert]] = {}  # rank 0: inserts waiting for a tape
        self._queue = list(plan_)
        self._read: dict = {}  # by the thread: tape -> Read, or None when it could not be read
        self._built: dict[str, tuple | None] = {}
        self._took: dict[str, list[float]] = {}  # each tape's seconds reading it and building its cache
        self._reading: tuple[str, int, int] | None = None  # by the thread: the tape it reads, bytes read, its bytes
        # caches begun: each one's tape -> what was read of it, the build's steps, when it began, bytes built
        self._building: dict[str, tuple] = {}
        self.build_bytes = BUILD_BYTES
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="snapshot-reader", daemon=True)
        if self.pending:
            self._thread.start()
        if snaps is not None:
            snaps.restores_pending = len(self.pending)

    @classmethod
    def agree(cls, snaps: Snapshots | None, gather, tape: TokenTape, fresh, rates: Rates, log,
              rank: int) -> "Restorer":
        """The plan every rank makes from what every rank holds; every rank calls it, with snapshots or
        without: `gather` (Lockstep.gather) is a collective."""
        mesh, held = (snaps.me.mesh, snaps.held()) if snaps else ("", [])
        offers = [json.loads(b) for b in gather(json.dumps({"mesh": mesh, "tapes": held}).encode())]
        if snaps is None:
            return cls(None, tape, [], fresh, rates, log)
        parents = {s: g.parent for s, g in snaps.segments.items()}
        if any(o["mesh"] != mesh for o in offers):
            snaps.skip_all("foreign", ends(held, parents),
                           f"tape(s) of a mesh whose ranks load other models or worlds "
                           f"({[o['mesh'] for o in offers]})")
            return cls(snaps, tape, [], fresh, rates, log)
        agreed = agree([o["tapes"] for o in offers])
        everywhere = set(agreed)
        snaps.skip_all("missing", ends([s for s in held if s not in everywhere], parents),
                       "tape(s) not whole on every rank")
        whole_states = snapshot_kind(leaf_types(fresh())) == "whole"
        planned = plan(agreed, parents, whole_states, tape.capacity)
        snaps.skip_all("capacity", [s for s in ends(agreed, parents) if s not in planned],
                       f"tape(s) past the token tape's {tape.capacity} entries (the most recently used are restored)")
        return cls(snaps, tape, planned, fresh, rates, log, rank)

    def _run(self) -> None:
        types = leaf_types(self.fresh())
        if self._rank == 0:  # what each tape holds, from its token arrays alone, before any is read whole
            for sid in list(self._queue):
                if (held := self.snaps.tokens_of(sid)) is not None:
                    self.tokens[sid] = held
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                sid = self._queue.pop(0)
            began, self._reading = time.monotonic(), (sid, 0, self.snaps.nbytes_of(sid))
            got = self.snaps.read(sid, types, on_part=self._advance)
            took = time.monotonic() - began
            if got is not None:
                self.rates.note(read_bps=got.nbytes / max(took, 1e-6))
            with self._cv:
                self._read[sid] = got
                self._took[sid] = [took, 0.0]
                self._reading = None

    def _advance(self, nbytes: int) -> None:
        """A segment of the tape being read, read (by the thread)."""
        sid, done, total = self._reading
        self._reading = (sid, done + nbytes, total)

    def build_some(self) -> None:
        """At most `build_bytes` of a cache the thread read, a leaf at least, built now (a build stalls the loop:
        the requests it serves step between the parts of a tape, never behind a whole one): of one a request
        waits for first, else of the one begun, else of the first read."""
        with self._cv:
            ready = [*self._building, *self._read]
            sid = next((s for s in ready if s in self.awaited), ready[0] if ready else None)
            got = self._read.pop(sid) if sid in self._read else None
        if sid is None:
            return
        if sid not in self._building:
            if got is None:
                self._built[sid] = None
                return
            self._building[sid] = (got, self.snaps.building(got, self.fresh), time.monotonic(), [0])
        got, steps, began, built = self._building[sid]
        done = 0
        try:
            while done < self.build_bytes:
                done += next(steps)
        except StopIteration as end:
            self._built[sid] = ((*end.value, got.tenant, got.taps, self.snaps.checkpoints(got))
                                if end.value is not None else None)
            del self._building[sid]
            if end.value is not None:  # its parts' bytes over the wall time they took, the steps between included
                self._took[sid][1] = time.monotonic() - began
                self.rates.note(build_bps=(built[0] + done) / max(self._took[sid][1], 1e-6))
        built[0] += done

    def first(self, sid: str) -> None:
        """Read `sid` next (a request waits for it)."""
        self.awaited.add(sid)
        with self._cv:
            if sid in self._queue:
                self._queue.remove(sid)
                self._queue.insert(0, sid)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def adopt(self, gather) -> list[str]:
        """Build a part of a cache this rank's thread read (`build_some`), then, with every rank (`gather` is a
        collective), put into the token tape the tapes every rank has ready; returns them."""
        self.build_some()
        agreed = settled([json.loads(b) for b in gather(json.dumps(
            {sid: built is not None for sid, built in self._built.items()}).encode())])
        adopted, tokens, points, took = [], 0, 0, [0.0, 0.0]
        for sid, ok in agreed.items():
            built, its = self._built.pop(sid), self._took.pop(sid, (0.0, 0.0))
            self.pending.remove(sid)
            self.awaited.discard(sid)
            self.tokens.pop(sid, None)
            if ok and self.tape.store_older(*built):
                adopted.append(sid)
                tokens += len(built[0])
                points += len(built[-1])
                took = [a + b for a, b in zip(took, its)]
            elif ok:  # the tape filled meanwhile, or a newer tape serves every prompt it serves
                full = len(self.tape) >= self.tape.capacity
                self.snaps.skip("capacity" if full else "superseded",
                                f"tape {sid}: the token tape holds {len(self.tape)} newer tapes" if full else
                                f"tape {sid}: a newer tape of its tenant serves every prompt it serves")
            elif built is not None:
                self.snaps.skip("missing", f"tape {sid}: another rank could not restore its part")
        # counted, not marked used: the next generation restores the conversations served last first, not the
        # tapes this one restored behind them
        self.snaps.restored += len(adopted)
        self.snaps.restores_pending = len(self.pending)
        self.restored_tokens += tokens
        if adopted:
            self.log(f"restored {len(adopted)} tape(s) ({tokens} tokens, {points} checkpoints) from snapshots while "
                     f"serving (read in {took[0]:.2f}s, built in {took[1]:.2f}s); {len(self.pending)} pending")
        if not self.pending:
            self.close()
            self.log(f"restores done in {time.monotonic() - self._began:.1f}s: {self.snaps.restored} tape(s), "
                     f"{self.restored_tokens} tokens; skipped so far: {self.snaps.skipped or 'none'}")
        return adopted

    # --- rank 0 ---------------------------------------------------------------------------------------------
    def screen(self, outbox: list[Message], through: str) -> list[Message]:
        """Rank 0's outbox with the inserts that wait for a pending tape held back (and that tape moved to
        the front everywhere), and those whose tape is done let through; request `through` never waits."""
        out: list[Message] = []
        for msg in outbox:
            if isinstance(msg, Insert) and msg.job.rid != through and \
                    (sid := self._worth(msg.job.prompt, msg.job.tenant)) is not None:
                if sid not in self._held:
                    out.append(RestoreFirst(sid))
                self.log(f"request {msg.job.rid} waits for tape {sid}, which is being restored: reading it is "
                         "sooner than prefilling what it holds")
                self._held.setdefault(sid, []).append(msg)
                continue
            if isinstance(msg, Cancel):
                for held in self._held.values():
                    held[:] = [m for m in held if m.job.rid != msg.rid]
            if isinstance(msg, Drain):
                out += self.release(all_=True)
            out.append(msg)
        return self.release() + out

    def release(self, all_: bool = False) -> list[Insert]:
        """The held inserts whose tape joined the token tape or was dropped (all of them with `all_`)."""
        out = []
        for sid in [s for s in self._held if all_ or s not in self.pending]:
            out += self._held.pop(sid)
        return out

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @property
    def buildable(self) -> bool:
        """A tape read and not yet built, or one being built: each exchange of the loop builds a part of it."""
        with self._cv:
            return bool(self._building or self._read)

    def _worth(self, prompt: tuple, tenant: str) -> str | None:
        """The pending tape of `tenant` a prompt should wait for, if any (`worth_waiting`)."""
        if not self.tokens:
            return None
        served = self.tape.served(prompt, tenant)
        best, best_len = None, served
        for sid, (owner, tokens) in list(self.tokens.items()):
            if owner != tenant:
                continue
            n = reusable_prefix(common_prefix(tokens, prompt), len(tokens), len(prompt), self.trimmable)
            if n > best_len:
                best, best_len = sid, n
        if best is None or not worth_waiting(best_len - served, *self._left(best), self.rates.read_bps,
                                             self.rates.build_bps, self.rates.prefill_tps):
            return None
        return best

    def _left(self, sid: str) -> tuple[int, int]:
        """The bytes still to read and to build before pending tape `sid` joins the token tape, once it is
        first in line: what is left of it, and of the tape the thread reads meanwhile."""
        nbytes = self.snaps.nbytes_of(sid)
        with self._cv:
            if sid in self._built:
                return 0, 0
            if sid in self._building:
                return 0, nbytes - self._building[sid][3][0]
            if sid in self._read:
                return 0, nbytes
            reading, done, total = self._reading or ("", 0, 0)
        return (nbytes - done, nbytes) if reading == sid else (nbytes + total - done, nbytes)
