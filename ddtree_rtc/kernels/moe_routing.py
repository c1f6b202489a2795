"""MoE routing on the GPU: router logits (cuBLAS, fp32 out), noaux_tc top-k and the align step.
See cuda_src/moe_routing.cu; rules in ddtree_rtc/reference/moe_routing.py."""

from __future__ import annotations

import numpy as np

from ..reference.moe_routing import MAX_EXPERTS, MoEAlignment, align_args, align_capacities, check_route_args
from . import _cublas
from ._args import BF16, check, out_array
from ._launch import launch, pdl_supported
from .registry import module

_ROUTE_WARPS = 4
_ROUTE_ENTRIES = (64, 128, 256, 384, 512, 1024)  # moe_route_e<N>: experts held in registers per warp
_ALIGN_WARPS = 8
# Pairs staged in shared memory (32 KB; with 2E + 2 ints for E <= 1024 the total stays under the
# 48 KB that needs no opt-in); beyond, the kernel reads the ids from global memory.
_ALIGN_SMEM_IDS_MAX = 8192

_ALPHA = np.ones(1, dtype=np.float32)  # host scalars; module-level so the pointers stay valid
_BETA = np.zeros(1, dtype=np.float32)


def router_logits(x, weight, out=None):
    """x [M, H] bf16, weight [E, H] bf16 or fp32 -> fp32 logits [M, E] (cuBLAS gemmEx, fp32 accumulate).
    An fp32 router (checkpoints saved from an fp32 model) multiplies x widened to fp32, exactly."""
    import cupy

    check("x", x, BF16, ndim=2)
    h = x.shape[1]
    if weight.dtype == np.float32:
        check("weight", weight, np.float32, shape=(None, h))
        x = (x.astype(cupy.uint32) << 16).view(cupy.float32)
        in_type = _cublas.R_32F
    else:
        check("weight", weight, BF16, shape=(None, h))
        in_type = _cublas.R_16BF
    m, e = x.shape[0], weight.shape[0]
    y = out_array("out", out, (m, e), np.float32)
    if m == 0:
        return y
    _cublas.gemm_ex(_cublas.OP_T, _cublas.OP_N, e, m, h,
                    _ALPHA.ctypes.data, weight.data.ptr, in_type, h, x.data.ptr, in_type, h,
                    _BETA.ctypes.data, y.data.ptr, _cublas.R_32F, e, _cublas.COMPUTE_32F, _cublas.GEMM_DEFAULT)
    return y


def moe_route(logits, bias, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0, out_ids=None, out_weights=None, selection: str = "merge"):
    """logits fp32 [M, E], bias fp32 [E] or None -> (ids int32 [M, top_k], weights fp32 [M, top_k]).
    ``selection``: "merge" (top_k <= 8: a per-lane sort and a butterfly merge; larger top_k scans) or
    "scan" (top_k rounds of a warp-wide max); the same bits either way (tests compare them)."""
    if selection not in ("merge", "scan"):
        raise ValueError(f"selection must be 'merge' or 'scan', got {selection!r}")
    check("logits", logits, np.float32, ndim=2)
    m, e = logits.shape
    check_route_args(e, top_k, n_group, topk_group)
    if bias is not None:
        check("bias", bias, np.float32, shape=(e,))
    ids = out_array("out_ids", out_ids, (m, top_k), np.int32)
    w = out_array("out_weights", out_weights, (m, top_k), np.float32)
    if m == 0:
        return ids, w
    grid = (-(-m // _ROUTE_WARPS),)
    args = (logits, bias if bias is not None else np.uint64(0), np.int32(m), np.int32(e), np.int32(top_k),
            np.int32(n_group), np.int32(topk_group), np.int32(bool(norm_topk_prob)),
            np.float32(routed_scaling_factor), np.int32(selection == "merge"), ids, w)
    cap = next(c for c in _ROUTE_ENTRIES if c >= e)
    # under PDL where the GPU has it: the kernel waits before it reads the logits (cuda_src/moe_routing.cu)
    launch(module("moe_routing").fn(f"moe_route_e{cap}"), grid, (32 * _ROUTE_WARPS,), args,
           shared_mem=_ROUTE_WARPS * e * 4 * ((n_group > 1) + (selection == "merge")), pdl=pdl_supported())
    return ids, w


def alignment_buffers(num_pairs: int, num_experts: int, block: int, large_block: int | None = None,
                      large_above: int | None = None) -> MoEAlignment:
    """Device buffers for ``moe_align`` (allocate once per shape, reuse across runs and graphs)."""
    import cupy

    large_block, large_above = align_args(num_pairs, block, large_block, large_above)
    cap_s, cap_l = align_capacities(num_pairs, num_experts, block, large_block, large_above)
    z = lambda n: cupy.zeros(n, dtype=cupy.int32)  # noqa: E731
    return MoEAlignment(z(num_experts), z(num_experts), z(cap_s + cap_l), z(cap_s // block + cap_l // large_block),
                        z(2), z(1), block, num_pairs, large_block, large_above, cap_s, cap_l)


def check_ids_in_range(topk_ids, num_experts: int) -> None:
    """Raise on the first expert id of ``topk_ids`` (device int32 [M, k]) outside [0, E) (one host sync)."""
    import cupy

    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        flat = topk_ids.reshape(-1)
        i = int(cupy.argmax((flat < 0) | (flat >= num_experts)))
        raise ValueError(f"topk_ids: expert id {int(flat[i])} at pair {i} (token {i // topk_ids.shape[1]}) "
                         f"is out of range [0, {num_experts})")


def moe_align(topk_ids, num_experts: int, block: int, out: MoEAlignment | None = None,
              check_ids: bool = True, large_block: int | None = None,
              large_above: int | None = None, pdl: bool = False) -> MoEAlignment:
    """topk_ids int32 [M, top_k] -> MoEAlignment (device arrays): experts with more than
    ``large_above`` pairs in ``large_block``-pair blocks, the others in ``block``-pair blocks (without
    ``large_block``, all). With ``check_ids`` an id out of [0, E) raises (one host sync); without,
    such pairs are left out and ``error[0]`` is set. ``pdl``: a programmatic dependent launch
    (kernels/_launch.py), for a call right after the kernel that wrote ``topk_ids``."""
    check("topk_ids", topk_ids, np.int32, ndim=2)
    p = topk_ids.size
    if p == 0:
        raise ValueError(f"topk_ids: no pairs (shape {tuple(topk_ids.shape)}); M = 0 is not a valid call")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    large_block, large_above = align_args(p, block, large_block, large_above)
    if check_ids:
        check_ids_in_range(topk_ids, num_experts)
    al = out if out is not None else alignment_buffers(p, num_experts, block, large_block, large_above)
    made = (al.block, al.num_pairs, al.large_block, al.large_above)
    if made != (block, p, large_block, large_above):
        raise ValueError(f"out: buffers made for (block, pairs, large_block, large_above) = {made}, "
                         f"called with {(block, p, large_block, large_above)}")
    cap_s, cap_l = align_capacities(p, num_experts, block, large_block, large_above)
    for name, n in (("counts", num_experts), ("offsets", num_experts), ("sorted_pairs", cap_s + cap_l),
                    ("block_expert", cap_s // block + cap_l // large_block), ("num_blocks", 2), ("error", 1)):
        check(f"out.{name}", getattr(al, name), np.int32, shape=(n,))
    in_smem = p <= _ALIGN_SMEM_IDS_MAX
    smem = (2 * num_experts + 2 + (p if in_smem else 0)) * 4
    grid = (-(-num_experts // _ALIGN_WARPS),)
    args = (topk_ids, np.int32(p), np.int32(num_experts), np.int32(block), np.int32(large_block),
            np.int32(large_above), np.int32(cap_s), np.int32(in_smem), al.counts, al.offsets, al.sorted_pairs,
            al.block_expert, al.num_blocks, al.error)
    launch(module("moe_routing").fn("moe_align_kernel"), grid, (32 * _ALIGN_WARPS,), args, shared_mem=smem, pdl=pdl)
    return al
