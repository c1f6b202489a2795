"""The small-M path's MLA attention block in one launch (cuda_src/mla_block.cu): a persistent kernel
whose phases are the bodies of the small-M kernels (q_a / kv_a, the q_a norm and cache rows, q_b, the
absorbed query, the d16 attention and its merge, W_UV, o_proj) with grid barriers between them. Same
signature and numbers as ``ddtree_rtc.reference.mla_block.mla_block_small`` (the composition of
today's references), and the same bits as the separate small-M kernels.

``mla_block_plan`` (host, once per shape) allocates the scratch activations and the grid barrier and
sizes the grid so every CTA is resident at once (the barrier needs it); with a plan and an ``out``,
``mla_block_small`` only launches, so it can be captured in a CUDA graph (one plan per forward: the
layers run one after another and share it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..reference.mla_block import block_dims
from ._args import BF16, allow_dynamic_smem, check, out_array
from ._launch import launch, pdl_supported, sm_count
from .linear import invariant_plan, skinny_plan
from .mla_attention import _smem_bytes
from .registry import module

MAX_TOKENS = 64
LAT, ROPE, ROW = 512, 64, 576
_THREADS = 256
_ATTENTION_VARIANT = "d16"  # the attention phase's body (mla_split.cuh); split="shape" picks it where it fits


class FusedBlockUnavailable(RuntimeError):
    """This GPU or this shape cannot run the fused attention block (the reason is the message); the
    small-M path's separate kernels still can."""


def smem_bytes() -> int:
    """Dynamic shared memory of the fused kernel: the d16 attention phase's (the other phases use static)."""
    return _smem_bytes(_ATTENTION_VARIANT)


@functools.cache
def _occupancy(device_id: int, entry: str) -> int:
    """CTAs of ``entry`` one SM holds at once (the driver's occupancy calculator)."""
    from cuda.bindings import driver

    fn = module("mla_block").fn(entry)
    allow_dynamic_smem(fn, smem_bytes())
    err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(driver.CUfunction(fn.ptr), _THREADS, smem_bytes())
    if err != driver.CUresult.CUDA_SUCCESS:
        raise FusedBlockUnavailable(f"mla_block: occupancy query failed: {err.name}")
    return int(n)


@dataclass
class MLABlockPlan:
    """Shape, grid, scratch activations and grid barrier of one fused attention block."""

    num_tokens: int
    hidden: int
    q_lora: int
    num_heads: int
    q_nope: int
    v_head: int
    f32_out: bool
    grid: int  # CTAs, all resident at once (occupancy x SMs)
    linears: tuple  # (warps_n, split) of q_a / kv_a, q_b, o_proj: the separate kernels' plans
    qa: object  # bf16 [M, q_lora]
    cq: object  # bf16 [M, q_lora]
    kv: object  # bf16 [M, 576]
    q: object  # bf16 [M, H (nope + 64)]
    q_att: object  # bf16 [M, H, 576]
    o_lat: object  # bf16 [M, H, 512]
    lse: object  # fp32 [M, H]
    o: object  # bf16 [M, H * v_head]
    bar: object  # uint32 [2]: the grid barrier's arrivals and generation
    pdl: bool

    @property
    def entry(self) -> str:
        return "mla_block_small_f32" if self.f32_out else "mla_block_small"


def mla_block_plan(num_tokens: int, hidden: int, q_lora: int, num_heads: int, q_nope: int = 128, v_head: int = 128,
                   f32_out: bool = False) -> MLABlockPlan:
    """Plan one shape (M <= 64). Raises FusedBlockUnavailable where this GPU cannot hold the kernel
    (shared memory) and ValueError on a shape the kernel does not take."""
    import cupy

    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"mla_block: M = {num_tokens} tokens outside 1..{MAX_TOKENS}")
    if (hidden % 8 or q_lora % 8 or q_nope % 4 or num_heads < 1 or v_head < 1 or (num_heads * (q_nope + ROPE)) % 8
            or (num_heads * v_head) % 8):
        raise ValueError(f"mla_block: needs hidden, q_lora, H (q_nope + 64) and H v_head multiples of 8 and q_nope "
                         f"of 4; got hidden {hidden}, q_lora {q_lora}, {num_heads} heads of q_nope {q_nope}, "
                         f"v_head {v_head}")
    dev = cupy.cuda.Device()
    limit = dev.attributes["MaxSharedMemoryPerBlockOptin"]
    if smem_bytes() + 17 * 1024 > limit:  # + the skinny reduce buffers' static shared memory
        raise FusedBlockUnavailable(f"mla_block: the attention phase needs {smem_bytes()} B of shared memory per "
                                    f"block plus ~17 KB static; this GPU allows {limit}")
    entry = "mla_block_small_f32" if f32_out else "mla_block_small"
    per_sm = _occupancy(dev.id, entry)
    if per_sm < 1:
        raise FusedBlockUnavailable(f"mla_block: {entry} does not fit on an SM ({smem_bytes()} B dynamic shared "
                                    f"memory, {_THREADS} threads)")
    sms = sm_count(dev.id)
    m, h = num_tokens, num_heads
    pa = skinny_plan(8, q_lora + ROW, hidden, sms)  # kernels/mla_small.py, mla_qkv_a_small
    pb = invariant_plan(m, h * (q_nope + ROPE), q_lora, sms)
    po = invariant_plan(m, hidden, h * v_head, sms, f32_out)

    def bf16(*shape):
        return cupy.empty(shape, dtype=cupy.uint16)

    return MLABlockPlan(m, hidden, q_lora, h, q_nope, v_head, f32_out, per_sm * sms,
                        ((pa.warps_n, pa.split), (pb.warps_n, pb.split), (po.warps_n, po.split)),
                        bf16(m, q_lora), bf16(m, q_lora), bf16(m, ROW), bf16(m, h * (q_nope + ROPE)),
                        bf16(m, h, ROW), bf16(m, h, LAT), cupy.empty((m, h), dtype=cupy.float32),
                        bf16(m, h * v_head), cupy.zeros(2, dtype=cupy.uint32), pdl_supported())


def residual_norm_args(residual, norm_weight, norm_eps: float, y, who: str) -> tuple:
    """The fused kernels' last-phase arguments (residual, norm_w, eps, y_norm, res_out): nulls without
    a residual; with one, checked against the output ``y`` (bf16: one rank) and new outputs."""
    import cupy

    if residual is None:
        return (np.uint64(0), np.uint64(0), np.float32(0.0), np.uint64(0), np.uint64(0))
    if y.dtype == np.float32:
        raise ValueError(f"{who}: the residual norm follows a bf16 output (one rank), not an fp32 partial")
    check("residual", residual, BF16, shape=tuple(y.shape))
    check("norm_weight", norm_weight, BF16, shape=(y.shape[1],))
    return (residual, norm_weight, np.float32(norm_eps), cupy.empty(y.shape, dtype=cupy.uint16),
            cupy.empty(y.shape, dtype=cupy.uint16))


def prologue_args(prologue, x, residual, who: str) -> tuple:
    """(x, the new residual or None, the kernels' phase-0 arguments pro_sum, pro_plus, pro_res, pro_w,
    pro_eps, pro_res_out): without a prologue x as given and nulls; with one (a tensor-parallel rank,
    x None) the x and residual arrays the kernel writes (its x_out / residual_out, or new), its inputs
    checked."""
    from ..reference.mla_block import prologue_rows

    if prologue is None:
        return x, None, (np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0), np.float32(0.0), np.uint64(0))
    if x is not None or residual is not None:
        prologue_rows(x, prologue, residual, who)  # raises, naming the misuse
    p = prologue
    check("prologue.sum", p.sum, np.float32, ndim=2)
    shape = tuple(p.sum.shape)
    if p.plus is not None:
        check("prologue.plus", p.plus, np.float32, shape=shape)
    check("prologue.residual", p.residual, BF16, shape=shape)
    check("prologue.weight", p.weight, BF16, shape=(shape[1],))
    _aligned(**{"prologue.sum": p.sum, "prologue.residual": p.residual, "prologue.weight": p.weight},
             **({} if p.plus is None else {"prologue.plus": p.plus}))
    x, h = out_array("prologue.x_out", p.x_out, shape, BF16), out_array("prologue.residual_out", p.residual_out,
                                                                       shape, BF16)
    return x, h, (p.sum, p.plus if p.plus is not None else np.uint64(0), p.residual, p.weight, np.float32(p.eps), h)


def _aligned(**arrays) -> None:
    for name, a in arrays.items():
        if a.data.ptr % 16:
            raise ValueError(f"{name}: the kernel reads 16-byte vectors; base address {a.data.ptr:#x} is not "
                             f"16-byte aligned")


def mla_block_small(x, w_qa, w_kva, qa_norm, kv_norm, eps: float, w_qb, kv_b, w_o, positions, inv_freq,
                    rope_scale: float, cache, slots, att_plan, softmax_scale: float, out=None, plan=None,
                    residual=None, norm_weight=None, norm_eps: float = 0.0, prologue=None):
    """x [M, hidden] bf16 (M <= 64) -> the attention block's output [M, hidden] bf16 (fp32 unrounded into
    an fp32 ``out``: a tensor-parallel partial), the new tokens' cache rows written at ``slots`` of
    ``cache`` (one layer [pages, page_size, 576]). Weights: w_qa [q_lora, hidden], w_kva [576, hidden],
    qa_norm [q_lora], kv_norm [512], w_qb [H (nope + 64), q_lora], kv_b [H (nope + v_head), 512], w_o
    [hidden, H v_head], all bf16 and contiguous. ``att_plan``: mla_attention_plan's, split="shape" with
    the d16 variant. ``plan``: mla_block_plan's for this shape (made here when not given). With a bf16
    ``residual`` [M, hidden] (one rank) the kernel's last phase is the decoder's post-attention norm:
    returns (RMSNorm(out + residual) * norm_weight, out + residual), new arrays. With a ``prologue``
    (reference.rmsnorm.NormPrologue: a tensor-parallel rank, x None) its first phase is the previous
    sublayer's residual norm, which makes x: returns (out, x, the new residual), new arrays."""
    x, h_new, pro = prologue_args(prologue, x, residual, "mla_block_small")
    check("x", x, BF16, ndim=2)
    m, hidden = x.shape
    b = att_plan.batch
    h = b.num_heads
    nope, v_head, q_lora = block_dims(w_qb, kv_b, w_o, h)
    check("w_qa", w_qa, BF16, shape=(q_lora, hidden))
    check("w_kva", w_kva, BF16, shape=(ROW, hidden))
    check("qa_norm", qa_norm, BF16, shape=(q_lora,))
    check("kv_norm", kv_norm, BF16, shape=(LAT,))
    check("w_qb", w_qb, BF16)
    check("kv_b", kv_b, BF16)
    check("w_o", w_o, BF16, shape=(hidden, h * v_head))
    check("positions", positions, np.int32, shape=(m,))
    check("inv_freq", inv_freq, np.float32, shape=(ROPE // 2,))
    check("slots", slots, np.int32, shape=(m,))
    check("cache", cache, BF16, shape=(b.num_pages, b.page_size, ROW))
    if b.total_tokens != m:
        raise ValueError(f"att_plan: planned for {b.total_tokens} tokens, x has {m}")
    if att_plan.variant != _ATTENTION_VARIANT or att_plan.split != "shape":
        raise FusedBlockUnavailable(f"mla_block: the attention phase is the {_ATTENTION_VARIANT} variant under "
                                    f"split='shape'; att_plan has {att_plan.variant!r}, split={att_plan.split!r}")
    _aligned(x=x, w_qa=w_qa, w_kva=w_kva, w_qb=w_qb, w_o=w_o, qa_norm=qa_norm, kv_norm=kv_norm, kv_b=kv_b)
    f32_out = out is not None and out.dtype == np.float32
    y = out_array("out", out, (m, hidden), np.float32 if f32_out else BF16)
    if plan is None:
        plan = mla_block_plan(m, hidden, q_lora, h, nope, v_head, f32_out)
    made = (plan.num_tokens, plan.hidden, plan.q_lora, plan.num_heads, plan.q_nope, plan.v_head, plan.f32_out)
    if made != (m, hidden, q_lora, h, nope, v_head, f32_out):
        raise ValueError(f"plan: made for (M, hidden, q_lora, H, q_nope, v_head, fp32 out) = {made}, called with "
                         f"{(m, hidden, q_lora, h, nope, v_head, f32_out)}")
    fn = module("mla_block").fn(plan.entry)
    allow_dynamic_smem(fn, smem_bytes())
    (wa, sa), (wb, sb), (wo, so) = plan.linears
    mask = att_plan.mask if att_plan.mask is not None else np.uint64(0)
    args = (x, np.int32(m), np.int32(hidden), np.int32(q_lora), np.int32(h), np.int32(nope), np.int32(v_head), w_qa,
            w_kva, qa_norm,
            kv_norm, np.float32(eps), w_qb, kv_b, w_o, positions, inv_freq, np.float32(rope_scale), cache,
            np.int64(cache.size // ROW), slots, att_plan.page_table, np.int32(att_plan.page_table.shape[1]),
            np.int32(b.page_size), att_plan.work, att_plan.cta_work, att_plan.req_info, mask,
            np.int32(b.mask_words), att_plan.o_part, att_plan.lse_part, att_plan.merge, att_plan.merge_count,
            np.int32(att_plan.grid), np.int32(1 if att_plan.merge_grid else 0),
            np.float32(softmax_scale * np.log2(np.e)), plan.qa, plan.cq, plan.kv, plan.q, plan.q_att, plan.o_lat,
            plan.lse, plan.o, y, np.int32(wa), np.int32(sa), np.int32(wb), np.int32(sb), np.int32(wo), np.int32(so),
            plan.bar)
    norm = residual_norm_args(residual, norm_weight, norm_eps, y, "mla_block_small")
    launch(fn, (plan.grid,), (_THREADS,), args[:-1] + norm + pro + args[-1:], shared_mem=smem_bytes(), pdl=plan.pdl)
    if prologue is not None:
        return y, x, h_new
    return y if residual is None else (norm[3], norm[4])
