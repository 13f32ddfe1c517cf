"""The tiny checkpoint in DeepSeek-V4 DSpark's layout (model type deepseek_v4, three mtp.* stages after four
backbone layers, `main_proj` over the last three layers' taps, a Markov head), built here from the omlx
stand-in's classes (tests/standins/omlx, over mlx-lm's deepseek_v41) with the demo tokenizer, the
environment a rank needs to import that stand-in, and a mesh of real agents whose ranks have it."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import meshctl, stop_controller

STANDINS = Path(__file__).resolve().parents[1] / "standins"
CONFIG = {"model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 8, "head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 4,
          "o_lora_rank": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "sliding_window": 16, "compress_ratios": [0] * 7,
          "hc_mult": 2, "hc_sinkhorn_iters": 3, "max_position_embeddings": 4096, "rope_theta": 10000.0,
          # the published config's 1, which is not the stage count (n_mtp_layers is)
          "num_nextn_predict_layers": 1, "n_mtp_layers": 3, "dspark_block_size": 5,
          "dspark_noise_token_id": 511, "dspark_target_layer_ids": [1, 2, 3], "dspark_markov_rank": 8,
          "torch_dtype": "float32"}


def standin_env() -> dict:
    """What a rank's environment needs for `model_package = "omlx"` to find the stand-in."""
    return {"PYTHONPATH": os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def build_dspark_model(path: Path, markov_steps: int = 150, seed: int = 0) -> Path:
    """Write the checkpoint to `path`: seeded random weights, the Markov head fitted to the bigrams of the
    backbone's own greedy text (so drafts are right where that text repeats itself; `markov_steps` 0: not
    fitted)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runtime.models.demo_model import DemoModelSpec, build_demo_model

    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    from omlx.patches.deepseek_v4 import apply_deepseek_v4_patch, deepseek_v4_model as v4
    from omlx.patches.mlx_lm_mtp import apply_mlx_lm_mtp_patch, set_mtp_active

    apply_deepseek_v4_patch()
    apply_mlx_lm_mtp_patch()
    set_mtp_active(True)
    build_demo_model(path, DemoModelSpec())  # the tokenizer; its template, config and weights replaced
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    # DeepSeek's DSML template as mlx-lm ships it (V3.2's, V4's twin): reasoning_content, tools, tool results
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template_type": "deepseek_v32"}))
    config = {**CONFIG, "eos_token_id": json.loads((path / "config.json").read_text())["eos_token_id"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    model = v4.Model(v4.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4.0  # clear greedy winners
    if markov_steps:
        fit_markov(model, markov_steps)
    weights = dict(tree_flatten(model.parameters()))
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}, indent=2))
    return path


def fit_markov(model, steps: int, rows: int = 96, prefix: int = 4) -> None:
    """Fit the Markov head to the bigrams of the backbone's greedy text after `rows` random prefixes of
    `prefix` tokens: each bigram once, weighted by how often it occurs (the loss over every position, in a
    row per bigram)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    tokens, cache = mx.random.randint(0, 500, (rows, prefix)), model.make_cache()
    logits = model(tokens, cache)
    for _ in range(40):
        tokens = mx.concatenate([tokens, mx.argmax(logits[:, -1:], axis=-1)], axis=1)
        logits = model(tokens[:, -1:], cache)
        mx.eval(logits)
    pairs, counts = np.unique(np.stack([np.array(tokens[:, prefix - 1:-1]).ravel(),
                                        np.array(tokens[:, prefix:]).ravel()], 1),
                              axis=0, return_counts=True)
    prev, nxt, weight = mx.array(pairs[:, 0]), mx.array(pairs[:, 1]), mx.array(counts / counts.sum())
    head = model.mtp[-1].markov_head

    def loss(h):
        return (nn.losses.cross_entropy(h.markov_w2(h.markov_w1(prev)), nxt, reduction="none") * weight).sum()

    optimizer, step = optim.Adam(learning_rate=3e-2), nn.value_and_grad(head, loss)
    for _ in range(steps):
        _, grads = step(head)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state)


@contextmanager
def omlx_mesh(tmp: Path, model: Path, n: int, env: dict | None = None, agent: dict | None = None, **mesh):
    """`n` agents whose ranks find the omlx stand-in (and `env`), `agent` added to each agent.toml, and
    `meshctl up` on a mesh.toml of them (`mesh`: write_mesh's tables); yields (mesh.toml, agents) and
    leaves no process behind."""
    agents = make_agents(tmp, n, stall={"base": 10}, extra=agent)
    path = None
    try:
        for a in agents:
            a.spawn({**standin_env(), **(env or {})})
        for a in agents:
            a.wait_healthy()
        path = write_mesh(tmp, agents, model, **mesh)
        up = meshctl(path, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        yield path, agents
    finally:
        if path is not None:
            stop_controller(path)
        for a in agents:
            a.kill()
