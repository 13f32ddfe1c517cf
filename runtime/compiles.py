"""Grammars compiled behind serving: an answer held to a grammar joins the batch only once every rank has
compiled it, and no rank's loop waits for a compile.

Rank 0 holds back each insert of a held answer and sends its grammar ahead (`CompileGrammar`); every rank
compiles it in its worker thread (runtime/engine/grammar.py's `prepare`: at once when it is cached). At each
loop iteration while any is pending, the ranks exchange which they have compiled, and a grammar every rank
has is settled at that same iteration on all of them: rank 0 lets its inserts through at the next exchange (a
grammar a rank could not compile fails them instead). Other requests' steps go on meanwhile. The pattern is
runtime/restore.py's: `pending` changes only at messages and at agreements, so it is the same on every rank.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future

from runtime.engine import grammar
from runtime.lockstep import Cancel, CompileGrammar, Drain, Insert, Message
from runtime.restore import settled


def grammar_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class Compiles:
    """One rank's compiles of held answers' grammars. `fail(rid, why)`: rank 0 ends a request whose grammar
    some rank could not compile."""

    def __init__(self, fail=None, prepare=None):
        self.pending: list[str] = []  # grammar ids, in the order rank 0 sent them (the same on every rank)
        self._compiling: dict[str, Future] = {}
        self._held: dict[str, list[Insert]] = {}  # rank 0: inserts waiting for their grammar
        self._settled: dict[str, bool] = {}  # rank 0: grammars agreed since the last screen, compiled or not
        self._fail = fail
        self._prepare = prepare or grammar.prepare  # text -> the future of its compile

    def start(self, text: str) -> None:
        """Compile this grammar in the background (every rank, at the same message)."""
        gid = grammar_id(text)
        if gid not in self._compiling:
            self.pending.append(gid)
            self._compiling[gid] = self._prepare(text)

    def agree(self, gather) -> None:
        """With every rank (`gather` is a collective): settle the grammars every rank is done compiling."""
        self.settle(gather(self.offer()))

    def offer(self) -> bytes:
        """What this rank says at an agreement: the grammars it is done with, each whether it compiled."""
        return json.dumps({gid: f.exception() is None for gid, f in self._compiling.items() if f.done()}).encode()

    def settle(self, offers: list[bytes]) -> None:
        """The grammars every rank's offer says it is done with leave `pending`."""
        for gid, ok in settled([json.loads(b) for b in offers]).items():
            self.pending.remove(gid)
            del self._compiling[gid]
            self._settled[gid] = ok

    # --- rank 0 ---------------------------------------------------------------------------------------------
    def screen(self, outbox: list[Message]) -> list[Message]:
        """Rank 0's outbox with the inserts of held answers held back (their grammars sent ahead) and those
        whose grammar every rank compiled let through."""
        out: list[Message] = []
        for msg in outbox:
            text = msg.job.sampling.get("grammar") if isinstance(msg, Insert) else None
            if text:
                gid = grammar_id(text)
                if gid not in self._held:
                    out.append(CompileGrammar(text))
                self._held.setdefault(gid, []).append(msg)
                continue
            if isinstance(msg, Cancel):
                for held in self._held.values():
                    held[:] = [m for m in held if m.job.rid != msg.rid]
            if isinstance(msg, Drain):  # the inserts go on to be refused with the others
                out += [m for held in self._held.values() for m in held]
                self._held.clear()
            out.append(msg)
        return self._release() + out

    def _release(self) -> list[Insert]:
        out = []
        for gid, ok in self._settled.items():
            for msg in self._held.pop(gid, []):
                if ok:
                    out.append(msg)
                else:
                    self._fail(msg.job.rid, "A rank of this generation could not compile the grammar this answer "
                                            "is held to; retry it, or leave structured output out")
        self._settled.clear()
        return out

    @property
    def waiting(self) -> bool:
        return bool(self.pending or self._held)
