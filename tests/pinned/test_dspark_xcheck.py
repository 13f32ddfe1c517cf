"""meshd's DSpark drafter cross-checked against dspark-mlx, an independent implementation of
DeepSeek-V4-Flash-DSpark's drafter from the checkpoint's mtp.* layout: the tiny checkpoint of pinned/dsv4.py
loaded through meshd's load path and into dspark-mlx's DSparkDrafter with the same weights, the same
committed taps and anchor give the same block, token for token and logprob for logprob at every depth,
whatever the context's length (the ring wraps past the 16-token window) and however many blocks were
committed since it began; and the blocks meshd's engine drafts while it answers are the reference's for
the taps of what it committed.

DeepSeek's positions (its reference's forward_spec after a prompt, and upstream omlx's DSpark loop): the
context holds the committed positions 0..C-1, the block's anchor is the token at C (the target's sample, not
yet through it) at its own position, the noise rows after it. forward_spec writes its main hidden's row at
start_pos and drafts after it, so dspark-mlx is driven at start_pos C - 1 with position C - 1's taps (its own
generate() feeds the anchor through the target first and drafts one position later: the "anchor fed" case
below, which differs).

Run: .venv-omlx/bin/python -m pytest tests/pinned/test_dspark_xcheck.py"""

import re

import mlx.core as mx
import pytest
from dspark_mlx.loading import load_drafter
from dspark_mlx.model.config import DSparkArgs
from dspark_mlx.model.drafter import DSparkDrafter
from mlx.utils import tree_flatten

from common.openai_api import SamplingParams
from runtime.models import dspark
from runtime.engine.jobs import Job
from runtime.engine.proposers import Stages
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.store import PrefixStore

TOL = 2e-5  # the two implementations' float32 logprobs differ by under 1e-5
TAPS = 48  # positions of target taps the blocks draft from: three windows
# dspark-mlx's argument: omlx's ModelArgs field it is
ARGS = {"vocab_size": "vocab_size", "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size",
        "n_layers": "num_hidden_layers", "n_mtp_layers": "n_mtp_layers", "n_hash_layers": "num_hash_layers",
        "n_heads": "num_attention_heads", "n_routed_experts": "n_routed_experts",
        "n_shared_experts": "n_shared_experts", "n_activated_experts": "num_experts_per_tok",
        "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "swiglu_limit": "swiglu_limit",
        "q_lora_rank": "q_lora_rank", "head_dim": "head_dim", "rope_head_dim": "qk_rope_head_dim",
        "o_groups": "o_groups", "o_lora_rank": "o_lora_rank", "window_size": "sliding_window",
        "norm_eps": "rms_norm_eps", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
        "hc_eps": "hc_eps", "rope_theta": "rope_theta", "dspark_block_size": "dspark_block_size",
        "dspark_noise_token_id": "dspark_noise_token_id", "dspark_target_layer_ids": "dspark_target_layer_ids",
        "dspark_markov_rank": "dspark_markov_rank"}
EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
# omlx's stage names -> the DeepSeek checkpoint's (upstream omlx's sanitize maps them the other way)
RENAMES = ((r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"), (r"\.hc_head\.(fn|base|scale)$", r".hc_head_\1"),
           (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
           (r"\.shared_experts\.(\w+)\.", lambda m: f".shared_experts.{EXPERT[m[1]]}."))


@pytest.fixture(scope="module")
def prompt():
    return mx.random.randint(0, 500, (TAPS + 1,), key=mx.random.key(11))


@pytest.fixture(scope="module")
def taps(model, prompt):
    """The target's taps of the prompt's first TAPS positions, as a prefill gives them."""
    return model(prompt[None, :TAPS], model.make_cache(), return_hidden=True)[1]


def checkpoint_weights(model) -> dict:
    """The model's embedding, head and DSpark stages by the DeepSeek checkpoint's keys, which dspark-mlx's
    loader reads: the hyper-connections as flat hc_* tensors, each routed expert its own w1/w2/w3, wo_a
    one matrix."""
    out = {"embed.weight": model.model.embed_tokens.weight, "head.weight": model.lm_head.weight}
    for key, value in tree_flatten(model.parameters()):
        if not key.startswith("mtp."):
            continue
        for pattern, name in RENAMES:
            key = re.sub(pattern, name, key)
        routed = re.fullmatch(r"(mtp\.\d+\.ffn)\.switch_mlp\.(\w+)\.weight", key)
        if routed:
            out.update({f"{routed[1]}.experts.{e}.{EXPERT[routed[2]]}.weight": w for e, w in enumerate(value)})
        else:
            out[key] = value.reshape(-1, value.shape[-1]) if key.endswith(".wo_a.weight") else value
    return out


def reference(model, changed: dict | None = None) -> DSparkDrafter:
    """dspark-mlx's drafter holding every one of the model's DSpark weights (`changed`: some replaced, by
    checkpoint key), greedy as meshd drafts."""
    args = {ours: getattr(model.args, theirs) for ours, theirs in ARGS.items()}
    drafter = DSparkDrafter(DSparkArgs.from_dict({**args, "temperature": 0.0}))
    weights = {**checkpoint_weights(model), **(changed or {})}
    assert load_drafter(drafter, weights) == []
    held = {re.sub(r"^mtp\.", "blocks.", k): v.shape for k, v in weights.items()}
    assert held == {k: v.shape for k, v in tree_flatten(drafter.parameters())}
    return drafter


def logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def meshd_blocks(model, taps, commits, width: int) -> list:
    """meshd's drafts and logprobs after each of `commits` ((committed length, anchor)): each commit's new
    taps entering one context, as the engine feeds them (runtime/dspark.draft)."""
    cache, at, out = model.make_mtp_cache(), 0, []
    for length, anchor in commits:
        drafts, logits = dspark.draft(model, cache, taps[:, at:length], anchor, width)
        out.append((drafts.tolist(), logprobs(logits)))
        at = length
    return out


def reference_blocks(drafter, taps, commits, width: int, fed: int = 0) -> list:
    """dspark-mlx's blocks after each of `commits`, its window the taps of positions 0..length-1 (`fed` 1:
    0..length, the anchor's position through the target too): forward_spec's prefill seeds the first, `advance`
    slides in each later commit's positions but its last, which forward_spec writes as it drafts."""
    out, at = [], None
    for length, anchor in commits:
        last = length - 1 + fed
        ids = mx.array([anchor], dtype=mx.int32)
        if at is None:
            drafter.forward_spec(ids, taps[:, :last], start_pos=0)
        else:
            for p in range(at, last):
                drafter.advance(taps[:, p], p)
        block, logits, _ = drafter.forward_spec(ids, taps[:, last:last + 1], start_pos=last)
        out.append((block[0, 1:width + 1].tolist(), logprobs(logits[0, :width])))
        at = last + 1
    return out


def distance(got: list, want: list) -> float:
    """How far apart two runs of blocks are: infinite where a draft differs, else the largest logprob gap."""
    if [d for d, _ in got] != [d for d, _ in want]:
        return float("inf")
    return max(mx.abs(g - w).max().item() for (_, g), (_, w) in zip(got, want))


# committed lengths: the prompt's prefill (inside the window, its size, past it), then blocks of 1 to 6
# positions (the anchor and up to 5 kept drafts), the ring wrapping as they come
SCHEDULES = {"from 2": (2, 3, 9, 14, 15, 16, 17, 22, 28, 33, 34, 40),
             "from 16": (16, 17, 21, 27, 32, 33, 39, 45),
             "from 30": (30, 31, 36, 42, 47)}


@pytest.mark.parametrize("lengths", SCHEDULES.values(), ids=SCHEDULES)
def test_meshds_block_is_dspark_mlxs_for_the_same_taps_and_anchor_at_every_depth(model, prompt, taps, lengths):
    commits = [(n, int(prompt[n].item())) for n in lengths]
    block = model.args.dspark_block_size
    got, want = meshd_blocks(model, taps, commits, block), reference_blocks(reference(model), taps, commits, block)
    assert distance(got, want) < TOL, ([d for d, _ in got], [d for d, _ in want])
    assert len({tuple(d) for d, _ in got}) > len(got) // 2  # blocks that differ: the check has something to see


def test_the_check_tells_each_difference(model, prompt, taps, monkeypatch):
    """The same comparison between blocks that differ, each time in one thing: a stage's weight; the anchor
    fed through the target first (dspark-mlx's own generate()); a block narrower than the checkpoint's, as
    meshd drafted before when num_draft_tokens was less than dspark_block_size."""
    commits = [(n, int(prompt[n].item())) for n in SCHEDULES["from 2"]]
    block, width = model.args.dspark_block_size, 3
    meshd = meshd_blocks(model, taps, commits, block)
    wq_a = checkpoint_weights(model)["mtp.1.attn.wq_a.weight"]
    noisy = wq_a + 0.1 * mx.random.normal(wq_a.shape, key=mx.random.key(0))
    changed = reference(model, {"mtp.1.attn.wq_a.weight": noisy})
    assert distance(meshd, reference_blocks(changed, taps, commits, block)) > 100 * TOL
    assert distance(meshd, reference_blocks(reference(model), taps, commits, block, fed=1)) > 100 * TOL

    forward = type(model).dspark_forward
    monkeypatch.setattr(type(model), "dspark_forward", lambda self, hidden, anchor, cache, draft_length=None:
                        forward(self, hidden, anchor, cache, draft_length=width))
    narrow = meshd_blocks(model, taps, commits, width)
    assert distance(narrow, reference_blocks(reference(model), taps, commits, width)) > 100 * TOL


@pytest.mark.parametrize("width", [5, 3], ids=["the block", "3 of the block"])
def test_the_engines_blocks_are_dspark_mlxs_for_the_taps_of_what_it_committed(model, width, monkeypatch):
    """A request alone answering a prompt (prefilled in one chunk, then blocks verified and kept in part): each
    block it drafted is the reference's for the anchor it drafted after, the context the taps of every
    position before that anchor as decoding them one at a time gives them."""
    prompt = tuple(mx.random.randint(0, 500, (30,), key=mx.random.key(12)).tolist())
    drafted = []
    draft = dspark.draft

    def recorded(model, cache, committed, anchor, n, *held):  # held: the grammar's filter of each row
        drafts, logits = draft(model, cache, committed, anchor, n, *held)
        drafted.append((anchor, drafts.tolist(), logprobs(logits)))
        return drafts, logits

    monkeypatch.setattr(dspark, "draft", recorded)
    engine = RowwiseEngine(model, {1}, Stages(model), prefixes=PrefixStore(model, prefill_step_size=32), num_draft_tokens=width,
                           prefill_step_size=32)
    engine.insert(Job("x", prompt, 64, 0, SamplingParams(max_tokens=1).sampling()))
    said, commits = list(prompt), []
    while engine.busy:
        said += [e.token for e in engine.step() if e.token is not None]
        if len(drafted) > len(commits):
            commits.append(len(said) - 1)  # the anchor's position: the last token said
    assert engine.stats()["draft_accepted"] > len(said) // 4 and len(commits) > 10, engine.stats()
    assert [anchor for anchor, _, _ in drafted] == [said[c] for c in commits]

    cache = model.make_cache()
    taps = [model(mx.array(prompt[:-1])[None], cache, return_hidden=True)[1]]
    taps += [model(mx.array([t])[None], cache, return_hidden=True)[1] for t in said[len(prompt) - 1:commits[-1]]]
    want = reference_blocks(reference(model), mx.concatenate(taps, axis=1), [(c, said[c]) for c in commits], width)
    assert distance([(d, lp) for _, d, lp in drafted], want) < 1e-4
