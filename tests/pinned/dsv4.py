"""A tiny DeepSeek-V4 checkpoint for omlx's REAL model class (flyto-mlx's omlx.patches.deepseek_v4), with
DSpark's three stages (mtp.*) as tests/standins/dspark_v4 gives that class, and the PYTHONPATH a rank in the
pinned env (.venv-omlx) needs for that stand-in.

Five backbone layers with compress_ratios [0, 4, 128, 4, 0]: the ratio-4 layers are omlx's
SparseCompressedAttention (CacheList(Rotating, Pooling, Pooling), an Indexer whose index_topk 4 a prompt past
16 tokens exceeds: the sparse path), the ratio-128 one CompressedAttention (CacheList(Rotating, Pooling)),
the others LocalAttention over a 16-token window. 16 heads in 4 output groups (TP2 and TP4 split them), 4
experts, float32, the demo tokenizer (vocab 512)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kit.dspark import fit_markov

STANDIN = Path(__file__).resolve().parents[1] / "standins" / "dspark_v4"
CONFIG = {"model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 5,
          "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 8,
          "q_lora_rank": 32, "o_groups": 4, "o_lora_rank": 16, "moe_intermediate_size": 32,
          "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "num_hash_layers": 1,
          "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0,
          "rms_norm_eps": 1e-6, "sliding_window": 16, "compress_ratios": [0, 4, 128, 4, 0],
          "compress_rope_theta": 160000.0, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4,
          "hc_mult": 2, "hc_sinkhorn_iters": 3, "hc_eps": 1e-6, "max_position_embeddings": 4096,
          "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
          # the published config's 1, which is not the stage count (n_mtp_layers is)
          "num_nextn_predict_layers": 1}
DSPARK = {"n_mtp_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 511,
          "dspark_target_layer_ids": [2, 3, 4], "dspark_markov_rank": 8}


def pinned_env() -> dict:
    """What a rank's environment in the pinned env needs for the stand-in (its sitecustomize)."""
    return {"PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


OVERLAY = ("--model-package", "omlx", "--prefill-step-size", "128")
PROMPT = ("The ranks step in lockstep: each token needs an all-reduce across the ring, and the pooled keys "
          "of the compressed layers keep what the window forgets. ") * 6
ASKS = {"greedy": {"logprobs": True}, "seeded": {"temperature": 0.9, "seed": 7, "logprobs": True, "top_logprobs": 2}}
COMPLETION = {"completion": {"logprobs": 2}}  # /v1/completions, greedy, the two most likely tokens at each place


def ask(url: str, model, name: str, tokens: int) -> dict:
    """One of ASKS (or COMPLETION, of /v1/completions), of PROMPT, `tokens` long: its text, usage, tokens, their
    log probabilities and the most likely tokens' at each place."""
    import requests

    from kit.demo_answers import endless

    if name in COMPLETION:
        r = requests.post(f"{url}/v1/completions", timeout=600,
                          json={"prompt": PROMPT, "max_tokens": tokens, **COMPLETION[name], **endless(model)})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        return {"text": choice["text"], "usage": r.json()["usage"], "tokens": lp["tokens"],
                "logprobs": lp["token_logprobs"], "top": lp["top_logprobs"]}
    r = requests.post(f"{url}/v1/chat/completions", timeout=600,
                      json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, **ASKS[name],
                            **endless(model)})
    assert r.status_code == 200, r.text
    body = r.json()
    content = (body["choices"][0].get("logprobs") or {}).get("content") or []
    return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"],
            "tokens": [t["token"] for t in content], "logprobs": [t["logprob"] for t in content]}


def answers(model, world: int, tmp, tokens: int, *args: str, asks=ASKS) -> tuple[dict, dict, str]:
    """`asks` (ASKS, COMPLETION) answered by `world` ranks on the ring serving `model` (with `args`), and rank 0's
    status and log."""
    from kit.ranks import start_mesh

    with start_mesh(model, world, tmp, *OVERLAY, *args, env=pinned_env()) as mesh:
        mesh.wait_ready(300)
        said = {name: ask(mesh.url, model, name, tokens) for name in asks}
        return said, mesh.status(0), mesh.log(0)


def check_drafted(drafted: dict, status: dict, log: str, plain: dict, fitted: bool, tokens: int) -> None:
    """DSpark drafted (often accepted with the head fitted, often rejected without) and every answer plain
    decoding's first `tokens` token for token and logprob for logprob (each token drawn with its place's key)."""
    import pytest

    assert "drafter armed: DSpark's 3 stages" in log, log
    assert status["drafter"] == "dspark" and status.get("draft_fallbacks", 0) == 0, (status, log[-3000:])
    proposed, accepted = status["draft_proposed"], status["draft_accepted"]
    assert proposed > 0, status
    if fitted:
        assert accepted > tokens // 4, status
    else:
        assert accepted < proposed // 2, status
    for name in ASKS:
        got, want = drafted[name], plain[name]
        assert got["usage"]["completion_tokens"] == tokens
        assert got["tokens"] == want["tokens"][:tokens], (name, status)
        assert got["logprobs"] == pytest.approx(want["logprobs"][:tokens], abs=1e-4), name
        if len(want["tokens"]) == tokens:
            assert got["text"] == want["text"]


def set_up_omlx():
    """omlx's patches as meshd's overlay calls them (the stand-in's hook in this process too); the real
    mlx_lm.models.deepseek_v4."""
    import importlib.util
    import sys

    if str(STANDIN) not in sys.path:
        sys.path.insert(0, str(STANDIN))
    if not any(type(f).__name__ == "_DSparkHook" for f in sys.meta_path):
        if "omlx.patches.mlx_lm_mtp" in sys.modules:
            raise RuntimeError("omlx.patches.mlx_lm_mtp was imported before the DSpark stand-in's hook")
        spec = importlib.util.spec_from_file_location("_dspark_v4_hook", STANDIN / "sitecustomize.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    import omlx.patches.deepseek_v4 as p4

    p4.apply_deepseek_v4_patch()
    import omlx.patches.mlx_lm_mtp as mtp

    assert mtp.apply_mlx_lm_mtp_patch() is True
    mtp.set_mtp_active(True)
    return sys.modules["mlx_lm.models.deepseek_v4"]


def _randomize(model, seed: int, embed_scale: float = 16.0) -> None:
    """Seeded weights where omlx's constructors leave zeros (router, hash table, hyper-connections,
    compressor positions, each head's sink), the embedding scaled so greedy winners are clear."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    n_experts, top_k = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"]
    new = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("tid2eid"):
            row = mx.argsort(mx.random.uniform(shape=(value.shape[0], n_experts)), axis=-1)[:, :top_k]
            new.append((name, row.astype(value.dtype)))
        elif name.endswith("gate.weight") or "_hc." in name or ".hc_head." in name or name.endswith(".ape"):
            if name.endswith(".scale"):
                continue
            new.append((name, (mx.random.normal(value.shape) * 0.5).astype(value.dtype)))
        elif name.endswith("attn_sink"):
            # each head its own sink, as a real checkpoint's: omlx's shard() gives a rank other heads' sinks
            # unless meshd regroups them (runtime/dspark.regroup_sinks)
            new.append((name, (mx.random.normal(value.shape) * 2.0).astype(value.dtype)))
    model.update(tree_unflatten(new))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * embed_scale


def build_v4_checkpoint(path, *, mtp: str = "dspark", markov_fitted: bool = True, seed: int = 0,
                        markov_steps: int = 150) -> Path:
    """Write the checkpoint to `path`: seeded random weights (the same backbone for any `mtp` and
    `markov_fitted`) and as its MTP: "dspark", the three stages, their Markov head fitted to the bigrams of
    the backbone's greedy text when `markov_fitted` (drafts often accepted), else left random (often
    rejected); "v3", the V3-shaped head omlx's own MTP patch builds (e_proj/h_proj); "none"."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runtime.models.demo_model import DemoModelSpec, build_demo_model

    path = Path(path)
    dsv4 = set_up_omlx()
    build_demo_model(path, DemoModelSpec())  # the tokenizer; config and weights replaced
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    config = {**CONFIG, **(DSPARK if mtp == "dspark" else {}), "eos_token_id": eos}
    mx.random.seed(seed)
    model = dsv4.Model(dsv4.ModelArgs.from_dict(config))
    _randomize(model, seed)
    if mtp == "dspark":
        assert len(model.mtp) == DSPARK["n_mtp_layers"] and hasattr(model.mtp[0], "main_proj"), "no DSpark stages"
        # the stages' own logits small beside the Markov head's bias: a fitted head's drafts are the
        # backbone's bigrams (often accepted), an unfitted one's near random (often rejected)
        model.mtp[-1].norm.weight = model.mtp[-1].norm.weight * 0.05
        if markov_fitted:
            fit_markov(model, markov_steps, rows=128, prefix=24)
    else:
        assert hasattr(model.mtp[0], "e_proj"), "omlx's MTP patch built no V3-shaped head"
    weights = dict(tree_flatten(model.parameters()))
    if mtp == "none":
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        config["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(weights)}}, indent=2))
    return path


def tiny_v4():
    """omlx's real DeepSeek-V4 Model of CONFIG, seeded, in this process (no checkpoint, no DSpark stages), its
    embedding scaled up so greedy answers have clear winners."""
    import mlx.core as mx
    import omlx.patches.deepseek_v4 as omlx_v4

    omlx_v4.apply_deepseek_v4_patch()
    from mlx_lm.models import deepseek_v4 as v4  # registered by omlx's patch

    mx.random.seed(0)
    m = v4.Model(v4.ModelArgs.from_dict(CONFIG))
    m.model.embed_tokens.weight = m.model.embed_tokens.weight * 4.0
    mx.eval(m.parameters())
    return m


def greedy(model, prompt: list[int], n: int, *, fresh_cache: bool = False) -> list[int]:
    """n greedy tokens after `prompt` through omlx's real model and cache; `fresh_cache`: every step with a
    new, empty cache fed only the last token (a wrong cache), for checking the answer depends on it."""
    import mlx.core as mx

    cache = model.make_cache()
    logits = model(mx.array(prompt)[None], cache)
    out = [int(mx.argmax(logits[0, -1]))]
    for _ in range(n - 1):
        if fresh_cache:
            cache = model.make_cache()
        logits = model(mx.array([out[-1]])[None], cache)
        out.append(int(mx.argmax(logits[0, -1])))
    return out
