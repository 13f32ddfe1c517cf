"""Caches cut back to checkpoints (runtime/prefix/checkpoints.py) on mlx-lm's own model classes whose caches write
in place: a sliding window that rotates (llama's and gpt-oss's sliding layers), a recurrent state (qwen3.5's
linear attention), DeepSeek-V4.1's layer cache (its window, closed groups and open group). A cache that went
on past a checkpoint (its window rotated, its groups closed, its state moved) and is cut back there answers a
new prompt sharing that prefix as a fresh prefill of the new prompt does, token for token and logprob for
logprob; a trim in its place does not, which shows these models' answers depend on their caches."""

import copy

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache
from mlx_lm.utils import _get_classes, load_tokenizer

from kit import cutback
from kit.families import FAMILIES
from kit.waiting import wait_for
from runtime.prefix import checkpoints
from runtime.models.pools import prompt_piece
from runtime.prefix.checkpoints import (Checkpoint, Held, Pool, Stopping, Taken, Trim, checkpoint, cut, message_markers,
                                        stops)
from runtime.prefix.rates import Rates
from runtime.prefix.snapshot import Identity, Snapshots
from runtime.prefix.tape import TokenTape
from runtime.restore import Restorer

MARK = 7  # a message marker in the prompts below
EVERY = 8  # the prefill's chunk
ANSWER = 10  # greedy tokens compared: every sliding window (8) rotates meanwhile


def model_of(family: str):
    config = FAMILIES[family]
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.load_weights([(k, v * 4.0 if k.endswith(("lm_head.weight", "embed_tokens.weight")) else v)
                        for k, v in tree_flatten(model.parameters())])  # clear winners, as kit.families' models
    mx.eval(model.parameters())
    return model


def tokens(seed: int, n: int) -> list[int]:
    return [8 + (seed * 7919 + i * 104729) % 480 for i in range(n)]


def prefill(model, cache, prompt: list[int], start: int, marked: dict | None = None) -> mx.array:
    return cutback.prefill(model, cache, prompt, start, frozenset({MARK}), EVERY, marked)


def decode(model, cache, logits: mx.array) -> tuple[list[int], list[float]]:
    return cutback.decode(model, cache, logits, ANSWER)


def fresh(model, prompt: list[int]):
    return cutback.fresh(model, prompt, frozenset({MARK}), EVERY, ANSWER)


FAMILIES_IN_PLACE = ["gpt_oss", "qwen3_5", "deepseek_v41"]  # llama's sliding layer barely moves its answer


@pytest.mark.parametrize("family", FAMILIES_IN_PLACE)
def test_a_cache_cut_back_to_a_checkpoint_answers_as_a_fresh_prefill(family):
    model = model_of(family)
    first = tokens(1, 12) + [MARK] + tokens(2, 17)  # 30 tokens: stops 8, 12 (the marker), 16, 24, 29
    cache, marked = model.make_cache(), {}
    decode(model, cache, prefill(model, cache, first, 0, marked))
    assert sorted(marked) == [8, 12, 16, 24, 29]
    assert checkpoints.needed(cache)
    seconds = {12: first[:13] + tokens(3, 9),  # the next message after the same first one
               16: first[:16] + tokens(3, 9),  # a prompt sharing two chunks
               29: first}  # the same prompt again
    for at, second in seconds.items():
        assert at in stops(second, frozenset({MARK}), EVERY)
        ours = copy.deepcopy(cache)
        cut(ours, marked[at])
        said, logprobs = decode(model, ours, prefill(model, ours, second, at))
        plain, plain_logprobs = fresh(model, second)
        assert said == plain, (family, at)
        assert logprobs == pytest.approx(plain_logprobs, abs=1e-5)


def test_a_tape_restored_after_a_restart_serves_from_the_checkpoints_its_snapshot_kept(tmp_path):
    """The checkpoints go to disk with the tape's last segment, so a tape restored by the next generation serves
    a prompt that shares only its first messages as the tape in memory did: from the checkpoint where they
    part, and as a fresh prefill of that prompt answers (gpt-oss: its answer moves with its windows, see the
    trim test below)."""
    model = model_of("gpt_oss")
    first = tokens(1, 12) + [MARK] + tokens(2, 17)
    cache, marked = model.make_cache(), {}
    prefill(model, cache, first, 0, marked)
    me = Identity("model", 1, 0, "layout")
    snaps = Snapshots(tmp_path, me, 1 << 24, every=8)
    snaps.stage(tuple(first), cache, ("", 0), final=True, checkpoints=tuple(marked.values()))
    snaps.close()
    held = sum(point.nbytes for point in marked.values())
    assert held > 0 and snaps.stats()["snapshot_checkpoint_bytes"] == held  # said apart from the caches' bytes
    again, tape = Snapshots(tmp_path, me, 1 << 24, every=8), TokenTape(capacity=8)
    assert again.stats()["snapshot_checkpoint_bytes"] == held  # and read back from the headers after a restart
    restorer = Restorer.agree(again, lambda b: [b], tape, model.make_cache, Rates(None), print, rank=0)
    wait_for(lambda: restorer.adopt(lambda b: [b]) == again.held(), 10, "the tape restored")
    assert sorted(marked) == [8, 12, 16, 24, 29] and again.skipped == {}
    assert (tape.checkpoint_count, tape.checkpoint_bytes) == (5, held)
    for at, second in {12: first[:13] + tokens(3, 9), 16: first[:16] + tokens(3, 9)}.items():
        ours, cached, _, _, _ = tape.take(tuple(second), stops=stops(second, frozenset({MARK}), EVERY))
        assert cached == at
        said, logprobs = decode(model, ours, prefill(model, ours, second, at))
        plain, plain_logprobs = fresh(model, second)
        assert said == plain, at
        assert logprobs == pytest.approx(plain_logprobs, abs=1e-5)
    assert tape.checkpoint_hits == 2
    again.close()


@pytest.mark.parametrize("family", FAMILIES_IN_PLACE)
def test_a_trim_in_place_of_the_cut_changes_the_answer(family):
    """Each cache's length set back but what it wrote in place left as it is (a rotated window, a recurrent
    state, closed groups): the model answers otherwise, so the test above can fail."""
    model = model_of(family)
    first = tokens(1, 12) + [MARK] + tokens(2, 17)
    cache = model.make_cache()
    decode(model, cache, prefill(model, cache, first, 0))
    second = first[:16] + tokens(3, 9)
    for leaf in cache:
        if isinstance(getattr(leaf, "offset", None), int):
            leaf.offset = 16
        if hasattr(leaf, "_idx"):
            leaf._idx = min(leaf._idx, 16)
    trimmed = decode(model, cache, prefill(model, cache, second, 16))
    assert trimmed != fresh(model, second)


def test_a_checkpoint_keeps_growing_parts_by_length_and_holds_what_is_written_in_place():
    model = model_of("llama")  # a full-attention layer, then a sliding one
    cache = model.make_cache()
    prefill(model, cache, tokens(1, 20), 0)
    point = checkpoint(cache, 19)
    assert isinstance(point.parts[0], Trim) and point.parts[0].offset == cache[0].offset
    assert isinstance(point.parts[1], Held) and point.nbytes == cache[1].keys.nbytes + cache[1].values.nbytes


def test_a_checkpoint_of_other_caches_cannot_cut_these():
    cache = model_of("llama").make_cache()
    with pytest.raises(ValueError, match="3 cache leaves cannot cut caches of 2"):
        cut(cache, Checkpoint(4, (Trim(4), Trim(4), Trim(4)), 0))


class FakePool:
    """omlx's PoolingCache as far as a checkpoint reads it (its class name is what marks it a pool)."""

    def __init__(self, rows: int, remainder: int):
        self.pooled = mx.arange(rows * 2, dtype=mx.float32).reshape(1, rows, 2) if rows else None
        self.buf_kv = mx.full((1, 4, 2), float(remainder))
        self.buf_gate = mx.full((1, 4, 2), -float(remainder))
        self.remainder = remainder

    @property
    def offset(self):
        return 0 if self.pooled is None else self.pooled.shape[1]


FakePool.__name__ = checkpoints.POOL


def test_a_pool_is_cut_to_its_rows_and_its_open_window_put_back():
    pool = FakePool(3, 2)
    point = checkpoint([pool], 14)
    assert isinstance(point.parts[0], Pool) and point.nbytes == 2 * 4 * 2 * 4
    pool.pooled = mx.concatenate([pool.pooled, mx.ones((1, 2, 2))], axis=1)
    pool.buf_kv[:, 0:1] = 9.0
    pool.remainder = 1
    cut([pool], point)
    assert pool.offset == 3 and pool.remainder == 2
    assert pool.buf_kv.tolist() == mx.full((1, 4, 2), 2.0).tolist()
    assert pool.pooled.tolist() == mx.arange(6, dtype=mx.float32).reshape(1, 3, 2).tolist()
    pool.buf_kv[:, 2:3] = 5.0  # the cut cache writes on: the checkpoint keeps what it held
    cut([pool], point)
    assert pool.buf_kv.tolist() == mx.full((1, 4, 2), 2.0).tolist()


@pytest.mark.parametrize("length,markers,every,gap,expected", [
    (30, {7: [12]}, 8, 4, (8, 12, 16, 24, 29)),
    (10, {}, 8, 4, (8, 9)),
    (9, {}, 8, 4, (8,)),  # the last token's place is a chunk's end too
    (1, {}, 8, 4, ()),
    (30, {7: [12, 13, 14, 20]}, 64, 4, (12, 20, 29)),  # a cluster of markers: its first
    (60, {7: [3, 10, 20, 30, 35, 50]}, 64, 10, (3, 20, 30, 50, 59)),  # markers closer than the gap: once
    (12, {7: [0]}, 64, 4, (11,)),  # a marker that opens the prompt is no stop
])
def test_where_a_prefill_stops(length, markers, every, gap, expected):
    prompt = [1] * length
    for token, places in markers.items():
        for p in places:
            prompt[p] = token
    assert stops(prompt, frozenset(markers), every, gap) == expected


def test_a_prompts_stops_before_its_last_token_are_those_of_every_prompt_that_shares_them():
    first = [1, 7, 2, 3, 7, 7, 4, 5, 6, 7, 8, 7, 9] * 6
    for cut in range(1, len(first)):
        longer = first[:cut] + [7, 7, 3, 7] * 5
        assert [s for s in stops(first, frozenset({7}), 16, 5) if s < cut] == \
            [s for s in stops(longer, frozenset({7}), 16, 5) if s < cut]


@pytest.mark.parametrize("at,length,said,stops,expected", [
    (0, 300, 0, (), 64),  # a chunk
    (0, 300, 0, (20, 64), 20),  # up to the next stop
    (20, 300, 0, (20, 64), 44),  # from a stop, to the next
    (256, 300, 0, (256, 273, 299), 17),
    (273, 300, 0, (256, 273, 299), 26),  # the last stop is the prompt's end: the last token is the step's
    (290, 300, 8, (295,), 1),  # a resumed answer's tokens in decoding's pieces, a stop or not
])
def test_a_prompt_is_fed_in_chunks_that_end_at_its_stops(at, length, said, stops, expected):
    assert prompt_piece(at, length, said, 64, (4,), stops) == expected


def test_a_request_keeps_the_checkpoints_it_inherited_and_takes_one_at_each_stop_it_reaches_once():
    model = model_of("gpt_oss")
    cache = model.make_cache()
    prefill(model, cache, tokens(1, 12), 0)
    inherited = checkpoint(cache, 8)
    taken = Taken((8, 11, 16), (inherited,))
    for at in (10, 11, 11, 16):
        taken.reached(cache, at)
    assert [p.at for p in taken.points] == [8, 11, 16] and taken.points[0] is inherited
    assert Stopping(frozenset({MARK}), EVERY, on=False).stops([1] * 30) == ()
    assert Stopping(frozenset({MARK}), EVERY, on=True).stops([1] * 30) == (8, 16, 24, 29)


def state_cache(value: float) -> list:
    cache = [ArraysCache(1)]
    cache[0][0] = mx.full((1, 4), value)  # 16 bytes a checkpoint holds
    return cache


def test_the_tape_serves_the_longest_checkpoint_the_new_prompt_stops_at_and_counts_shared_ones_once():
    tape = TokenTape(checkpoint_budget=40)
    points = []
    for at in (5, 10, 19):
        points.append(checkpoint(state_cache(float(at)), at))
    tokens = tuple(range(30))
    tape.store(tokens[:20], state_cache(20.0), checkpoints=tuple(points))
    assert tape.checkpoint_count == 2 and tape.checkpoint_bytes == 32  # the oldest went for the budget
    assert tape.served(tokens[:12] + (99, 98), stops=(5, 10, 13)) == 10
    assert tape.served(tokens[:12] + (99, 98), stops=(5, 13)) == 0  # 10 is not where this prompt stops
    assert tape.served(tokens[:25]) == 20  # a prompt that extends the whole tape: all of it
    cache, cached, _, inherited, _ = tape.take(tokens[:19] + (77, 78, 79), stops=(10, 19, 21))
    assert cached == 19 and cache[0][0].tolist() == [[19.0] * 4] and inherited == tuple(points[1:])
    tape.store(tokens[:19] + (77, 78), state_cache(21.0), checkpoints=inherited)
    assert tape.checkpoint_count == 2 and tape.checkpoint_bytes == 32 and tape.checkpoint_hits == 1


def test_past_the_budget_a_tape_keeps_its_first_and_last_checkpoints_longest():
    points = tuple(checkpoint(state_cache(float(at)), at) for at in range(1, 14))  # 13 of 16 bytes each
    tape = TokenTape(checkpoint_budget=16 * 11)
    tape.store(tuple(range(20)), state_cache(0.0), checkpoints=points)
    assert [c.at for c in tape._entries[0].checkpoints] == [1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    tape.checkpoint_budget = 16 * 9
    tape.store(tuple(range(50, 70)), state_cache(0.0))
    assert [c.at for c in tape._entries[0].checkpoints] == [2, 6, 7, 8, 9, 10, 11, 12, 13]  # then the oldest


def test_the_markers_are_the_added_tokens_the_chat_template_writes_between_messages(demo_model):
    tokenizer = load_tokenizer(demo_model)
    assert {tokenizer._tokenizer.convert_ids_to_tokens(t) for t in message_markers(tokenizer)} == \
        {"<|im_start|>", "<|im_end|>"}
    tokenizer.chat_template = None
    assert message_markers(tokenizer) == frozenset()
