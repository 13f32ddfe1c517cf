"""A model directory laid out as huggingface_hub's cache keeps a downloaded
repo (blobs named by hash, a snapshot of links to them, refs/main), so tests
resolve and copy repo ids without downloading anything."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def plant(cache: Path, repo: str, model_dir: Path) -> Path:
    """`model_dir`'s files as `repo` in the hub cache `cache`; returns the snapshot directory."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / blob)
        link = snapshot / f.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(root / "blobs" / blob, link.parent))
    return snapshot
