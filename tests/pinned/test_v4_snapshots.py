"""Prefix snapshots of omlx's own DeepSeek-V4 caches (runtime/prefix/snapshot.py: a rotating window, or a CacheList of one
and one or two pools, written in place: each snapshot their whole state), in the pinned env: a snapshot restores
the live caches' next-token logits, a spoiled one is skipped with its reason, an answer resumed from one
continues as plain decoding does, drafted or not; and on real ranks at TP2, started by their agents, a drafted
stream cut by a SIGKILL resumes on the next generation from its snapshot, plain decoding's answer token for
token."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load_tokenizer

from common.openai_api import SamplingParams
from kit.agents import make_agents
from kit.demo_answers import endless
from kit.snapshots import EVERY, Gen, answer_in_flight
from kit.waiting import wait_for
from pinned.dsv4 import PROMPT, pinned_env
from kit.drafters import undrafted
from runtime.engine.jobs import Job
from runtime.engine.proposers import Stages
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore
from runtime.models import dspark
from runtime.prefix.snapshot import Identity, Snapshots, leaf_types, read_header, segment_files, tape_id

ME = Identity("v4", 1, 0, "layout")
TOKENS = tuple(int(t) for t in mx.random.randint(0, 500, (150,), key=mx.random.key(5)).tolist())


def fed(model, tokens, prefill: int) -> list:
    """A fresh cache fed `tokens`: the first `prefill` in chunks of 128, then one at a time (the windows
    rotate in place, the pools keep a part of a window)."""
    cache = make_prompt_cache(model)
    for at in range(0, prefill, 128):
        model(mx.array(tokens[at:min(at + 128, prefill)])[None], cache)
    for t in tokens[prefill:]:
        model(mx.array([t])[None], cache)
    mx.eval([a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)])
    return cache


def plain_kv(n: int) -> list:
    """Five plain KV caches of `n` tokens: a cache of another kind than this model's."""
    cache = [KVCache() for _ in range(5)]
    for c in cache:
        c.update_and_fetch(mx.zeros((1, 1, n, 8)), mx.zeros((1, 1, n, 8)))
    return cache


def test_a_v4_cache_written_whole_and_restored_gives_the_live_caches_next_logits(model, tmp_path):
    live = fed(model, TOKENS, 130)
    kinds = [type(c).__name__ + "".join(type(m).__name__[0] for m in getattr(c, "caches", ())) for c in live]
    assert kinds == ["RotatingKVCache", "CacheListRPP", "CacheListRP", "CacheListRPP", "RotatingKVCache"]
    snaps = Snapshots(tmp_path, ME, 1 << 30, every=EVERY)
    snaps.stage(TOKENS, live, ("", 0), final=True)
    snaps.close()
    [header] = [read_header(p) for p in segment_files(snaps.folder)]
    assert (header["start"], header["end"]) == ("0", str(len(TOKENS)))

    again = Snapshots(tmp_path, ME, 1 << 30, every=EVERY)
    [(tokens, restored, sid)] = again.restore(again.held(), lambda: make_prompt_cache(model))
    assert tokens == TOKENS and sid == tape_id(TOKENS)
    ahead = mx.array([7, 300, 42, 5, 99, 61, 8])
    for piece in (ahead[:1], ahead[1:6], ahead[6:]):  # a decode step, a verify's piece, a decode step
        want, got = model(piece[None], live), model(piece[None], restored)
        assert mx.array_equal(got, want).item()
    again.close()


def test_a_corrupted_truncated_foreign_or_old_v4_snapshot_is_skipped_with_its_reason(model, tmp_path):
    tapes = {how: tuple(range(i * 100, i * 100 + 40)) for i, how in
             enumerate(["good", "corrupt", "truncated", "other model", "old format", "other caches"])}
    snaps = Snapshots(tmp_path, ME, 1 << 30, every=EVERY)
    for how, tokens in tapes.items():
        snaps.stage(tokens, plain_kv(40) if how == "other caches" else fed(model, tokens, 32), ("", 0), final=True)
    snaps.close()
    for how, tokens in tapes.items():
        [path] = snaps.folder.glob(f"{tape_id(tokens)}.*.safetensors")
        arrays, meta = mx.load(str(path), return_metadata=True)
        if how == "corrupt":
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF
            path.write_bytes(bytes(data))
        elif how == "truncated":
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
        elif how == "other model":
            mx.save_safetensors(str(path), arrays, metadata={**meta, "model": "another"})
        elif how == "old format":  # what meshd-snapshot/1 wrote: each layer's keys and values
            mx.save_safetensors(str(path), {"tokens": arrays["tokens"], "k.0": arrays["0.0"], "v.0": arrays["0.1"]},
                                metadata={**meta, "format": "meshd-snapshot/1"})

    again = Snapshots(tmp_path, ME, 1 << 30, every=EVERY)
    assert again.skipped == {"truncated": 1, "foreign": 2}  # at its scan: deleted
    restored = again.restore(again.held(), lambda: make_prompt_cache(model))
    assert [tokens for tokens, _, _ in restored] == [tapes["good"]]
    assert again.skipped == {"truncated": 1, "foreign": 3, "corrupt": 1}
    assert {p.name.split(".")[0] for p in segment_files(again.folder)} == {tape_id(tapes["good"])}
    again.close()


GREEDY = SamplingParams(max_tokens=1).sampling()


def run(engine, job: Job, *beside: Job) -> tuple[list[int], list[float], int | None]:
    """The job's tokens, their log probabilities (when it asks) and the cached count its engine said (with its
    insert, else with its first token); the jobs `beside` sent with it (a batch's rows)."""
    cached, said = engine.insert(job), []
    for other in beside:
        engine.insert(other)
    while engine.busy:
        for e in engine.step():
            if e.rid == job.rid:
                cached = e.cached if e.cached is not None else cached
                said += [(e.token, e.logprob)] if e.token is not None else []
    return [t for t, _ in said], [p for _, p in said], cached


def engine(model, drafted: bool, snapshots=None):
    """The batch engine, or DSpark's, with no end-of-sequence token: every answer its full length."""
    prefixes = PrefixStore(model, prefill_step_size=32, snapshots=snapshots)
    if drafted:
        return RowwiseEngine(model, set(), Stages(model), prefixes=prefixes, prefill_step_size=32)
    return undrafted(model, set(), prefill_step_size=32, prefixes=prefixes)


ANSWER = Job("a", TOKENS, 128, 3, GREEDY, logprobs=0)
BESIDE = Job("b", TOKENS[::-1], 128, 4, GREEDY)  # another conversation, in the same batch


@pytest.fixture(scope="module")
def plain_answer(model):
    """Plain decoding's answer to ANSWER: its tokens and their log probabilities."""
    return run(engine(model, False), ANSWER)[:2]


@pytest.mark.parametrize("drafted,beside", [(False, ()), (True, ()), (False, (BESIDE,)), (True, (BESIDE,))],
                         ids=["plain", "drafted", "plain rows", "drafted rows"])
def test_an_answer_resumed_from_its_snapshot_in_flight_continues_as_plain_decoding(model, plain_answer, tmp_path,
                                                                                   drafted, beside):
    """The answer's tokens past its snapshot go through the target as decoding fed them (pools.prompt_piece):
    fed as a prompt's chunks, its pools would differ, and its log probabilities by 1e-2. A batch's rows are
    snapshotted in flight too, each taken out of the batch whole when due."""
    plain, plain_logprobs = plain_answer
    first = engine(model, drafted, Snapshots(tmp_path, ME, 1 << 30, every=EVERY))
    assert run(first, ANSWER, *beside)[0] == plain
    first.close()

    again = Snapshots(tmp_path, ME, 1 << 30, every=EVERY)
    mid = min((s for s in again.segments.values() if s.end > len(TOKENS)
               and again.tokens_of(s.sid)[1][:len(TOKENS)] == TOKENS), key=lambda s: s.end)
    assert mid.end < len(TOKENS) + 64  # the answer's first snapshot in flight, not its last
    kept = again.read(mid.sid, leaf_types(make_prompt_cache(model))).taps  # DSpark's stages' context, on disk
    assert (kept.shape[1] if drafted else kept) == (dspark.window(model) if drafted else None)
    [(tokens, cache, sid)] = again.restore([mid.sid], lambda: make_prompt_cache(model))
    second = engine(model, drafted, again)
    second.prefixes.tape.store(tokens, cache, sid)
    said = mid.end - len(TOKENS) + 40  # the snapshot's answer tokens and 40 more were delivered
    rest, logprobs, cached = run(second, Job("a", TOKENS + tuple(plain[:said]), 128 - said, 3, GREEDY, offset=said,
                                             logprobs=0))
    assert cached == mid.end and rest == plain[said:]
    assert logprobs == pytest.approx(plain_logprobs[said:], abs=1e-4)
    second.close()


CUT = 64  # answer tokens the client has when a rank is killed
CHAT = [{"role": "user", "content": PROMPT[:len(PROMPT) // 3]}]  # 180 tokens: past the 128-token pool's window


def test_a_drafted_v4_stream_cut_by_a_sigkill_resumes_from_its_snapshot_as_plain_decoding_answers(
        checkpoint, model, tmp_path):
    prompt = load_tokenizer(checkpoint).apply_chat_template(CHAT, add_generation_prompt=True)
    agents = make_agents(tmp_path, 2)
    for agent in agents:
        agent.start(env=pinned_env())
    folders = [a.dir / "state" / "snapshots" for a in agents]
    args = {"model_package": "omlx", "prefill_step_size": 128}  # pinned.dsv4.OVERLAY, as an agent takes it
    cut = {"messages": CHAT, "max_tokens": 1000, "temperature": 0, **endless(checkpoint)}
    try:
        g1 = Gen(agents, checkpoint, 1, **args)
        try:
            head, delivered, chars, _, r = g1.stream(cut, stop_after=CUT)
            # a snapshot of the answer in flight within what the client has, on both ranks
            wait_for(lambda: all(answer_in_flight(next(f.glob("*-w2-r*")), prompt, 2, len(delivered) - 1)
                                 for f in folders), 60, "the answer in flight to be snapshotted on both ranks")
            g1.sigkill(1)
            r.close()
        finally:
            g1.stop()
        g2 = Gen(agents, checkpoint, 2, **args)
        try:
            restored = [g2.restored(rank)["snapshots_restored"] for rank in range(2)]
            resume = {"ids": delivered, "chars": chars, "id": head["id"], "created": head["created"],
                      "seed": head["seed"]}
            served = g2.settled(0)["tape_hit_tokens"]
            _, resumed, _, cached, _ = g2.stream({**cut, "max_tokens": len(delivered) + 16}, resume=resume)
            stats = g2.settled(0)
        finally:
            g2.stop()
    finally:
        for agent in agents:
            agent.kill()
    bias = tuple((int(t), float(b)) for t, b in endless(checkpoint)["logit_bias"].items())
    sampling = SamplingParams(max_tokens=1, logit_bias=bias).sampling()
    plain, _, _ = run(undrafted(model, set(), prefill_step_size=128),
                      Job("p", tuple(prompt), len(resumed), 0, sampling))
    assert all(n >= 1 for n in restored) and stats["drafter"] == "dspark", (restored, stats)
    assert resumed == plain  # the ids delivered before the kill, and the rest of it, drafted from the snapshot
    # the prompt and part of the answer came from a snapshot the answer in flight left; the client's usage
    # counts that answer once, as completion, and only its prompt as cached
    served = stats["tape_hit_tokens"] - served
    assert len(prompt) < served < len(prompt) + len(delivered), (served, len(prompt), len(delivered))
    assert cached == len(prompt)
