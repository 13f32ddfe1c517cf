"""Lockstep control channel: rank 0 shares a list of control messages (`Message`s,
below) with every rank once per loop iteration, through the same collective the model uses.

Each exchange is one `all_sum` of a header (payload size, doze, steps, and a
digest of every token each rank has sampled) and, when there is a payload, one
`all_sum` of its bytes. Every rank applies the same messages at the same
iteration, which keeps batch composition, cancellations and drain identical
across the mesh; the digests prove the ranks also sampled the same tokens (on
GPUs a reduction in another order can flip a greedy token), and a mismatch
ends the generation at that exchange instead of letting it drift. While idle
the loop still exchanges (empty) at a low pace, so a dead peer surfaces as a
transport error instead of a silent wait.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from runtime.engine.jobs import Divergence, Job


class DrainMode(StrEnum):
    """How a generation drains (POST /internal/drain's `mode`, SIGTERM's `finish`): `finish` lets the answers
    in flight end and admits no more; `cancel` ends them now, each client told `draining`. A cancelling
    drain never goes back to finishing."""

    FINISH = "finish"
    CANCEL = "cancel"


@dataclass(frozen=True)
class Insert:
    job: Job


@dataclass(frozen=True)
class Cancel:
    rid: str


@dataclass(frozen=True)
class Drain:
    mode: DrainMode


@dataclass(frozen=True)
class RestoreFirst:
    """Read this pending tape next: a request waits for it (runtime/restore.py)."""

    sid: str


@dataclass(frozen=True)
class CompileGrammar:
    """Compile this grammar in the background: answers held to it wait for every rank's (runtime/compiles.py)."""

    grammar: str


Message = Insert | Cancel | Drain | RestoreFirst | CompileGrammar
OPS = {Insert: "insert", Cancel: "cancel", Drain: "drain", RestoreFirst: "restore_first",
       CompileGrammar: "compile_grammar"}
KINDS = {op: kind for kind, op in OPS.items()}


def encode(messages: list[Message]) -> bytes:
    """Messages as the lockstep exchange carries them: a JSON list of `{"op": ..., fields}`."""
    return json.dumps([{"op": OPS[type(m)], **asdict(m.job if isinstance(m, Insert) else m)}
                       for m in messages]).encode()


def decode(data: bytes) -> list[Message]:
    """`encode`'s messages back, as every rank applies them."""
    return [_message(fields) for fields in json.loads(data)]


def _message(fields: dict) -> Message:
    kind = KINDS[fields.pop("op")]
    if kind is Insert:
        return Insert(Job(**{**fields, "prompt": tuple(fields["prompt"])}))
    if kind is Drain:
        return Drain(DrainMode(fields["mode"]))
    return kind(**fields)


class PeerLost(RuntimeError):
    """An exchange came back without every rank's share: a peer is gone and the transport handed back
    what it had instead of failing."""


def fold(digest: int, token: int) -> int:
    """The running digest of a rank's sampled tokens, in emission order (fits an int32)."""
    return (digest * 1_000_003 + token + 1) % 2_147_483_647


class Lockstep:
    def __init__(self, group: "mx.distributed.Group"):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def _all_sum(self, x: mx.array) -> mx.array:
        # The generator evaluates the next forward pass asynchronously on its
        # stream; a collective on any other stream could overtake the model's
        # own all_sums on some ranks and not others, and mix their bytes.
        out = mx.distributed.all_sum(x, group=self.group, stream=generation_stream)
        mx.eval(out)
        return out

    def exchange(self, messages: list[Message] | None, doze: float = 0.0, steps: int = 1,
                 digest: int = 0) -> tuple[list[Message], float, int]:
        """Rank 0 passes its outbox, how long every rank may sleep before the
        next exchange (when idle) and how many engine steps to take before it
        (when busy); other ranks pass None. All get rank 0's three values.
        Every rank passes the digest of the tokens it sampled so far; if they
        differ, every rank raises Divergence here. Each rank also adds its own
        bit to a tally: a tally short of a bit is an exchange a dead peer did
        not take part in (PeerLost), and its digests mean nothing. Ranks sleep instead of
        waiting inside the collective because the ring transport busy-polls
        while it waits."""
        if self.size == 1:
            return list(messages or []), doze, steps
        payload = encode(messages) if (self.rank == 0 and messages) else b""
        header = [len(payload), int(doze * 1000), steps] if self.rank == 0 else [0, 0, 0]
        digests = [0] * self.size
        digests[self.rank] = digest
        got = self._all_sum(mx.array(header + [1 << self.rank] + digests, dtype=mx.int32)).tolist()
        (n, doze_ms, steps, tally), digests = got[:4], got[4:]
        if tally != (1 << self.size) - 1:
            raise PeerLost(f"[meshd] lost a peer: the lockstep exchange came back with tally {tally:#x}, not "
                           f"{(1 << self.size) - 1:#x} (a rank missing from it)")
        if len(set(digests)) > 1:
            raise Divergence(f"[meshd] divergence: the ranks sampled different tokens; digests by rank {digests}")
        if n == 0:
            return [], doze_ms / 1000, steps
        if self.rank == 0:
            data = mx.array(np.frombuffer(payload, dtype=np.uint8))
        else:
            data = mx.zeros((n,), dtype=mx.uint8)
        return decode(bytes(np.array(self._all_sum(data), copy=False))), doze_ms / 1000, steps

    def share(self, value: int) -> int:
        """Rank 0's `value` on every rank (the others' are ignored); a barrier too."""
        if self.size == 1:
            return value
        return int(self._all_sum(mx.array([value if self.rank == 0 else 0], dtype=mx.int32)).item())

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, on every rank, in rank order (at load: nothing else is in flight)."""
        if self.size == 1:
            return [data]
        sizes = [0] * self.size
        sizes[self.rank] = len(data)
        sizes = self._all_sum(mx.array(sizes, dtype=mx.int32)).tolist()
        buf = np.zeros(sum(sizes), dtype=np.uint8)
        at = sum(sizes[:self.rank])
        buf[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        got = bytes(np.array(self._all_sum(mx.array(buf)), copy=False)) if len(buf) else b""
        bounds = np.cumsum([0] + sizes).tolist()
        return [got[a:b] for a, b in zip(bounds, bounds[1:])]
