"""SiLU(gate) * up on the GPU. See cuda_src/silu_mul.cu."""

from __future__ import annotations

import numpy as np

from ._args import BF16, check, out_array
from .registry import module

_THREADS = 256
_UNITS_PER_THREAD = 4


def silu_mul(x, out=None):
    """x [..., 2*I] bf16 = [gate | up] -> [..., I] bf16 = bf16(silu(gate) * up), fp32 math."""
    check("x", x, BF16)
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    y = out_array("out", out, (*x.shape[:-1], inter), BF16)
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or inter == 0:
        return y
    if rows >= 2**31:
        raise ValueError(f"x: {rows} rows exceed the grid")
    vec = inter % 8 == 0 and x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
    units = inter // 8 if vec else inter
    chunks = -(-units // (_THREADS * _UNITS_PER_THREAD))
    module("silu_mul").fn("silu_mul_kernel")((rows, chunks), (_THREADS,), (x, y, np.int32(inter), np.int32(vec)))
    return y
