"""mlx_lm.models.deepseek_v4 as omlx registers it, stand-in: mlx-lm's deepseek_v41 backbone (hyper-connections,
MoE, windowed attention) whose target attention verifies through `fast.dspark_ring_gemm` while DSpark's verify
is armed, and which taps the hidden states of `dspark_target_layer_ids`. The DSpark stages come with
omlx.patches.mlx_lm_mtp. A fault for tests, by environment: MESHD_FAULT_TARGET_REFUSE_AT=N makes the armed
verify refuse once the cache holds N positions."""

import os
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as v41

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
    def __call__(self, x, *, start_pos, window_idx, cache, shared):
        batch, length, _ = x.shape
        if not (is_dspark_verify_armed() and batch == 1 and 1 < length <= 6 and fast.has_symbol("dspark_ring_gemm")):
            return super().__call__(x, start_pos=start_pos, window_idx=window_idx, cache=cache, shared=shared)
        refuse_at = int(os.environ.get("MESHD_FAULT_TARGET_REFUSE_AT", "0"))
        if refuse_at and start_pos + length > refuse_at:
            raise ValueError(f"Unsupported DSpark physical-ring GEMM layout. (MESHD_FAULT_TARGET_REFUSE_AT: "
                             f"{start_pos + length} positions)")
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).reshape(batch, length, self.num_heads, self.head_dim)
        q = v41._apply_rope(q, self.rope, rope_dim=self.rope_dim, offset=start_pos)
        kv = self.kv_norm(self.kv_proj(x))
        kv = v41._fake_quant_fp8(v41._apply_rope(kv, self.rope, rope_dim=self.rope_dim, offset=start_pos), 32)
        window = cache.update_window(kv)[0]  # [rows, dim]
        scores = fast.dspark_ring_gemm(q[0], window, window_idx[0], True) * self.head_dim ** -0.5
        scores = mx.where((window_idx[0] >= 0)[:, None, :], scores, -mx.inf)
        sinks = mx.broadcast_to(self.sinks.astype(mx.float32)[None, :, None], (length, self.num_heads, 1))
        weights = mx.softmax(mx.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]
        rows = window[mx.maximum(window_idx[0], 0)].astype(mx.float32)  # [length, k, dim]
        out = (weights @ rows)[None].astype(x.dtype)
        out = v41._apply_rope(out, self.rope, rope_dim=self.rope_dim, offset=start_pos, inverse=True)
        out = self.o_a_proj(out.reshape(batch * length, self.o_groups, 1, -1), self._group_ids)
        return self.o_b_proj(out.reshape(batch, length, -1))


class DecoderLayer(v41.DecoderLayer):
    def __init__(self, args, layer_id):
        super().__init__(args, layer_id)
        self.self_attn = Attention(args, layer_id)


class DeepseekV4Model(v41.TextModel):
    def __init__(self, args):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]

    def __call__(self, inputs, cache=None, return_dspark_hidden=False):
        h = self.embed_tokens(inputs)
        batch, length, _ = h.shape
        cache = cache or self.make_cache()
        start_pos = cache[0].offset
        previous = 0 if cache[0].window is None else cache[0].window.shape[1]
        window_idx = v41._window_indices(previous=previous, length=length, window=self.args.sliding_window)
        window_idx = mx.broadcast_to(window_idx, (batch, *window_idx.shape))
        streams = mx.broadcast_to(h[:, :, None, :], (batch, length, self.args.hc_mult, self.args.hidden_size))
        pre_mix = mx.zeros((batch, length, self.args.hc_mult), dtype=mx.float32)
        pre_mix[..., 0] = 1.0
        shared, taps = {}, {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            streams, pre_mix = layer(streams, pre_mix, start_pos=start_pos, window_idx=window_idx,
                                     cache=layer_cache, shared=shared)
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
