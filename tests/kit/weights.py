"""Weight files changed in place, as a user's edit (a merged LoRA, a re-quantized tensor) changes them."""

import json
import struct
from pathlib import Path

import numpy as np

NUDGED = "model.layers.1.self_attn.v_proj.weight"


def nudge(model: Path, tensor: str = NUDGED, delta: float = 0.05) -> tuple[int, int, int]:
    """Add `delta` to a float32 tensor in place; the bytes it spans and the file's size."""
    path = model / "model.safetensors"
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start, end = (8 + n + o for o in json.loads(f.read(n))[tensor]["data_offsets"])
        f.seek(start)
        values = np.frombuffer(f.read(end - start), dtype=np.float32) + np.float32(delta)
        f.seek(start)
        f.write(values.astype(np.float32).tobytes())
    return start, end, path.stat().st_size
