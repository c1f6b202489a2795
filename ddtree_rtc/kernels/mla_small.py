"""The small-M path's row-invariant MLA head GEMM (cuda_src/mla_small.cu): ``mla_head_gemm(...,
impl="invariant")`` runs it instead of the strided-batched cuBLAS GEMM, whose kernel and summation
order follow the token count. Same contract and numbers (up to fp32 summation order) as
``ddtree_rtc.reference.mla_attention.mla_head_gemm``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ._args import BF16, check, out_array
from ._launch import launch, pdl_supported
from .linear import bucket_grid, pair_plan, token_bucket
from .registry import module

MAX_TOKENS = 64


@functools.cache
def _pdl(device_id: int) -> bool:
    """PDL launches (kernels/_launch.py): each kernel here waits on the previous one before it
    reads, so the next launch's weight prefetch may start as soon as it has."""
    return pdl_supported()


def _strides(name: str, a) -> tuple[int, ...]:
    if any(s % a.itemsize or s < 0 for s in a.strides):
        raise ValueError(f"{name}: strides {a.strides} are not whole non-negative elements")
    return tuple(s // a.itemsize for s in a.strides)


def group_size(t: int) -> int:
    """Tokens per CTA of the head GEMMs (grid z = ceil(T / group)): the smallest power of two >=
    min(T, 8). It changes only which CTA takes a token, never a token's arithmetic."""
    g = 1
    while g < min(t, 8):
        g *= 2
    return g


def _aligned(ptr: int, strides) -> bool:
    """Whether every row start of a view at ``ptr`` (bytes; element strides ``strides`` of its
    leading dims, bf16) is 16-byte aligned: the kernels' 16-byte loads."""
    return ptr % 16 == 0 and all(s % 8 == 0 for s in strides)


@dataclass(frozen=True)
class HeadGemmPlan:
    grid: tuple[int, int, int]  # (ceil(N / 32), H, ceil(T / group)), 256 threads
    group: int  # tokens per CTA
    kc: bool  # W has k contiguous (head_gemm_kc), else head_gemm_nc
    w_k: int
    w_n: int
    vec: bool  # 16-byte loads: the kernel's VEC promise (aligned rows, whole 8-element vectors)


def head_gemm_plan(t: int, h: int, k: int, n: int, trans_w: bool, x_ptr: int, x_strides, w_ptr: int,
                   w_strides) -> HeadGemmPlan:
    """The launch of mla_head_gemm_small for x [T, H, K] (element strides ``x_strides``, k
    contiguous) and w [H, N, K] (trans_w) or [H, K, N] (``w_strides``), from shapes, strides and
    addresses; never from anything but this call's operands."""
    w_k, w_n = (w_strides[2], w_strides[1]) if trans_w else (w_strides[1], w_strides[2])
    kc = w_k == 1
    if kc:  # whole 16-byte k chunks of W's and x's rows
        vec = k % 8 == 0 and _aligned(w_ptr, (w_strides[0], w_n)) and _aligned(x_ptr, x_strides[:2])
    else:  # whole 8-column pieces of W's rows
        vec = w_n == 1 and n % 8 == 0 and _aligned(w_ptr, (w_strides[0], w_k))
    g = group_size(t)
    return HeadGemmPlan((-(-n // 32), h, -(-t // g)), g, kc, w_k, w_n, vec)


def mla_head_gemm_small(x, w, trans_w: bool, out):
    """Per head h: out[:, h] = x[:, h] @ (w[h].T if trans_w else w[h]); x [T, H, K] (T <= 64), w
    [H, N, K] (trans_w) or [H, K, N], out [T, H, N] bf16; views with a contiguous last dim (x, out)."""
    t, h, k = x.shape
    n = out.shape[2]
    if t > MAX_TOKENS:
        raise ValueError(f"mla_head_gemm impl='invariant': T = {t} tokens > {MAX_TOKENS} (the small-M path)")
    xs, ws, os_ = _strides("x", x), _strides("w", w), _strides("out", out)
    if (xs[2] != 1 and k > 1) or (os_[2] != 1 and n > 1):
        raise ValueError(f"x / out: the last dim must be contiguous (strides {x.strides}, {out.strides})")
    check("out", out, BF16, shape=(t, h, n), contiguous=False)
    if t == 0 or h == 0 or n == 0:
        return out
    p = head_gemm_plan(t, h, k, n, trans_w, x.data.ptr, xs, w.data.ptr, ws)
    launch(module("mla_small").fn("mla_head_gemm_small"), p.grid, (256,),
           (x, np.int64(xs[0]), np.int64(xs[1]), w, np.int64(ws[0]), np.int64(p.w_k), np.int64(p.w_n), out,
            np.int64(os_[0]), np.int64(os_[1]), np.int32(t), np.int32(k), np.int32(n), np.int32(p.group),
            np.int32(p.kc), np.int32(p.vec)), pdl=_pdl(x.device.id))
    return out


LAT, ROPE = 512, 64  # the latent row [c 512 | k_pe 64] the MLA attention kernels take


def mla_query_small(q, w_uk, positions, inv_freq, rope_scale: float = 1.0, out=None, rows=None):
    """The absorbed query in one launch: q [T, H, nope + 64] bf16 (T <= 64; a view with a contiguous
    last dim), w_uk [H, nope, 512] (a view of kv_b), positions int32 [T], inv_freq fp32 [32] ->
    q_att [T, H, 576] = [q_nope · W_UK[h] | RoPE(q_pe)] bf16 (into ``out`` when given). ``rows``:
    ``(kv, norm_w, eps, cache, slots)``: in the same launch, the new tokens' cache rows (``_rows_args``):
    cache (one layer) row slots[t] = [RMSNorm(kv[t, :512]) * norm_w | RoPE(kv[t, 512:])], slots
    outside the cache skipped."""
    import cupy

    t, h, d = q.shape
    nope = d - ROPE
    if t > MAX_TOKENS or nope < 4 or nope % 4:
        raise ValueError(f"mla_query_small: q {tuple(q.shape)}: needs T <= {MAX_TOKENS} and q_nope a multiple of 4")
    check("w_uk", w_uk, BF16, shape=(h, nope, LAT), contiguous=False)
    check("positions", positions, np.int32, shape=(t,))
    check("inv_freq", inv_freq, np.float32, shape=(ROPE // 2,))
    qs, ws = _strides("q", q), _strides("w_uk", w_uk)
    if qs[2] != 1 or ws[2] != 1:
        raise ValueError(f"q / w_uk: the last dim must be contiguous (strides {q.strides}, {w_uk.strides})")
    out = cupy.empty((t, h, LAT + ROPE), dtype=cupy.uint16) if out is None else out
    check("out", out, BF16, shape=(t, h, LAT + ROPE))
    extra = _rows_args(t, rows)
    if t == 0:
        return out
    p = head_gemm_plan(t, h, nope, LAT, False, q.data.ptr, qs, w_uk.data.ptr, ws)  # the W_UK part's
    launch(module("mla_small").fn("mla_query_small"), (LAT // 32 + 1 + (rows is not None), h, p.grid[2]), (256,),
           (q, np.int64(qs[0]), np.int64(qs[1]), np.int32(nope), w_uk, np.int64(ws[0]), np.int64(ws[1]), out,
            positions, inv_freq, np.float32(rope_scale), np.int32(t), np.int32(h), np.int32(p.group),
            np.int32(p.vec), *extra), pdl=_pdl(q.device.id))
    return out


def _rows_args(t: int, rows) -> tuple:
    """mla_query_small's kernel arguments for the cache rows of ``rows`` = (kv [T, 576] bf16 = x
    W_kva^T, rows contiguous with a row stride a multiple of 8; norm_w [512]; eps; cache (one layer,
    rows of 576); slots int32 [T]), checked; nulls and rows = 0 without them."""
    if rows is None:
        return (np.uint64(0), np.int64(0), np.uint64(0), np.float32(0), np.uint64(0), np.int64(0), np.uint64(0),
                np.int32(0))
    kv, norm_w, eps, cache, slots = rows
    check("kv", kv, BF16, shape=(t, LAT + ROPE), contiguous=False)
    ks = _strides("kv", kv)
    if ks[1] != 1 or ks[0] % 8 or kv.data.ptr % 16:
        raise ValueError(f"kv: rows must be contiguous and 16-byte aligned (strides {kv.strides})")
    check("norm_w", norm_w, BF16, shape=(LAT,))
    check("cache", cache, BF16)
    if cache.shape[-1] != LAT + ROPE:
        raise ValueError(f"cache: rows of {cache.shape[-1]}, expected {LAT + ROPE}")
    check("slots", slots, np.int32, shape=(t,))
    return (kv, np.int64(ks[0]), norm_w, np.float32(eps), cache, np.int64(cache.size // (LAT + ROPE)), slots,
            np.int32(1))


def mla_qkv_a_small(x, w_qa, w_kva, out_q=None, out_kv=None):
    """q_a and kv_a over the same x in one skinny launch (mla_qkv_a_small_m*_s*: cuda_src/include/
    skinny_pair.cuh, MODE 1): x [M, H] bf16 (M <= 64), w_qa [q_lora, H], w_kva [576, H] bf16 ->
    (x w_qa^T, x w_kva^T) bf16; K split planned from the shapes and the GPU alone: rows independent of M."""
    check("x", x, BF16, ndim=2)
    m, h = x.shape
    check("w_qa", w_qa, BF16, ndim=2)
    n1 = w_qa.shape[0]
    check("w_qa", w_qa, BF16, shape=(n1, h))
    check("w_kva", w_kva, BF16, shape=(LAT + ROPE, h))
    if not 1 <= m <= MAX_TOKENS or n1 % 8 or h % 8:
        raise ValueError(f"mla_qkv_a_small: needs 1 <= M <= {MAX_TOKENS}, q_lora and H multiples of 8; got x "
                         f"{tuple(x.shape)}, w_qa {tuple(w_qa.shape)}")
    for name, a in (("x", x), ("w_qa", w_qa), ("w_kva", w_kva)):
        if a.data.ptr % 16:
            raise ValueError(f"{name}: base address {a.data.ptr:#x} is not 16-byte aligned")
    oq = out_array("out_q", out_q, (m, n1), BF16)
    okv = out_array("out_kv", out_kv, (m, LAT + ROPE), BF16)
    # (warps_n, split) from the shapes and the GPU alone (the invariant linears' plan, moved where its
    # clusters would not fit in one wave); M only picks the entry's token rows (include/skinny_pair.cuh:
    # a row's sums are the same in every bucket)
    plan = pair_plan(n1 + LAT + ROPE, h, x.device.id, "mla_small", "mla_qkv_a_small")
    mt = token_bucket(m, "mla_qkv_a_small")
    grid = bucket_grid(n1 + LAT + ROPE, plan.warps_n, plan.split, mt)
    launch(module("mla_small").fn(f"mla_qkv_a_small_m{mt}_s{plan.split}"), (grid,), (256,), (
        x, w_qa, w_kva, oq, okv, np.int32(m), np.int32(n1), np.int32(LAT + ROPE), np.int32(h),
        np.int32(plan.warps_n)), pdl=_pdl(x.device.id))
    return oq, okv
