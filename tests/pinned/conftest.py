"""tests/pinned runs against the real omlx package (flyto-mlx's) at its pins, in .venv-omlx (scripts/venv-omlx):
a run anywhere else fails here, naming the fix, rather than testing a stand-in by mistake. The test process
gives that omlx DSpark's stages (tests/standins/dspark_v4, which it lacks) before any test module imports it,
as a rank in pinned.dsv4.pinned_env() has them; a rank started without that environment has omlx as
published."""

import importlib.metadata

import pytest

from pinned.dsv4 import set_up_omlx


def _pins() -> str:
    try:
        return " ".join(f"{d}=={importlib.metadata.version(d)}" for d in ("mlx", "mlx-lm", "flyto-mlx"))
    except importlib.metadata.PackageNotFoundError as e:
        return f"missing {e.name}"


PINS = _pins()
if PINS != "mlx==0.32.3 mlx-lm==0.31.3 flyto-mlx==0.7.0":
    raise pytest.UsageError(f"tests/pinned needs omlx's pins ({PINS} here): run scripts/venv-omlx, then "
                            ".venv-omlx/bin/python -m pytest tests/pinned")

set_up_omlx()
