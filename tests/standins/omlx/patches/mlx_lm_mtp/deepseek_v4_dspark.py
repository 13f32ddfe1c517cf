"""DSpark's drafter for deepseek_v4, stand-in at omlx's names: three heterogeneous stages (stage 0 fuses the
target layers' taps through `main_proj`; the last holds the norm and the Markov head), a block of drafts at
once (the anchor and noise tokens, attending to the committed context and the whole block), and a context
cache that only the committed timeline ever enters (no trim). The stages are built like the backbone's layers
(mlx-lm deepseek_v41 names), so the backbone's split applies to them; nothing here splits them. A fault for
tests, by environment: MESHD_FAULT_DSPARK_UNREDUCED leaves a split stage's attention without its all-reduce."""

import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v41 as v41


def is_dspark_config(cfg) -> bool:
    return bool(cfg.dspark_block_size > 0 and cfg.dspark_target_layer_ids)


def stage_count(cfg) -> int:
    return cfg.n_mtp_layers or len(cfg.dspark_target_layer_ids)


class DSparkContextCache:
    """Keys of the committed positions, the last `max_size` of them (the block attends without a mask, so
    their order does not matter)."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.offset = 0
        self.keys = None

    def append(self, keys: mx.array, *, start_offset: int | None = None) -> None:
        if start_offset is not None and self.keys is None:  # an empty context starts where it is told
            self.offset = start_offset
        elif start_offset is not None and start_offset != self.offset:
            raise ValueError(f"DSpark context is not contiguous: cache={self.offset}, append={start_offset}")
        self.offset += keys.shape[1]
        keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=1)
        self.keys = keys[:, -self.max_size:]


class DSparkAttention(v41.Attention):
    """One shared K=V head over the committed context and the whole block, the queries the block's."""

    def context_row(self, x: mx.array, offset: int) -> mx.array:
        return v41._apply_rope(self.kv_norm(self.kv_proj(x)), self.rope, rope_dim=self.rope_dim, offset=offset)

    def __call__(self, x, ctx: DSparkContextCache):
        batch, width, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).reshape(batch, width, self.num_heads, self.head_dim)
        q = v41._apply_rope(q, self.rope, rope_dim=self.rope_dim, offset=ctx.offset)
        block = self.context_row(x, ctx.offset)
        keys = block if ctx.keys is None else mx.concatenate([ctx.keys, block], axis=1)
        keys = keys[:, None].astype(mx.float32)
        out = mx.fast.scaled_dot_product_attention(q.transpose(0, 2, 1, 3).astype(mx.float32), keys, keys,
                                                   scale=self.head_dim ** -0.5, sinks=self.sinks.astype(mx.float32))
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)
        out = v41._apply_rope(out, self.rope, rope_dim=self.rope_dim, offset=ctx.offset, inverse=True)
        out = self.o_a_proj(out.reshape(batch * width, self.o_groups, 1, -1), self._group_ids)
        out = out.reshape(batch, width, -1)
        if os.environ.get("MESHD_FAULT_DSPARK_UNREDUCED") and hasattr(self.o_b_proj, "group"):
            return out @ self.o_b_proj["weight"].T  # this rank's partial sum as if it were the whole
        return self.o_b_proj(out)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class DSparkBlock(nn.Module):
    def __init__(self, args, index: int, count: int):
        super().__init__()
        layer = args.num_hidden_layers + index
        self.self_attn = DSparkAttention(args, layer)
        self.mlp = v41.MoE(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attn_hc = v41.HyperConnection(args)
        self.ffn_hc = v41.HyperConnection(args)
        if index == 0:
            self.main_proj = nn.Linear(args.hidden_size * len(args.dspark_target_layer_ids), args.hidden_size,
                                       bias=False)
            self.main_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if index == count - 1:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)

    def __call__(self, streams, pre_mix, ctx):
        attn_pre, attn_post, attn_comb = self.attn_hc(streams)
        h = self.self_attn(self.input_layernorm(v41._collapse(streams, pre_mix)), ctx)
        streams = v41._expand(h, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(v41._collapse(streams, attn_pre)))
        return v41._expand(h, streams, ffn_post, ffn_comb), ffn_pre


# The methods apply_mlx_lm_mtp_patch() gives deepseek_v4's Model, at omlx's names and signatures.
def make_mtp_cache(self) -> list:
    return [DSparkContextCache(self.args.sliding_window) for _ in self.mtp]


def dspark_append_context(self, main_hidden, cache, *, start_offset=None):
    main_x = self.mtp[0].main_norm(self.mtp[0].main_proj(main_hidden))
    for stage, c in zip(self.mtp, cache):
        c.append(stage.self_attn.context_row(main_x, c.offset if start_offset is None else start_offset),
                 start_offset=start_offset)
    return main_x


def dspark_forward(self, main_hidden, anchor_ids, cache=None, *, draft_length=None):
    if main_hidden is not None:
        self.dspark_append_context(main_hidden, cache)
    args = self.args
    width = max(1, min(draft_length or args.dspark_block_size, args.dspark_block_size))
    batch = anchor_ids.shape[0]
    ids = mx.concatenate([anchor_ids.reshape(batch, 1),
                          mx.full((batch, width - 1), args.dspark_noise_token_id, dtype=anchor_ids.dtype)], axis=1)
    h = self.model.embed_tokens(ids)
    streams = mx.broadcast_to(h[:, :, None, :], (batch, width, args.hc_mult, args.hidden_size))
    pre_mix = mx.zeros((batch, width, args.hc_mult), dtype=mx.float32)
    pre_mix[..., 0] = 1.0
    for stage, c in zip(self.mtp, cache):
        streams, pre_mix = stage(streams, pre_mix, c)
    head = self.mtp[-1].norm(v41._collapse(streams, pre_mix))
    return self.lm_head(head), head


def dspark_markov(self, token_ids):
    emb = self.mtp[-1].markov_head.markov_w1(token_ids)
    return self.mtp[-1].markov_head.markov_w2(emb), emb
