"""Dense linear reference: y = x @ weight^T, products and sums in float64, rounded once to bf16.

Every numpy reference accumulates its matmuls in float64 so that its results do not depend on how
many rows a call has (BLAS picks other kernels and summation orders for other shapes): a tree-verify
forward then gives each node exactly the logits an autoregressive forward gives the same prefix."""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

from .rmsnorm import rmsnorm


def linear(x, weight, out=None, impl: str = "auto"):
    """x [M, K] bf16, weight [N, K] bf16 -> [M, N] bf16 (fp32, unrounded, when ``out`` is an fp32
    array: a tensor-parallel partial sum). ``impl`` picks the CUDA twin's kernel (skinny or cuBLAS);
    the reference has one path and takes it for signature parity."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: expected x [M, K] and weight [N, K], got {x.shape} and {weight.shape}")
    y = (x.astype(np.float64) @ weight.astype(np.float64).T).astype(np.float32)
    if out is not None and out.dtype == np.float32:
        out[...] = y
        return out
    y = y.astype(bfloat16)
    if out is not None:
        out[...] = y
        return out
    return y


def norm_linear(x, norm_weight, eps: float, weight, out=None):
    """x [M, K] bf16, norm_weight [K], weight [N, K] -> [M, N] bf16: ``rmsnorm`` (one bf16 rounding of
    the normed x), then ``linear``, exactly: the twin of the CUDA wrapper's one launch."""
    return linear(rmsnorm(x, norm_weight, eps), weight, out=out)
