"""SiLU(gate) * up reference over a fused [gate | up] input, fp32 math, one bf16 rounding."""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16


def silu_mul(x, out=None):
    """x [..., 2*I] bf16 = [gate | up] -> [..., I] bf16 = bf16(silu(gate) * up)."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got shape {x.shape}")
    inter = x.shape[-1] // 2
    g = x[..., :inter].astype(np.float32)
    u = x[..., inter:].astype(np.float32)
    with np.errstate(over="ignore"):
        y = (g / (np.float32(1) + np.exp(-g)) * u).astype(bfloat16)
    if out is not None:
        out[...] = y
        return out
    return y
