"""Dense bf16 linear y = x @ weight^T (fp32 accumulate): our skinny-M kernel for decode shapes
(cuda_src/linear.cu, M <= 16), cuBLAS gemmEx for everything else.

cuBLAS: row-major y [M, N] is column-major y^T [N, M] = weight (col-major [K, N], transposed) x x^T
(col-major [K, M]), so one gemmEx with op(A) = T on the weight covers any M, N, K.

Skinny: weight-bandwidth bound, so the plan only decides how the weight rows and K are spread over
CTAs (8 rows per warp tile; warps_n row tiles x 8 / warps_n K ranges per CTA; a cluster of `split`
CTAs along K) so that enough 16-byte loads are in flight on every SM without a long tail.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import _cublas
from ._args import BF16, check, out_array
from ._launch import sm_count
from .registry import module

# Host scalars for alpha/beta (host pointer mode); module-level so the pointers stay valid.
_ALPHA = np.ones(1, dtype=np.float32)
_BETA = np.zeros(1, dtype=np.float32)

IMPLS = ("auto", "skinny", "cublas")
SKINNY_MAX_M = 16
# auto: skinny for M <= 8 on mid-sized weights (1M..64M elements), where cuBLAS leaves read bandwidth
# unused; the largest weights (dense MLP, lm_head) cuBLAS already reads near the ceiling, and at
# M = 16 the skinny kernel stops winning (`bench linear`; figures: benchmarks/README.md, Linear).
AUTO_MAX_M = 8
AUTO_MIN_WEIGHT_ELEMS = 1 << 20
AUTO_MAX_WEIGHT_ELEMS = 64 << 20
AUTO_MAX_N = 65536

_THREADS = 256
_CTAS_PER_SM = 2  # __launch_bounds__(256, 2) in linear.cu
_WARPS_N = (8, 4, 2, 1)
_SPLITS = (1, 2, 4, 8)
# Plan cost model (rough, for ranking only): DRAM GB/s; one CTA's in-flight bytes (256 threads x 8
# x 16 B) over ~1 µs of loaded latency, in GB/s; L2 GB/s for the x re-reads; a cluster reduce in µs.
_DRAM_GBS = 4300.0
_CTA_GBS = 32.0
_L2_GBS = 10000.0
_SPLIT_US = 0.3


@dataclass(frozen=True)
class SkinnyPlan:
    entry: str
    grid: int
    warps_n: int  # row tiles (8 rows) per CTA; 8 / warps_n warps split the CTA's K range
    split: int  # CTAs per cluster along K
    est_us: float  # the cost model's estimate, for reports


def _estimate_us(m: int, n: int, k: int, warps_n: int, split: int, sms: int) -> float:
    ctas = -(-n // (8 * warps_n)) * split
    cta_bytes = 16 * warps_n * k / split  # 8 warps_n rows x k / split bf16
    slots = sms * _CTAS_PER_SM
    us = 0.0
    left = ctas
    while left > 0:  # one wave at a time, each as slow as its in-flight loads allow
        wave = min(left, slots)
        us += cta_bytes * wave / min(_DRAM_GBS, wave * _CTA_GBS) / 1e3
        left -= wave
    x_bytes = ctas * 2 * m * k / split  # x from L2, once per CTA
    return us + x_bytes / _L2_GBS / 1e3 + (_SPLIT_US if split > 1 else 0.0)


@functools.cache
def skinny_plan(m: int, n: int, k: int, sms: int) -> SkinnyPlan:
    """Cheapest (warps_n, split) under the cost model; ties go to more x reuse and fewer splits."""
    if not 1 <= m <= SKINNY_MAX_M:
        raise ValueError(f"skinny linear: M = {m} outside 1..{SKINNY_MAX_M}")
    best = min((_estimate_us(m, n, k, wn, s, sms), -wn, s) for wn in _WARPS_N for s in _SPLITS)
    est, wn, s = best[0], -best[1], best[2]
    return SkinnyPlan(f"linear_m{8 if m <= 8 else 16}_s{s}", -(-n // (8 * wn)) * s, wn, s, est)


def skinny_fits(x, weight) -> bool:
    """Whether the skinny kernel can run at all: M <= 16, K % 8 == 0, 16-byte aligned x and weight."""
    m, k = x.shape
    n = weight.shape[0]
    return (1 <= m <= SKINNY_MAX_M and k % 8 == 0 and n < 2**31 and k < 2**31
            and x.data.ptr % 16 == 0 and weight.data.ptr % 16 == 0)


def route(x, weight, impl: str = "auto") -> str:
    """'skinny' or 'cublas' for these operands. impl='skinny' takes the kernel wherever it fits at
    all (odd K or unaligned pointers still go to cuBLAS); 'auto' only on the shapes where it should win."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "cublas" or not skinny_fits(x, weight):
        return "cublas"
    if impl == "skinny":
        return "skinny"
    n, k = weight.shape
    m = x.shape[0]
    if m > AUTO_MAX_M or not AUTO_MIN_WEIGHT_ELEMS <= n * k <= AUTO_MAX_WEIGHT_ELEMS or n >= AUTO_MAX_N:
        return "cublas"
    if m > 1 and n >= 4096 and skinny_plan(m, n, k, sm_count(x.device.id)).split >= 4:
        return "cublas"
    return "skinny"


def _cublas_linear(x, weight, y, m: int, n: int, k: int) -> None:
    if max(m, n, k) >= 2**31:
        raise ValueError(f"linear: dims {(m, n, k)} exceed cuBLAS int32 sizes")
    y_type = _cublas.R_32F if y.dtype == np.float32 else _cublas.R_16BF
    _cublas.gemm_ex(_cublas.OP_T, _cublas.OP_N, n, m, k,
                    _ALPHA.ctypes.data, weight.data.ptr, _cublas.R_16BF, k, x.data.ptr, _cublas.R_16BF, k,
                    _BETA.ctypes.data, y.data.ptr, y_type, n, _cublas.COMPUTE_32F, _cublas.GEMM_DEFAULT)


def _skinny_linear(x, weight, y, m: int, n: int, k: int) -> None:
    plan = skinny_plan(m, n, k, sm_count(x.device.id))
    module("linear").fn(plan.entry)((plan.grid,), (_THREADS,),
                                    (x, weight, y, np.int32(m), np.int32(n), np.int32(k), np.int32(plan.warps_n)))


def linear(x, weight, out=None, impl: str = "auto"):
    """x [M, K] bf16, weight [N, K] bf16 -> [M, N] bf16 (fp32 accumulate, one rounding), or fp32
    unrounded when ``out`` is an fp32 array (a tensor-parallel partial sum; always cuBLAS).
    ``impl``: 'auto' | 'skinny' | 'cublas' (see ``route``); all give the same values up to fp32
    summation order."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    check("x", x, BF16, ndim=2)
    k = x.shape[1]
    check("weight", weight, BF16, ndim=2)
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected [N, {k}] to match x [M, {k}], got {tuple(weight.shape)}")
    m, n = x.shape[0], weight.shape[0]
    f32_out = out is not None and out.dtype == np.float32
    y = out_array("out", out, (m, n), np.float32 if f32_out else BF16)
    if m == 0 or n == 0:
        return y
    if k == 0:
        y.fill(0)
        return y
    if not f32_out and route(x, weight, impl) == "skinny":
        _skinny_linear(x, weight, y, m, n, k)
    else:
        _cublas_linear(x, weight, y, m, n, k)
    return y
