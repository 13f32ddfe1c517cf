"""Prefix snapshots: each rank's shard of its token-tape caches on local disk, restored by the next generation.

A snapshot is a chain of segments, one safetensors file each: the keys and values of a tape's tokens
[start, end) for every layer, naming its parent (the same tape's [0, start)), so a follow-up turn writes
only its new tokens. The lockstep loop only slices and queues; a writer thread writes, and evicts least
recently used tapes past the disk budget. At load the ranks exchange the tapes each holds whole and restore
only those every rank has; whatever is missing, truncated, corrupted or of another model, world, rank or
shard layout is skipped with a log line and a counted reason. Only plain KV caches are snapshotted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

FORMAT = "meshd-snapshot/1"


def tape_id(tokens) -> str:
    """The name of a tape, the same on every rank: a hash of its token ids."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.uint32).tobytes(), digest_size=12).hexdigest()


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


# --- the decisions -------------------------------------------------------------------------------------------

def due(written: int, have: int, every: int, final: bool) -> bool:
    """Whether a tape whose snapshot covers `written` of the `have` tokens its cache holds is written now: at
    its end (a finished answer) or once `every` tokens are new (a long prefill, an answer in flight)."""
    return have > written and (final or have - written >= every)


def agree(held: list[list[str]]) -> list[str]:
    """The tapes every rank holds, in rank 0's order."""
    everywhere = set(held[0]).intersection(*held[1:])
    return [sid for sid in held[0] if sid in everywhere]


def ends(sids: list[str], parents: dict[str, str]) -> list[str]:
    """The tapes of `sids` that no other one of them extends, in their order."""
    extended = {parents[s] for s in sids}
    return [s for s in sids if s not in extended]


def whole(segments: dict[str, Segment]) -> list[str]:
    """The tapes whose every segment down to the first token is present, least recently used first."""
    ok: dict[str, bool] = {"": True}
    for sid in segments:
        chain = []
        while sid not in ok and sid in segments:
            chain.append(sid)
            sid = segments[sid].parent
        verdict = ok.get(sid, False)
        for s in chain:
            ok[s] = verdict
    return sorted((s for s in segments if ok[s]), key=lambda s: (segments[s].used_at, s))


def evict(segments: dict[str, Segment], budget: int) -> list[str]:
    """The segments to delete so that the rest fit in `budget` bytes: the least recently used tape ends
    first; a segment goes only once nothing kept extends it."""
    left = dict(segments)
    total = sum(s.nbytes for s in left.values())
    gone: list[str] = []
    while total > budget and left:
        children = {s.parent for s in left.values()}
        sid = min((s for s in left if s not in children), key=lambda s: (left[s].used_at, s))
        total -= left.pop(sid).nbytes
        gone.append(sid)
    return gone


# --- the files -----------------------------------------------------------------------------------------------

class Unusable(Exception):
    """A segment file that cannot be used; `reason` is its counter's label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def read_header(path: Path) -> dict:
    """A segment file's safetensors metadata, after checking the file holds all the data its header
    declares (Unusable "truncated" otherwise)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (struct.error, ValueError):
        header = None
    if not isinstance(header, dict):
        raise Unusable("truncated", f"{path.name}: its header is cut short")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        raise Unusable("truncated", f"{path.name}: {size} bytes, its header declares {8 + n + end}")
    return header.get("__metadata__", {})


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def segment_files(folder: Path) -> list[Path]:
    """The segment files in a rank's folder, not the writer's temporary ones (`.SID.safetensors`)."""
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))


def scan(folder: Path, me: Identity) -> tuple[dict[str, Segment], dict[Path, str]]:
    """This rank's segments in `folder` (named `SID.DIGEST.safetensors`), and the files that are not usable
    with the reason why."""
    found: dict[str, Segment] = {}
    bad: dict[Path, str] = {}
    for path in segment_files(folder):
        try:
            meta = read_header(path)
            if {k: meta.get(k) for k in me.tags()} != me.tags():
                raise Unusable("foreign", f"{path.name}: of another model, world, rank or shard layout")
            sid = path.name.split(".")[0]
            found[sid] = Segment(sid, meta["parent"], int(meta["start"]), int(meta["end"]), path.stat().st_size,
                                 path.stat().st_mtime, path)
        except Unusable as e:
            bad[path] = e.reason
        except (OSError, KeyError, ValueError):
            bad[path] = "truncated"
    return found, bad


def load_segment(seg: Segment, layers: int) -> dict[str, mx.array]:
    """A segment's arrays, after checking its bytes against the digest in its name and its arrays against
    its header (Unusable "corrupt" otherwise)."""
    if file_digest(seg.path) != seg.path.name.split(".")[1]:
        raise Unusable("corrupt", f"{seg.path.name}: its bytes do not match its digest")
    try:
        arrays = mx.load(str(seg.path))
        n = seg.end - seg.start
        fits = arrays["tokens"].shape == (n,) and all(arrays[f"{kv}.{i}"].shape[2] == n
                                                      for i in range(layers) for kv in "kv")
    except (KeyError, IndexError, RuntimeError, ValueError) as e:
        raise Unusable("corrupt", f"{seg.path.name}: unreadable ({e})")
    if not fits:
        raise Unusable("corrupt", f"{seg.path.name}: its arrays do not fit its header")
    return arrays


# --- the mechanism -------------------------------------------------------------------------------------------

def snapshottable(cache: list) -> bool:
    """Only plain KV caches grow by appending and are cut back exactly; the others are not snapshotted."""
    return bool(cache) and all(type(c) is KVCache for c in cache)


class Snapshots:
    """One rank's snapshots: stage a tape's new tokens from the loop, written by a thread, restored at load.

    The loop calls `stage` (slices queued on the device) and `pump` at each engine step, which hands the
    slices staged a step before (evaluated by then) to the writer thread; a tape's last slices go at once."""

    def __init__(self, root: Path, me: Identity, budget_bytes: int, every: int, log=print):
        self.me, self.budget, self.every, self.log = me, budget_bytes, every, log
        self.root = root
        self.folder = root / me.folder
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob(".*.safetensors"):
            tmp.unlink(missing_ok=True)
        self.written = self.restored = 0
        self.skipped: dict[str, int] = {}
        self._lock = threading.Lock()  # the segment index, shared with the writer
        self.segments, bad = scan(self.folder, me)
        for path, reason in bad.items():  # none of them can ever serve from this folder
            self.skip(reason, f"{path.name} ({reason})")
            path.unlink(missing_ok=True)
        self._others = self._trim_others()
        self._count_bytes()
        self._staged: list[tuple[Segment, dict[str, mx.array]]] = []
        self._pending = 0  # bytes staged or queued, not yet written
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="snapshot-writer", daemon=True)
        self._thread.start()

    def _trim_others(self) -> int:
        """Other models' and worlds' folders, least recently used first, deleted while all of them and this
        rank's own segments exceed the budget; returns the bytes of those kept."""
        others = {}
        for folder in self.root.iterdir():
            if folder.is_dir() and folder != self.folder:
                files = [p.stat() for p in folder.glob("*.safetensors")]
                others[folder.name] = Segment(folder.name, "", 0, 0, sum(f.st_size for f in files),
                                              max((f.st_mtime for f in files), default=0.0), folder)
        mine = sum(s.nbytes for s in self.segments.values())
        for name in evict(others, max(0, self.budget - mine)):
            shutil.rmtree(others.pop(name).path, ignore_errors=True)
            self.log(f"snapshots of another model or world removed to fit the budget: {name}")
        return sum(s.nbytes for s in others.values())

    def skip(self, reason: str, what: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.log(f"snapshot skipped ({reason}): {what}")

    def _count_bytes(self) -> None:
        self.nbytes = self._others + sum(s.nbytes for s in self.segments.values() if s.path is not None)

    def stats(self) -> dict:
        return {"snapshots_written": self.written, "snapshots_restored": self.restored,
                "snapshots_skipped": dict(self.skipped), "snapshot_bytes": self.nbytes}

    # --- restore --------------------------------------------------------------------------------------------
    def held(self) -> list[str]:
        """The tapes this rank holds whole, least recently used first."""
        with self._lock:
            return whole(self.segments)

    def restore(self, sids: list[str], layers: int, on_progress=lambda: None) -> list[tuple[tuple, list, str]]:
        """The tapes `sids` as (tokens, cache, sid); one whose files turn out unusable is left out."""
        out = []
        for sid in sids:
            chain, s = [], sid
            while s in self.segments:
                chain.append(self.segments[s])
                s = self.segments[s].parent
            if s:  # a segment it shares with a tape before it was unusable
                self.skip("corrupt", f"tape {sid}: a segment of its chain is unusable")
                continue
            parts = self._load_chain(chain[::-1], layers, on_progress)
            if parts is None:
                continue
            tokens = tuple(np.concatenate([np.array(p["tokens"]) for p in parts]).tolist())
            if tape_id(tokens) != sid:
                self.skip("corrupt", f"tape {sid}: its tokens do not hash to its name")
                continue
            cache = []
            for i in range(layers):
                c = KVCache()
                c.keys = mx.concatenate([p[f"k.{i}"] for p in parts], axis=2)
                c.values = mx.concatenate([p[f"v.{i}"] for p in parts], axis=2)
                c.offset = len(tokens)
                cache.append(c)
            mx.eval([c.state[:2] for c in cache])
            out.append((tokens, cache, sid))
        return out

    def _load_chain(self, chain: list[Segment], layers: int, on_progress) -> list[dict] | None:
        """Each segment's arrays, first to last (`on_progress` after each); None when one is unusable, which
        is deleted."""
        parts = []
        for seg in chain:
            try:
                parts.append(load_segment(seg, layers))
                on_progress()
            except Unusable as e:
                self.skip(e.reason, str(e))
                with self._lock:
                    self.segments.pop(seg.sid, None)
                    seg.path.unlink(missing_ok=True)
                    self._count_bytes()
                return None
        return parts

    def restored_as(self, sids: list[str]) -> None:
        """The tapes every rank restored: counted, and their files marked as used now."""
        now = time.time()
        with self._lock:
            for sid in sids:
                s = sid
                while s:
                    seg = self.segments[s]
                    os.utime(seg.path, (now, now))
                    self.segments[s] = Segment(seg.sid, seg.parent, seg.start, seg.end, seg.nbytes, now, seg.path)
                    s = seg.parent
        self.restored += len(sids)

    # --- write ----------------------------------------------------------------------------------------------
    def base(self, sid: str, cached: int) -> tuple[str, int]:
        """Where a tape whose first `cached` tokens came from the tape entry `sid` appends: the longest
        segment of that entry's chain that ends within them ("", 0: from the first token)."""
        with self._lock:
            while sid and sid in self.segments and self.segments[sid].end > cached:
                sid = self.segments[sid].parent
            seg = self.segments.get(sid)
        return (sid, seg.end) if seg else ("", 0)

    def stage(self, tokens, cache: list, since: tuple[str, int], final: bool) -> tuple[str, int]:
        """Slice the tokens a tape's cache holds past `since` (a snapshot id and its length) for the writer,
        when `due`; returns the tape's snapshot point after it."""
        have = min(len(tokens), cache[0].offset) if cache and cache[0].keys is not None else 0
        if not due(since[1], have, self.every, final):
            return since
        start = since[1]
        sid = tape_id(tokens[:have])
        with mx.stream(generation_stream):
            arrays = {"tokens": mx.array(tokens[start:have], dtype=mx.uint32)}
            for i, c in enumerate(cache):
                arrays[f"k.{i}"] = mx.contiguous(c.keys[..., start:have, :])
                arrays[f"v.{i}"] = mx.contiguous(c.values[..., start:have, :])
        nbytes = sum(a.nbytes for a in arrays.values())
        with self._lock:
            if sid in self.segments:  # this very tape is on disk already
                return sid, have
            if self._pending + nbytes > self.budget:
                self.skip("budget", f"tape {sid}: {nbytes} bytes, with the writer's backlog past the budget "
                                    f"({self.budget} bytes)")
                return since
            self._pending += nbytes
            seg = Segment(sid, since[0], start, have, nbytes, time.time())
            self.segments[sid] = seg  # the next segment's parent, before it is written
        mx.async_eval(list(arrays.values()))
        self._staged.append((seg, arrays))
        if final:  # no step may follow to hand it over
            self.pump()
        return sid, have

    def pump(self) -> None:
        if self._staged:
            staged, self._staged = self._staged, []
            mx.eval([a for _, arrays in staged for a in arrays.values()])
            for item in staged:
                self._queue.put(item)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is staged and queued, then stop the writer."""
        self.pump()
        self._queue.put(None)
        self._thread.join(timeout)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            seg, arrays = item
            try:
                with self._lock:
                    evicted = self.segments.get(seg.sid) is not seg  # before it was written
                if not evicted:
                    self._write(seg, arrays)
            finally:
                with self._lock:
                    self._pending -= seg.nbytes

    def _write(self, seg: Segment, arrays: dict[str, mx.array]) -> None:
        tmp = self.folder / f".{seg.sid}.safetensors"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata={**self.me.tags(), "parent": seg.parent,
                                                            "start": str(seg.start), "end": str(seg.end)})
            path = self.folder / f"{seg.sid}.{file_digest(tmp)}.safetensors"
            os.replace(tmp, path)
        except Exception as e:  # whatever mlx or the disk raise, the writer goes on and the tape is skipped
            tmp.unlink(missing_ok=True)
            with self._lock:
                if self.segments.get(seg.sid) == seg:
                    del self.segments[seg.sid]
            # mlx's writer says only that it could not write: the free space tells a full disk
            full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or \
                shutil.disk_usage(self.folder).free < seg.nbytes + (1 << 16)
            self.skip("disk_full" if full else "write_failed", f"tape {seg.sid}: {e}")
            return
        with self._lock:
            self.segments[seg.sid] = Segment(seg.sid, seg.parent, seg.start, seg.end, path.stat().st_size,
                                             seg.used_at, path)
            for sid in evict(self.segments, max(0, self.budget - self._others)):
                gone = self.segments.pop(sid).path
                if gone is not None:
                    gone.unlink(missing_ok=True)
            self._count_bytes()
        self.written += 1


def restore_agreed(snaps: Snapshots | None, gather, capacity: int, layers: int,
                   on_progress=lambda: None) -> list[tuple[tuple, list, str]]:
    """The tapes every rank holds whole and restored, at most `capacity`, least recently used first (by rank
    0's use), as (tokens, cache, sid) for the token tape. Every rank calls it, with snapshots or without:
    `gather` (Lockstep.gather) is a collective."""
    mesh, held = (snaps.me.mesh, snaps.held()) if snaps else ("", [])
    offers = [json.loads(b) for b in gather(json.dumps({"mesh": mesh, "tapes": held}).encode())]
    if snaps is None:
        return []
    parents = {s: g.parent for s, g in snaps.segments.items()}
    if any(o["mesh"] != mesh for o in offers):
        for sid in ends(held, parents):
            snaps.skip("foreign", f"tape {sid}: the ranks load other models or worlds ({[o['mesh'] for o in offers]})")
        return []
    agreed = agree([o["tapes"] for o in offers])
    for sid in ends([s for s in held if s not in set(agreed)], parents):
        snaps.skip("missing", f"tape {sid}: not whole on every rank")
    got = snaps.restore(ends(agreed, parents)[-capacity:], layers, on_progress)
    everywhere = set(agree([json.loads(b) for b in gather(json.dumps([t[2] for t in got]).encode())]))
    for *_, sid in got:
        if sid not in everywhere:
            snaps.skip("missing", f"tape {sid}: another rank could not restore its part")
    kept = [t for t in got if t[2] in everywhere]
    snaps.restored_as([t[2] for t in kept])
    return kept
