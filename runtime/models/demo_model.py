"""Build the tiny demo model: llama architecture, seeded random weights, a real
byte-level BPE tokenizer with a chat template, in mlx-lm's on-disk format.

No download: the tokenizer is trained here on a small built-in corpus, the
weights come from a seeded generator. Used by the demo mesh and by tests.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Tools as Qwen2.5's template renders them (mlx-lm reads it as the json_tools family): the functions in a
# system turn, the assistant's calls as <tool_call> JSON, the tools' results as a user turn.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions. For each call, answer\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>\n<tools>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}{% set tool_call = call['function'] %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {% if tool_call.arguments is string %}{{ tool_call.arguments }}'
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}}\n</tool_call>\n"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A model that thinks (`DemoModelSpec.thinking`) opens a think block after the assistant's header unless
# `enable_thinking` is false, which closes an empty one (as DeepSeek-R1's and Qwen3's templates do).
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
CORPUS = """
A mesh of machines serves one model. Every rank holds a shard of every layer.
The ranks step in lockstep: each token needs an all-reduce across the ring.
When one rank dies the generation ends on every node and a new one starts.
Drain before close: stop admitting, finish the step, synchronize, then exit.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs.
user assistant system hello world what is the answer the tensor parallel model
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } : ; , . ! ? ' " # @ $ %
"""


@dataclass(frozen=True)
class DemoModelSpec:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    seed: int = 0
    model_vocab: int = 0  # rows of the embedding and head when larger than the tokenizer's (a real model's shape)
    thinking: bool = False  # <think> and </think> tokens, and a template that opens a think block
    dtype: str = "float32"  # or bfloat16, float16
    mtp: bool = False  # a DeepSeek-style MTP head (model type demo_mtp, from runtime.models.overlays.demo_mtp)
    mtp_train_steps: int = 0  # steps distilling the head on the model's own greedy text (0: random weights)


# mlx, mlx-lm and tokenizers are imported when a model is built: meshctl imports
# this module at every start (for the demo) and builds the model once; those
# imports would cost every meshctl call 2 s.
def _train_tokenizer(vocab_size: int, special_tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def build_demo_model(path: str | Path, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Write the model to `path` (created) and return it. Deterministic in `spec`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec.vocab_size, SPECIAL_TOKENS + (THINK_TOKENS if spec.thinking else []))
    tok.save(str(path / "tokenizer.json"))
    eos_id = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": THINKING_TEMPLATE if spec.thinking else CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "model_max_length": spec.max_position_embeddings,
            },
            indent=2,
        )
    )
    config = {
        "model_type": "demo_mtp" if spec.mtp else "llama",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "vocab_size": max(tok.get_vocab_size(), spec.model_vocab),
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "torch_dtype": spec.dtype,
        "meshd_demo": asdict(spec),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))

    mx.random.seed(spec.seed)
    if spec.mtp:
        from runtime.models.overlays import demo_mtp as family
    else:
        family = llama
    model = family.Model(family.ModelArgs.from_dict(config))
    # Scale the embeddings so random logits are spread out: greedy argmax then
    # has clear winners, and a float reduction order cannot flip it.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4.0
    if spec.mtp and spec.mtp_train_steps:
        distill_mtp(model, spec.mtp_train_steps, tok.get_vocab_size(), spec.seed)
    model.set_dtype(getattr(mx, spec.dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}},
            indent=2,
        )
    )
    return path


def distill_mtp(model, steps: int, vocab: int, seed: int, batch: int = 16, length: int = 48) -> None:
    """Teach the MTP head what the model itself says two tokens on: text the model writes greedily
    from random starts, the head trained (the backbone frozen) to name the token after next."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    mx.random.seed(seed + 1)
    tokens = mx.random.randint(0, vocab, (batch, 4))
    for _ in range(length):  # greedy continuations, recomputed whole: the demo model is tiny
        tokens = mx.concatenate([tokens, mx.argmax(model(tokens)[:, -1:], axis=-1)], axis=1)
    hidden = mx.stop_gradient(model.hidden(tokens, None))
    pairs, nexts, targets = hidden[:, :-2], tokens[:, 1:-1], tokens[:, 2:]

    def loss(mtp):
        h = mtp(pairs, model.model.embed_tokens(nexts), None)
        return nn.losses.cross_entropy(model.lm_head(model.model.norm(h)), targets, reduction="mean")

    optimizer = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model.mtp, loss)
    for _ in range(steps):
        _, grads = step(model.mtp)
        optimizer.update(model.mtp, grads)
        mx.eval(model.mtp.parameters(), optimizer.state)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write the model into")
    defaults = DemoModelSpec()
    for name, value in asdict(defaults).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args(argv)
    spec = DemoModelSpec(**{k: getattr(args, k) for k in asdict(defaults)})
    print(build_demo_model(args.path, spec))


if __name__ == "__main__":
    main()
