"""The pinned env's ranks: omlx as published (flyto-mlx), given DSpark's stages at omlx's upstream names.

On PYTHONPATH of a rank in the pinned env only. It shadows nothing: an import hook waits for the real
`omlx.patches.mlx_lm_mtp` to be imported, then wraps its `apply_mlx_lm_mtp_patch` so that, after the
real patch has run, `dspark_v4_standin.install()` gives the real `mlx_lm.models.deepseek_v4.Model` its
DSpark stages and entry points. Nothing is imported until omlx's MTP patch is (a process that never
imports it pays one meta-path lookup per import)."""

import importlib.machinery
import sys

_TARGET = "omlx.patches.mlx_lm_mtp"


class _DSparkHook:
    """Finds the real omlx.patches.mlx_lm_mtp on the ordinary path and wraps its loader's exec_module."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_wrap(module, _exec=exec_module):
            _exec(module)
            import dspark_v4_standin

            dspark_v4_standin.wrap_patch_module(module)

        spec.loader.exec_module = exec_then_wrap
        return spec


if not any(isinstance(f, _DSparkHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _DSparkHook())

# chain to a sitecustomize further down the path, which this one hides
try:
    import importlib.util as _util

    for _entry in sys.path:
        if _entry and _entry.rstrip("/").endswith("dspark_v4"):
            continue
        _spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [_entry] if _entry else None)
        if _spec is not None and _spec.origin and "dspark_v4" not in _spec.origin:
            _mod = _util.module_from_spec(_spec)
            _spec.loader.exec_module(_mod)
            break
except Exception:  # a broken sitecustomize elsewhere is not this one's business
    pass
