"""Dense bf16 linear y = x @ weight^T through cuBLAS (gemmEx, fp32 accumulate); no .cu of ours.

Row-major y [M, N] is column-major y^T [N, M] = weight (col-major [K, N], transposed) x x^T
(col-major [K, M]), so one gemmEx with op(A) = T on the weight covers any M, N, K.
"""

from __future__ import annotations

import numpy as np

from . import _cublas
from ._args import BF16, check, out_array

_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_GEMM_DEFAULT = -1
# Host scalars for alpha/beta (host pointer mode); module-level so the pointers stay valid.
_ALPHA = np.ones(1, dtype=np.float32)
_BETA = np.zeros(1, dtype=np.float32)


def linear(x, weight, out=None):
    """x [M, K] bf16, weight [N, K] bf16 -> [M, N] bf16 (fp32 accumulate)."""
    check("x", x, BF16, ndim=2)
    k = x.shape[1]
    check("weight", weight, BF16, ndim=2)
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected [N, {k}] to match x [M, {k}], got {tuple(weight.shape)}")
    m, n = x.shape[0], weight.shape[0]
    y = out_array("out", out, (m, n), BF16)
    if m == 0 or n == 0:
        return y
    if k == 0:
        y.fill(0)
        return y
    if max(m, n, k) >= 2**31:
        raise ValueError(f"linear: dims {(m, n, k)} exceed cuBLAS int32 sizes")
    _cublas.gemm_ex(_CUBLAS_OP_T, _CUBLAS_OP_N, n, m, k,
                    _ALPHA.ctypes.data, weight.data.ptr, _CUDA_R_16BF, k, x.data.ptr, _CUDA_R_16BF, k,
                    _BETA.ctypes.data, y.data.ptr, _CUDA_R_16BF, n, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
    return y
