"""The small-M path's MoE layer in one launch (cuda_src/moe_block.cu): a persistent kernel whose phases
are the bodies of the small-M kernels (moe_small_dense, moe_route, the shared expert's down linear,
moe_small_gate_up, moe_small_down + combine) with grid barriers between them. Same signature and
numbers as ``ddtree_rtc.reference.moe_block.moe_block_small`` (the composition of today's references)
and the same bits as the separate small-M kernels.

``moe_block_plan`` (host, once per shape) allocates the scratch and the grid barrier and sizes the grid
so every CTA is resident at once; with a plan and an ``out`` the call only launches (graph-capturable;
one plan per forward, shared by its MoE layers, which run one after another)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..reference.moe_small import check_small_shape
from ._args import BF16, allow_dynamic_smem, check, out_array
from ._launch import launch, pdl_supported, sm_count
from .linear import invariant_plan, skinny_plan
from .mla_block import FusedBlockUnavailable, prologue_args, residual_norm_args
from .moe_gemm import check_expert_inputs
from .moe_small import BLOCK_BYTES
from .registry import module, spec

_THREADS = 256
_WARPS = 8
MAX_ROUTER = 384  # the entries' router capacity (moe_block_small[_f32])
_STATIC_SMEM = 35472  # the kernel's static shared memory, at most (`kernels build` lists it)


def dynamic_smem(num_pairs: int, num_experts: int, n_group: int) -> int:
    """The phases' shared memory, one region in turn: the routing's scratch (n_group > 1), the gate_up
    rings (at least the warps' partial sums, 32 KB), the down rings + P x 16 fp32 down values."""
    ring = _WARPS * spec("moe_block").params["MOE_SMALL_STAGES"] * BLOCK_BYTES
    return max(_WARPS * num_experts * 4 if n_group > 1 else 0, ring, _WARPS * 8 * 32 * 4 * 4, ring + num_pairs * 64)


@functools.cache
def _occupancy(device_id: int, entry: str, smem: int) -> int:
    from cuda.bindings import driver

    fn = module("moe_block").fn(entry)
    allow_dynamic_smem(fn, smem)
    err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(driver.CUfunction(fn.ptr), _THREADS, smem)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise FusedBlockUnavailable(f"moe_block: occupancy query failed: {err.name}")
    return int(n)


@dataclass
class MoEBlockPlan:
    """Shape, grid, scratch and grid barrier of one fused MoE layer."""

    num_tokens: int
    num_experts: int  # the router's
    local_experts: int
    top_k: int
    hidden: int
    intermediate: int
    shared_intermediate: int
    n_group: int
    f32_out: bool
    entry: str
    smem: int  # dynamic shared memory
    grid: int
    linears: tuple  # (warps_n, split) of the dense part and of the shared down: the separate kernels' plans
    logits: object  # fp32 [M, E]
    hs: object  # bf16 [M, Is]
    ids: object  # int32 [M, top_k]
    topk_w: object  # fp32 [M, top_k]
    shared: object  # bf16 [M, H]: the shared expert's output (one rank)
    h: object  # bf16 [M top_k, I]
    bar: object  # uint32 [2]
    pdl: bool


def moe_block_plan(num_tokens: int, num_experts: int, local_experts: int, top_k: int, hidden: int,
                   intermediate: int, shared_intermediate: int, n_group: int = 1,
                   f32_out: bool = False) -> MoEBlockPlan:
    """Plan one shape (M <= 64). Raises FusedBlockUnavailable where no entry takes the router or the GPU
    cannot hold the kernel, ValueError on a shape the small-M kernels do not take."""
    import cupy

    check_small_shape(num_tokens, local_experts, top_k, hidden, intermediate)
    if num_experts % 8 or (2 * shared_intermediate) % 8 or hidden % 8:
        raise ValueError(f"moe_block: E = {num_experts} and 2 Is = {2 * shared_intermediate} must be multiples of 8")
    if num_experts > MAX_ROUTER:
        raise FusedBlockUnavailable(f"moe_block: a router of {num_experts} experts (the kernel routes at most "
                                    f"{MAX_ROUTER})")
    entry = f"moe_block_small{'_f32' if f32_out else ''}"
    dev = cupy.cuda.Device()
    smem = dynamic_smem(num_tokens * top_k, num_experts, n_group)
    limit = dev.attributes["MaxSharedMemoryPerBlockOptin"]
    if smem + _STATIC_SMEM > limit:
        raise FusedBlockUnavailable(f"moe_block: {smem + _STATIC_SMEM} B of shared memory per block; this GPU "
                                    f"allows {limit}")
    per_sm = _occupancy(dev.id, entry, smem)
    if per_sm < 1:
        raise FusedBlockUnavailable(f"moe_block: {entry} does not fit on an SM ({smem} B dynamic shared memory)")
    sms = sm_count(dev.id)
    m, i2 = num_tokens, 2 * shared_intermediate
    pd = skinny_plan(8, num_experts + i2, hidden, sms)  # kernels/moe_small.py, moe_small_dense
    ps = invariant_plan(m, hidden, shared_intermediate, sms, f32_out)
    return MoEBlockPlan(m, num_experts, local_experts, top_k, hidden, intermediate, shared_intermediate, n_group,
                        f32_out, entry, smem, per_sm * sms, ((pd.warps_n, pd.split), (ps.warps_n, ps.split)),
                        cupy.empty((m, num_experts), dtype=cupy.float32),
                        cupy.empty((m, shared_intermediate), dtype=cupy.uint16),
                        cupy.empty((m, top_k), dtype=cupy.int32), cupy.empty((m, top_k), dtype=cupy.float32),
                        cupy.empty((m, hidden), dtype=cupy.uint16),
                        cupy.empty((m * top_k, intermediate), dtype=cupy.uint16), cupy.zeros(2, dtype=cupy.uint32),
                        pdl_supported())


def moe_block_small(x, gate_weight, bias, shared_w13, shared_w2, experts, top_k: int, n_group: int = 1,
                    topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                    id_offset: int = 0, out=None, shared_out=None, plan=None, residual=None, norm_weight=None,
                    norm_eps: float = 0.0, prologue=None):
    """x [M, H] bf16 (M <= 64) -> the MoE layer's output [M, H]: bf16 routed + shared, or with an fp32
    ``out`` the routed partial unrounded and the shared expert's into ``shared_out`` (fp32 [M, H], then
    required). gate_weight bf16 [E, H], bias fp32 [E] or None, shared_w13 bf16 [2 Is, H], shared_w2 bf16
    [H, Is]; ``experts`` (layout 'mma'): the router's ids id_offset .. id_offset + local - 1. With a bf16
    ``residual`` [M, H] (one rank) the kernel's last phase is the decoder's next norm: returns
    (RMSNorm(y + residual) * norm_weight, y + residual), new arrays. With a ``prologue``
    (reference.rmsnorm.NormPrologue: a tensor-parallel rank, x None) its first phase is the attention's
    residual norm, which makes x: returns (y, x, the new residual), new arrays."""
    x, h_new, pro = prologue_args(prologue, x, residual, "moe_block_small")
    check("x", x, BF16, ndim=2)
    m, h = x.shape
    check("gate_weight", gate_weight, BF16, ndim=2)
    e = gate_weight.shape[0]
    check("gate_weight", gate_weight, BF16, shape=(e, h))
    if bias is not None:
        check("bias", bias, np.float32, shape=(e,))
    check("shared_w13", shared_w13, BF16, ndim=2)
    i2 = shared_w13.shape[0]
    check("shared_w13", shared_w13, BF16, shape=(i2, h))
    check("shared_w2", shared_w2, BF16, shape=(h, i2 // 2))
    if not 0 <= id_offset <= e - experts.num_experts:
        raise ValueError(f"id_offset {id_offset}: experts {id_offset}..{id_offset + experts.num_experts - 1} are "
                         f"not experts of a router over {e}")
    for name, a in (("x", x), ("gate_weight", gate_weight), ("shared_w13", shared_w13), ("shared_w2", shared_w2)):
        if a.data.ptr % 16:
            raise ValueError(f"{name}: the kernel reads 16-byte vectors; base address {a.data.ptr:#x} is not "
                             f"16-byte aligned")
    f32_out = out is not None and out.dtype == np.float32
    if f32_out != (shared_out is not None):
        raise ValueError("moe_block_small: an fp32 out (the routed partial) and shared_out (the shared expert's) "
                         "go together")
    y = out_array("out", out, (m, h), np.float32 if f32_out else BF16)
    if shared_out is not None:
        check("shared_out", shared_out, np.float32, shape=(m, h))
    if plan is None:
        plan = moe_block_plan(m, e, experts.num_experts, top_k, h, experts.intermediate, i2 // 2, n_group, f32_out)
    made = (plan.num_tokens, plan.num_experts, plan.local_experts, plan.top_k, plan.hidden, plan.intermediate,
            plan.shared_intermediate, plan.n_group, plan.f32_out)
    want = (m, e, experts.num_experts, top_k, h, experts.intermediate, i2 // 2, n_group, f32_out)
    if made != want:
        raise ValueError(f"plan: made for (M, E, local E, top_k, H, I, Is, n_group, fp32 out) = {made}, called with "
                         f"{want}")
    check_expert_inputs(x, plan.ids, plan.topk_w, experts, None)  # x and the experts' layout and shapes
    fn = module("moe_block").fn(plan.entry)
    allow_dynamic_smem(fn, plan.smem)
    (wd, sd), (ws, ss) = plan.linears
    args = (x, np.int32(m), np.int32(h), gate_weight, np.int32(e), bias if bias is not None else np.uint64(0),
            shared_w13, np.int32(i2), shared_w2, experts.w13, np.int64(experts.w13[0].nbytes), experts.w2,
            np.int64(experts.w2[0].nbytes), np.int32(experts.num_experts), np.int32(experts.intermediate),
            np.int32(id_offset), np.int32(top_k), np.int32(n_group), np.int32(topk_group),
            np.int32(bool(norm_topk_prob)), np.float32(routed_scaling_factor), plan.logits, plan.hs, plan.ids,
            plan.topk_w, plan.shared, shared_out if shared_out is not None else np.uint64(0), plan.h, y,
            np.int32(wd), np.int32(sd), np.int32(ws), np.int32(ss))
    norm = residual_norm_args(residual, norm_weight, norm_eps, y, "moe_block_small")
    launch(fn, (plan.grid,), (_THREADS,), args + norm + pro + (plan.bar,), shared_mem=plan.smem, pdl=plan.pdl)
    if prologue is not None:
        return y, x, h_new
    return y if residual is None else (norm[3], norm[4])
