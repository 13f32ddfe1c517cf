"""DSpark's stages in tensor parallel, and the model-specific kernels a split breaks.

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


def stages(model) -> list:
    """The model's DSpark stages (none when it has no drafter or its checkpoint had no stages)."""
    return list(getattr(model, "mtp", None) or []) if hasattr(model, "dspark_forward") else []


def attention(layer):
    return getattr(layer, "self_attn", None) or layer.attn


def heads(layer) -> int:
    """A layer's query heads on this rank."""
    attn = attention(layer)
    return int(getattr(attn, "num_heads", None) or attn.n_heads)


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
