"""omlx.patches.mlx_lm_mtp, stand-in: MTP switched on before load (`set_mtp_active`, read when the model is
built) and `apply_mlx_lm_mtp_patch()`, which gives deepseek_v4's Model its DSpark stages and methods.
OMLX_STUB_OLD plays older versions: "nodspark", an omlx from before DSpark (no stages, no `dspark_forward`);
"noactive", one without `set_mtp_active`."""

import os

_depth = [5]
OLD = os.environ.get("OMLX_STUB_OLD", "")


def set_mtp_active(active: bool) -> None:
    from omlx.patches.deepseek_v4 import deepseek_v4_model

    deepseek_v4_model.MTP["active"] = bool(active)


if OLD == "noactive":
    del set_mtp_active


def is_mtp_active() -> bool:
    from omlx.patches.deepseek_v4 import deepseek_v4_model

    return deepseek_v4_model.MTP["active"]


def set_mtp_depth(depth: int) -> None:
    _depth[0] = max(1, min(int(depth), 8))


def get_mtp_depth() -> int:
    return _depth[0]


def apply_mlx_lm_mtp_patch() -> bool:
    import sys

    module = sys.modules.get("mlx_lm.models.deepseek_v4")
    if module is None:  # deepseek_v4's patch must come first; omlx only logs this
        return True
    from . import deepseek_v4_dspark as dspark

    if OLD == "nodspark":
        return True
    module.MTP["patched"] = True
    for name in ("make_mtp_cache", "dspark_append_context", "dspark_forward", "dspark_markov"):
        setattr(module.Model, name, getattr(dspark, name))
    return True
