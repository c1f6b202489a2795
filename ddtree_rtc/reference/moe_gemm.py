"""Fused INT4 MoE experts reference, straight from the ORIGINAL compressed-tensors tensors (so a
repack bug in the GPU layout cannot hide here).

Per (token t, slot j) with expert e = topk_ids[t, j]:
  [g | u] = x[t] @ W13[e]^T     (fp32)          W13 = [gate; up] dequantized exactly
  h       = bf16(silu(g) * u)                   (fp32 math, one rounding: the down GEMM reads bf16)
  d       = h @ W2[e]^T          (fp32)
  y[t]    = bf16(sum_j  w[t, j] * d  (+ shared[t]))   slots summed in order, fp32
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

from .moe_routing import moe_align

GROUP = 32


def dequant_int4(packed, scale, group_size: int = GROUP) -> np.ndarray:
    """compressed-tensors pack-quantized -> fp32 [N, K]:
    W[n, k] = (((P[n, k >> 3] >> (4 * (k & 7))) & 0xF) - 8) * S[n, k // group_size]  (exact in fp32)."""
    p = np.asarray(packed).view(np.uint32)
    n, k8 = p.shape
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    q = ((p[:, :, None] >> shifts) & 0xF).astype(np.int32).reshape(n, k8 * 8) - 8
    s = np.asarray(scale).astype(np.float32)
    if s.shape != (n, k8 * 8 // group_size):
        raise ValueError(f"scale: expected [{n}, {k8 * 8 // group_size}], got {s.shape}")
    return q.astype(np.float32) * np.repeat(s, group_size, axis=1)


def silu_f32(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (v / (np.float32(1) + np.exp(-v))).astype(np.float32)


def check_experts_layout(experts, layout: str) -> None:
    got = getattr(experts, "layout", None)
    if got != layout:
        raise TypeError(f"experts: expected layout {layout!r}, got {got!r} (prepare the experts for this "
                        f"backend with ddtree_rtc.model.int4_repack.prepare_experts)")


def moe_experts(x, topk_ids, topk_weights, experts, shared=None, out=None, plan=None, check_ids: bool = True):
    """x [M, H] bf16, topk_ids int32 [M, k], topk_weights fp32 [M, k], experts (layout
    'compressed-tensors'), shared bf16 [M, H] or None -> y bf16 [M, H] (fp32, unrounded, when
    ``out`` is an fp32 array: a tensor-parallel partial sum). ``plan`` is the CUDA
    wrapper's and is ignored here. Pairs whose id is out of range contribute nothing (with
    ``check_ids`` they raise instead). The composition of ``expert_hidden`` and ``down_combine``."""
    h = expert_hidden(x, topk_ids, experts, check_ids)
    return down_combine(h, topk_ids, topk_weights, experts, shared, out)


def expert_hidden(x, topk_ids, experts, check_ids: bool = True) -> np.ndarray:
    """The first half of ``moe_experts``: h [M * k, I] fp32 holding bf16 values, h[m * k + j] =
    bf16(silu(g) * u) of token m through expert topk_ids[m, j] (g, u: float64 sums rounded to fp32);
    rows of out-of-range ids are zero. A kernel's own h (its gate/up sums rounded in its order) can be
    fed to ``down_combine`` to check the rest of it exactly."""
    check_experts_layout(experts, "compressed-tensors")
    m, hidden = x.shape
    if m == 0:
        raise ValueError("x: M = 0 tokens; call moe_experts with at least one token")
    if hidden != experts.hidden:
        raise ValueError(f"x: expected [M, {experts.hidden}], got {x.shape}")
    ids = np.asarray(topk_ids)
    top_k = ids.shape[1]
    if ids.shape[0] != m:
        raise ValueError(f"topk_ids: expected [{m}, k], got {ids.shape}")
    al = moe_align(ids, experts.num_experts, 1, check_ids=check_ids)
    inter = experts.intermediate
    xf = x.astype(np.float32)
    h = np.zeros((m * top_k, inter), dtype=np.float32)
    for e in range(experts.num_experts):
        pairs = al.sorted_pairs[al.offsets[e]:al.offsets[e] + al.counts[e]]
        if pairs.size == 0:
            continue
        w13 = dequant_int4(experts.w13[e], experts.w13_scale[e])
        gu = (xf[pairs // top_k].astype(np.float64) @ w13.T.astype(np.float64)).astype(np.float32)
        h[pairs] = (silu_f32(gu[:, :inter]) * gu[:, inter:]).astype(bfloat16).astype(np.float32)
    return h


def down_combine(h, topk_ids, topk_weights, experts, shared=None, out=None):
    """The second half of ``moe_experts``: h [M * k, I] (bf16 values) -> y, d = h @ W2[e]^T summed in
    float64, y = sum_j w[m, j] * d (slots in order, fp32) (+ shared[m]); out-of-range ids add nothing."""
    ids = np.asarray(topk_ids)
    m, top_k = ids.shape
    hidden = experts.hidden
    if np.asarray(topk_weights).shape != ids.shape:
        raise ValueError(f"topk_ids/topk_weights: expected [{m}, k] each, got {ids.shape} and "
                         f"{np.asarray(topk_weights).shape}")
    if h.shape != (m * top_k, experts.intermediate):
        raise ValueError(f"h: expected [{m * top_k}, {experts.intermediate}], got {h.shape}")
    valid = (ids >= 0) & (ids < experts.num_experts)
    flat = ids.reshape(-1)
    d = np.zeros((m * top_k, hidden), dtype=np.float32)
    for e in np.unique(flat[valid.reshape(-1)]):
        pairs = np.flatnonzero(flat == e)
        w2 = dequant_int4(experts.w2[e], experts.w2_scale[e])
        d[pairs] = np.asarray(h[pairs], np.float32).astype(np.float64) @ w2.T.astype(np.float64)  # batch-invariant
    w = np.asarray(topk_weights, dtype=np.float32)
    d = d.reshape(m, top_k, hidden)
    acc = np.zeros((m, hidden), dtype=np.float32)
    for j in range(top_k):
        acc = acc + np.where(valid[:, j:j + 1], w[:, j:j + 1] * d[:, j], np.float32(0))
    if shared is not None:
        if shared.shape != (m, hidden):
            raise ValueError(f"shared: expected [{m}, {hidden}], got {shared.shape}")
        acc = acc + shared.astype(np.float32)
    if out is not None and out.dtype == np.float32:
        out[...] = acc
        return out
    y = acc.astype(bfloat16)
    if out is not None:
        out[...] = y
        return out
    return y


def moe_plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, **knobs):
    """The CUDA path's launch plan has no numpy counterpart (the reference allocates per call):
    None, which ``moe_experts`` accepts as its ``plan``."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens} (M = 0 has nothing to route)")
    return None
