"""omlx.patches.deepseek_v4, stand-in: `apply_deepseek_v4_patch()` registers model type deepseek_v4 into
mlx-lm and replaces `mlx_lm.utils.load_model` (in mlx-lm's own modules only, as omlx's utils_patch does) with
the loader that can read the checkpoint: a loader bound before the patch fails on it."""

import sys

_applied = False


def apply_deepseek_v4_patch() -> bool:
    global _applied
    if _applied:
        return False
    import mlx_lm.utils

    from . import deepseek_v4_model

    sys.modules["mlx_lm.models.deepseek_v4"] = deepseek_v4_model
    stock = mlx_lm.utils.load_model

    def load_model(*args, **kwargs):
        deepseek_v4_model.PATCHED_LOADER[0] = True
        try:
            return stock(*args, **kwargs)
        finally:
            deepseek_v4_model.PATCHED_LOADER[0] = False

    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm") and getattr(module, "load_model", None) is stock:
            module.load_model = load_model
    _applied = True
    return True


def is_applied() -> bool:
    return _applied
