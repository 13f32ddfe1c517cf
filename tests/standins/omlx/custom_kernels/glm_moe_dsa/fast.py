"""omlx's native kernels, as a pure-MLX stand-in: `dspark_ring_gemm` is built for a fixed head count (8 here,
64 in omlx) and refuses any other, as the real kernel refuses 32 heads per rank at TP4."""

import mlx.core as mx

BUILT_HEADS = 8


def is_native_available() -> bool:
    return True


def has_symbol(name: str) -> bool:
    return name == "dspark_ring_gemm"


def dspark_ring_gemm(lhs: mx.array, source: mx.array, indices: mx.array, transpose_rhs: bool = True) -> mx.array:
    """Scores of verify rows `lhs` [rows, heads, dim] against the ring rows `indices` [rows, k] of `source`
    [ring, dim]: [rows, heads, k]."""
    if not (lhs.ndim == 3 and 1 <= lhs.shape[0] <= 6 and lhs.shape[0] == indices.shape[0]
            and lhs.shape[1] == BUILT_HEADS and source.ndim == 2 and transpose_rhs):
        raise ValueError("Unsupported DSpark physical-ring GEMM layout.")
    rows = source[mx.maximum(indices, 0).astype(mx.int32)]  # [rows, k, dim]
    return lhs.astype(mx.float32) @ rows.astype(mx.float32).transpose(0, 2, 1)
