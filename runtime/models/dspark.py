"""DSpark's stages in tensor parallel, the model-specific kernels a split breaks, the forwards its target can
take at once, and a block drafted from the stages as DeepSeek's reference drafts it.

The stages are full decoder layers stored beside the backbone (`model.mtp`), which the model's `shard()`
leaves whole: they are split here with the backbone's own split (its `shard()` run over a view whose layers
are the stages), so each stage's heads and experts sit with the same rank as the backbone's. A kernel built
for one head count (omlx's 64-head ring GEMM, which refuses 32 heads per rank at TP4) is probed at load with
the shape this rank will give it, and hidden when it refuses: the model takes its portable path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx

from runtime.models.overlay import OMLX
from runtime.models.pools import attention


def stages(model) -> list:
    """The model's DSpark stages: none when it has no drafter, or its drafter did not arm (a checkpoint whose
    MTP is not DSpark's, or none)."""
    if not (hasattr(model, "dspark_forward") and getattr(model, OMLX.armed, False)):
        return []
    return list(getattr(model, "mtp", None) or [])


def heads(layer) -> int:
    """A layer's query heads on this rank."""
    attn = attention(layer)
    return int(getattr(attn, "num_heads", None) or attn.n_heads)


def shard(model, group) -> None:
    """The model's own split, its DSpark stages split as its layers, and each rank given its own heads' sinks
    where the model splits its query heads by output group (omlx's DeepSeek-V4: wq_b in `o_groups`
    segments) but its `shard()` splits the sinks in one piece, giving each rank other heads' sinks (a split
    answer then differs from one rank's)."""
    groups = int(getattr(model.args, "o_groups", 1))
    whole = [(attention(layer), attention(layer).attn_sink) for layer in list(model.layers) + stages(model)
             if groups > 1 and hasattr(attention(layer), "attn_sink") and hasattr(attention(layer), "wq_b")]
    model.shard(group)
    if stages(model):
        shard_stages(model, group)
    for attn, sinks in whole:
        attn.attn_sink = sinks.reshape(groups, group.size(), -1)[:, group.rank()].reshape(-1)


def shard_stages(model, group) -> None:
    """Split every stage as the backbone's layers are split, then check that it took: a stage left whole
    would cost every rank the whole stage, one split differently would draft from the wrong heads."""
    parts = stages(model)
    view = SimpleNamespace(args=model.args, layers=parts, model=SimpleNamespace(layers=parts, pipeline_layers=parts))
    type(model).shard(view, group)
    backbone = heads(model.layers[0])
    for i, stage in enumerate(parts):
        if heads(stage) != backbone:
            raise RuntimeError(f"DSpark stage {i} holds {heads(stage)} heads on this rank after the split, the "
                               f"backbone's layers {backbone}: the model's shard() did not split its stages")


@dataclass(frozen=True)
class Kernel:
    """A kernel the model calls when its module says it has it (`has_symbol(symbol)`), and the probe that
    tries it with this rank's shape."""

    module: str
    symbol: str
    probe: object  # (fn, heads per rank, config) -> the call's result


def _ring_gemm_probe(fn, rank_heads: int, config: dict):
    dim, ring = int(config.get("head_dim", 512)), int(config.get("sliding_window", 128))
    return fn(mx.zeros((1, rank_heads, dim), mx.bfloat16), mx.zeros((ring, dim), mx.bfloat16),
              mx.zeros((1, ring), mx.uint32), True)


KERNELS = {"omlx": (Kernel("omlx.custom_kernels.glm_moe_dsa.fast", "dspark_ring_gemm", _ring_gemm_probe),)}
HIDDEN: list[str] = []  # the kernels this process hid (a rank loads one model): its status file counts them


def gate_kernels(package: str | None, model, config: dict, log) -> None:
    """Hide each of the overlay's kernels that refuses this rank's head count (into HIDDEN)."""
    for kernel in KERNELS.get(package or "", ()):
        try:
            fast = importlib.import_module(kernel.module)
        except ImportError:
            continue  # no native kernels on this node: nothing to hide
        if not fast.has_symbol(kernel.symbol):
            continue
        rank_heads = heads(model.layers[0])
        try:
            mx.eval(kernel.probe(getattr(fast, kernel.symbol), rank_heads, config))
        except Exception as e:
            has_symbol = fast.has_symbol
            fast.has_symbol = lambda name, _has=has_symbol, _hide=kernel.symbol: name != _hide and _has(name)
            HIDDEN.append(kernel.symbol)
            log(f"kernel {kernel.symbol} hidden: it refuses {rank_heads} heads per rank "
                f"({type(e).__name__}: {str(e)[:120]}); the model takes its portable path")


def window(model) -> int:
    """How many committed positions the stages' context holds (the newest)."""
    return int(model.make_mtp_cache()[0].max_size)


def recent(held: mx.array | None, taps: mx.array, size: int) -> mx.array:
    """The target's taps at the last `size` positions a request's caches hold: `held`, then `taps` (those of the
    positions just fed)."""
    return (taps if held is None else mx.concatenate([held, taps], axis=1))[:, -size:]


def context(model, taps: mx.array | None, at: int) -> list:
    """The stages' context for a request whose caches hold `at` positions: `taps` (the target's at the positions
    just before `at`, kept with the tape its cache came from) entered at their own positions, as a prefill of
    them would have entered them; else empty. A stage refusing their shape leaves it empty: drafts only guess."""
    stages = model.make_mtp_cache()
    if taps is None:
        return stages
    try:
        model.dspark_append_context(taps, stages, start_offset=at - taps.shape[1])
    except Exception:
        return model.make_mtp_cache()
    return stages


def draft(model, cache: list, committed: mx.array, anchor: int, width: int,
          allowed=lambda drafts, row: row) -> tuple[mx.array, mx.array]:
    """The first `width` drafts of DeepSeek's DSpark block after `anchor` (the token the target sampled last,
    not yet through it), and the biased logits each was taken from. `committed` (the target's taps of the
    positions before the anchor that `cache` lacks) enters the stages' context first; the whole block (the
    anchor at its own position, then noise tokens) goes through the stages, as the checkpoint was trained: a
    narrower one would attend to fewer noise rows and draft other tokens. Its rows are walked left to right,
    each biased by the Markov head from the draft before it (the anchor before the first), then by
    `allowed(drafts before it, row)` (a request's grammar), and taken greedily."""
    prev = mx.array([anchor], dtype=mx.uint32)
    logits, _ = model.dspark_forward(committed, prev, cache, draft_length=int(model.args.dspark_block_size))
    drafts, rows = [], []
    for i in range(width):
        bias, _ = model.dspark_markov(prev)
        rows.append(allowed(drafts, logits[:, i] + bias))
        prev = mx.argmax(rows[-1], axis=-1).astype(mx.uint32)
        drafts.append(prev)
    return mx.concatenate(drafts), mx.concatenate(rows)
