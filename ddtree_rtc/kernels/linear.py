"""Dense bf16 linear y = x @ weight^T (fp32 accumulate): our skinny-M kernel for decode shapes
(cuda_src/linear.cu, M <= 16; M <= 64 and fp32 out too for impl="invariant", the small-M path's
row-invariant plan), cuBLAS gemmEx for everything else.

cuBLAS: row-major y [M, N] is column-major y^T [N, M] = weight (col-major [K, N], transposed) x x^T
(col-major [K, M]), so one gemmEx with op(A) = T on the weight covers any M, N, K.

Skinny: weight-bandwidth bound, so the plan only decides how the weight rows and K are spread over
CTAs (8 rows per warp tile; warps_n row tiles x 8 / warps_n K ranges per CTA; a cluster of `split`
CTAs along K) so that enough 16-byte loads are in flight on every SM without a long tail. The 64-row
entries give each warp two weight tiles (BUCKET_NTILES), so a CTA covers two of the plan's row blocks.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np

from . import _cublas
from ._args import BF16, check, out_array
from ._launch import ctas_per_sm, launch, pdl_supported, sm_count
from .registry import module
from .rmsnorm import row_group

# Host scalars for alpha/beta (host pointer mode); module-level so the pointers stay valid.
_ALPHA = np.ones(1, dtype=np.float32)
_BETA = np.zeros(1, dtype=np.float32)

IMPLS = ("auto", "skinny", "cublas", "invariant")
SKINNY_MAX_M = 16
# impl="invariant" (the small-M path): the skinny kernel for M <= 64 with the K split planned from
# (N, K) alone, so a row's sums do not depend on M or on the other rows
INVARIANT_MAX_M = 64
_INVARIANT_PLAN_M = 8
# auto: skinny for M <= 8 on mid-sized weights (1M..64M elements), where cuBLAS leaves read bandwidth
# unused; the largest weights (dense MLP, lm_head) cuBLAS already reads near the ceiling, and at
# M = 16 the skinny kernel stops winning (`bench linear`; figures: benchmarks/README.md, Linear).
AUTO_MAX_M = 8
AUTO_MIN_WEIGHT_ELEMS = 1 << 20
AUTO_MAX_WEIGHT_ELEMS = 64 << 20
AUTO_MAX_N = 65536

_THREADS = 256
_CTAS_PER_SM = 2  # __launch_bounds__(256, 2) in linear.cu and skinny_pair.cuh (all but the 64-row entries)
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


# n8 weight tiles a warp holds in each token bucket's entries (include/skinny_mma.cuh, bucket_ntiles):
# a CTA of the 64-row entries covers NT of the plan's row blocks, its warps' x loads shared by them;
# the K split, so a row's sums, stay the plan's.
BUCKET_NTILES = {8: 1, 16: 1, 32: 1, 64: 2}


def bucket_grid(n: int, warps_n: int, split: int, rows: int) -> int:
    """CTAs of a skinny entry of ``rows`` token rows (``token_bucket``) over ``n`` weight rows."""
    return -(-n // (8 * warps_n * BUCKET_NTILES[rows])) * split


def token_bucket(m: int, what: str = "invariant linear") -> int:
    """The token rows (8, 16, 32 or 64) of the skinny entry that takes M <= 64 tokens (linear.cu's
    linear_m*, include/skinny_pair.cuh's *_m*): only how many rows it holds, never how a row is summed."""
    if not 1 <= m <= INVARIANT_MAX_M:
        raise ValueError(f"{what}: M = {m} outside 1..{INVARIANT_MAX_M}")
    return next(v for v in (8, 16, 32, 64) if m <= v)


def invariant_plan(m: int, n: int, k: int, sms: int, f32: bool = False) -> SkinnyPlan:
    """The row-invariant plan: (warps_n, split) from (N, K) and the GPU alone, the entry's token
    tiles (8, 16, 32, 64 rows) and so its grid from M; bf16 or fp32 (``f32``) output."""
    mt = token_bucket(m)
    base = skinny_plan(_INVARIANT_PLAN_M, n, k, sms)
    return SkinnyPlan(f"linear_m{mt}{'_f32' if f32 else ''}_s{base.split}",
                      bucket_grid(n, base.warps_n, base.split, mt), base.warps_n, base.split, base.est_us)


def invariant_plans(m: int, n: int, k: int, sms: int, f32: bool = False) -> list[SkinnyPlan]:
    """Every (warps_n, split) the invariant entries can run for ``m`` tokens over [n, k] (any of them
    keeps a row's sums independent of M, as long as one is chosen from the shape alone), with the
    cost model's estimate; `invariant_plan`'s choice is among them. For measuring the plan rule
    (`ddtree-rtc bench linear --invariant-plans`)."""
    mt = token_bucket(m)
    return [SkinnyPlan(f"linear_m{mt}{'_f32' if f32 else ''}_s{s}", bucket_grid(n, wn, s, mt), wn, s,
                       _estimate_us(_INVARIANT_PLAN_M, n, k, wn, s, sms))
            for wn in _WARPS_N for s in _SPLITS]


def launch_plan(x, weight, y, plan: SkinnyPlan) -> None:
    """One invariant entry launched with ``plan`` (from `invariant_plans`), plainly (no PDL)."""
    m, k = x.shape
    args = (x, weight, y, np.int32(m), np.int32(weight.shape[0]), np.int32(k), np.int32(plan.warps_n))
    _launch_skinny(module("linear").fn(plan.entry), plan.grid, args, early=False)


def one_wave_plan(n: int, k: int, sms: int, clusters_at_once) -> SkinnyPlan:
    """`skinny_plan` at M = 8 (the invariant plan) if its ceil(n / (8 warps_n)) clusters fit on the
    GPU at once, else the (warps_n, split) nearest to it (fewest halvings or doublings of either; then
    the cost model) whose clusters do; the base plan if none does (no split removes a tail the grid has anyway).
    ``clusters_at_once(split)``: how many clusters of ``split`` CTAs of the kernel's 8-row entry fit
    at once (`active_clusters`; a stub on the CPU). Nothing here depends on M, so every token bucket
    launches the same (warps_n, split) and a row's sums (fixed by warps_n, split and K) agree."""
    if n < 1 or k < 1:
        raise ValueError(f"one_wave_plan: N = {n} and K = {k} must be >= 1")
    base = skinny_plan(_INVARIANT_PLAN_M, n, k, sms)

    def fits(wn: int, s: int) -> bool:
        at_once = clusters_at_once(s)
        if not isinstance(at_once, (int, np.integer)) or at_once < 1:
            raise ValueError(f"one_wave_plan: {at_once!r} clusters of {s} CTAs fit at once; expected an int >= 1")
        return -(-n // (8 * wn)) <= at_once

    if fits(base.warps_n, base.split):
        return base
    steps = {v: i for i, v in enumerate(_SPLITS)}  # log2 of warps_n and split alike
    fitting = [(abs(steps[wn] - steps[base.warps_n]) + abs(steps[s] - steps[base.split]),
                _estimate_us(_INVARIANT_PLAN_M, n, k, wn, s, sms), -wn, s)
               for wn in _WARPS_N for s in _SPLITS if fits(wn, s)]
    if not fitting:
        return base
    _, est, neg_wn, s = min(fitting)
    return SkinnyPlan(f"linear_m{_INVARIANT_PLAN_M}_s{s}", -(-n // (8 * -neg_wn)) * s, -neg_wn, s, est)


@functools.cache
def active_clusters(device_id: int, family: str, entry: str, split: int) -> int:
    """cuOccupancyMaxActiveClusters of one entry of ``family`` (256 threads, static shared memory
    only; its cluster size ``split`` is compiled in) on a device; for split 1 the CTAs that fit at
    once (occupancy x SMs). Cached per (device, entry)."""
    import cupy
    from cuda.bindings import driver

    with cupy.cuda.Device(device_id):
        kern = module(family).fn(entry)
        if split == 1:
            active = ctas_per_sm(kern, _THREADS) * sm_count(device_id)
        else:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = split, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = _THREADS, 1, 1
            cfg.sharedMemBytes = 0
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = split, 1, 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            err, active = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(kern.ptr), cfg)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"{family}:{entry}: occupancy query at cluster size {split} failed: {err.name}")
    if active < 1:
        raise RuntimeError(f"{family}:{entry}: no cluster of {split} CTAs fits on device {device_id}")
    return int(active)


@functools.cache
def pair_plan(n: int, k: int, device_id: int, family: str, prefix: str) -> SkinnyPlan:
    """(warps_n, split) of a skinny pair kernel (include/skinny_pair.cuh: entries PREFIX_m{8..64}_s{S}
    of ``family``) over its n = n1 + n2 weight rows: `one_wave_plan` with the driver's cluster
    capacity of its 8-row entries (the plan's reference bucket, whatever M is), cached per device."""
    return one_wave_plan(n, k, sm_count(device_id),
                         lambda s: active_clusters(device_id, family, f"{prefix}_m{_INVARIANT_PLAN_M}_s{s}", s))


def skinny_fits(x, weight, max_m: int = SKINNY_MAX_M) -> bool:
    """Whether the skinny kernel can run at all: M <= max_m, K % 8 == 0, 16-byte aligned x and weight."""
    m, k = x.shape
    n = weight.shape[0]
    return (1 <= m <= max_m and k % 8 == 0 and n < 2**31 and k < 2**31
            and x.data.ptr % 16 == 0 and weight.data.ptr % 16 == 0)


def route(x, weight, impl: str = "auto") -> str:
    """'skinny', 'cublas' or 'invariant' for these operands. impl='skinny' takes the kernel wherever
    it fits at all (odd K or unaligned pointers still go to cuBLAS); 'auto' only on the shapes where it
    should win; 'invariant' always (an error where it cannot run: no silent non-invariant fallback)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "invariant":
        if not skinny_fits(x, weight, INVARIANT_MAX_M):
            raise ValueError(f"linear impl='invariant': needs 1 <= M <= {INVARIANT_MAX_M}, K % 8 == 0 and 16-byte "
                             f"aligned x and weight; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        return "invariant"
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


_PDL_REFUSED: list = []  # the driver's error, once a PDL launch of the skinny kernel was refused


@functools.cache
def _pdl(device_id: int) -> bool:
    return pdl_supported()


def _launch_skinny(fn, grid: int, args: tuple, early: bool) -> None:
    """A skinny entry with its last argument ``early``: under PDL (early = 1) where asked, the GPU has
    it and no driver refused it, its weights moving to L2 while the previous kernel finishes
    (linear.cu); else a plain launch (early = 0)."""
    if early and not _PDL_REFUSED:
        try:
            launch(fn, (grid,), (_THREADS,), args + (np.int32(1),), pdl=True)
            return
        except RuntimeError as e:  # a driver that refuses PDL with a cluster kernel: plain launches from now on
            _PDL_REFUSED.append(str(e))
            warnings.warn(f"linear: PDL launch refused ({e}); the small-M linears launch plainly", stacklevel=3)
    launch(fn, (grid,), (_THREADS,), args + (np.int32(0),))


def _skinny_linear(x, weight, y, m: int, n: int, k: int, invariant: bool = False) -> None:
    """The skinny kernel; on the small-M path (``invariant``) launched under PDL where the GPU has
    it, its weights moving to L2 while the previous kernel finishes (linear.cu, early)."""
    sms = sm_count(x.device.id)
    plan = invariant_plan(m, n, k, sms, y.dtype == np.float32) if invariant else skinny_plan(m, n, k, sms)
    args = (x, weight, y, np.int32(m), np.int32(n), np.int32(k), np.int32(plan.warps_n))
    _launch_skinny(module("linear").fn(plan.entry), plan.grid, args, invariant and _pdl(x.device.id))


def linear(x, weight, out=None, impl: str = "auto"):
    """x [M, K] bf16, weight [N, K] bf16 -> [M, N] bf16 (fp32 accumulate, one rounding), or fp32
    unrounded when ``out`` is an fp32 array (a tensor-parallel partial sum; cuBLAS unless 'invariant').
    ``impl``: 'auto' | 'skinny' | 'cublas' | 'invariant' (see ``route``); all give the same values up
    to fp32 summation order. 'invariant' (M <= 64, bf16 or fp32 out) sums every row the same way
    whatever M is: the small-M path's linear."""
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
    path = route(x, weight, impl)
    if path == "invariant":
        _skinny_linear(x, weight, y, m, n, k, invariant=True)
    elif not f32_out and path == "skinny":
        _skinny_linear(x, weight, y, m, n, k)
    else:
        _cublas_linear(x, weight, y, m, n, k)
    return y


def norm_linear(x, norm_weight, eps: float, weight, out=None):
    """bf16(rmsnorm(x, norm_weight, eps) @ weight^T) in one launch (linear.cu's linear_norm_m*_s*:
    include/skinny_norm.cuh): x [M, K] bf16 (1 <= M <= 64), norm_weight [K], weight [N, K] -> [M, N]
    bf16 (into ``out`` when given). The small-M path's q_a norm and q_b: the bits of ``rmsnorm`` then
    ``linear(..., impl="invariant")``, whose plan it launches, so a row's bits do not depend on M."""
    check("x", x, BF16, ndim=2)
    m, k = x.shape
    check("norm_weight", norm_weight, BF16, shape=(k,))
    check("weight", weight, BF16, ndim=2)
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected [N, {k}] to match x [M, {k}], got {tuple(weight.shape)}")
    n = weight.shape[0]
    y = out_array("out", out, (m, n), BF16)
    if not (skinny_fits(x, weight, INVARIANT_MAX_M) and k > 0 and norm_weight.data.ptr % 16 == 0):
        raise ValueError(f"norm_linear: needs 1 <= M <= {INVARIANT_MAX_M}, K a positive multiple of 8 and 16-byte "
                         f"aligned x, norm_weight and weight; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if n == 0:
        return y
    plan = invariant_plan(m, n, k, sm_count(x.device.id))
    fn = module("linear").fn(f"linear_norm_m{token_bucket(m)}_s{plan.split}")
    args = (x, norm_weight, np.float32(eps), np.int32(row_group(k)), weight, y, np.int32(m), np.int32(n),
            np.int32(k), np.int32(plan.warps_n))
    _launch_skinny(fn, plan.grid, args, _pdl(x.device.id))
    return y
