"""Node facts. Every external command runs under a timeout: a hung tool (an
`ibv_devices` stuck in the RDMA driver) is reported as hung, never waited on."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import platform
import secrets
import shutil
import socket
import sys
import threading
from concurrent.futures import Future
from importlib import metadata
from pathlib import Path

import psutil

from common import procs
from common.buildinfo import installed
from common.checkpoint import survey
from common.fingerprint import weights_digest
from common.modelref import ModelNotFound, resolve

TOOL_TIMEOUT = 5.0
# What a tokenizer mlx-lm can load leaves in a model directory: one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


async def run_tool(argv: list[str], timeout: float = TOOL_TIMEOUT) -> dict:
    """{"ok", "output"} or {"ok": False, "error"}; a timeout kills the tool and its children."""
    if shutil.which(argv[0]) is None:
        return {"ok": False, "error": f"{argv[0]} not found"}
    r = await asyncio.to_thread(procs.run, argv, timeout)
    if r.hung:
        return {"ok": False, "error": f"{' '.join(argv)} hung for more than {timeout:.0f}s", "hung": True}
    if not r.ok:
        return {"ok": False, "error": f"{' '.join(argv)} exited {r.code}: {r.output.strip()[:300]}"}
    return {"ok": True, "output": r.output}


async def boot_id() -> str:
    """macOS's boot session UUID (sysctl), else Linux's boot_id, else the boot time."""
    mac = await run_tool(["sysctl", "-n", "kern.bootsessionuuid"])
    if mac["ok"] and mac["output"].strip():
        return mac["output"].strip()
    linux = Path("/proc/sys/kernel/random/boot_id")
    if linux.exists():
        return linux.read_text().strip()
    return str(psutil.boot_time())


async def wired_limit_mb() -> int | None:
    """`iogpu.wired_limit_mb` (macOS; 0 means the OS default), None where the key does not exist."""
    r = await run_tool(["sysctl", "-n", "iogpu.wired_limit_mb"])
    try:
        return int(r["output"].strip()) if r["ok"] else None
    except ValueError:
        return None


async def apply_wired_limit(mb: int) -> dict:
    """Set `iogpu.wired_limit_mb` (lost at every reboot) unless it already holds `mb`."""
    before = await wired_limit_mb()
    if before == mb:
        return {"wanted": mb, "ok": True, "was": before}
    r = await run_tool(["sudo", "-n", "sysctl", f"iogpu.wired_limit_mb={mb}"])
    return {"wanted": mb, "ok": r["ok"], "was": before, **({} if r["ok"] else {"error": r["error"]})}


def model_files(model_dir: str) -> dict:
    """Whether the model is here whole enough to load: its weights' bytes and files (nothing read)."""
    root = Path(model_dir)
    try:
        if not (root / "config.json").is_file():
            return {"present": False, "path": model_dir}
        if not any((root / name).is_file() for name in TOKENIZER_FILES):
            return {"present": False, "path": model_dir, "error": f"no tokenizer ({' / '.join(TOKENIZER_FILES)})"}
        sizes = [p.stat().st_size for p in root.iterdir() if p.suffix == ".safetensors"]
    except OSError as e:
        return {"present": False, "path": model_dir, "error": str(e)}
    return {"present": True, "path": model_dir, "bytes": sum(sizes), "weight_files": len(sizes)}


def model_fingerprint(model_dir: str) -> dict:
    """`model_files`, and the weights' fingerprint (common/fingerprint.py), waited for."""
    found = model_files(model_dir)
    try:
        return {**found, "fingerprint": weights_digest(Path(model_dir))} if found["present"] else found
    except (OSError, ValueError) as e:
        return {"present": False, "path": model_dir, "error": str(e)}


class Hashing:
    """One model folder's fingerprint, hashed in a thread of its own, and how far it is."""

    def __init__(self, root: Path):
        self.done, self.total = 0, sum(p.stat().st_size for p in root.glob("*.safetensors"))
        self._lock = threading.Lock()
        self.future: Future = Future()
        threading.Thread(target=self._run, args=(root,), name="hashing", daemon=True).start()

    def _advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes

    def _run(self, root: Path) -> None:
        try:
            self.future.set_result(weights_digest(root, self._advance))
        except BaseException as e:  # the caller's to say
            self.future.set_exception(e)


HASH_WAIT = 1.0  # seconds a facts call waits for a fingerprint before it answers with how far its hashing is
_hashing: dict[str, Hashing] = {}  # the agent's hashes, by model folder: one at a time each


async def model_facts(model_dir: str) -> dict:
    """`model_files`, the checkpoint's findings (common/checkpoint.py, from its headers), and the fingerprint,
    or, while a first hash runs (a 100 GB model's takes minutes, more than any caller waits), how far it is:
    "hashing" with the bytes done and in all, the fingerprint "".
    The hash goes on behind; the caller asks again. A hash that ended is started afresh at the next call,
    which the digest cache makes quick unless a file changed since."""
    found = await asyncio.to_thread(model_files, model_dir)
    if not found["present"]:
        return found
    found["checkpoint"] = (await asyncio.to_thread(survey, Path(model_dir))).to_dict()
    job = _hashing.get(model_dir)
    try:
        if job is None or job.future.done():
            job = _hashing[model_dir] = await asyncio.to_thread(Hashing, Path(model_dir))
        fingerprint = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), HASH_WAIT)
    except TimeoutError:
        return {**found, "fingerprint": "", "hashing": {"done_bytes": job.done, "total_bytes": job.total}}
    except (OSError, ValueError) as e:
        return {"present": False, "path": model_dir, "error": str(e)}
    return {**found, "fingerprint": fingerprint}


def tree_files(root: Path) -> tuple[int, int]:
    """The files under `root` and their bytes ((0, 0) when it does not exist)."""
    files = total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file():
                files, total = files + 1, total + path.stat().st_size
        except OSError:
            continue
    return files, total


def clear_folder(root: Path) -> dict:
    """Delete what `root` holds, `root` itself kept (its mode stays). Each entry is first renamed aside (a hidden
    name in `root`) and deleted there: a rank writing into its folder meanwhile fails that one write and makes
    its folder again (runtime/prefix/snapshot.py `_lost_folder`), never racing the deletion. Returns the files and
    bytes deleted, and what could not be (an aside left from such a failure goes at the next clear)."""
    files = nbytes = 0
    problems: list[str] = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        aside = root / f".clearing-{secrets.token_hex(6)}"
        try:
            entry.rename(aside)
        except OSError as e:
            problems.append(f"{entry}: {e.strerror}")
            continue
        if aside.is_dir() and not aside.is_symlink():
            held = tree_files(aside)
            shutil.rmtree(aside, onerror=lambda _, path, exc: problems.append(f"{path}: {exc[1]}"))
            left = tree_files(aside)
        else:  # a file, or a link (not what it points to)
            held, left = (1, aside.lstat().st_size), (0, 0)
            aside.unlink()
        files, nbytes = files + held[0] - left[0], nbytes + held[1] - left[1]
    return {"folder": str(root), "files": files, "bytes": nbytes, "problems": problems}


def parse_ibv_devices(output: str) -> list[str]:
    """Device names from `ibv_devices` (a two-line header, then name + GUID)."""
    names = []
    for line in output.splitlines()[2:]:
        parts = line.split()
        if parts:
            names.append(parts[0])
    return names


def package_facts(name: str) -> dict:
    """Does model overlay `name` import here, and in which version (its distribution's, else its file's hash)?"""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        return {"name": name, "present": False, "error": f"{type(e).__name__}: {e}"}
    if spec is None or spec.origin is None:
        return {"name": name, "present": False, "error": "no such module"}
    dists = metadata.packages_distributions().get(name.split(".")[0], [])
    version = installed(dists[0]) if dists else None
    return {"name": name, "present": True,
            "version": version or "sha256:" + hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]}


async def facts(model: str | None = None, node: str = "this node", package: str | None = None) -> dict:
    """This machine as doctor wants it; with `model` (a path or a Hugging Face repo id) its fingerprint,
    with `package` (a model overlay) whether it imports and its version."""
    mem = psutil.virtual_memory()
    out = {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu_count": psutil.cpu_count(),
        "memory_total_bytes": mem.total,
        "memory_available_bytes": mem.available,
        "python": sys.version.split()[0],
        "mlx": installed("mlx"),
        "mlx_lm": installed("mlx-lm"),
        "boot_id": await boot_id(),
        "wired_limit_mb": await wired_limit_mb(),
        "rdma_devices": None,
    }
    if package:
        out["model_package"] = package_facts(package)
    model_dir = None
    if model:
        try:
            model_dir = str(resolve(model, node))
        except ModelNotFound as e:
            out["model"] = {"present": False, "path": model, "error": str(e)}
        else:
            out["model"] = {**await model_facts(model_dir), "name": model}
    where = Path(model_dir) if model_dir else Path.home()
    try:
        while not where.exists() and where != where.parent:
            where = where.parent
        out["disk_free_bytes"] = shutil.disk_usage(where).free
    except (OSError, ValueError):  # a path with a NUL byte, or one we may not stat
        out["disk_free_bytes"] = None
    ibv = await run_tool(["ibv_devices"])
    out["rdma_devices"] = parse_ibv_devices(ibv["output"]) if ibv["ok"] else {"error": ibv["error"],
                                                                             "hung": ibv.get("hung", False)}
    return out
