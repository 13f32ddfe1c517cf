"""Node facts. Every external command runs under a timeout: a hung tool (an
`ibv_devices` stuck in the RDMA driver) is reported as hung, never waited on."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import shutil
import socket
import sys
from importlib import metadata
from pathlib import Path

import psutil

TOOL_TIMEOUT = 5.0


async def run_tool(argv: list[str], timeout: float = TOOL_TIMEOUT) -> dict:
    """{"ok", "output"} or {"ok": False, "error"}; a timeout kills the tool."""
    if shutil.which(argv[0]) is None:
        return {"ok": False, "error": f"{argv[0]} not found"}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT,
                                                start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        # The whole session: a hung tool's children would hold the pipe open.
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return {"ok": False, "error": f"{' '.join(argv)} hung for more than {timeout:.0f}s", "hung": True}
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        return {"ok": False, "error": f"{' '.join(argv)} exited {proc.returncode}: {text.strip()[:300]}"}
    return {"ok": True, "output": text}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def boot_id() -> str:
    linux = Path("/proc/sys/kernel/random/boot_id")
    if linux.exists():
        return linux.read_text().strip()
    return str(psutil.boot_time())


def parse_ibv_devices(output: str) -> list[str]:
    """Device names from `ibv_devices` (a two-line header, then name + GUID)."""
    names = []
    for line in output.splitlines()[2:]:
        parts = line.split()
        if parts:
            names.append(parts[0])
    return names


async def facts(model_dir: str | None = None) -> dict:
    mem = psutil.virtual_memory()
    out = {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu_count": psutil.cpu_count(),
        "memory_total_bytes": mem.total,
        "memory_available_bytes": mem.available,
        "python": sys.version.split()[0],
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "boot_id": boot_id(),
        "wired_limit_mb": None,
        "rdma_devices": None,
    }
    where = Path(model_dir) if model_dir else Path.home()
    while not where.exists() and where != where.parent:
        where = where.parent
    out["disk_free_bytes"] = shutil.disk_usage(where).free
    if platform.system() == "Darwin":
        wired = await run_tool(["sysctl", "-n", "iogpu.wired_limit_mb"])
        out["wired_limit_mb"] = int(wired["output"].strip()) if wired["ok"] else None
    ibv = await run_tool(["ibv_devices"])
    out["rdma_devices"] = parse_ibv_devices(ibv["output"]) if ibv["ok"] else {"error": ibv["error"],
                                                                             "hung": ibv.get("hung", False)}
    return out
