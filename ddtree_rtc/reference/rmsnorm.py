"""RMSNorm reference: h = x (+ residual, rounded to bf16); y = bf16(h * rsqrt(mean(h^2) + eps) * w).
x may also be a tensor-parallel rank's all-reduced fp32 sublayer sum (plus the MoE shared expert's fp32
sum): it is rounded to bf16 first, exactly as ``rounded_sum`` (``Backend.to_bf16``) rounds it."""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16


def rmsnorm(x, weight, eps: float, residual=None, out=None, residual_out=None, plus=None):
    """x, residual: [..., d] bf16; weight: [d] bf16. Returns y, or (y, residual_out) with a residual.
    x fp32: ``rounded_sum(x, plus)`` is normalised (``plus``: fp32 like x, or None; only with fp32 x)."""
    if np.asarray(x).dtype == np.float32:
        x = rounded_sum(x, plus)
    elif plus is not None:
        raise TypeError("rmsnorm: plus is only taken with fp32 x (an all-reduced partial sum)")
    h = x.astype(np.float32)
    if residual is not None:
        h = (h + residual.astype(np.float32)).astype(bfloat16).astype(np.float32)
    inv = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    y = (h * inv * weight.astype(np.float32)).astype(bfloat16)
    if out is not None:
        out[...] = y
        y = out
    if residual is None:
        return y
    r = h.astype(bfloat16)
    if residual_out is not None:
        residual_out[...] = r
        r = residual_out
    return y, r


def rounded_sum(x, plus=None):
    """fp32 ``x`` -> bf16, round to nearest even: the one rounding of an all-reduced tensor-parallel
    partial sum (``Backend.to_bf16``). ``plus`` (fp32, same shape) is first rounded to bf16 and added in
    fp32, as the MoE combine adds the bf16 shared expert."""
    x = np.asarray(x, dtype=np.float32)
    if plus is not None:
        x = x + np.asarray(plus, dtype=np.float32).astype(bfloat16).astype(np.float32)
    return x.astype(bfloat16)

