"""RMSNorm (+ fused residual add) on the GPU. See cuda_src/rmsnorm.cu."""

from __future__ import annotations

import numpy as np

from ._args import BF16, check, grid_1d, out_array
from ._launch import launch, pdl_supported
from .registry import module

_ROWS_PER_BLOCK = 8  # short rows: one warp per row, 256 threads
_BLOCK_ROW_MIN_D = 1024  # longer rows: one 256-thread block per row


def row_group(d: int) -> int:
    """Threads that sum one row of ``d`` elements: a warp (32) up to 1024, else a block (256). Their
    count fixes the order of the row's sum of squares (include/rmsnorm.cuh), which linear.cu's
    linear_norm entries reproduce."""
    return 256 if d > _BLOCK_ROW_MIN_D else 32


def rmsnorm(x, weight, eps: float, residual=None, out=None, residual_out=None, plus=None):
    """x, residual: [..., d] bf16; weight: [d] bf16. Returns y, or (y, residual_out) with a residual.
    ``out``/``residual_out`` may alias ``x``/``residual`` (in-place update of the residual stream).
    x fp32 (a tensor-parallel rank's all-reduced sublayer sum; ``plus``: the MoE shared expert's fp32
    sum, or None): rounded to bf16 in the kernel as ``Backend.to_bf16`` rounds it, one launch instead of
    two (the ``_f32`` entries)."""
    f32 = getattr(x, "dtype", None) == np.float32
    check("x", x, np.float32 if f32 else BF16)
    d = x.shape[-1]
    if plus is not None:
        if not f32:
            raise TypeError("plus: only taken with fp32 x (an all-reduced partial sum), got bf16 x")
        check("plus", plus, np.float32, shape=x.shape)
    check("weight", weight, BF16, shape=(d,))
    rows = x.size // d if d else 0
    y = out_array("out", out, x.shape, BF16)
    if residual is not None:
        check("residual", residual, BF16, shape=x.shape)
        r_out = out_array("residual_out", residual_out, x.shape, BF16)
    if rows == 0:
        return y if residual is None else (y, r_out)
    vec = int(d % 8 == 0)
    head = (x, np.int64(d)) + ((plus if plus is not None else np.uint64(0),) if f32 else ())
    args = head + (residual if residual is not None else np.uint64(0), np.int64(d), weight,
            y, np.int64(d), r_out if residual is not None else np.uint64(0), np.int64(d),
            np.int32(rows), np.int32(d), np.float32(eps), np.int32(vec))
    # under PDL where the GPU has it: the kernels wait before they read (cuda_src/rmsnorm.cu)
    if row_group(d) == 256:
        entry = "rmsnorm_block_f32_kernel" if f32 else "rmsnorm_block_kernel"
        launch(module("rmsnorm").fn(entry), (rows,), (256,), args, pdl=pdl_supported())
    else:
        entry = "rmsnorm_f32_kernel" if f32 else "rmsnorm_kernel"
        launch(module("rmsnorm").fn(entry), grid_1d(rows, _ROWS_PER_BLOCK), (32 * _ROWS_PER_BLOCK,), args,
               pdl=pdl_supported())
    return y if residual is None else (y, r_out)
