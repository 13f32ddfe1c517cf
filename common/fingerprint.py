"""What tells two copies of a model apart: every byte of every weight file, the config and weight index, and
the tokenizer's files. One digest for every comparison: the nodes' copies (`meshctl doctor`, `meshctl model
pull`), the meshes a proxy may move a stream between, and the model a prefix snapshot was made with.

A weight file is hashed whole (chunks in parallel, one thread a core; bench/fingerprint.py measures it), once
per change of the file: its content digest is kept in a cache (cache_path()) under its path, size, mtime_ns,
ctime_ns, inode and device. A write through the file system moves mtime and ctime; setting mtime back
(utime) moves ctime; a file replaced by a rename has another inode: no change of bytes leaves the five equal.
A file changed within RACY_NS of its hashing is not cached (a second write in the same timestamp tick would
leave them equal, as git's "racily clean" entries), and an unreadable or foreign cache is only a re-hash.
The first hash of a large model takes minutes: `progress` hears of each chunk's bytes as it is hashed (a cached
file's at once), so that whoever waits can say how far it is (agents/node.py)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 64 << 20  # bytes a thread hashes at a time
RACY_NS = 2_000_000_000
EXTRA_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model",
               "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshd" / "weights-digests.json"


def weights_digest(model_dir: Path, progress=lambda nbytes: None) -> str:
    """The model's fingerprint (16 hex digits); `progress(nbytes)` told of the weights' bytes as they are
    hashed. Raises OSError when a file cannot be read and ValueError when a weight file is not safetensors."""
    h = hashlib.blake2b(digest_size=8)
    for name in EXTRA_FILES:
        if name == "config.json" or (model_dir / name).is_file():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    cache = _read_cache()
    weights = sorted(model_dir.glob("*.safetensors"))
    for path in weights:
        h.update(f"{path.name}\0".encode() + _file_digest(path, cache, progress))
    if weights:
        _write_cache(cache)
    return h.hexdigest()


def stamps(model_dir: Path) -> list:
    """What tells whether a model's files are still the ones they were: each one the fingerprint reads, with
    the size, mtime_ns, ctime_ns, inode and device the digest cache keys it by (None where it is missing)."""
    names = [*EXTRA_FILES, *sorted(p.name for p in model_dir.glob("*.safetensors"))]
    out = []
    for name in names:
        try:
            st = os.stat(model_dir / name)
        except OSError:
            out.append((name, None))
            continue
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    return out


def loaded_digest(model_dir: Path, before: list) -> str:
    """The fingerprint of the weights a rank loaded, given the `stamps` its files had before the load: hashed
    after it (from the digest cache where the agent hashed them), and "" unless every file is still the one
    that was there before the load, so that a file replaced or written while it loaded is never reported as
    either weights (nor one that cannot be read since)."""
    try:
        digest = weights_digest(model_dir)
    except (OSError, ValueError):
        return ""
    return digest if stamps(model_dir) == before else ""


def _file_digest(path: Path, cache: dict, progress) -> bytes:
    """`path`'s content digest, from `cache` while the file is unchanged, else hashed (and put there)."""
    began = time.time_ns()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        known = cache.get(key)
        if isinstance(known, list) and len(known) == 6 and known[:5] == stamp and isinstance(known[5], str):
            progress(st.st_size)
            return bytes.fromhex(known[5])
        try:
            (n,) = struct.unpack("<Q", os.pread(f.fileno(), 8, 0))
        except struct.error:
            raise ValueError(f"{path.name} is not safetensors ({st.st_size} bytes)") from None
        if n > st.st_size - 8:
            raise ValueError(f"{path.name} is not safetensors (a header of {n} bytes in {st.st_size})")
        digest = content_digest(f.fileno(), st.st_size, progress=progress)
    if began - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
        cache[key] = [*stamp, digest.hex()]
    return digest


def content_digest(fd: int, size: int, threads: int | None = None, progress=lambda nbytes: None) -> bytes:
    """SHA-256 over each CHUNK of the file (read and hashed in parallel: hashlib and pread let go of the GIL;
    the CPUs' SHA instructions make it twice BLAKE2b's speed), then over those digests in order, with the size."""
    def chunk(offset: int) -> bytes:
        data = os.pread(fd, min(CHUNK, size - offset), offset)
        if len(data) != min(CHUNK, size - offset):
            raise OSError(f"the file shrank while it was hashed (at byte {offset + len(data)} of {size})")
        digest = hashlib.sha256(data).digest()
        progress(len(data))
        return digest

    top = hashlib.sha256(str(size).encode())
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        for d in pool.map(chunk, range(0, size, CHUNK)):
            top.update(d)
    return top.digest()


def _read_cache() -> dict:
    try:
        cache = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache: dict) -> None:
    """Atomically, 0600 in a 0700 folder, without the files that are gone; a cache that cannot be written is
    only a re-hash next time."""
    path = cache_path()
    cache = {k: v for k, v in cache.items() if os.path.exists(k)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
