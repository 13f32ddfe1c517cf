"""What tells two copies of a model apart without reading all their weights: the config (and weight index),
and each weight file's name, size, safetensors header and last MiB, so that a fine-tune of the same shapes
differs. One digest for every comparison: the nodes' copies (`meshctl doctor`, `meshctl model pull`), the
meshes a proxy may move a stream between, and the model a prefix snapshot was made with."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

TAIL_BYTES = 1 << 20  # of each weight file


def weights_digest(model_dir: Path) -> str:
    """The model's fingerprint (16 hex digits). Raises OSError when a file cannot be read and ValueError when
    a weight file is not safetensors."""
    h = hashlib.blake2b(digest_size=8)
    for name in ("config.json", "model.safetensors.index.json"):
        if name == "config.json" or (model_dir / name).is_file():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
            except struct.error:
                raise ValueError(f"{path.name} is not safetensors ({size} bytes)") from None
            h.update(f"{path.name}:{size}".encode() + f.read(min(n, size)))
            f.seek(max(0, size - TAIL_BYTES))
            h.update(f.read())
    return h.hexdigest()
