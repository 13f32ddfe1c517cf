"""What this process is built from (meshd, MLX, mlx-lm, Python): for
`meshctl --version`, the agent's node facts and the `meshd_build_info` metric;
the `process_*` metrics every meshd registry carries; and when the code on
disk last changed (a standby rank that started before is stale)."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"meshd": installed("meshd"), "mlx": installed("mlx"), "mlx_lm": installed("mlx-lm"),
            "python": sys.version.split()[0]}


def register_process_metrics(registry, component: str) -> None:
    """process_* (CPU, memory, open files), python_info, and meshd_build_info{component, versions} in
    `registry`: a custom registry has none of them by itself."""
    from prometheus_client import Info, PlatformCollector, ProcessCollector

    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Info("meshd_build", "The versions this process runs", registry=registry).info(
        {"component": component, **{k: v or "not installed" for k, v in versions().items()}})


def newest_change(roots: list[str]) -> float:
    """When anything under `roots` (package directories) last changed: the newest status change (ctime,
    which no installer can set back) of any file or directory there. Code a process imported before this
    time may not be the code on disk now. Bytecode caches, which imports themselves write, do not count."""
    newest = 0.0
    for root in roots:
        for path in (Path(root), *Path(root).rglob("*")):
            if "__pycache__" in path.parts:
                continue
            try:
                newest = max(newest, path.stat().st_ctime)
            except OSError:
                continue
    return newest
