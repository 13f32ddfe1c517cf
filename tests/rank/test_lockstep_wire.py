"""The lockstep messages on the wire between ranks: each kind through `encode` and `decode`, and through a
two-rank exchange, comes back as it went."""

import mlx.core as mx
import pytest

from common.openai_api import SamplingParams
from runtime.engine.jobs import Job
from runtime.lockstep import Cancel, Drain, DrainMode, Insert, RestoreFirst, decode, encode
from runtime.lockstep import Lockstep, fold

SAMPLING = SamplingParams(max_tokens=5, temperature=0.7, logit_bias=((3, -1.5),), grammar="start: \"a\"").sampling()
RESUMED = Job("chatcmpl-1", (1, 2, 3), 5, 42, SAMPLING, offset=2, logprobs=3, tenant="team", draft_tokens=2)


@pytest.mark.parametrize("message", [
    Insert(RESUMED),
    Insert(Job("meshd-warmup", (7,), 1, 0, SamplingParams(max_tokens=1).sampling())),
    Cancel("chatcmpl-1"),
    Drain(DrainMode.FINISH),
    Drain(DrainMode.CANCEL),
    RestoreFirst("tape-9"),
])
def test_every_message_comes_back_from_the_wire_as_it_went(message):
    assert decode(encode([message])) == [message]


def test_a_drain_mode_on_the_wire_is_the_drain_route_s_word():
    assert encode([Drain(DrainMode.CANCEL)]) == b'[{"op": "drain", "mode": "cancel"}]'


def test_rank_0s_outbox_reaches_every_rank_in_order_through_the_exchange():
    """Rank 0 of two; rank 1's share of each collective is its tally bit, its digest and no bytes."""
    lockstep = Lockstep.__new__(Lockstep)
    lockstep.rank, lockstep.size = 0, 2
    peer = mx.array([0, 0, 0, 2, 0, fold(0, 7)], dtype=mx.int32)
    lockstep._all_sum = lambda x: x + peer if x.dtype == mx.int32 else x
    outbox = [Insert(RESUMED), Cancel("other"), Drain(DrainMode.FINISH)]
    assert lockstep.exchange(outbox, 0.25, 3, digest=fold(0, 7)) == (outbox, 0.25, 3)
