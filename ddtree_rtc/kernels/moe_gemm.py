"""Fused INT4 MoE experts on the GPU. See cuda_src/moe_gemm.cu and ddtree_rtc/model/int4_repack.py.

``moe_plan`` (host, once per shape) picks the launch shape and allocates every buffer;
``moe_experts`` with a plan and an ``out`` only launches kernels (no sync, no allocation), so it can
be captured in a CUDA graph: align -> gate_up (+ SiLU*up) [-> split-K reduce] -> down -> combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference.moe_gemm import check_experts_layout
from ..reference.moe_routing import MoEAlignment, align_capacity
from ._args import BF16, allow_dynamic_smem, check, out_array
from .moe_routing import alignment_buffers, moe_align
from .registry import module

ROWS_PER_CTA = 128  # 4 warps x 32 rows
TILE_K = 128
BLOCK_BYTES = 1152
STAGES = 4  # cp.async ring depth of cuda_src/moe_gemm.cu (kStages)
NT1_MAX_PAIRS_PER_EXPERT = 6.5  # above this mean, 8-pair blocks re-stream too many experts' weights
_COMBINE_COLS = 256 * 4
_MAX_GRID_Y = 65535


@dataclass
class MoEPlan:
    """Launch shape and device buffers for one (M, E, top_k, H, I)."""

    num_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    nt: int  # n8 token tiles per CTA: 1 (few pairs per expert) or 4
    split_gate_up: int
    split_down: int
    blocks_bound: int
    align: MoEAlignment
    h: object  # bf16 [P, I]
    part_gate_up: object  # fp32 [S, P, 2I] when split_gate_up > 1, else None
    part_down: object  # fp32 [S, P, H]

    @property
    def block(self) -> int:
        return 8 * self.nt

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pick_split(k: int, ctas: int, target: int, want: int | None, what: str) -> int:
    """Split-K factor: ``want`` if given (checked), else the smallest divisor of K/128 that brings
    the CTA count up to ``target``."""
    kb = k // TILE_K
    if want is not None:
        if want < 1 or kb % want:
            raise ValueError(f"{what}: split {want} must divide K/128 = {kb}")
        return want
    for d in _divisors(kb):
        if ctas * d >= target:
            return d
    return kb


def pick_nt(num_pairs: int, num_experts: int) -> int:
    """Token tile: 8-pair blocks (nt 1, the cheapest dequant) while the mean pairs per touched expert
    stays low; 32-pair blocks (nt 4) beyond, where 8-pair blocks would stream an expert's weights
    once per 8 pairs. Measured on the H200 at K2.6 dims: nt 1 is 91% of the read ceiling at M=256
    (5.3 pairs per expert) against 75% for nt 4; at M=1024 (21) nt 1 falls to 32% against 58%."""
    return 1 if num_pairs / min(num_experts, num_pairs) <= NT1_MAX_PAIRS_PER_EXPERT else 4


def stage_bytes(nt: int) -> int:
    """One ring stage: the CTA's 8 weight blocks + nt x 8 pairs x 128 k bf16 activations (the
    launches take STAGES of them: 45 KB for nt 1, 68 KB for nt 4)."""
    return 4 * 2 * BLOCK_BYTES + nt * 8 * TILE_K * 2


def _num_sms() -> int:
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def moe_plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
             split_gate_up: int | None = None, split_down: int | None = None, nt: int | None = None,
             num_sms: int | None = None) -> MoEPlan:
    """Plan one MoE shape: token tile (8 or 32 pairs per block), split-K of each GEMM (enough CTAs
    to cover the SMs when few experts are touched), and buffers."""
    import cupy

    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens} (M = 0 has nothing to route)")
    for name, v in (("hidden", hidden), ("intermediate", intermediate)):
        if v <= 0 or v % TILE_K:
            raise ValueError(f"{name} size {v} must be a positive multiple of {TILE_K} (the INT4 MoE k block)")
    p = num_tokens * top_k
    nt = nt if nt is not None else pick_nt(p, num_experts)
    if nt not in (1, 4):
        raise ValueError(f"nt must be 1 or 4, got {nt}")
    block = 8 * nt
    blocks_bound = align_capacity(p, num_experts, block) // block
    if blocks_bound > _MAX_GRID_Y:
        raise ValueError(f"{p} (token, expert) pairs need {blocks_bound} blocks > {_MAX_GRID_Y}; "
                         f"split the batch")
    busy = min(num_experts, p)  # experts touched at most
    target = int(1.5 * (num_sms or _num_sms()))
    n13, n2 = busy * -(-2 * intermediate // ROWS_PER_CTA), busy * -(-hidden // ROWS_PER_CTA)
    s13 = _pick_split(hidden, n13, target, split_gate_up, "gate_up")
    s2 = _pick_split(intermediate, n2, target, split_down, "down")
    return MoEPlan(
        num_tokens, num_experts, top_k, hidden, intermediate, nt, s13, s2, blocks_bound,
        alignment_buffers(p, num_experts, block),
        cupy.empty((p, intermediate), dtype=cupy.uint16),
        cupy.empty((s13, p, 2 * intermediate), dtype=cupy.float32) if s13 > 1 else None,
        cupy.empty((s2, p, hidden), dtype=cupy.float32))


def _check_experts(experts) -> None:
    check_experts_layout(experts, "mma")
    e, h, i = experts.num_experts, experts.hidden, experts.intermediate
    check("experts.w13", experts.w13, np.uint8, shape=(e, 2 * i // 16, h // TILE_K, BLOCK_BYTES))
    check("experts.w2", experts.w2, np.uint8, shape=(e, h // 16, i // TILE_K, BLOCK_BYTES))


def _gemm_fn(mod, entry: str, smem: int):
    """The entry, allowed ``smem`` bytes of dynamic shared memory (above 48 KB needs the opt-in)."""
    fn = mod.fn(entry)
    allow_dynamic_smem(fn, smem)
    return fn


def _aligned(name: str, a) -> None:
    if a.data.ptr % 16:
        raise ValueError(f"{name}: the kernels read 16-byte vectors; base address {a.data.ptr:#x} is not "
                         f"16-byte aligned (pass a fresh array, not an offset view)")


def moe_experts(x, topk_ids, topk_weights, experts, shared=None, out=None, plan: MoEPlan | None = None,
                check_ids: bool = True):
    """x [M, H] bf16, topk_ids int32 [M, k], topk_weights fp32 [M, k], experts (layout 'mma'),
    shared bf16 [M, H] or None (added to the output) -> y bf16 [M, H].
    ``check_ids`` validates the ids on the host (one sync); pass False for ids from ``moe_route``
    (always in range) and for graph capture; out-of-range pairs then contribute nothing."""
    _check_experts(experts)
    check("x", x, BF16, ndim=2)
    m, h = x.shape
    if m == 0:
        raise ValueError("x: M = 0 tokens; call moe_experts with at least one token")
    if h != experts.hidden:
        raise ValueError(f"x: expected [M, {experts.hidden}] (the experts' hidden size), got {tuple(x.shape)}")
    check("topk_ids", topk_ids, np.int32, ndim=2)
    top_k = topk_ids.shape[1]
    check("topk_ids", topk_ids, np.int32, shape=(m, top_k))
    check("topk_weights", topk_weights, np.float32, shape=(m, top_k))
    if shared is not None:
        check("shared", shared, BF16, shape=(m, h))
    _aligned("x", x)
    e, inter = experts.num_experts, experts.intermediate
    if plan is None:
        plan = moe_plan(m, e, top_k, h, inter)
    else:
        made = (plan.num_tokens, plan.num_experts, plan.top_k, plan.hidden, plan.intermediate)
        if made != (m, e, top_k, h, inter):
            raise ValueError(f"plan: made for (M, E, top_k, H, I) = {made}, called with {(m, e, top_k, h, inter)}")
    y = out_array("out", out, (m, h), BF16)
    _aligned("out", y)
    moe_align(topk_ids, e, plan.block, out=plan.align, check_ids=check_ids)
    moe_gate_up(x, experts, plan)
    moe_down(experts, plan)
    null = np.uint64(0)
    mod = module("moe_gemm")
    mod.fn("moe_combine_kernel")((-(-h // _COMBINE_COLS), m), (256,), (
        plan.part_down, np.int32(plan.split_down), topk_ids, topk_weights, np.int32(e), np.int32(top_k), np.int32(m),
        np.int32(h), shared if shared is not None else null, y))
    return y


# The two GEMM steps of moe_experts, also used on their own by the per-kernel benchmark. They read
# the routing from plan.align (filled by moe_align for the current topk_ids) and trust their inputs.

def _routing(plan: MoEPlan) -> tuple:
    al = plan.align
    return al.sorted_pairs, al.block_expert, al.num_blocks, np.int32(plan.num_pairs)


def moe_gate_up(x, experts, plan: MoEPlan) -> None:
    """gate_up GEMM of the routed pairs with SiLU(gate) * up -> plan.h (split-K: + the reduce)."""
    mod = module("moe_gemm")
    null = np.uint64(0)
    h, inter, s13 = plan.hidden, plan.intermediate, plan.split_gate_up
    n13 = -(-2 * inter // ROWS_PER_CTA)
    smem = STAGES * stage_bytes(plan.nt)
    entry = f"moe_gemm_nt{plan.nt}_{'h' if s13 == 1 else 'f32'}"
    _gemm_fn(mod, entry, smem)((n13 * s13, plan.blocks_bound), (ROWS_PER_CTA,), (
        experts.w13, np.int64(experts.w13[0].nbytes), x, np.int32(plan.top_k), *_routing(plan),
        np.int32(2 * inter), np.int32(h), np.int32(h // s13), np.int32(n13),
        plan.h if s13 == 1 else null, plan.part_gate_up if s13 > 1 else null), shared_mem=smem)
    if s13 > 1:
        p = plan.num_pairs
        mod.fn("moe_gate_up_reduce_kernel")((-(-p * inter // 256),), (256,), (
            plan.part_gate_up, np.int32(s13), np.int32(p), np.int32(inter), plan.h))


def moe_down(experts, plan: MoEPlan) -> None:
    """down GEMM of plan.h -> fp32 partials plan.part_down [split_down, P, H]."""
    mod = module("moe_gemm")
    h, inter, s2 = plan.hidden, plan.intermediate, plan.split_down
    n2 = -(-h // ROWS_PER_CTA)
    smem = STAGES * stage_bytes(plan.nt)
    _gemm_fn(mod, f"moe_gemm_nt{plan.nt}_f32", smem)((n2 * s2, plan.blocks_bound), (ROWS_PER_CTA,), (
        experts.w2, np.int64(experts.w2[0].nbytes), plan.h, np.int32(1), *_routing(plan), np.int32(h),
        np.int32(inter), np.int32(inter // s2), np.int32(n2), np.uint64(0), plan.part_down),
        shared_mem=smem)
