"""The demo model with a multi-token-prediction head in DeepSeek's layout, as
a model overlay (`[runtime] model_package = "runtime.models.overlays.demo_mtp"`):
importing it registers model type `demo_mtp` into mlx-lm.

The MTP head takes the backbone's last hidden state and the next token's
embedding (each normed, concatenated, projected) through one transformer
block, then the backbone's own final norm and head: it guesses the token after
next. `shard` splits the head's block exactly as the backbone's layers, as
DeepSeek's checkpoints need (stock `Model.shard()` leaves `self.mtp` alone and
TP desynchronises). Two faults for tests, by environment: MESHD_FAULT_MTP_UNREDUCED
shards the block without its all-reduce (each rank drafts its own guess),
MESHD_FAULT_MTP_REFUSE_AFTER=N makes the head refuse past N positions, as a
DSpark kernel refuses a layout (`Unsupported DSpark physical-ring GEMM
layout` near 4k tokens), and MESHD_FAULT_TARGET_REFUSE_AT=N makes the target
refuse a verify's shape (2 to 8 positions at once) past N positions."""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache


ModelArgs = llama.ModelArgs  # the backbone's arguments: the head adds none


class MTP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.enorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.block = llama.TransformerBlock(args)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        return self.block(x, create_attention_mask(x, cache), cache)


def _refuse_a_verify(inputs: mx.array, cache) -> None:
    limit = int(os.environ.get("MESHD_FAULT_TARGET_REFUSE_AT", "0"))
    at = (cache[0].offset if cache else 0) + inputs.shape[1]
    if limit and 1 < inputs.shape[1] <= 8 and at > limit:
        raise ValueError(f"Unsupported DSpark physical-ring GEMM layout. ({at} positions, "
                         "MESHD_FAULT_TARGET_REFUSE_AT)")


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.mtp = MTP(args)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        _refuse_a_verify(inputs, cache)
        return super().__call__(inputs, cache, **kwargs)

    def hidden(self, inputs: mx.array, cache) -> mx.array:
        """The backbone's last hidden states (normed), one per input position."""
        _refuse_a_verify(inputs, cache)
        return self.model(inputs, cache)

    def head(self, hidden: mx.array) -> mx.array:
        return self.lm_head(hidden)

    def make_mtp_cache(self) -> list:
        return [KVCache()]

    def mtp_draft(self, hidden: mx.array, next_tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """The MTP head's hidden states and logits for (hidden state at p, token at p+1) pairs."""
        limit = int(os.environ.get("MESHD_FAULT_MTP_REFUSE_AFTER", "0"))
        if limit and cache[0].offset + hidden.shape[1] > limit:
            raise RuntimeError(f"Unsupported DSpark physical-ring GEMM layout: {cache[0].offset + hidden.shape[1]} "
                               f"positions at {self.args.num_attention_heads} heads (MESHD_FAULT_MTP_REFUSE_AFTER)")
        h = self.mtp(hidden, self.model.embed_tokens(next_tokens), cache[0])
        return h, self.lm_head(self.model.norm(h))

    def shard(self, group: mx.distributed.Group | None = None):
        group = group or mx.distributed.init()
        super().shard(group)
        block, n = self.mtp.block, group.size()
        attn, mlp = block.self_attn, block.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        if os.environ.get("MESHD_FAULT_MTP_UNREDUCED"):
            attn.o_proj, mlp.down_proj = _local(attn.o_proj), _local(mlp.down_proj)


def _local(sharded) -> nn.Linear:
    """The same rank-local weights without the all-reduce: this rank's partial sum is its answer."""
    out_dims, in_dims = sharded.weight.shape
    local = nn.Linear(in_dims, out_dims, bias=False)
    local.weight = sharded.weight
    return local


sys.modules.setdefault("mlx_lm.models.demo_mtp", sys.modules[__name__])
