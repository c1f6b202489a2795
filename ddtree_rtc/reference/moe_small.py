"""The small-M MoE layer's numpy twins: compositions of today's references (``moe_gemm.moe_experts``;
``router_logits`` with ``linear`` and ``silu_mul``; ``moe_route`` with ``linear``), so the numpy
backend's output is unchanged by the small-M path, plus the limits its kernels have
(cuda_src/moe_small.cu: one bit per token, 8 mma column tiles, the routing's experts per lane)."""

from __future__ import annotations

from .linear import linear
from .moe_gemm import moe_experts
from .moe_routing import check_route_args, moe_route, router_logits
from .silu_mul import silu_mul

MAX_TOKENS = 64
MAX_EXPERTS = 1024
MAX_PAIRS = 1024
TILE_K = 128
MAX_TOP_K = 32  # moe_small_down_x keeps a token's slots with one expert in a 32-bit mask
# moe_small_route_shared routes with 12 experts a lane (its registers are the skinny linear's budget);
# a layer over more experts routes in a launch of its own (model/moe.py)
ROUTE_SHARED_MAX_EXPERTS = 384


def check_small_shape(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int) -> None:
    """The small-M kernels' limits, each refusal naming the value."""
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"moe_small: M = {num_tokens} tokens outside 1..{MAX_TOKENS} (the small-M path)")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"moe_small: {num_experts} experts outside 1..{MAX_EXPERTS}")
    if top_k < 1 or num_tokens * top_k > MAX_PAIRS:
        raise ValueError(f"moe_small: M * top_k = {num_tokens} * {top_k} pairs outside 1..{MAX_PAIRS}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"moe_small: top_k = {top_k} above {MAX_TOP_K}")
    for name, v in (("hidden", hidden), ("intermediate", intermediate)):
        if v <= 0 or v % TILE_K:
            raise ValueError(f"moe_small: {name} size {v} must be a positive multiple of {TILE_K}")


def moe_small_plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                   pdl: bool | None = None):
    """Checks the shape; the numpy path needs no buffers (None, which ``moe_small_experts`` takes)."""
    check_small_shape(num_tokens, num_experts, top_k, hidden, intermediate)
    return None


def moe_small_experts(x, topk_ids, topk_weights, experts, shared=None, out=None, plan=None, check_ids: bool = True,
                      id_offset: int = 0):
    """Same contract as the CUDA kernel pair: M <= 64 tokens, then ``moe_gemm.moe_experts`` of the
    ids less ``id_offset`` (an expert shard's first expert)."""
    m, top_k = (x.shape[0], topk_ids.shape[1]) if topk_ids.ndim == 2 else (x.shape[0], 0)
    check_small_shape(m, experts.num_experts, top_k, experts.hidden, experts.intermediate)
    ids = topk_ids - topk_ids.dtype.type(id_offset) if id_offset else topk_ids
    return moe_experts(x, ids, topk_weights, experts, shared=shared, out=out, check_ids=check_ids)


def moe_small_dense(x, gate_weight, shared_w13, out_logits=None, out_hs=None):
    """The router logits and the shared expert's SiLU(gate) * up: ``router_logits`` and
    ``silu_mul(linear(x, shared_w13))``, the general path's ops."""
    logits = router_logits(x, gate_weight, out=out_logits)
    hs = silu_mul(linear(x, shared_w13), out=out_hs)
    return logits, hs


def check_route_shared(num_tokens: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                       hidden: int, shared_intermediate: int) -> None:
    """moe_small_route_shared's limits, each refusal naming the value: the routing's (check_route_args,
    at most ROUTE_SHARED_MAX_EXPERTS experts) and the invariant linear's (K % 8 == 0)."""
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"moe_small_route_shared: M = {num_tokens} tokens outside 1..{MAX_TOKENS}")
    check_route_args(num_experts, top_k, n_group, topk_group)
    if num_experts > ROUTE_SHARED_MAX_EXPERTS:
        raise ValueError(f"moe_small_route_shared: {num_experts} experts above {ROUTE_SHARED_MAX_EXPERTS} "
                         f"(route them with moe_route)")
    if hidden < 1 or shared_intermediate < 8 or shared_intermediate % 8:
        raise ValueError(f"moe_small_route_shared: shared expert down [{hidden}, {shared_intermediate}]: H must be "
                         f">= 1 and Is a positive multiple of 8")


def moe_small_route_shared(logits, bias, hs, shared_w2, top_k: int, n_group: int = 1, topk_group: int = 1,
                           norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, out_ids=None,
                           out_weights=None, out=None):
    """logits fp32 [M, E], bias fp32 [E] or None, hs bf16 [M, Is], shared_w2 bf16 [H, Is] ->
    (ids int32 [M, top_k], weights fp32 [M, top_k], hs shared_w2^T [M, H] bf16, or fp32 unrounded
    when ``out`` is fp32): ``moe_route`` and ``linear``, the two ops the one launch replaces."""
    check_route_shared(logits.shape[0], logits.shape[1], top_k, n_group, topk_group, shared_w2.shape[0],
                       shared_w2.shape[1])
    if tuple(hs.shape) != (logits.shape[0], shared_w2.shape[1]):
        raise ValueError(f"hs: expected [{logits.shape[0]}, {shared_w2.shape[1]}] (the logits' rows, shared_w2's "
                         f"columns), got {tuple(hs.shape)}")
    ids, w = moe_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                       out_ids=out_ids, out_weights=out_weights)
    return ids, w, linear(hs, shared_w2, out=out)
