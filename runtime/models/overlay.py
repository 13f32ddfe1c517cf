"""Model overlays as a contract: what `[runtime] model_package` names is set up before the model loads.

A package that registers itself on import needs nothing more. One whose patches must be called (omlx's
`deepseek_v4` + `mlx_lm_mtp`: patch functions, MTP switched on) has an adapter here, which names the calls,
the entry points a usable version has, the checkpoint tensors that must land in the model and the model
methods its drafter uses. Every entry point is
looked up before any is called, so an old version fails naming what it lacks, not half set up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from common.checkpoint import mtp_layout, tensors


class OverlayError(Exception):
    """The overlay cannot be set up, or the model it loaded is not what it promises; says why and the fix."""


@dataclass(frozen=True)
class Call:
    target: str  # "package.module:function"
    args: tuple = ()
    must_be_true: bool = False  # its result says whether it applied


@dataclass(frozen=True)
class Overlay:
    package: str
    before_load: tuple[Call, ...] = ()
    loads: tuple[str, ...] = ()  # checkpoint tensor prefixes that must end up in the model
    methods: tuple[str, ...] = ()  # what the loaded model must have (its drafter's entry points)
    armed: str = ""  # the model attribute that says its drafter is on
    after_load: tuple[Call, ...] = ()  # once the model is loaded: the overlay's own decoding hooks switched off
    disarmed: tuple[str, ...] = ()  # model attributes set False after load, for the same
    fix: str = ""  # how to get a version that has everything
    draft_fix: str = ""  # how to get a checkpoint its drafter drafts with


OMLX = Overlay(
    "omlx",
    before_load=(Call("omlx.patches.deepseek_v4:apply_deepseek_v4_patch"),
                 Call("omlx.patches.mlx_lm_mtp:apply_mlx_lm_mtp_patch", must_be_true=True),
                 Call("omlx.patches.mlx_lm_mtp:set_mtp_active", (True,))),
    loads=("mtp.",),
    methods=("make_mtp_cache", "dspark_append_context", "dspark_forward", "dspark_markov"),
    armed="_omlx_dspark_decode_enabled",
    # omlx drafts a lone row of mlx-lm's batch generator itself (its GenerationBatch.next patch), with no
    # cross-rank agreement: under meshd the ranks' engines draft, in lockstep, and omlx's path stays off
    after_load=(Call("omlx.patches.mlx_lm_mtp:set_mtp_active", (False,)),),
    disarmed=("_omlx_mtp_active", "_omlx_mtp_decode_enabled"),
    fix="install an omlx whose patches/mlx_lm_mtp has DeepSeek-V4 DSpark (github.com/jundot/omlx) on every node",
    draft_fix="a DeepSeek-V4 DSpark checkpoint (its mtp.* stages: mtp.0.main_proj over the target layers' taps, "
              "a Markov head in the last) drafts",
)
ADAPTERS = {o.package: o for o in (OMLX,)}


def overlay_for(package: str | None) -> Overlay | None:
    """The overlay `[runtime] model_package` names: an adapter meshd ships, or a package that needs only its
    import. None without one."""
    if not package:
        return None
    return ADAPTERS.get(package, Overlay(package))


def _resolve(target: str, fix: str):
    module, _, name = target.partition(":")
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise OverlayError(f"{module} cannot be imported ({e}); {fix}") from None
    if not hasattr(found, name):
        where = getattr(found, "__file__", None) or module
        raise OverlayError(f"{module}.{name} is missing in {where}: this version lacks an entry point meshd "
                           f"calls before load; {fix}")
    return getattr(found, name)


def set_up(overlay: Overlay) -> None:
    """Import the package, check every entry point is there, then make the calls in order."""
    fix = overlay.fix or "install it on this node (`meshctl doctor` checks every node has it, in one version)"
    try:
        importlib.import_module(overlay.package)
    except ImportError as e:
        raise OverlayError(f"--model-package {overlay.package} cannot be imported ({e}); {fix}") from None
    functions = [_resolve(call.target, fix) for call in overlay.before_load]
    for call, fn in zip(overlay.before_load, functions):
        if fn(*call.args) is False and call.must_be_true:
            raise OverlayError(f"{call.target.replace(':', '.')}() refused to apply (returned False); {fix}")


def checkpoint_tensors(model_path: Path) -> list[str]:
    """The tensor names a checkpoint holds, from its safetensors headers (no tensor is read)."""
    return sorted(tensors(model_path))


def unloaded(prefixes: tuple[str, ...], checkpoint: list[str], parameters: list[str]) -> list[str]:
    """The checkpoint's tensors under `prefixes` when the model holds no parameter under that prefix: the
    loader dropped them (a model built without its MTP stages drops every mtp.* tensor)."""
    return [name for p in prefixes if not any(k.startswith(p) for k in parameters)
            for name in checkpoint if name.startswith(p)]


def check_loaded(overlay: Overlay | None, model, checkpoint: list[str], parameters: list[str]) -> None:
    """What the overlay promises of the loaded model: its tensors loaded."""
    if overlay is None:
        return
    dropped = unloaded(overlay.loads, checkpoint, parameters)
    if dropped:
        shown = ", ".join(dropped[:6]) + (f" and {len(dropped) - 6} more" if len(dropped) > 6 else "")
        raise OverlayError(f"{len(dropped)} checkpoint tensors did not load ({shown}): the model was built "
                           f"without them. The overlay {overlay.package} was set up ({overlay.fix or 'check it'})")


def drafter_off(overlay: Overlay | None, model, checkpoint: list[str]) -> str | None:
    """Why the overlay's drafter does not arm on this model, in one line that says how to get one that does;
    None when it arms (or the overlay has none)."""
    if overlay is None or not overlay.methods:
        return None
    missing = [m for m in overlay.methods if not hasattr(model, m)]
    if not missing and getattr(model, overlay.armed, False):
        return None
    names = [n for n in checkpoint if n.startswith(overlay.loads)]
    held = mtp_layout(names)
    if missing:
        why = (f"this {overlay.package} has no drafter for it (it lacks {', '.join(missing)}) and the checkpoint "
               f"holds {held}; {overlay.fix}, and {overlay.draft_fix}")
    elif any(".main_proj." in n for n in names):
        why = (f"the checkpoint holds {held} but its config.json does not declare them (dspark_block_size, "
               "dspark_target_layer_ids); `meshctl doctor` names the fix")
    else:
        why = f"the checkpoint holds {held}, not DSpark's stages; {overlay.draft_fix}"
    return f"drafter off, serving undrafted: {why}"


def disarm(overlay: Overlay | None, model) -> None:
    """The overlay's own decoding hooks off for this model (meshd's engines decode it, in lockstep)."""
    if overlay is None:
        return
    for call in overlay.after_load:
        _resolve(call.target, overlay.fix)(*call.args)
    for name in overlay.disarmed:
        setattr(model, name, False)
