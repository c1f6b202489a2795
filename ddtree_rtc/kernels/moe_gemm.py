"""Fused INT4 MoE experts on the GPU. See cuda_src/moe_gemm.cu and ddtree_rtc/model/int4_repack.py.

``moe_plan`` (host, once per shape) picks the launch shape and allocates every buffer;
``moe_experts`` with a plan and an ``out`` only launches kernels (no sync, no allocation), so it can
be captured in a CUDA graph: align -> gate_up (+ SiLU*up) [-> split-K reduce] -> down -> combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference.moe_gemm import check_experts_layout
from ..reference.moe_routing import MoEAlignment
from ._args import BF16, allow_dynamic_smem, check, out_array
from ._launch import launch, pdl_supported, sm_count
from .moe_routing import alignment_buffers, moe_align
from .registry import module, spec

ROWS_PER_CTA = 128  # 4 warps x 32 rows
TILE_K = 128
BLOCK_BYTES = 1152
# Experts with more pairs than this get 32-pair (nt 4) blocks, decided per expert on the device by the
# align step; the others 8-pair (nt 1) blocks. An expert that needs two nt 1 blocks streams its
# weights twice and pays the (cheap, scale-after-mma) dequant twice; one nt 4 block streams them once
# and its bf16 dequant costs about two nt 1 dequants, so from 9 pairs on nt 4 does no more dequant
# work and halves the weight traffic through L2 and shared memory (the H200 sweep, `ddtree-rtc bench moe
# --sweep --nt4-above`, is the judge).
NT4_ABOVE = 8
# Programmatic dependent launches inside moe_experts (kernels/_launch.py; a plan's default where the
# GPU has them): the align, split-K reduce, down and combine launches start while the previous kernel
# drains, and the down GEMM's first weight stages are in flight before gate_up ends. Only on one
# stream (a plan with a side stream launches as before). The gate_up GEMM itself launches plainly:
# PDL there measured no steady gain (benchmarks/README.md, moe_gemm).
LARGE_BLOCK = 32  # pairs per block of the large list (nt 4)
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
    split_gate_up: int
    split_down: int
    align: MoEAlignment  # small list: nt 1 (8-pair) blocks, large list: nt 4 (32-pair) blocks
    h: object  # bf16 [P, I]
    part_gate_up: object  # fp32 [S, P, 2I] when split_gate_up > 1, else None
    part_down: object  # fp32 [S, P, H]
    stages: tuple[int, int]  # cp.async ring depth of the nt 1 and nt 4 GEMMs
    side: object = None  # with both lists: a second stream that runs the nt 4 launch beside the nt 1 one
    events: tuple = ()  # (fork, join) events of that side stream
    pdl: bool = False  # programmatic dependent launches (one stream only)

    def module(self):
        """The moe_gemm module built with this plan's ring depths."""
        params = {}
        if self.stages != default_stages():
            params.update(MOE_STAGES_NT1=self.stages[0], MOE_STAGES_NT4=self.stages[1])
        return module("moe_gemm", **params)

    def stages_of(self, nt: int) -> int:
        return self.stages[0 if nt == 1 else 1]

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def nt4_above(self) -> int:
        """Experts with more pairs than this run as nt 4 blocks (>= num_pairs: none)."""
        return self.align.large_above

    @property
    def tiles(self) -> str:
        """Which GEMM variants the plan launches: 'nt1', 'nt4' or 'nt1+nt4>T' (per expert: nt 4
        above T pairs)."""
        al = self.align
        if al.large_capacity == 0:
            return "nt1"
        return "nt4" if al.small_capacity == 0 else f"nt1+nt4>{al.large_above}"


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


def pick_nt4_above(num_tokens: int, top_k: int, nt: int | None, nt4_above: int | None) -> int:
    """The align threshold: nt 1 forced -> every expert in 8-pair blocks (threshold = all pairs);
    nt 4 forced -> every expert in 32-pair blocks (0); else ``nt4_above`` (default NT4_ABOVE), and
    no nt 4 list (nor its launches) while the batch has too few tokens for an expert to exceed it
    (ids from moe_route name an expert at most once per token; with repeats such an expert simply
    takes several nt 1 blocks)."""
    p = num_tokens * top_k
    if nt is not None:
        if nt4_above is not None:
            raise ValueError("give nt (one tile for every expert) or nt4_above (per expert), not both")
        if nt not in (1, 4):
            raise ValueError(f"nt must be 1 or 4, got {nt}")
        return p if nt == 1 else 0
    t = NT4_ABOVE if nt4_above is None else nt4_above
    if t < 0:
        raise ValueError(f"nt4_above must be >= 0, got {t}")
    return t if num_tokens > t else p


def stage_bytes(nt: int) -> int:
    """One ring stage: the CTA's 8 weight blocks + nt x 8 pairs x 128 k bf16 activations (11.3 KB
    for nt 1, 17.2 KB for nt 4); a launch takes the plan's ring depth of them."""
    return 4 * 2 * BLOCK_BYTES + nt * 8 * TILE_K * 2


def default_stages() -> tuple[int, int]:
    """The ring depths cuda_src/moe_gemm.cu is built with by default (nt 1, nt 4): shallow rings, since
    deeper ones take shared memory per CTA and so CTAs per SM (H200 sweeps: benchmarks/README.md); the
    parameter stays for other GPUs' sweeps."""
    p = spec("moe_gemm").params
    return p["MOE_STAGES_NT1"], p["MOE_STAGES_NT4"]


def moe_plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
             split_gate_up: int | None = None, split_down: int | None = None, nt: int | None = None,
             num_sms: int | None = None, nt4_above: int | None = None,
             stages: tuple[int, int] | None = None, concurrent: bool | None = None,
             pdl: bool | None = None) -> MoEPlan:
    """Plan one MoE shape: token tiles (by default per expert on the device: 8-pair blocks for
    experts with at most ``nt4_above`` pairs, 32-pair blocks beyond; ``nt`` 1 or 4 forces one tile
    for all), split-K of each GEMM (enough CTAs to cover the SMs when few experts are touched), and
    buffers. ``stages`` (nt 1, nt 4) overrides the GEMMs' cp.async ring depths (2..16; 0 = default).
    ``concurrent`` (default on): with both block lists, the nt 4 and nt 1 launches of each
    GEMM run on two streams (forked and joined by events, so a CUDA graph captures them as two
    branches) and share the SMs: the compute-bound 32-pair blocks beside the byte-bound 8-pair ones.
    ``pdl`` (default on, on GPUs that have it): programmatic dependent launches of moe_experts'
    kernels, for a plan without the side stream (asking for both is an error). Turning either off
    gives the plain single-stream schedule (the tests' control; the same outputs)."""
    import cupy

    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens} (M = 0 has nothing to route)")
    for name, v in (("hidden", hidden), ("intermediate", intermediate)):
        if v <= 0 or v % TILE_K:
            raise ValueError(f"{name} size {v} must be a positive multiple of {TILE_K} (the INT4 MoE k block)")
    stages = (0, 0) if stages is None else tuple(int(v) for v in stages)
    if len(stages) != 2 or any(v and not 2 <= v <= 16 for v in stages):
        raise ValueError(f"stages={stages}: expected (nt1, nt4) ring depths in 2..16 (0 = default)")
    stages = tuple(v or d for v, d in zip(stages, default_stages()))
    p = num_tokens * top_k
    align = alignment_buffers(p, num_experts, 8, LARGE_BLOCK,
                              pick_nt4_above(num_tokens, top_k, nt, nt4_above))
    for what, n in (("8-pair", align.small_blocks), (f"{align.large_block}-pair", align.large_blocks)):
        if n > _MAX_GRID_Y:
            raise ValueError(f"{p} (token, expert) pairs need up to {n} {what} blocks > {_MAX_GRID_Y}; "
                             f"split the batch")
    busy = min(num_experts, p)  # experts touched at most
    target = int(1.5 * (num_sms or sm_count()))
    n13, n2 = busy * -(-2 * intermediate // ROWS_PER_CTA), busy * -(-hidden // ROWS_PER_CTA)
    s13 = _pick_split(hidden, n13, target, split_gate_up, "gate_up")
    s2 = _pick_split(intermediate, n2, target, split_down, "down")
    plan = MoEPlan(
        num_tokens, num_experts, top_k, hidden, intermediate, s13, s2, align,
        cupy.empty((p, intermediate), dtype=cupy.uint16),
        cupy.empty((s13, p, 2 * intermediate), dtype=cupy.float32) if s13 > 1 else None,
        cupy.empty((s2, p, hidden), dtype=cupy.float32), stages)
    if concurrent is not False and align.large_capacity and align.small_capacity:
        plan.side = cupy.cuda.Stream(non_blocking=True)
        plan.events = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
    if pdl and plan.side is not None:
        raise ValueError("pdl=True with the concurrent side stream: programmatic launches need one stream "
                         "(pass concurrent=False)")
    plan.pdl = pdl is not False and plan.side is None and pdl_supported()
    return plan


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


def check_expert_inputs(x, topk_ids, topk_weights, experts, shared) -> tuple[int, int, int]:
    """The checks every expert kernel's wrapper makes on its inputs; returns (M, H, top_k)."""
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
    return m, h, top_k


def moe_experts(x, topk_ids, topk_weights, experts, shared=None, out=None, plan: MoEPlan | None = None,
                check_ids: bool = True):
    """x [M, H] bf16, topk_ids int32 [M, k], topk_weights fp32 [M, k], experts (layout 'mma'),
    shared bf16 [M, H] or None (added to the output) -> y bf16 [M, H] (or fp32, unrounded, when
    ``out`` is an fp32 array: a tensor-parallel partial sum).
    ``check_ids`` validates the ids on the host (one sync); pass False for ids from ``moe_route``
    (always in range) and for graph capture; out-of-range pairs then contribute nothing."""
    m, h, top_k = check_expert_inputs(x, topk_ids, topk_weights, experts, shared)
    _aligned("x", x)
    e, inter = experts.num_experts, experts.intermediate
    if plan is None:
        plan = moe_plan(m, e, top_k, h, inter)
    else:
        made = (plan.num_tokens, plan.num_experts, plan.top_k, plan.hidden, plan.intermediate)
        if made != (m, e, top_k, h, inter):
            raise ValueError(f"plan: made for (M, E, top_k, H, I) = {made}, called with {(m, e, top_k, h, inter)}")
    f32_out = out is not None and out.dtype == np.float32
    y = out_array("out", out, (m, h), np.float32 if f32_out else BF16)
    _aligned("out", y)
    al = plan.align
    moe_align(topk_ids, e, al.block, out=al, check_ids=check_ids, large_block=al.large_block,
              large_above=al.large_above, pdl=plan.pdl)
    moe_gate_up(x, experts, plan)
    moe_down(experts, plan)
    null = np.uint64(0)
    mod = plan.module()
    launch(mod.fn("moe_combine_f32_kernel" if f32_out else "moe_combine_kernel"), (-(-h // _COMBINE_COLS), m), (256,), (
        plan.part_down, np.int32(plan.split_down), topk_ids, topk_weights, np.int32(e), np.int32(top_k), np.int32(m),
        np.int32(h), shared if shared is not None else null, y), pdl=plan.pdl)
    return y


# The two GEMM steps of moe_experts, also used on their own by the per-kernel benchmark. They read
# the routing from plan.align (filled by moe_align for the current topk_ids) and trust their inputs.
# Each launches the nt 1 variant over the small block list and the nt 4 variant over the large one
# (a list of capacity 0 is not launched); the two write disjoint pairs.

def _lists(plan: MoEPlan):
    """(kernel, n-tiles per block, grid y bound, sorted_pairs, block_expert, num_blocks) of each
    non-empty block list; kernel is the entry's stem ("nt1" or "nt4")."""
    al = plan.align
    cs, bs = al.small_capacity, al.small_blocks
    out = []
    if al.large_capacity:
        out.append(("nt4", al.large_block // 8, al.large_blocks, al.sorted_pairs[cs:], al.block_expert[bs:],
                    al.num_blocks[1:]))
    if cs:
        out.append(("nt1", 1, bs, al.sorted_pairs[:cs], al.block_expert[:bs], al.num_blocks[:1]))
    return out


def _streams(plan: MoEPlan, n: int):
    """The stream of each of the n launches of a GEMM step: with a side stream and both lists, the
    first (nt 4) on the side stream, forked from the current one; ``_join`` ends the fork."""
    import cupy

    cur = cupy.cuda.get_current_stream()
    if plan.side is None or n < 2:
        return [cur] * n
    plan.events[0].record(cur)
    plan.side.wait_event(plan.events[0])
    return [plan.side] + [cur] * (n - 1)


def _join(plan: MoEPlan, n: int) -> None:
    import cupy

    if plan.side is not None and n >= 2:
        plan.events[1].record(plan.side)
        cupy.cuda.get_current_stream().wait_event(plan.events[1])


def moe_gate_up(x, experts, plan: MoEPlan) -> None:
    """gate_up GEMM of the routed pairs with SiLU(gate) * up -> plan.h (split-K: + the reduce)."""
    mod = plan.module()
    null = np.uint64(0)
    h, inter, s13 = plan.hidden, plan.intermediate, plan.split_gate_up
    n13 = -(-2 * inter // ROWS_PER_CTA)
    lists = _lists(plan)
    for (kern, nt, bound, pairs, experts_of, count), stream in zip(lists, _streams(plan, len(lists))):
        smem = plan.stages_of(nt) * stage_bytes(nt)
        entry = f"moe_gemm_{kern}_{'h' if s13 == 1 else 'f32'}"
        launch(_gemm_fn(mod, entry, smem), (n13 * s13, bound), (ROWS_PER_CTA,), (
            experts.w13, np.int64(experts.w13[0].nbytes), x, np.int32(plan.top_k), pairs, experts_of, count,
            np.int32(plan.num_pairs), np.int32(2 * inter), np.int32(h), np.int32(h // s13), np.int32(n13),
            plan.h if s13 == 1 else null, plan.part_gate_up if s13 > 1 else null), shared_mem=smem,
            stream=stream)  # never PDL (see PDL above); the kernel still triggers the next launch
    _join(plan, len(lists))
    if s13 > 1:
        p = plan.num_pairs
        launch(mod.fn("moe_gate_up_reduce_kernel"), (-(-p * inter // 256),), (256,), (
            plan.part_gate_up, np.int32(s13), np.int32(p), np.int32(inter), plan.h), pdl=plan.pdl)


def moe_down(experts, plan: MoEPlan) -> None:
    """down GEMM of plan.h -> fp32 partials plan.part_down [split_down, P, H]."""
    mod = plan.module()
    h, inter, s2 = plan.hidden, plan.intermediate, plan.split_down
    n2 = -(-h // ROWS_PER_CTA)
    lists = _lists(plan)
    for (kern, nt, bound, pairs, experts_of, count), stream in zip(lists, _streams(plan, len(lists))):
        smem = plan.stages_of(nt) * stage_bytes(nt)
        # nt1_down reads the block lists (the align step's, two or more launches back) and starts
        # its weight copies before the PDL wait (see moe_gemm.cu)
        entry = "moe_gemm_nt1_down" if nt == 1 else f"moe_gemm_{kern}_f32"
        launch(_gemm_fn(mod, entry, smem), (n2 * s2, bound), (ROWS_PER_CTA,), (
            experts.w2, np.int64(experts.w2[0].nbytes), plan.h, np.int32(1), pairs, experts_of, count,
            np.int32(plan.num_pairs), np.int32(h), np.int32(inter), np.int32(inter // s2), np.int32(n2),
            np.uint64(0), plan.part_down), shared_mem=smem, stream=stream, pdl=plan.pdl)
    _join(plan, len(lists))

