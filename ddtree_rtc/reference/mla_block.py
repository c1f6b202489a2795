"""The small-M path's MLA attention block in numpy: the composition of today's references in the
order ``model/mla.py`` runs the small-M kernels (q_a and kv_a, the q_a norm, q_b, the absorbed query,
the cache rows, the attention, W_UV, o_proj). The CUDA twin (cuda_src/mla_block.cu) runs the same
kernel bodies as phases of one launch."""

from __future__ import annotations

import numpy as np

from .linear import linear
from .mla_attention import mla_attention, mla_head_gemm
from .mla_small import mla_kv_rows_small, mla_qkv_a_small, mla_query_small
from .rmsnorm import NormPrologue, norm_prologue, rmsnorm

LAT, ROPE = 512, 64


def block_dims(w_qb, kv_b, w_o, num_heads: int) -> tuple[int, int, int]:
    """(q_nope, v_head, q_lora) of the block's weights for ``num_heads`` heads, checked: w_qb
    [H (nope + 64), q_lora], kv_b [H (nope + v_head), 512], w_o [hidden, H v_head]."""
    rows = w_qb.shape[0]
    if num_heads < 1 or w_qb.ndim != 2 or rows % num_heads or rows // num_heads <= ROPE:
        raise ValueError(f"w_qb: {tuple(w_qb.shape)} is not [{num_heads} heads x (q_nope + {ROPE}), q_lora]")
    nope = rows // num_heads - ROPE
    if kv_b.ndim != 2 or kv_b.shape[1] != LAT or kv_b.shape[0] % num_heads or kv_b.shape[0] // num_heads <= nope:
        raise ValueError(f"kv_b: {tuple(kv_b.shape)} is not [{num_heads} heads x ({nope} + v_head), {LAT}]")
    v_head = kv_b.shape[0] // num_heads - nope
    if w_o.ndim != 2 or w_o.shape[1] != num_heads * v_head:
        raise ValueError(f"w_o: {tuple(w_o.shape)} is not [hidden, {num_heads} heads x {v_head}]")
    return nope, v_head, int(w_qb.shape[1])


def mla_block_plan(num_tokens: int, hidden: int, q_lora: int, num_heads: int, q_nope: int = 128, v_head: int = 128,
                   f32_out: bool = False):
    """The CUDA twin's scratch buffers and grid; nothing to plan on numpy."""
    return None


def mla_block_small(x, w_qa, w_kva, qa_norm, kv_norm, eps: float, w_qb, kv_b, w_o, positions, inv_freq,
                    rope_scale: float, cache, slots, att_plan, softmax_scale: float, out=None, plan=None,
                    residual=None, norm_weight=None, norm_eps: float = 0.0, prologue: NormPrologue | None = None):
    """x [M, hidden] bf16 (M <= 64 on the GPU) -> the attention block's output [M, hidden] bf16, or
    fp32 unrounded into an fp32 ``out`` (a tensor-parallel partial); the new tokens' cache rows are
    written at ``slots`` of ``cache`` (one layer) first. ``att_plan``: ``mla_attention_plan``'s
    (split="shape" on the GPU). ``plan``: ``mla_block_plan``'s (the CUDA twin's buffers). With a bf16
    ``residual`` (one rank) the decoder's post-attention norm follows: returns
    ``rmsnorm(output, norm_weight, norm_eps, residual=residual)``, the (normed, residual) pair. With a
    ``prologue`` (a tensor-parallel rank; ``x`` None) the block opens with the previous sublayer's
    residual norm, ``x, h = norm_prologue(prologue)``, and returns (output, x, h)."""
    x, h_new = prologue_rows(x, prologue, residual, "mla_block_small")
    t, h = x.shape[0], att_plan.num_heads
    nope, v_head, _ = block_dims(w_qb, kv_b, w_o, h)
    qa, kv = mla_qkv_a_small(x, w_qa, w_kva)
    q = linear(rmsnorm(qa, qa_norm, eps), w_qb).reshape(t, h, nope + ROPE)
    heads = kv_b.reshape(h, nope + v_head, LAT)
    q_att = mla_query_small(q, heads[:, :nope], positions, inv_freq, rope_scale)
    mla_kv_rows_small(kv, kv_norm, eps, positions, inv_freq, rope_scale, cache, slots)
    o_lat, _ = mla_attention(att_plan, q_att, cache, softmax_scale)
    o = mla_head_gemm(o_lat, heads[:, nope:], True)
    y = linear(o.reshape(t, h * v_head), w_o, out=out)
    if prologue is not None:
        return y, x, h_new
    if residual is None:
        return y
    if y.dtype == np.float32:
        raise ValueError("mla_block_small: the residual norm follows a bf16 output (one rank), not an fp32 partial")
    return rmsnorm(y, norm_weight, norm_eps, residual=residual)


def prologue_rows(x, prologue, residual, who: str):
    """(x, new residual or None): a fused kernel's input, made by its prologue when one is given."""
    if prologue is None:
        return x, None
    if x is not None or residual is not None:
        raise ValueError(f"{who}: with a prologue the kernel makes x (pass x=None) and takes no residual norm "
                         f"after it (a tensor-parallel rank's output is an fp32 partial)")
    return norm_prologue(prologue)
