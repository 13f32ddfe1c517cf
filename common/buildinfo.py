"""What this process is built from (meshd, MLX, mlx-lm, Python): for
`meshctl --version`, the agent's node facts and the `meshd_build_info` metric;
the `process_*` metrics every meshd registry carries; and the identity of the
files a process's code came from (a standby rank whose files changed since is stale)."""

from __future__ import annotations

import os
import sys
from importlib import metadata


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


def identities(paths: list[str]) -> dict[str, list[int] | None]:
    """Each path's identity: its device, inode, mtime (ns) and size; None when it is gone. A file an edit
    rewrote, an upgrade replaced or removed, or a directory renamed away has another identity (or none)."""
    found: dict[str, list[int] | None] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            found[path] = None
            continue
        found[path] = [st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size]
    return found
