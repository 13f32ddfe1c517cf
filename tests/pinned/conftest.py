"""tests/pinned runs against the real omlx package (flyto-mlx's) at its pins, in .venv-omlx (scripts/venv-omlx):
a run anywhere else fails here, naming the fix, rather than testing a stand-in by mistake. The test process
gives that omlx DSpark's stages (tests/standins/dspark_v4, which it lacks) before any test module imports it,
as a rank in pinned.dsv4.pinned_env() has them; a rank started without that environment has omlx as
published."""

import importlib.metadata

import mlx.core as mx
import pytest

from pinned.dsv4 import build_v4_checkpoint, set_up_omlx
from runtime.models.overlay import OMLX
from runtime.rank import load_sharded


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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny DeepSeek-V4 checkpoint with DSpark's stages (pinned.dsv4), for the module's tests."""
    return build_v4_checkpoint(tmp_path_factory.mktemp("models") / "v4")


@pytest.fixture(scope="module")
def model(checkpoint):
    """That checkpoint loaded through meshd-rank's load path, on one rank."""
    return load_sharded(checkpoint, mx.distributed.init(), lambda done, total: None, OMLX)
