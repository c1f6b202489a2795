"""Dense linear reference: y = x @ weight^T with fp32 products and sums, rounded once to bf16."""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16


def linear(x, weight, out=None, impl: str = "auto"):
    """x [M, K] bf16, weight [N, K] bf16 -> [M, N] bf16. ``impl`` picks the CUDA twin's kernel
    (skinny or cuBLAS); the reference has one path and takes it for signature parity."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: expected x [M, K] and weight [N, K], got {x.shape} and {weight.shape}")
    y = (x.astype(np.float32) @ weight.astype(np.float32).T).astype(bfloat16)
    if out is not None:
        out[...] = y
        return out
    return y
