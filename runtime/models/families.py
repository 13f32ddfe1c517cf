"""What a model family needs of the node and of the engine, checked when a rank loads: a family that cannot
run as asked is refused with the reason and the way out, before it could answer garbage."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

# Caches that give back any number of tokens whatever they hold: a draft model takes back the drafts the target
# rejects. A sliding window past its size, a recurrent state or a compressed one cannot. (The target's own caches
# need not: a verify's writes are undone exactly whatever they are, runtime/prefix/rollback.py.)
TRIMMABLE = frozenset({"KVCache", "QuantizedKVCache", "ConcatenateKVCache"})
# Families whose mlx-lm 0.32.2 code reads the left padding of a batch, so a prompt shorter than another in the
# same batch gets another answer than it gets alone (tests/models/test_families.py shows each still does).
# longcat_flash_ngram's n-gram embedding hashed the padding of mlx-lm's BatchGenerator's prompts; the engine's
# rows take their prompts in alone, and it answers in a batch as alone.
PADDING_BLIND = {
    "minimax_m3_vl": "its sparse attention indexes the padding",
}


@dataclass(frozen=True)
class Needs:
    model_type: str
    metal_kernels: tuple[str, ...] = ()  # mlx-lm's Metal-only kernels (mlx_lm.kernels) its model code calls
    caches: frozenset[str] = frozenset({"KVCache"})  # the cache types of its layers
    unbatchable: frozenset[str] = frozenset()  # those that cannot join a batch's caches (no `merge`)


def refusal(needs: Needs, *, metal: bool, draft: Needs | None = None, batch: int = 16) -> str | None:
    """Why this node cannot run the family as asked, None when it can. `draft`: the --draft-model's needs;
    `batch`: the --completion-batch-size."""
    family = needs.model_type
    if needs.metal_kernels and not metal:
        return (f"{family} models run on mlx-lm's Metal-only kernels ({', '.join(needs.metal_kernels)}) "
                "and this node has no Metal GPU; serve them from Apple silicon")
    if draft is not None and (untrimmable := sorted(draft.caches - TRIMMABLE)):
        return (f"--draft-model (speculative decoding) cannot draft with a {draft.model_type} model: the draft "
                f"model's {', '.join(untrimmable)} cannot give back the drafts the target rejects, so it would "
                "draft nothing after its first miss; pick a draft model with plain KV caches, or drop --draft-model")
    if needs.unbatchable and batch > 1:
        return (f"{family} models cannot be batched: the rows of a batch share its caches, and their "
                f"{', '.join(sorted(needs.unbatchable))} cannot be merged in this mlx-lm; serve one request at a "
                "time: --completion-batch-size 1 ([runtime] args.completion_batch_size = 1)")
    if family in PADDING_BLIND and batch > 1:
        return (f"{family} models answer differently when batched with a longer prompt in this mlx-lm "
                f"({PADDING_BLIND[family]}); serve one request at a time: --completion-batch-size 1 "
                "([runtime] args.completion_batch_size = 1)")
    return None


def cache_types(caches: list) -> set[type]:
    """The cache classes of a model's layers, those inside a CacheList included."""
    out: set[type] = set()
    for c in caches:
        inner = getattr(c, "caches", None)
        out |= cache_types(inner) if inner is not None else {type(c)}
    return out


def needs_of(config: dict) -> Needs:
    """A family's needs from its config: its mlx-lm module and the caches of a model built from the config
    (lazily: no weights are made)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    module = vars(sys.modules[model_class.__module__])
    kernels = tuple(sorted(name for name, v in module.items()
                           if getattr(v, "__module__", "").startswith("mlx_lm.kernels")))
    model = model_class(args_class.from_dict(config))
    caches = cache_types(make_prompt_cache(model))
    return Needs(config["model_type"], kernels, frozenset(c.__name__ for c in caches),
                 frozenset(c.__name__ for c in caches if not hasattr(c, "merge")))


def refuse(config: dict, *, draft: str | None, batch: int) -> None:
    """Exit naming why the model of `config` cannot run here as asked (`draft`: the --draft-model directory)."""
    import mlx.core as mx
    from mlx_lm.utils import load_config

    why = refusal(needs_of(config), metal=mx.metal.is_available(),
                  draft=needs_of(load_config(Path(draft))) if draft else None, batch=batch)
    if why:
        raise SystemExit(f"meshd-rank: {why}")
