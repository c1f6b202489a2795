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
from ._args import BF16, check, out_array
from .moe_routing import alignment_buffers, moe_align
from .registry import module

ROWS_PER_CTA = 128  # 4 warps x 32 rows
TILE_K = 128
BLOCK_BYTES = 1152
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
    nt: int  # n8 token tiles per CTA: 1 (M <= 8) or 4
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
    nt = nt if nt is not None else (1 if num_tokens <= 8 else 4)
    if nt not in (1, 4):
        raise ValueError(f"nt must be 1 or 4, got {nt}")
    p = num_tokens * top_k
    block = 8 * nt
    blocks_bound = align_capacity(p, num_experts, block) // block
    if blocks_bound > _MAX_GRID_Y:
        raise ValueError(f"{p} (token, expert) pairs need {blocks_bound} blocks > {_MAX_GRID_Y}; "
                         f"split the batch")
    busy = min(num_experts, p)  # experts touched at most
    target = int(1.5 * (num_sms or _num_sms()))
    s13 = _pick_split(hidden, busy * -(-2 * intermediate // ROWS_PER_CTA), target, split_gate_up, "gate_up")
    s2 = _pick_split(intermediate, busy * -(-hidden // ROWS_PER_CTA), target, split_down, "down")
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
    p = m * top_k
    al = moe_align(topk_ids, e, plan.block, out=plan.align, check_ids=check_ids)
    mod = module("moe_gemm")
    null = np.uint64(0)
    s13, s2 = plan.split_gate_up, plan.split_down
    n13, n2 = -(-2 * inter // ROWS_PER_CTA), -(-h // ROWS_PER_CTA)
    routing = (al.sorted_pairs, al.block_expert, al.num_blocks, np.int32(p))
    w13_bytes = np.int64(experts.w13[0].nbytes)
    w2_bytes = np.int64(experts.w2[0].nbytes)
    entry = f"moe_gemm_nt{plan.nt}_{'h' if s13 == 1 else 'f32'}"
    mod.fn(entry)((n13 * s13, plan.blocks_bound), (ROWS_PER_CTA,), (
        experts.w13, w13_bytes, x, np.int32(top_k), *routing, np.int32(2 * inter), np.int32(h),
        np.int32(h // s13), np.int32(n13), plan.h if s13 == 1 else null,
        plan.part_gate_up if s13 > 1 else null))
    if s13 > 1:
        mod.fn("moe_gate_up_reduce_kernel")((-(-p * inter // 256),), (256,), (
            plan.part_gate_up, np.int32(s13), np.int32(p), np.int32(inter), plan.h))
    mod.fn(f"moe_gemm_nt{plan.nt}_f32")((n2 * s2, plan.blocks_bound), (ROWS_PER_CTA,), (
        experts.w2, w2_bytes, plan.h, np.int32(1), *routing, np.int32(h), np.int32(inter),
        np.int32(inter // s2), np.int32(n2), null, plan.part_down))
    mod.fn("moe_combine_kernel")((-(-h // _COMBINE_COLS), m), (256,), (
        plan.part_down, np.int32(s2), topk_ids, topk_weights, np.int32(e), np.int32(top_k), np.int32(m),
        np.int32(h), shared if shared is not None else null, y))
    return y
