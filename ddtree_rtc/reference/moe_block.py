"""The small-M path's MoE layer in numpy: the composition of today's references in the order
``model/moe.py`` runs the small-M kernels (the dense part, the routing, the shared expert's down
projection, the routed experts with the combine). The CUDA twin (cuda_src/moe_block.cu) runs the same
kernel bodies as phases of one launch."""

from __future__ import annotations

from .linear import linear
from .mla_block import prologue_rows
from .moe_routing import moe_route
from .moe_small import check_small_shape, moe_small_dense, moe_small_experts
from .rmsnorm import NormPrologue, rmsnorm


def moe_block_plan(num_tokens: int, num_experts: int, local_experts: int, top_k: int, hidden: int,
                   intermediate: int, shared_intermediate: int, n_group: int = 1, f32_out: bool = False):
    """Checks the shape; the numpy path needs no buffers (None, which ``moe_block_small`` takes)."""
    check_small_shape(num_tokens, local_experts, top_k, hidden, intermediate)
    return None


def moe_block_small(x, gate_weight, bias, shared_w13, shared_w2, experts, top_k: int, n_group: int = 1,
                    topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                    id_offset: int = 0, out=None, shared_out=None, plan=None, residual=None, norm_weight=None,
                    norm_eps: float = 0.0, prologue: NormPrologue | None = None):
    """x [M, H] bf16 (M <= 64 on the GPU) -> the MoE layer's output [M, H]: bf16 routed + shared, or
    with an fp32 ``out`` the routed partial unrounded and, with ``shared_out`` (fp32 [M, H]), the shared
    expert's partial there (a tensor-parallel rank's two sums). gate_weight bf16 [E, H] (the whole
    router), bias fp32 [E] or None, shared_w13 bf16 [2 Is, H] = [gate; up], shared_w2 bf16 [H, Is];
    ``experts``: this rank's, the router's experts id_offset .. id_offset + local - 1. With a bf16
    ``residual`` (one rank) the decoder's next norm follows: returns ``rmsnorm(output, norm_weight,
    norm_eps, residual=residual)``, the (normed, residual) pair. With a ``prologue`` (a tensor-parallel
    rank; ``x`` None) the layer opens with the attention's residual norm, ``x, h =
    norm_prologue(prologue)``, and returns (output, x, h)."""
    x, h_new = prologue_rows(x, prologue, residual, "moe_block_small")
    logits, hs = moe_small_dense(x, gate_weight, shared_w13)
    ids, w = moe_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    shared = linear(hs, shared_w2, out=shared_out)
    y = moe_small_experts(x, ids, w, experts, shared=None if shared_out is not None else shared, out=out,
                          check_ids=False, id_offset=id_offset)
    if prologue is not None:
        return y, x, h_new
    if residual is None:
        return y
    if shared_out is not None:
        raise ValueError("moe_block_small: the residual norm follows a bf16 output (one rank), not fp32 partials")
    return rmsnorm(y, norm_weight, norm_eps, residual=residual)
