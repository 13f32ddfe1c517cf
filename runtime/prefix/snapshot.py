"""Prefix snapshots: each rank's shard of its token-tape caches on local disk, restored by the next generation.

A snapshot is a chain of segments, one safetensors file each, holding every cache leaf's own state (its
`state`, and its `meta_state` where mlx-lm has one; a CacheList's members in its place, as runtime/prefix/rollback.py
walks them) at a point of a tape. Plain KV caches grow by appending: a segment holds their tokens
[start, end) and names its parent (the same tape's [0, start)), so a follow-up turn writes only its new
tokens. Caches written in place (a sliding window, DeepSeek-V4's pools) have no slice of tokens: each of
their segments holds the whole state at its end (start 0) and names as parent the snapshot its tape grew
from, which it does not need. Segments are written as the tape grows (after each prefill chunk and every
`every` tokens of an answer), so a death loses at most the last one. The lockstep loop only slices and queues;
a writer thread writes each segment once, its arrays side by side (each hashed as its bytes go out, the segment's
digest over its header and those hashes), flushes it to the disk and evicts least recently used tapes past the
disk budget. The next generation restores the tapes every rank holds
whole while it serves (runtime/restore.py); whatever is missing, truncated, corrupted or of another model,
world, rank, shard layout or file format is skipped with a log line and a counted reason.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import math
import os
import queue
import secrets
import shutil
import struct
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from runtime.prefix.checkpoints import Checkpoint, loaded, saved
from runtime.prefix.rollback import leaves

FORMAT = "meshd-snapshot/4"  # /3: digests keyed by the node's snapshot key; /4: over each array's own digest
# how a cache leaf is snapshotted: by its new tokens, appended to its parent's, or as its whole state
LEAVES = {"KVCache": "append", "RotatingKVCache": "whole", "PoolingCache": "whole"}
# threads that read and hash one tape's segments, as many as the writers: with 4, one H100 machine read a 1.6 GB
# tape in 1.0-1.3 s (bench/restart_tapes.py's rank logs), about 4 threads' hashing
READERS = 8
# threads that hash and write one segment's arrays: each hashes at about 570 MB/s (keyed blake2b, on the cores of
# one H100 machine), so 4 landed about 600 MB/s behind an 8B model's 890 MB/s prefill; 8 land about 780, and 16
# no more than 8 (bench/snapshot_writer.py, docs/BENCHMARKS.md)
WRITERS = 8
CHECKPOINT = "cp."  # the names of a segment's arrays that hold its tape's checkpoints' ("cp.0", "cp.1", ...)
SIDE_BY_SIDE = 1 << 22  # bytes of a segment from which its arrays go to those threads (a smaller one: one by one)
PROGRESS_EVERY = 10_000  # files between the lines that say how far the scan of a large folder is


def tape_id(tokens, tenant: str = "") -> str:
    """The name of a tape, the same on every rank: a hash of its tenant and its token ids (two tenants' same
    tokens are two tapes)."""
    scope = tenant.encode() + b"\0" if tenant else b""
    return hashlib.blake2b(scope + np.asarray(tokens, dtype=np.uint32).tobytes(), digest_size=12).hexdigest()


def shard_layout(model) -> str:
    """This rank's shard of the model: every parameter's name, shape and dtype, hashed."""
    shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(model.parameters())]
    return hashlib.blake2b(repr(shapes).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Identity:
    """What a snapshot is of: the model, the world, this rank and its shard layout."""

    model: str
    world: int
    rank: int
    layout: str

    def tags(self) -> dict[str, str]:
        return {"format": FORMAT, "model": self.model, "world": str(self.world), "rank": str(self.rank),
                "layout": self.layout}

    @property
    def mesh(self) -> str:
        """What every rank must share: the model and the world."""
        return f"{self.model}/{self.world}"

    @property
    def folder(self) -> str:
        return f"{self.model}-w{self.world}-r{self.rank}"


@dataclass(frozen=True)
class Segment:
    sid: str  # the tape id of tokens [0, end)
    parent: str  # the tape id of tokens [0, start); "" from the first token
    start: int
    end: int
    nbytes: int
    used_at: float
    path: Path | None = None
    tenant: str = ""  # whose tape it is (runtime/prefix/tape.py)
    checkpoint_bytes: int = 0  # of `nbytes`, the tape's checkpoints' arrays (a tape's last segment holds them)

    @property
    def needs(self) -> str:
        """The segment this one's state is appended to ("" when it holds its tape's state whole)."""
        return self.parent if self.start else ""


# --- the decisions -------------------------------------------------------------------------------------------

def snapshot_kind(leaf_types: list[str]) -> str | None:
    """How a cache whose leaves are of these types is snapshotted: "append" when all are plain KV caches (they
    grow by appending and are cut back exactly: a segment is a slice of tokens), "whole" when each is one whose
    whole state restores it exactly (a sliding window, DeepSeek-V4's pools; plain KV caches beside them), None
    when any other is among them."""
    kinds = {LEAVES.get(t) for t in leaf_types}
    if not kinds or None in kinds:
        return None
    return "whole" if "whole" in kinds else "append"


def due(written: int, have: int, every: int, final: bool, whole_state: bool) -> bool:
    """Whether a tape whose snapshot covers `written` of the `have` tokens its cache holds is written now: at
    its end (a finished answer) or once `every` tokens are new (a long prefill, an answer in flight). A tape
    whose `whole_state` is written is written again whole, so it also waits until a quarter of it is new: all
    its snapshots together then stay within about four times its last one."""
    new = have - written
    return new > 0 and (final or (new >= every and (not whole_state or 4 * new >= have)))


def agree(held: list[list[str]]) -> list[str]:
    """The tapes every rank holds, in rank 0's order."""
    everywhere = set(held[0]).intersection(*held[1:])
    return [sid for sid in held[0] if sid in everywhere]


def ends(sids: list[str], parents: dict[str, str]) -> list[str]:
    """The tapes of `sids` that no other one of them extends, in their order."""
    extended = {parents[s] for s in sids}
    return [s for s in sids if s not in extended]


def serving(sids: list[str], parents: dict[str, str], whole_states: bool) -> list[str]:
    """The tapes of `sids` to restore, in their order: the ends, which no other of them extends (a plain KV
    cache's end serves every prefix of it, cut back); of `whole_states`, which serve only the prompts that extend
    them, each end with the one it grew from too, for a stream resumed with fewer tokens than the end holds
    (its rank was ahead of its client when it died)."""
    keep = set(ends(sids, parents))
    if whole_states:
        keep |= {parents[s] for s in keep}
    return [s for s in sids if s in keep]


def whole(segments: dict[str, Segment]) -> list[str]:
    """The tapes whose every segment down to the first token is present, least recently used first."""
    ok: dict[str, bool] = {"": True}
    for sid in segments:
        chain = []
        while sid not in ok and sid in segments:
            chain.append(sid)
            sid = segments[sid].needs
        verdict = ok.get(sid, False)
        for s in chain:
            ok[s] = verdict
    return sorted((s for s in segments if ok[s]), key=lambda s: (segments[s].used_at, s))


def tips(segments: dict[str, Segment]) -> list[str]:
    """The segments nothing among `segments` is appended to: the only ones that may go (a tape's end first)."""
    children = {s.needs for s in segments.values()}
    return [sid for sid in segments if sid not in children]


def expired(segments: dict[str, Segment], now: float, max_age: float) -> list[str]:
    """The segments to delete because their tape was last used more than `max_age` seconds ago (0: never):
    tape ends first, a segment only once nothing kept is appended to it (as `evict`)."""
    left, gone = dict(segments), []
    while max_age and (old := [sid for sid in tips(left) if left[sid].used_at < now - max_age]):
        for sid in old:
            del left[sid]
        gone += old
    return gone


def evict(segments: dict[str, Segment], budget: int) -> list[str]:
    """The segments to delete so that the rest fit in `budget` bytes: the least recently used tape ends
    first; a segment goes only once nothing kept is appended to it."""
    left = dict(segments)
    total = sum(s.nbytes for s in left.values())
    gone: list[str] = []
    while total > budget and left:
        sid = min(tips(left), key=lambda s: (left[s].used_at, s))
        total -= left.pop(sid).nbytes
        gone.append(sid)
    return gone


# --- the files -----------------------------------------------------------------------------------------------

class Unusable(Exception):
    """A segment file that cannot be used; `reason` is its counter's label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# safetensors' dtype names, and how numpy holds each (bfloat16 as its bits)
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "uint16", "U32": "uint32", "I32": "int32", "U8": "uint8",
          "U16": "uint16", "I64": "int64", "BOOL": "bool"}
ITEMSIZE = {name: np.dtype(held).itemsize for name, held in DTYPES.items()}
BY_MLX = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "int32": "I32", "uint8": "U8",
          "uint16": "U16", "int64": "I64", "bool": "BOOL"}


def header_of(arrays: dict[str, mx.array], metadata: dict[str, str]) -> bytes:
    """The safetensors header of `arrays`, in their order, with `metadata`, padded to 8 bytes."""
    entries, at = {"__metadata__": metadata}, 0
    for name, a in arrays.items():
        entries[name] = {"dtype": BY_MLX[str(a.dtype).rpartition(".")[2]], "shape": list(a.shape),
                         "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    text = json.dumps(entries).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def raw(a: mx.array) -> memoryview:
    """An evaluated array's bytes (bfloat16 as its bits: numpy has no such type)."""
    flat = np.ascontiguousarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).reshape(-1)
    return memoryview(flat.view(np.uint8))


def digest(key: bytes):
    """The hash a segment's name carries: BLAKE2b keyed by the node's snapshot key, so that only its ranks
    can name a file they would restore (a writer to the folder without the key cannot)."""
    return hashlib.blake2b(digest_size=16, key=key)


def digest_of(data, key: bytes) -> bytes:
    h = digest(key)
    h.update(data)
    return h.digest()


def combined(header: bytes, sums: list[bytes], key: bytes) -> str:
    """A segment's digest: over its header's bytes and its arrays' own digests in the file's order (so that
    its arrays are hashed side by side)."""
    h = digest(key)
    h.update(header)
    for one in sums:
        h.update(one)
    return h.hexdigest()


def write_segment(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str], key: bytes,
                  pool: Executor | None = None) -> str:
    """`arrays` (evaluated) as a safetensors file at `path` (mode 0600: the tokens are a conversation), whole
    in the page cache when it returns (`flush` puts it on the disk); its digest, each array hashed from its
    bytes as they are written (never read back), the arrays side by side on `pool`'s threads (hashing and
    writing release the GIL) when they are SIDE_BY_SIDE bytes or more."""
    header = header_of(arrays, metadata)
    at = list(itertools.accumulate((a.nbytes for a in arrays.values()), initial=len(header)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        put(fd, memoryview(header), 0)

        def one(a: mx.array, offset: int) -> bytes:
            data = raw(a)
            put(fd, data, offset)
            return digest_of(data, key)

        side_by_side = pool is not None and at[-1] >= SIDE_BY_SIDE
        sums = list((pool.map if side_by_side else map)(one, arrays.values(), at[:-1]))
    finally:
        os.close(fd)
    return combined(header, sums, key)


def flush(path: Path) -> None:
    """A file's bytes on the disk, then its folder's entry for it (the rename that named it); a file deleted
    meanwhile needs neither."""
    try:
        fsync(path)
    except FileNotFoundError:
        return
    fsync(path.parent)


def put(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` written at `offset` (a large write may be taken in parts)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def parse_header(name: str, first8: bytes, read, size: int) -> tuple[int, dict]:
    """A safetensors file's header length and header, given its first 8 bytes, a `read(n)` of what follows
    and its size; Unusable "truncated" when the header is cut short or malformed, or the file is not the size
    it declares."""
    try:
        (n,) = struct.unpack("<Q", first8)
        header = json.loads(read(n)) if 8 + n <= size else None
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
            raise ValueError("not a safetensors header")
        end = 0
        for k, t in header.items():
            if k == "__metadata__":
                continue
            shape, (a, b) = t["shape"], t["data_offsets"]
            if not (all(type(d) is int and d >= 0 for d in shape) and type(a) is int and type(b) is int
                    and 0 <= a <= b and math.prod(shape) * ITEMSIZE[t["dtype"]] == b - a):
                raise ValueError(f"{k}: its shape does not fit its offsets")
            end = max(end, b)
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise Unusable("truncated", f"{name}: its header is cut short or malformed") from None
    if size != 8 + n + end:
        raise Unusable("truncated", f"{name}: {size} bytes, its header declares {8 + n + end}")
    return n, header


def checkpoint_bytes(header: dict) -> int:
    """The bytes a segment's header gives its checkpoints' arrays."""
    return sum(end - start for name, entry in header.items() if name.startswith(CHECKPOINT)
               for start, end in [entry["data_offsets"]])


def read_header(path: Path) -> dict:
    """A segment file's safetensors metadata, its header checked (`parse_header`)."""
    return read_meta(path)[0].get("__metadata__", {})


def read_meta(path: Path) -> tuple[dict, os.stat_result]:
    """A segment file's safetensors header, checked, and the file's stat: one open, one read for a small
    header."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        _, header = parse_header(path.name, f.read(8), f.read, st.st_size)
    return header, st


def read_tokens(path: Path) -> list[int]:
    """A segment file's token ids, read alone."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n, header = parse_header(path.name, f.read(8), f.read, size)
        a, b = header["tokens"]["data_offsets"]
        f.seek(8 + n + a)
        return np.frombuffer(f.read(b - a), dtype=np.uint32).tolist()


def read_segment(path: Path, key: bytes) -> tuple[str, dict, dict[str, tuple[np.ndarray, str]]]:
    """A segment file read once: its digest, its metadata and its arrays (numpy, each with its safetensors
    dtype). No MLX: a thread may read while the model runs."""
    data = path.read_bytes()
    n, header = parse_header(path.name, data[:8], lambda k: data[8:8 + k], len(data))
    arrays, sums = {}, []
    for name, t in header.items():
        if name != "__metadata__":
            a, b = t["data_offsets"]
            dtype = np.dtype(DTYPES[t["dtype"]])
            arrays[name] = (np.frombuffer(data, dtype=dtype, count=(b - a) // dtype.itemsize, offset=8 + n + a)
                            .reshape(t["shape"]), t["dtype"])
            sums.append(digest_of(memoryview(data)[8 + n + a:8 + n + b], key))
    return combined(data[:8 + n], sums, key), header.get("__metadata__", {}), arrays


def to_mx(a: np.ndarray, dtype: str) -> mx.array:
    return mx.array(a).view(mx.bfloat16) if dtype == "BF16" else mx.array(a)


def segment_files(folder: Path) -> list[Path]:
    """The segment files in a rank's folder: regular files (a pipe would block its reader), not the writer's
    temporary ones (`.SID.safetensors`)."""
    with os.scandir(folder) as entries:
        names = sorted(e.name for e in entries
                       if e.name.endswith(".safetensors") and not e.name.startswith(".") and e.is_file())
    return [folder / name for name in names]


def scan(folder: Path, me: Identity, progress=lambda done, total: None) -> tuple[dict[str, Segment],
                                                                                 dict[Path, str]]:
    """This rank's segments in `folder` (named `SID.DIGEST.safetensors`), and the files that are not usable
    with the reason why: each file's header read once, `progress(done, total)` every PROGRESS_EVERY files."""
    found: dict[str, Segment] = {}
    bad: dict[Path, str] = {}
    paths = segment_files(folder)
    for done, path in enumerate(paths, 1):
        if done % PROGRESS_EVERY == 0:
            progress(done, len(paths))
        try:
            header, st = read_meta(path)
            meta = header.get("__metadata__", {})
            if meta.get("format") != FORMAT:
                raise Unusable("foreign", f"{path.name}: of snapshot format {meta.get('format')}, this rank reads "
                                          f"{FORMAT}")
            if {k: meta.get(k) for k in me.tags()} != me.tags():
                raise Unusable("foreign", f"{path.name}: of another model, world, rank or shard layout")
            sid = path.name.split(".")[0]
            found[sid] = Segment(sid, str(meta["parent"]), int(meta["start"]), int(meta["end"]), st.st_size,
                                 st.st_mtime, path, str(meta.get("tenant", "")), checkpoint_bytes(header))
        except Unusable as e:
            bad[path] = e.reason
        except (OSError, KeyError, ValueError, TypeError, AttributeError):  # a header of other shapes
            bad[path] = "truncated"
    return found, bad


class Part(NamedTuple):
    """A segment read and checked: its arrays (numpy, each with its safetensors dtype), its leaves' description
    (type, meta state, the state's entries that are not arrays) and the tape's checkpoints it holds (as
    runtime/prefix/checkpoints.py `saved` them; a tape's last segment holds them)."""

    arrays: dict
    about: list
    points: list


@dataclass(frozen=True)
class Read:
    """A tape read from its segment files and checked, not yet in MLX: its tokens and each segment's arrays
    (numpy, with their dtypes) and leaves' description, first to last."""

    sid: str
    tokens: tuple
    parts: list
    nbytes: int
    tenant: str

    @property
    def taps(self) -> mx.array | None:
        """The target's taps at the tape's last positions, as its last segment kept them (None without)."""
        last = self.parts[-1].arrays
        return to_mx(*last["taps"]) if "taps" in last else None


def read_part(seg: Segment, types: list[str], key: bytes) -> Part:
    """A segment's `Part`, after checking its bytes against the digest in its name (Unusable "corrupt"
    otherwise), its leaves against this model's caches ("foreign") and its arrays against its header
    ("corrupt")."""
    hashed, meta, arrays = read_segment(seg.path, key)
    if hashed != seg.path.name.split(".")[1]:
        raise Unusable("corrupt", f"{seg.path.name}: its bytes do not match its digest (changed, or not written "
                                  "with this node's snapshot key)")
    try:
        about = json.loads(meta["leaves"])
        points = json.loads(meta.get("checkpoints", "[]"))
        its = [t for t, _, _ in about]
        n = seg.end - seg.start
        fits = isinstance(points, list) and arrays["tokens"][0].shape == (n,) and (snapshot_kind(its) == "whole" or all(
            a.shape[2] == n for k, (a, _) in arrays.items() if k not in ("tokens", "taps")))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise Unusable("corrupt", f"{seg.path.name}: unreadable ({e})")
    if its != types:
        raise Unusable("foreign", f"{seg.path.name}: its caches ({', '.join(sorted(set(its)))}) are not this "
                                  f"model's ({', '.join(sorted(set(types)))})")
    if not fits:
        raise Unusable("corrupt", f"{seg.path.name}: its arrays do not fit its header")
    return Part(arrays, about, points)


def _part_or_error(seg: Segment, types: list[str], key: bytes) -> Part | Exception:
    try:
        return read_part(seg, types, key)
    except (Unusable, OSError) as e:
        return e


def leaf_types(cache: list) -> list[str]:
    return [type(leaf).__name__ for leaf in leaves(cache)]


def tokens_held(parts: list) -> int:
    """The tokens the cache leaves `parts` hold: the offset of those that hold keys (a pool's counts its
    windows)."""
    return next((leaf.offset for leaf in parts if hasattr(leaf, "keys")), 0)


def rebuilding(cache: list, parts: list[Part]):
    """`cache` (a fresh one) given the state the segments `parts` (`Read.parts`) hold, first to last, leaf by leaf:
    each leaf's arrays concatenated along the token axis (one part: a whole state), the rest of its state and
    its meta state as the last part says, evaluated; between two leaves, yields the bytes of the one built."""
    about = parts[-1].about
    built = 0
    for i, leaf in enumerate(leaves(cache)):
        if i:
            yield built
        _, meta, values = about[i]
        if meta is not None:
            leaf.meta_state = meta
        state = []
        for j in range(len(values)):
            got = [to_mx(*part.arrays[f"{i}.{j}"]) for part in parts if f"{i}.{j}" in part.arrays]
            state.append(values[j] if not got else got[0] if len(got) == 1 else mx.concatenate(got, axis=2))
        leaf.state = tuple(state)
        arrays = [a for a in leaf.state if isinstance(a, mx.array)]
        mx.eval(arrays)
        built = sum(a.nbytes for a in arrays)


# --- the mechanism -------------------------------------------------------------------------------------------

class Snapshots:
    """One rank's snapshots: stage a tape's new tokens from the loop, written by a thread, restored at load.

    The loop calls `stage` (slices queued on the device) and `pump` at each engine step, which hands the
    slices staged a step before (evaluated by then) to the writer thread; a tape's last slices go at once."""

    def __init__(self, root: Path, me: Identity, budget_bytes: int, every: int, log=print, key: bytes = b"",
                 max_age: float = 0.0, writers: int = WRITERS):
        self.me, self.budget, self.every, self.log, self.key = me, budget_bytes, every, log, key
        self.max_age = max_age  # seconds a tape unused is kept (0: as long as the budget allows)
        self.writer_error = ""  # why the writer thread stopped, if it did: nothing is staged then
        self.root = root
        self.folder = root / me.folder
        private_folder(root)
        private_folder(self.folder)
        for tmp in self.folder.glob(".*.safetensors"):
            tmp.unlink(missing_ok=True)
        self.written = self.restored = 0
        self.restores_pending = 0  # tapes the next generation is still restoring (runtime/restore.py)
        self.skipped: dict[str, int] = {}
        self._lock = threading.Lock()  # the segment index, shared with the writer
        began = time.monotonic()
        self.segments, bad = scan(self.folder, me, lambda done, total: log(
            f"snapshots: {done} of {total} files read in {self.folder} ({time.monotonic() - began:.1f}s)"))
        if len(self.segments) + len(bad) >= PROGRESS_EVERY:  # a scan whose progress was said: its end too
            log(f"snapshots: {len(self.segments) + len(bad)} file(s) read in {time.monotonic() - began:.1f}s: "
                f"{len(self.segments)} segment(s) of this rank's, {len(bad)} unusable")
        for reason in sorted(set(bad.values())):  # none of them can ever serve from this folder
            self.skip_all(reason, [p.name for p, r in bad.items() if r == reason], "file(s) unusable, deleted")
        for path in bad:
            path.unlink(missing_ok=True)
        self._others = self._trim_others()
        self._expire()
        self._staged: list[tuple[Segment, dict[str, mx.array], dict[str, str]]] = []
        self._pending = self._pending_n = 0  # bytes and segments staged or queued, not yet written
        self._queue: queue.Queue = queue.Queue()
        self._arrays = ThreadPoolExecutor(writers, thread_name_prefix="snapshot-arrays") if writers > 1 else None
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="snapshot-flush")
        self._thread = threading.Thread(target=self._write_loop, name="snapshot-writer", daemon=True)
        self._thread.start()

    def _trim_others(self) -> int:
        """Other models' and worlds' folders, least recently used first, deleted while all of them and this
        rank's own segments exceed the budget; returns the bytes of those kept."""
        others = {}
        for folder in self.root.iterdir():
            if folder.is_dir() and folder != self.folder:
                files = [p.stat() for p in folder.glob("*.safetensors") if p.is_file()]  # no dangling link
                others[folder.name] = Segment(folder.name, "", 0, 0, sum(f.st_size for f in files),
                                              max((f.st_mtime for f in files), default=0.0), folder)
        mine = sum(s.nbytes for s in self.segments.values())
        for name in evict(others, max(0, self.budget - mine)):
            shutil.rmtree(others.pop(name).path, ignore_errors=True)
            self.log(f"snapshots of another model or world removed to fit the budget: {name}")
        return sum(s.nbytes for s in others.values())

    def skip(self, reason: str, what: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count
        self.log(f"snapshot skipped ({reason}): {what}")

    def skip_all(self, reason: str, names: list[str], what: str) -> None:
        """Many skipped for one reason: counted each, said in one line (a folder of 60k tapes logs no 60k
        lines)."""
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            self.skip(reason, f"{len(names)} {what}: {shown}", count=len(names))

    def _count_bytes(self) -> None:
        written = [s for s in self.segments.values() if s.path is not None]
        self.nbytes = self._others + sum(s.nbytes for s in written)
        self.checkpoint_nbytes = sum(s.checkpoint_bytes for s in written)

    def stats(self) -> dict:
        return {"snapshots_written": self.written, "snapshots_restored": self.restored,
                "snapshots_skipped": dict(self.skipped), "snapshot_bytes": self.nbytes,
                "snapshot_checkpoint_bytes": self.checkpoint_nbytes,
                "snapshots_pending": self._pending_n, "snapshot_pending_bytes": self._pending,
                "snapshot_restores_pending": self.restores_pending, "snapshot_writer_error": self.writer_error}

    # --- restore --------------------------------------------------------------------------------------------
    def held(self) -> list[str]:
        """The tapes this rank holds whole, least recently used first."""
        with self._lock:
            return whole(self.segments)

    def restore(self, sids: list[str], fresh) -> list[tuple[tuple, list, str]]:
        """The tapes `sids` as (tokens, cache, sid), each cache a `fresh()` one given the state its snapshot
        holds; one whose files turn out unusable is left out."""
        types = leaf_types(fresh())
        reads = [r for sid in sids if (r := self.read(sid, types)) is not None]
        return [t for r in reads if (t := self.build(r, fresh)) is not None]

    def _chain(self, sid: str) -> tuple[list[Segment], bool]:
        """A tape's segments from its end back to its first token, and whether all of them are held."""
        chain = []
        with self._lock:
            while sid in self.segments:
                chain.append(self.segments[sid])
                sid = self.segments[sid].needs
        return chain, not sid

    def nbytes_of(self, sid: str) -> int:
        """The bytes of a tape's chain of segments."""
        return sum(seg.nbytes for seg in self._chain(sid)[0])

    def tokens_of(self, sid: str) -> tuple[str, tuple] | None:
        """A tape's tenant and tokens, read from its segments' token arrays alone; None when a segment cannot
        tell."""
        chain, held = self._chain(sid)
        if not (held and chain):
            return None
        try:
            return chain[0].tenant, tuple(t for seg in chain[::-1] for t in read_tokens(seg.path))
        except (Unusable, OSError, KeyError, TypeError, ValueError):
            return None

    def read(self, sid: str, types: list[str], on_part=lambda nbytes: None) -> Read | None:
        """A tape's segments read and checked (no MLX: a thread may call it while the model runs), `on_part`
        told each one's bytes as it is; None when one is missing or unusable (deleted, counted)."""
        chain, held = self._chain(sid)
        if not held:  # a segment it shares with a tape before it was unusable
            self.skip("corrupt", f"tape {sid}: a segment of its chain is unusable")
            return None
        parts = []
        with ThreadPoolExecutor(READERS) as pool:  # hashing releases the GIL: the segments are read side by side
            for seg, part in zip(chain[::-1], pool.map(lambda seg: _part_or_error(seg, types, self.key), chain[::-1])):
                if isinstance(part, Exception):
                    self.skip(getattr(part, "reason", "truncated"), str(part))
                    with self._lock:
                        self.segments.pop(seg.sid, None)
                        seg.path.unlink(missing_ok=True)
                        self._count_bytes()
                    return None
                parts.append(part)
                on_part(seg.nbytes)
        tokens = tuple(np.concatenate([part.arrays["tokens"][0] for part in parts]).tolist())
        if tape_id(tokens, chain[0].tenant) != sid:
            self.skip("corrupt", f"tape {sid}: its tenant and tokens do not hash to its name")
            return None
        return Read(sid, tokens, parts, sum(seg.nbytes for seg in chain), chain[0].tenant)

    def build(self, read: Read, fresh) -> tuple[tuple, list, str] | None:
        """A tape read from its files as (tokens, cache, sid), its cache a `fresh()` one given its state; None
        when that state does not fit (counted)."""
        steps = self.building(read, fresh)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def building(self, read: Read, fresh):
        """`build`, leaf by leaf: between two leaves yields the bytes of the one built (so that a loop can step
        between them), returns what `build` returns."""
        cache = fresh()
        try:
            yield from rebuilding(cache, read.parts)
            fits = tokens_held(leaves(cache)) == len(read.tokens)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            self.skip("corrupt", f"tape {read.sid}: its state does not fit this model's caches ({e})")
            return None
        if not fits:
            self.skip("corrupt", f"tape {read.sid}: its caches do not hold its {len(read.tokens)} tokens")
            return None
        return read.tokens, cache, read.sid

    def checkpoints(self, read: Read) -> tuple[Checkpoint, ...]:
        """The checkpoints a tape's last segment holds, in MLX (on the loop); none when they do not fit this
        model's caches (counted)."""
        last = read.parts[-1]
        try:
            points = tuple(loaded(p, lambda name: to_mx(*last.arrays[name])) for p in last.points)
        except (KeyError, TypeError, ValueError) as e:
            self.skip("corrupt", f"tape {read.sid}: its checkpoints are unreadable ({e}); restored without them")
            return ()
        if any(len(p.parts) != len(last.about) or not 0 < p.at < len(read.tokens) for p in points):
            self.skip("corrupt", f"tape {read.sid}: its checkpoints do not fit its caches; restored without them")
            return ()
        return points

    def used(self, sid: str) -> None:
        """A tape that served: its chain marked as used now, its files' times by the writer (the loop never
        waits on the disk), so a tape in daily use is neither evicted nor expired first."""
        now, paths = time.time(), []
        chain, _ = self._chain(sid)
        with self._lock:
            for seg in chain:
                if seg.path is not None and self.segments.get(seg.sid) is seg:  # written, and not evicted since
                    self.segments[seg.sid] = replace(seg, used_at=now)
                    paths.append(seg.path)
        self._queue.put(lambda: [_touch(p, now) for p in paths])

    def _expire(self) -> None:
        """Tapes unused for longer than `max_age`, deleted (counted `expired`)."""
        with self._lock:
            gone = [self.segments.pop(sid) for sid in expired(self.segments, time.time(), self.max_age)]
            self._count_bytes()
        for seg in gone:
            self.skip("expired", f"{seg.path.name}: unused for more than {self.max_age:.0f}s (snapshot_max_age)")
            with contextlib.suppress(OSError):
                seg.path.unlink(missing_ok=True)

    # --- write ----------------------------------------------------------------------------------------------
    def base(self, sid: str, cached: int) -> tuple[str, int]:
        """Where a tape whose first `cached` tokens came from the tape entry `sid` appends: the longest
        segment of that entry's chain that ends within them ("", 0: from the first token)."""
        with self._lock:
            while sid and sid in self.segments and self.segments[sid].end > cached:
                sid = self.segments[sid].parent
            seg = self.segments.get(sid)
        return (sid, seg.end) if seg else ("", 0)

    def _points(self, sid: str, checkpoints: list[Checkpoint], arrays: dict[str, mx.array]) -> list[dict]:
        """`checkpoints` as a segment's metadata holds them, their arrays added to `arrays`; none when a cache
        holds what cannot be saved (said)."""
        held: dict[str, mx.array] = {}

        def put(a: mx.array) -> str:
            held[name := f"{CHECKPOINT}{len(held)}"] = mx.contiguous(a)
            return name
        try:
            points = [saved(c, put) for c in checkpoints]
        except TypeError as e:
            self.log(f"snapshot of tape {sid} without its checkpoints: {e}")
            return []
        arrays.update(held)
        return points

    def stage(self, tokens, cache: list, since: tuple[str, int], final: bool, tenant: str = "",
              taps: mx.array | None = None, checkpoints: tuple[Checkpoint, ...] = ()) -> tuple[str, int]:
        """Take the state of a tape's cache for the writer when `due`: its tokens past `since` (a snapshot id
        and its length) for plain KV caches, its whole state for others, `taps` (the target's at the last
        positions its cache holds, for DSpark's stages: runtime/prefix/tape.py) and at its end its
        `checkpoints` (runtime/prefix/checkpoints.py: a restored tape is cut back to them as the one in memory
        is); returns the tape's snapshot point after it (the same while the writer is stopped: nothing is
        staged for no one)."""
        if self.writer_error:
            return since
        parts = leaves(cache)
        whole_state = snapshot_kind(leaf_types(cache)) == "whole"
        have = min(len(tokens), tokens_held(parts))
        if not due(since[1], have, self.every, final, whole_state):
            return since
        start = 0 if whole_state else since[1]
        sid = tape_id(tokens[:have], tenant)
        about = []  # per leaf: its type, its meta state, its state's entries with the arrays left out
        with mx.stream(generation_stream):
            arrays = {"tokens": mx.array(tokens[start:have], dtype=mx.uint32)}
            for i, leaf in enumerate(parts):
                values = []
                for j, value in enumerate(leaf.state):
                    if isinstance(value, mx.array):
                        arrays[f"{i}.{j}"] = mx.contiguous(value if whole_state else value[..., start:have, :])
                        value = None
                    values.append(value)
                about.append((type(leaf).__name__, getattr(leaf, "meta_state", None), values))
            if taps is not None:
                arrays["taps"] = mx.contiguous(taps)
            points = self._points(sid, [c for c in checkpoints if c.at < have], arrays)
        nbytes = sum(a.nbytes for a in arrays.values())
        with self._lock:
            if sid in self.segments:  # this very tape is on disk already
                return sid, have
            if self._pending + nbytes > self.budget:
                self.skip("budget", f"tape {sid}: {nbytes} bytes, with the writer's backlog past the budget "
                                    f"({self.budget} bytes)")
                return since
            self._pending += nbytes
            self._pending_n += 1
            seg = Segment(sid, since[0], start, have, nbytes, time.time(), tenant=tenant,
                          checkpoint_bytes=sum(a.nbytes for name, a in arrays.items() if name.startswith(CHECKPOINT)))
            self.segments[sid] = seg  # the next segment's parent, before it is written
        mx.async_eval(list(arrays.values()))
        self._staged.append((seg, arrays, {"leaves": json.dumps(about),
                                           **({"checkpoints": json.dumps(points)} if points else {})}))
        if final:  # no step may follow to hand it over
            self.pump()
        return sid, have

    def pump(self) -> None:
        if self._staged:
            staged, self._staged = self._staged, []
            mx.eval([a for _, arrays, _ in staged for a in arrays.values()])
            for item in staged:
                self._queue.put(item)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is staged and queued, then stop the writer."""
        self.pump()
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._flusher.shutdown()
            if self._arrays:
                self._arrays.shutdown()

    def _write_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                if callable(item):  # a chore of the disk's that the loop hands over (`used`)
                    item()
                    continue
                seg, arrays, described = item
                try:
                    with self._lock:
                        evicted = self.segments.get(seg.sid) is not seg  # before it was written
                    if not evicted:
                        self._write(seg, arrays, described)
                        self._expire()
                finally:
                    with self._lock:
                        self._pending -= seg.nbytes
                        self._pending_n -= 1
        except BaseException as e:  # the rank says so and stages nothing more, rather than queue for no one
            self.writer_error = f"{type(e).__name__}: {e}"
            self.log(f"snapshot writer stopped ({self.writer_error}); no snapshot is written until the next "
                     "generation")

    def _write(self, seg: Segment, arrays: dict[str, mx.array], described: dict[str, str]) -> None:
        """One segment, whole on its own once its name is in the folder: written to a temporary file whose
        digest is hashed as it is written and renamed, landed then (a rank's death loses nothing of it); put
        on the disk while the next one is written (`_flush`), so the writer never waits on the disk. A file a
        machine's crash tore is refused at restore by its digest. A write that finds the folder deleted under
        the rank (to free space) fails, counted `write_failed`; the folder is made again for the next one, and
        the segments that went with it are forgotten."""
        tmp = self.folder / f".{seg.sid}.safetensors"
        try:
            hashed = write_segment(tmp, arrays, {**self.me.tags(), "parent": seg.parent, **described,
                                                 "start": str(seg.start), "end": str(seg.end),
                                                 "tenant": seg.tenant}, self.key, self._arrays)
            path = self.folder / f"{seg.sid}.{hashed}.safetensors"
            os.replace(tmp, path)
            nbytes = path.stat().st_size
        except Exception as e:  # whatever the disk raises, the writer goes on and the tape is skipped
            with self._lock:
                if self.segments.get(seg.sid) == seg:
                    del self.segments[seg.sid]
            if not self.folder.is_dir():
                self.skip("write_failed", f"tape {seg.sid}: {self._lost_folder()}")
                return
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free_bytes(self.folder) < seg.nbytes
            self.skip("disk_full" if full else "write_failed", f"tape {seg.sid}: {e}")
            return
        with self._lock:
            self.segments[seg.sid] = replace(seg, nbytes=nbytes, path=path)
            gone = [self.segments.pop(sid).path for sid in evict(self.segments, max(0, self.budget - self._others))]
            self._count_bytes()
        for gone_path in gone:  # outside the lock: the loop's `stage` never waits on the disk
            if gone_path is not None:
                with contextlib.suppress(OSError):
                    gone_path.unlink(missing_ok=True)
        self.written += 1
        self._flusher.submit(self._flush, path)

    def _flush(self, path: Path) -> None:
        """A landed segment put on the disk. Where the disk fails it, the file stays: if its bytes are not what
        was hashed, the restore refuses it by its digest (`corrupt`)."""
        try:
            flush(path)
        except OSError as e:
            self.log(f"snapshot {path.name} not flushed to the disk ({e}): a crash of the machine may tear it")

    def _lost_folder(self) -> str:
        """The rank's folder, deleted under it, made again (the segments that went with it forgotten); what
        happened, said."""
        with self._lock:
            gone = [sid for sid, seg in self.segments.items() if seg.path is not None and not seg.path.exists()]
            for sid in gone:
                del self.segments[sid]
            self._count_bytes()
        try:
            private_folder(self.root)
            private_folder(self.folder)
        except OSError as e:
            return f"the folder {self.folder} was deleted while this rank served and cannot be made again ({e})"
        return (f"the folder {self.folder} was deleted while this rank served: made again, {len(gone)} "
                "segment(s) that went with it forgotten")


def private_folder(folder: Path) -> None:
    """`folder` made when missing, and readable by its user alone (0700): what it holds are conversations."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)


def snapshot_key(path: Path) -> bytes:
    """The node's snapshot key in `path` (32 random bytes, created 0600 when missing), kept outside the
    snapshot folder: a writer to that folder cannot replace it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != 32:
            raise OSError(f"{path} holds {len(key)} bytes, not a 32-byte snapshot key; delete it (the snapshots "
                          "written with it are then skipped)")
        return key
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _touch(path: Path, when: float) -> None:
    with contextlib.suppress(OSError):  # deleted meanwhile: the writer forgets it at its next write
        os.utime(path, (when, when))


def fsync(path: Path) -> None:
    """A file's or a folder's state on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(folder: Path) -> int:
    """The free space where `folder` is (0 when that cannot be told: a full disk is the likely cause)."""
    try:
        return shutil.disk_usage(folder).free - (1 << 16)
    except OSError:
        return 0
