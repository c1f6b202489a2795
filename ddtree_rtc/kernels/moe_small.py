"""Row-invariant INT4 MoE experts for M <= 64 tokens: the small-M path's expert step
(cuda_src/moe_small.cu). Same signature and numbers as ``moe_gemm.moe_experts`` (the numpy twin is
that reference), chained under PDL — gate_up, then down + combine (up to 16 tokens), or down, then
combine (from 17) — with no align step, no split-K reduce and no atomic sums, and a token's output the
same bits whatever M and whatever the other tokens are (both downs compute a value the same way).

``moe_small_plan`` (host, once per shape) allocates the buffers (h; from 17 tokens the down values d)
and checks the limits;
``moe_small_experts`` with a plan and an ``out`` only launches, so it can be captured in a CUDA graph.
``moe_small_dense`` is the layer's dense part (router logits and the shared expert's SiLU(gate) * up)
in one row-invariant launch; ``moe_small_route_shared`` the routing and the shared expert's down
projection, which follow it, in one more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference.moe_small import check_route_shared, check_small_shape
from ._args import BF16, allow_dynamic_smem, check, out_array
from ._launch import launch, pdl_supported, sm_count
from .linear import bucket_grid, invariant_plan, pair_plan, token_bucket
from .moe_gemm import check_expert_inputs
from .moe_routing import check_ids_in_range
from .registry import module, spec

BLOCK_BYTES = 1152
_THREADS = 256
_WARPS = 8
_CTAS_PER_SM = 2  # __launch_bounds__(256, 2): the grids are one wave of CTAs looping over their items
GATE_UP_T2_TOKENS = 17  # from this M on moe_small_gate_up_t2: 2 fused tiles per item (one x load for both)
_GU_PASS_NT = 4  # moe_small_gate_up's column tiles per pass at most (gu_pass_nt: 2 for two tiles per item)
# the warps' partial sums of a column pass at the most tiles an item holds: [warp][tile][nt][lane] float4
_GATE_UP_RED_BYTES = _WARPS * 2 * _GU_PASS_NT * 32 * 16
MAX_DENSE_TOKENS = 64
_STATIC_SMEM = 18576  # moe_small_down's static shared memory (the routing; `kernels build` lists it)
_STATIC_SMEM_X = 17040  # moe_small_down_x's
_STAGE_BYTES = 36864  # moe_small_down_x's staged h rows of one segment (kStageBytes)
DOWN_X_TOKENS = 17  # from this M on moe_small_down_x + moe_small_combine (faster from 17 rows on an H100)


def stages() -> int:
    """The per-warp cp.async ring depth cuda_src/moe_small.cu is built with."""
    return spec("moe_small").params["MOE_SMALL_STAGES"]


def ring_bytes() -> int:
    return _WARPS * stages() * BLOCK_BYTES


def gate_up_tiles(num_tokens: int) -> int:
    """Fused 16-row tiles per moe_small_gate_up item at M tokens (the values do not depend on it)."""
    return 2 if num_tokens >= GATE_UP_T2_TOKENS else 1


def gate_up_smem(tiles: int) -> int:
    """Its rings (stages of ``tiles`` weight blocks), at least the partial sums' bytes."""
    return max(tiles * ring_bytes(), _GATE_UP_RED_BYTES)


def down_smem(num_pairs: int) -> int:
    """moe_small_down's: the rings plus the fp32 down values of every pair for the CTA's 16 rows."""
    return ring_bytes() + num_pairs * 16 * 4


def experts_launches(num_tokens: int) -> int:
    """Kernel launches of ``moe_small_experts`` at M tokens: gate_up, then down + combine, or from
    DOWN_X_TOKENS gate_up, down and combine."""
    return 3 if num_tokens >= DOWN_X_TOKENS else 2


def down_x_smem() -> int:
    """moe_small_down_x's: the rings plus one segment's staged h rows."""
    return ring_bytes() + _STAGE_BYTES


@dataclass
class MoESmallPlan:
    """Shape and buffer of one small-M expert step."""

    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    h: object  # bf16 [P, I]
    d: object = None  # fp32 [P, H]: the down values of every pair (from DOWN_X_TOKENS tokens)
    pdl: bool = False

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k


def _check_smem(num_tokens: int, num_pairs: int, smem_per_block: int) -> None:
    x = num_tokens >= DOWN_X_TOKENS
    need = down_x_smem() + _STATIC_SMEM_X if x else down_smem(num_pairs) + _STATIC_SMEM
    if need > smem_per_block:
        raise ValueError(f"moe_small: {num_pairs} pairs need {need} B of shared memory per block in "
                         f"{'moe_small_down_x' if x else 'moe_small_down'}, this GPU allows {smem_per_block}")


def moe_small_plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                   pdl: bool | None = None) -> MoESmallPlan:
    """Plan one shape (M <= 64, M * top_k <= 1024). ``pdl`` (default: where the GPU has it):
    programmatic dependent launches of both kernels."""
    import cupy

    check_small_shape(num_tokens, num_experts, top_k, hidden, intermediate)
    p = num_tokens * top_k
    _check_smem(num_tokens, p, cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    return MoESmallPlan(num_tokens, num_experts, top_k, hidden, intermediate,
                        cupy.empty((p, intermediate), dtype=cupy.uint16),
                        cupy.empty((p, hidden), dtype=cupy.float32) if num_tokens >= DOWN_X_TOKENS else None,
                        (True if pdl is None else pdl) and pdl_supported())


def moe_small_experts(x, topk_ids, topk_weights, experts, shared=None, out=None, plan: MoESmallPlan | None = None,
                      check_ids: bool = True, id_offset: int = 0):
    """x [M, H] bf16 (M <= 64), topk_ids int32 [M, k], topk_weights fp32 [M, k], experts (layout
    'mma'), shared bf16 [M, H] or None -> y bf16 [M, H] (fp32 unrounded when ``out`` is fp32).
    Expert e is ``experts``' e - ``id_offset`` (an expert shard's first expert: the router's ids
    are taken as they come, no subtraction launch); pairs outside the shard contribute nothing
    (``check_ids`` raises on them instead, with one host sync). Every row's value is independent
    of M and of the other rows."""
    m, h, top_k = check_expert_inputs(x, topk_ids, topk_weights, experts, shared)
    e, inter = experts.num_experts, experts.intermediate
    f32_out = out is not None and out.dtype == np.float32
    y = out_array("out", out, (m, h), np.float32 if f32_out else BF16)
    if plan is None:
        plan = moe_small_plan(m, e, top_k, h, inter)
    made = (plan.num_tokens, plan.num_experts, plan.top_k, plan.hidden, plan.intermediate)
    if made != (m, e, top_k, h, inter):
        raise ValueError(f"plan: made for (M, E, top_k, H, I) = {made}, called with {(m, e, top_k, h, inter)}")
    if check_ids:
        check_ids_in_range(topk_ids - np.int32(id_offset) if id_offset else topk_ids, e)
    mod = module("moe_small")
    p = m * top_k
    wave = _CTAS_PER_SM * sm_count(x.device.id)
    launch_gate_up(x, topk_ids, experts, plan.h, gate_up_tiles(m), id_offset, plan.pdl)
    sh = shared if shared is not None else np.uint64(0)
    if m >= DOWN_X_TOKENS:
        down = mod.fn("moe_small_down_x")
        allow_dynamic_smem(down, down_x_smem())
        launch(down, (wave,), (_THREADS,), (
            experts.w2, np.int64(experts.w2[0].nbytes), plan.h, topk_ids, np.int32(id_offset), np.int32(m),
            np.int32(top_k), np.int32(e), np.int32(h), np.int32(inter), plan.d), shared_mem=down_x_smem(),
            pdl=plan.pdl)
        launch(mod.fn("moe_small_combine"), (min(4 * wave, -(-m * h // _THREADS)),), (_THREADS,), (
            topk_ids, np.int32(id_offset), topk_weights, plan.d, np.int32(m), np.int32(top_k), np.int32(e),
            np.int32(h), sh, y, np.int32(f32_out)), pdl=plan.pdl)
        return y
    down = mod.fn("moe_small_down")
    allow_dynamic_smem(down, down_smem(p))
    launch(down, (min(wave, h // 16),), (_THREADS,), (
        experts.w2, np.int64(experts.w2[0].nbytes), plan.h, topk_ids, np.int32(id_offset), topk_weights,
        np.int32(m), np.int32(top_k),
        np.int32(e), np.int32(h), np.int32(inter), sh, y, np.int32(f32_out)), shared_mem=down_smem(p), pdl=plan.pdl)
    return y


def launch_gate_up(x, topk_ids, experts, h, tiles: int, id_offset: int = 0, pdl: bool = False) -> None:
    """moe_small_experts' first launch: h [M * k, I] bf16 (uint16) = bf16(silu(gate) * up) of every pair
    whose id less ``id_offset`` is in [0, E) (other rows untouched), by moe_small_gate_up with ``tiles``
    fused 16-row tiles per item (moe_small_experts takes gate_up_tiles(M); the values do not depend on
    it, which the GPU tests check bitwise). Inputs as moe_small_experts takes them, unchecked."""
    m, top_k = topk_ids.shape
    e, hid, inter = experts.num_experts, experts.hidden, experts.intermediate
    if tiles not in (1, 2):
        raise ValueError(f"tiles: {tiles} fused tiles per item; moe_small_gate_up has 1 or 2")
    up = module("moe_small").fn("moe_small_gate_up" if tiles == 1 else f"moe_small_gate_up_t{tiles}")
    allow_dynamic_smem(up, gate_up_smem(tiles))
    wave = _CTAS_PER_SM * sm_count(x.device.id)
    launch(up, (min(wave, min(e, m * top_k) * (2 * inter // 16 // tiles)),), (_THREADS,), (
        experts.w13, np.int64(experts.w13[0].nbytes), x, topk_ids, np.int32(id_offset), np.int32(m),
        np.int32(top_k), np.int32(e), np.int32(hid), np.int32(inter), h), shared_mem=gate_up_smem(tiles), pdl=pdl)


def moe_small_dense(x, gate_weight, shared_w13, out_logits=None, out_hs=None):
    """The MoE layer's dense part in one launch (moe_small_dense_m*_s*: cuda_src/include/skinny_pair.cuh,
    MODE 0): x [M, H]
    bf16 (M <= 64), gate_weight bf16 [E, H] (E % 8 == 0), shared_w13 bf16 [2 Is, H] = [gate; up]
    (Is % 4 == 0) -> (router logits fp32 [M, E], bf16(silu(bf16(x gate^T)) * bf16(x up^T)) [M, Is]).
    K split planned from the shapes and the GPU alone: every row's values independent of M."""
    check("x", x, BF16, ndim=2)
    m, h = x.shape
    check("gate_weight", gate_weight, BF16, ndim=2)
    e = gate_weight.shape[0]
    check("gate_weight", gate_weight, BF16, shape=(e, h))
    check("shared_w13", shared_w13, BF16, ndim=2)
    i2 = shared_w13.shape[0]
    check("shared_w13", shared_w13, BF16, shape=(i2, h))
    if not 1 <= m <= MAX_DENSE_TOKENS:
        raise ValueError(f"moe_small_dense: M = {m} tokens outside 1..{MAX_DENSE_TOKENS}")
    if e % 8 or i2 % 8 or h % 8:
        raise ValueError(f"moe_small_dense: E = {e} and 2 Is = {i2} must be multiples of 8, H = {h} of 8")
    for name, a in (("x", x), ("gate_weight", gate_weight), ("shared_w13", shared_w13)):
        if a.data.ptr % 16:
            raise ValueError(f"{name}: the kernel reads 16-byte vectors; base address {a.data.ptr:#x} is not "
                             f"16-byte aligned")
    logits = out_array("out_logits", out_logits, (m, e), np.float32)
    hs = out_array("out_hs", out_hs, (m, i2 // 2), BF16)
    # (warps_n, split) from the shapes and the GPU alone (the invariant linears' plan, moved where its
    # clusters would not fit in one wave); M only picks the entry's token rows (include/skinny_pair.cuh:
    # a row's sums are the same in every bucket)
    plan = pair_plan(e + i2, h, x.device.id, "moe_small", "moe_small_dense")
    mt = token_bucket(m, "moe_small_dense")
    grid = bucket_grid(e + i2, plan.warps_n, plan.split, mt)
    launch(module("moe_small").fn(f"moe_small_dense_m{mt}_s{plan.split}"), (grid,), (_THREADS,), (
        x, gate_weight, shared_w13, logits, hs, np.int32(m), np.int32(e), np.int32(i2), np.int32(h),
        np.int32(plan.warps_n)), pdl=pdl_supported())
    return logits, hs


@dataclass(frozen=True)
class RouteSharedPlan:
    """One moe_small_route_shared launch: ``route_ctas`` CTAs of routing (a warp per token, a whole
    number of the linear's clusters), then the shared down's own invariant-linear grid."""

    entry: str
    route_ctas: int
    grid: int  # route_ctas + the linear's CTAs
    warps_n: int
    split: int


def route_shared_plan(num_tokens: int, hidden: int, shared_intermediate: int, sms: int,
                      f32: bool = False) -> RouteSharedPlan:
    """The shared down's plan is ``linear.invariant_plan``'s for its shape (the same tiles, split and
    grid as its own launch, so the same bits); the routing CTAs go first, rounded up to whole clusters,
    so that each cluster does one or the other and the linear's CTAs keep their cluster ranks."""
    mt = token_bucket(num_tokens, "moe_small_route_shared")
    lin = invariant_plan(num_tokens, hidden, shared_intermediate, sms, f32)
    route = -(-num_tokens // _WARPS)
    route = -(-route // lin.split) * lin.split
    entry = (f"moe_small_route_shared_m{mt}_f32_s{lin.split}" if f32 else
             f"moe_small_route_shared_m{mt}_s{lin.split}")
    return RouteSharedPlan(entry, route, route + lin.grid, lin.warps_n, lin.split)


def route_shared_smem(num_experts: int, n_group: int) -> int:
    """Its dynamic shared memory: the routing's per warp (group scores when grouped, and the merge
    path's unbiased scores), as moe_route_e* takes it."""
    return _WARPS * num_experts * 4 * ((n_group > 1) + 1)


def moe_small_route_shared(logits, bias, hs, shared_w2, top_k: int, n_group: int = 1, topk_group: int = 1,
                           norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, out_ids=None,
                           out_weights=None, out=None):
    """``moe_route`` (merge selection) and ``linear(hs, shared_w2, out=out, impl="invariant")`` in one
    launch (moe_small_route_shared_m*_s*, cuda_src/moe_small.cu): logits fp32 [M, E] (E <= 384), bias
    fp32 [E] or None, hs bf16 [M, Is] (Is % 8 == 0), shared_w2 bf16 [H, Is] -> (ids int32 [M, top_k],
    weights fp32 [M, top_k], shared [M, H] bf16, or fp32 unrounded when ``out`` is fp32). The bits of
    both are those of their own launches."""
    check("logits", logits, np.float32, ndim=2)
    m, e = logits.shape
    check("shared_w2", shared_w2, BF16, ndim=2)
    h, inter = shared_w2.shape
    check_route_shared(m, e, top_k, n_group, topk_group, h, inter)
    if bias is not None:
        check("bias", bias, np.float32, shape=(e,))
    check("hs", hs, BF16, shape=(m, inter))
    for name, a in (("hs", hs), ("shared_w2", shared_w2)):
        if a.data.ptr % 16:
            raise ValueError(f"{name}: the kernel reads 16-byte vectors; base address {a.data.ptr:#x} is not "
                             f"16-byte aligned")
    ids = out_array("out_ids", out_ids, (m, top_k), np.int32)
    w = out_array("out_weights", out_weights, (m, top_k), np.float32)
    f32 = out is not None and out.dtype == np.float32
    y = out_array("out", out, (m, h), np.float32 if f32 else BF16)
    plan = route_shared_plan(m, h, inter, sm_count(logits.device.id), f32)
    fn = module("moe_small").fn(plan.entry)
    smem = route_shared_smem(e, n_group)
    allow_dynamic_smem(fn, smem)
    pdl = pdl_supported()  # as moe_route and the invariant linear: the weights go to L2 before the wait
    launch(fn, (plan.grid,), (_THREADS,), (
        logits, bias if bias is not None else np.uint64(0), np.int32(m), np.int32(e), np.int32(top_k),
        np.int32(n_group), np.int32(topk_group), np.int32(bool(norm_topk_prob)), np.float32(routed_scaling_factor),
        np.int32(1), ids, w, np.int32(plan.route_ctas), hs, shared_w2, y, np.int32(h), np.int32(inter),
        np.int32(plan.warps_n), np.int32(pdl)), shared_mem=smem, pdl=pdl)
    return ids, w, y
