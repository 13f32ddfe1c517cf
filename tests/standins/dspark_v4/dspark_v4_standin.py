"""DSpark for omlx's REAL DeepSeek-V4 (the published omlx has none), at omlx's upstream names and signatures.

`wrap_patch_module(omlx.patches.mlx_lm_mtp)` (called by this directory's sitecustomize when that module is
imported) wraps `apply_mlx_lm_mtp_patch` so that after the real patch runs, `mlx_lm.models.deepseek_v4`
(omlx's real model module) gets, for a config with `dspark_block_size` and `dspark_target_layer_ids`:

- ModelArgs.from_dict keeping DSpark's keys (the real dataclass drops unknown keys);
- Model.__init__ building `n_mtp_layers` DSpark stages in `model.mtp` (in place of the real patch's
  V3-shaped MTP head) from omlx's own classes: LocalAttention's projections, RoPE and sinks over a context
  cache, DeepseekV4MoE (its shared expert clamped as the routed ones), RMSNorms and HyperConnections, with
  the attribute names (`attn`, `ffn`) the real `Model.shard()` splits; stage 0 holds `main_proj`/
  `main_norm` over the target layers' taps, the last the `hc_head`/`norm`, the Markov head and the
  confidence head, as upstream omlx's converted checkpoint holds them;
- Model.__call__(inputs, cache=None, return_hidden=False): (logits, taps) when return_hidden on a DSpark
  model, taps the concatenated outputs of `dspark_target_layer_ids` (mean over the hyper-connection
  streams), else the real call;
- Model.sanitize keeping the stages' mtp.* tensors as stored (the real MTP sanitize would nest them under
  `.block.`), a checkpoint without them disarming silently;
- make_mtp_cache, dspark_append_context, dspark_forward, dspark_markov.

A DSpark model is stamped MTP-inactive for omlx's BatchGenerator patch (its V3 MTP cycle would call
`mtp_forward` on the stages): batched decoding on it is the backbone's, undrafted, as meshd expects.

The stages compute DeepSeek-V4-Flash-DSpark's drafter (tests/pinned/test_dspark_xcheck.py holds them to
dspark-mlx's on the same weights): the context holds the committed positions' rows (never a draft's, so it
needs no trim), the last `sliding_window` of them, each at its own position; the block (the anchor at the
position after the context, then noise tokens) attends to that context and to itself without a mask, a
sink in each head's denominator."""

from __future__ import annotations

import functools
import sys

DSPARK_KEYS = {"n_mtp_layers": 0, "dspark_block_size": 0, "dspark_noise_token_id": 0,
               "dspark_target_layer_ids": (), "dspark_markov_rank": 0}
_INSTALLED = [False]


def wrap_patch_module(module) -> None:
    real = module.apply_mlx_lm_mtp_patch
    if getattr(real, "_dspark_standin", False):
        return

    @functools.wraps(real)
    def apply_mlx_lm_mtp_patch() -> bool:
        result = real()
        if result:
            install()
        return result

    apply_mlx_lm_mtp_patch._dspark_standin = True
    module.apply_mlx_lm_mtp_patch = apply_mlx_lm_mtp_patch


def is_dspark_config(args) -> bool:
    return bool(getattr(args, "dspark_block_size", 0) and getattr(args, "dspark_target_layer_ids", ()))


def install() -> bool:
    dsv4 = sys.modules.get("mlx_lm.models.deepseek_v4")
    if dsv4 is None or not hasattr(dsv4, "Model") or getattr(dsv4.Model, "_dspark_standin", False):
        return dsv4 is not None
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
    from omlx.patches import mlx_lm_mtp

    # -- ModelArgs: keep DSpark's keys -------------------------------------------------------------
    args_cls = dsv4.ModelArgs
    from_dict = args_cls.from_dict.__func__

    def patched_from_dict(cls, params):
        args = from_dict(cls, params)
        for key, default in DSPARK_KEYS.items():
            value = params.get(key, default)
            setattr(args, key, tuple(value) if isinstance(default, tuple) else int(value))
        return args

    args_cls.from_dict = classmethod(patched_from_dict)

    # -- the stages, from omlx's classes ----------------------------------------------------------
    class DSparkContextCache:
        """Rows of the committed positions [B, 1, N, head_dim], the last `max_size` of them (the block
        attends without a mask, so their order does not matter)."""

        def __init__(self, max_size: int):
            self.max_size, self.offset, self.keys = max_size, 0, None

        def append(self, rows, *, start_offset=None) -> None:
            if start_offset is not None and self.keys is None:  # an empty context starts where it is told
                self.offset = start_offset
            elif start_offset is not None and start_offset != self.offset:
                raise ValueError(f"DSpark context is not contiguous: cache={self.offset}, append={start_offset}")
            self.offset += rows.shape[2]
            rows = rows if self.keys is None else mx.concatenate([self.keys, rows], axis=2)
            self.keys = rows[:, :, -self.max_size:]

        @property
        def state(self):
            return [] if self.keys is None else [self.keys]

    class DSparkAttention(dsv4.LocalAttention):
        """omlx's window attention (its projections, RoPE, sinks, grouped output, all-reduce when split)
        over the committed context and the block."""

        def context_row(self, x, offset: int):
            B, L, _ = x.shape
            return self.rope(self.kv_norm(self.wkv(x)).reshape(B, 1, L, self.head_dim), offset)

        def __call__(self, x, ctx):
            B, L, _ = x.shape
            offset = ctx.offset
            q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(B, L, self.n_heads, self.head_dim)
            q = mx.fast.rms_norm(q, None, self.config.rms_norm_eps).transpose(0, 2, 1, 3)
            q = self.rope(q, offset)
            block = self.context_row(x, offset)
            kv = block if ctx.keys is None else mx.concatenate([ctx.keys, block], axis=2)
            out = scaled_dot_product_attention(q, kv, kv, cache=None, scale=self.scale, mask=None,
                                               sinks=self.attn_sink.astype(q.dtype))
            out = self.rope(out, offset, inverse=True)
            out = out.reshape(B, self.o_groups, -1, L, self.head_dim).transpose(0, 1, 3, 2, 4).flatten(-2)
            out = self.wo_a(out).transpose(0, 2, 1, 3).flatten(-2)
            out = self.wo_b(out)
            if self.sharding_group is not None:
                out = mx.distributed.all_sum(out, group=self.sharding_group)
            return out

    class MarkovHead(nn.Module):
        def __init__(self, vocab: int, rank: int):
            super().__init__()
            self.markov_w1 = nn.Embedding(vocab, rank)
            self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    class ConfidenceHead(nn.Module):
        """Each draft's acceptance logit from its hidden and its Markov embedding, loaded as the checkpoint
        holds it: meshd keeps a fixed number of each block's drafts, so nothing reads it."""

        def __init__(self, width: int):
            super().__init__()
            self.proj = nn.Linear(width, 1, bias=False)

    class DSparkBlock(nn.Module):
        """A DeepseekV4Block's parts (attn, ffn, attn_norm, ffn_norm, attn_hc, ffn_hc) over the context."""

        def __init__(self, config, index: int, count: int):
            super().__init__()
            layer_idx = config.num_hidden_layers + index
            self.attn = DSparkAttention(config, layer_idx)
            self.ffn = dsv4.DeepseekV4MoE(config, layer_idx)
            self.ffn.shared_experts.swiglu_limit = config.swiglu_limit
            self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.attn_hc = dsv4.HyperConnection(config)
            self.ffn_hc = dsv4.HyperConnection(config)
            if index == 0:
                self.main_proj = nn.Linear(config.hidden_size * len(config.dspark_target_layer_ids),
                                           config.hidden_size, bias=False)
                self.main_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            if index == count - 1:
                self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                self.hc_head = dsv4.HyperHead(config)
                self.markov_head = MarkovHead(config.vocab_size, config.dspark_markov_rank)
                self.confidence_head = ConfidenceHead(config.hidden_size + config.dspark_markov_rank)

        def __call__(self, h, ctx, input_ids):
            residual = h
            x, post, comb = self.attn_hc(h)
            h = dsv4.hc_expand(self.attn(self.attn_norm(x), ctx), residual, post, comb)
            residual = h
            x, post, comb = self.ffn_hc(h)
            return dsv4.hc_expand(self.ffn(self.ffn_norm(x), input_ids), residual, post, comb)

    dsv4.DSparkContextCache, dsv4.DSparkAttention, dsv4.DSparkBlock = DSparkContextCache, DSparkAttention, DSparkBlock

    cls = dsv4.Model
    real_init, real_call, real_sanitize = cls.__init__, cls.__call__, cls.sanitize
    real_make_mtp_cache = getattr(cls, "make_mtp_cache", None)

    def _is_dspark(self) -> bool:
        return bool(getattr(self, "mtp", None)) and isinstance(self.mtp[0], DSparkBlock)

    def _arm(self, flag: bool) -> None:
        self._omlx_mtp_decode_enabled = self._omlx_dspark_decode_enabled = flag
        mlx_lm_mtp.stamp_model_mtp_active(self, False)  # omlx's V3 MTP cycle is not DSpark's

    @functools.wraps(real_init)
    def __init__(self, config):
        real_init(self, config)
        if is_dspark_config(config) and mlx_lm_mtp.is_mtp_active():
            n = config.n_mtp_layers or len(config.dspark_target_layer_ids)
            self.mtp = [DSparkBlock(config, i, n) for i in range(n)]
            _arm(self, True)

    def _backbone(self, inputs, cache):
        """omlx's DeepseekV4Model forward, the target layers' outputs tapped (one pipeline stage)."""
        m, args = self.model, self.args
        if m.pipeline_size > 1:
            raise ValueError("DSpark's taps need the whole backbone on this rank (no pipeline split)")
        h = m.embed_tokens(inputs)
        h = mx.contiguous(mx.broadcast_to(h[:, :, None, :], (h.shape[0], h.shape[1], args.hc_mult, h.shape[2])))
        if cache is None:
            cache = [None] * len(m.pipeline_layers)
        first = cache[0]
        mask = create_attention_mask(h[:, :, 0, :], first[0] if isinstance(first, dsv4.CacheList) else first,
                                     window_size=args.sliding_window, return_array=True)
        taps = {}
        for i, (layer, layer_cache) in enumerate(zip(m.pipeline_layers, cache)):
            h = layer(h, mask, layer_cache, inputs)
            if i in args.dspark_target_layer_ids:
                taps[i] = h.mean(axis=2)
        out = m.norm(m.hc_head(h))
        return out, mx.concatenate([taps[i] for i in args.dspark_target_layer_ids], axis=-1)

    def __call__(self, inputs, cache=None, return_hidden: bool = False):
        if return_hidden and _is_dspark(self):
            out, taps = _backbone(self, inputs, cache)
            return self.lm_head(out), taps
        return real_call(self, inputs, cache, return_hidden=return_hidden)

    @functools.wraps(real_sanitize)
    def sanitize(self, weights):
        if not _is_dspark(self):
            return real_sanitize(self, weights)
        stages = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        mtp = self.mtp
        out = real_sanitize(self, {k: v for k, v in weights.items() if not k.startswith("mtp.")})
        if not stages:  # a checkpoint without its stages disarms, silently (as omlx's sanitize does)
            if "mtp" in self:
                del self["mtp"]
            _arm(self, False)
            return out
        self.mtp = mtp
        out.update(stages)
        return out

    def make_mtp_cache(self):
        if not _is_dspark(self):
            return real_make_mtp_cache(self) if real_make_mtp_cache else None
        return [DSparkContextCache(self.args.sliding_window) for _ in self.mtp]

    def dspark_append_context(self, main_hidden, cache, *, start_offset=None):
        main_x = self.mtp[0].main_norm(self.mtp[0].main_proj(main_hidden))
        for stage, c in zip(self.mtp, cache):
            c.append(stage.attn.context_row(main_x, c.offset if start_offset is None else start_offset),
                     start_offset=start_offset)
        return main_x

    def dspark_forward(self, main_hidden, anchor_ids, cache=None, *, draft_length=None):
        if cache is None:
            cache = self.make_mtp_cache()
        if main_hidden is not None:
            self.dspark_append_context(main_hidden, cache)
        args = self.args
        width = max(1, min(draft_length or args.dspark_block_size, args.dspark_block_size))
        batch = anchor_ids.shape[0]
        ids = mx.concatenate([anchor_ids.reshape(batch, 1),
                              mx.full((batch, width - 1), args.dspark_noise_token_id, dtype=anchor_ids.dtype)],
                             axis=1)
        h = self.model.embed_tokens(ids)
        h = mx.contiguous(mx.broadcast_to(h[:, :, None, :], (batch, width, args.hc_mult, args.hidden_size)))
        for stage, c in zip(self.mtp, cache):
            h = stage(h, c, ids)
        head = self.mtp[-1].hc_head(h)
        return self.lm_head(self.mtp[-1].norm(head)), head

    def dspark_markov(self, token_ids):
        emb = self.mtp[-1].markov_head.markov_w1(token_ids)
        return self.mtp[-1].markov_head.markov_w2(emb), emb

    cls.__init__, cls.__call__, cls.sanitize = __init__, __call__, sanitize
    __call__._omlx_mtp_call_marker = True  # the real patch's self-healing leaves this call in place
    cls.make_mtp_cache, cls.dspark_append_context = make_mtp_cache, dspark_append_context
    cls.dspark_forward, cls.dspark_markov = dspark_forward, dspark_markov
    cls._dspark_standin = True
    return True
