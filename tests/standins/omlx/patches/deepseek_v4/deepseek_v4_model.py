"""mlx_lm.models.deepseek_v4 as omlx registers it, stand-in: mlx-lm's deepseek_v41 layers (hyper-connections,
MoE, one shared K=V head) over a sliding window in mlx-lm's RotatingKVCache (which batches, as omlx's caches
do), whose attention verifies through `fast.dspark_ring_gemm` while DSpark's verify is armed, and which taps
the hidden states of `dspark_target_layer_ids`. The DSpark stages come with omlx.patches.mlx_lm_mtp. A fault
for tests, by environment: MESHD_FAULT_TARGET_REFUSE_AT=N makes the armed verify refuse past N positions."""

import os
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as v41
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import RotatingKVCache

from omlx.custom_kernels.glm_moe_dsa import fast

PATCHED_LOADER = [False]  # set while omlx's loader runs: the stock loader cannot read the checkpoint
_VERIFY = [False]
MTP = {"patched": False, "active": False}  # omlx.patches.mlx_lm_mtp's switches, read at construction


def set_dspark_verify_armed(flag: bool) -> None:
    _VERIFY[0] = bool(flag)


def is_dspark_verify_armed() -> bool:
    return _VERIFY[0]


@dataclass
class ModelArgs(v41.ModelArgs):
    model_type: str = "deepseek_v4"
    num_nextn_predict_layers: int = 0
    n_mtp_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple = ()
    dspark_markov_rank: int = 0


class Attention(v41.Attention):
    """The window attention over mlx-lm's RotatingKVCache (which batches, as omlx's caches do)."""

    def __call__(self, x, mask, cache):
        batch, length, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).reshape(batch, length, self.num_heads, self.head_dim)
        q = v41._apply_rope(q, self.rope, rope_dim=self.rope_dim, offset=offset).transpose(0, 2, 1, 3)
        kv = self.kv_norm(self.kv_proj(x)).reshape(batch, length, 1, self.head_dim)
        kv = v41._fake_quant_fp8(v41._apply_rope(kv, self.rope, rope_dim=self.rope_dim, offset=offset), 32)
        kv = kv.transpose(0, 2, 1, 3)
        verify = is_dspark_verify_armed() and batch == 1 and 1 < length <= 6
        refuse_at = int(os.environ.get("MESHD_FAULT_TARGET_REFUSE_AT", "0"))
        if verify and refuse_at and offset + length > refuse_at:
            raise ValueError(f"Unsupported DSpark physical-ring GEMM layout. (MESHD_FAULT_TARGET_REFUSE_AT: "
                             f"{offset + length} positions)")
        keys, _ = cache.update_and_fetch(kv, kv) if cache is not None else (kv, kv)
        keys = keys.astype(mx.float32)
        if verify and fast.has_symbol("dspark_ring_gemm"):
            out = self._ring(q[0], keys[0, 0])
        else:
            out = scaled_dot_product_attention(q.astype(mx.float32), keys, keys, cache=cache,
                                               scale=self.head_dim ** -0.5, mask=mask,
                                               sinks=self.sinks.astype(mx.float32))
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)
        out = v41._apply_rope(out, self.rope, rope_dim=self.rope_dim, offset=offset, inverse=True)
        out = self.o_a_proj(out.reshape(batch * length, self.o_groups, 1, -1), self._group_ids)
        return self.o_b_proj(out.reshape(batch, length, -1))

    def _ring(self, q, rows):
        """DSpark's verify rows [heads, rows, dim] through the ring GEMM kernel over the window's keys."""
        length, window = q.shape[1], self.args_window
        idx = v41._window_indices(previous=rows.shape[0] - length, length=length, window=window)
        scores = fast.dspark_ring_gemm(q.transpose(1, 0, 2), rows, idx, True) * self.head_dim ** -0.5
        scores = mx.where((idx >= 0)[:, None, :], scores, -mx.inf)
        sinks = mx.broadcast_to(self.sinks.astype(mx.float32)[None, :, None], (length, self.num_heads, 1))
        weights = mx.softmax(mx.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]
        return (weights @ rows[mx.maximum(idx, 0)])[None].transpose(0, 2, 1, 3)


class DecoderLayer(v41.DecoderLayer):
    def __init__(self, args, layer_id):
        super().__init__(args, layer_id)
        self.self_attn = Attention(args, layer_id)
        self.self_attn.args_window = args.sliding_window

    def __call__(self, streams, pre_mix, mask, cache):
        attn_pre, attn_post, attn_comb = self.attn_hc(streams)
        h = self.self_attn(self.input_layernorm(v41._collapse(streams, pre_mix)), mask, cache)
        streams = v41._expand(h, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(v41._collapse(streams, attn_pre)))
        return v41._expand(h, streams, ffn_post, ffn_comb), ffn_pre


class DeepseekV4Model(v41.TextModel):
    def __init__(self, args):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]

    def make_cache(self):
        return [RotatingKVCache(max_size=self.args.sliding_window) for _ in self.layers]

    def __call__(self, inputs, cache=None, return_dspark_hidden=False):
        h = self.embed_tokens(inputs)
        batch, length, _ = h.shape
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0], window_size=self.args.sliding_window)
        streams = mx.broadcast_to(h[:, :, None, :], (batch, length, self.args.hc_mult, self.args.hidden_size))
        pre_mix = mx.zeros((batch, length, self.args.hc_mult), dtype=mx.float32)
        pre_mix[..., 0] = 1.0
        taps = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            streams, pre_mix = layer(streams, pre_mix, mask, layer_cache)
            if i in self.args.dspark_target_layer_ids:
                taps[i] = streams.mean(axis=2)
        out = self.norm(v41._collapse(streams, pre_mix))
        if not return_dspark_hidden:
            return out
        return out, mx.concatenate([taps[i] for i in self.args.dspark_target_layer_ids], axis=-1)


class Model(v41.Model):
    def __init__(self, args):
        super().__init__(args)
        self.model = DeepseekV4Model(args)
        if MTP["patched"] and MTP["active"] and args.n_mtp_layers:
            from omlx.patches.mlx_lm_mtp import deepseek_v4_dspark as dspark

            n = args.n_mtp_layers
            self.mtp = [dspark.DSparkBlock(args, i, n) for i in range(n)]
            self._omlx_mtp_decode_enabled = self._omlx_dspark_decode_enabled = True

    def __call__(self, inputs, cache=None, return_hidden=False, n_confirmed=0):
        if return_hidden and getattr(self, "mtp", None):
            h, taps = self.model(inputs, cache, return_dspark_hidden=True)
            return self.lm_head(h), taps
        return self.lm_head(self.model(inputs, cache))

    def sanitize(self, weights):
        if not PATCHED_LOADER[0]:
            raise ValueError("deepseek_v4 checkpoints hold F8_E8M0 scales that only omlx's patched "
                             "mlx_lm.utils.load_model reads")
        if getattr(self, "mtp", None) and not any(k.startswith("mtp.") for k in weights):
            del self.mtp  # a checkpoint without its stages disarms, silently (as omlx's sanitize does)
            self._omlx_mtp_decode_enabled = self._omlx_dspark_decode_enabled = False
        if not getattr(self, "mtp", None):
            weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        return weights
