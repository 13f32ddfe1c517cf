"""A real small filesystem (tmpfs, mounted: the tests run as root, as
scripts/test does) that a test fills to the last byte and frees again."""

from __future__ import annotations

import errno
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

FILLER = ".filler"


@contextmanager
def small_filesystem(path: Path, size: str = "8m"):
    """`path` as the mount point of a tmpfs of `size`; unmounted afterwards (lazily: a daemon may still
    hold a file there)."""
    assert os.geteuid() == 0, "mounting a small filesystem needs root (scripts/test runs the suite as root)"
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write into `path` until its filesystem has not one byte left."""
    with open(path / FILLER, "ab", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


def free(path: Path) -> None:
    (path / FILLER).unlink()
