"""The small-M path's MLA pieces in numpy: each the composition of today's references in the order
``model/mla.py`` runs them, so the numpy backend's numbers are the general path's (the CUDA twins,
cuda_src/mla_small.cu, do each in one launch)."""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

from .kv_cache import kv_cache_write
from .linear import linear
from .mla_attention import mla_head_gemm
from .rmsnorm import rmsnorm
from .rope import rope

LAT, ROPE = 512, 64


def mla_query_small(q, w_uk, positions, inv_freq, rope_scale: float = 1.0, out=None, rows=None):
    """q [T, H, nope + 64] -> q_att [T, H, 576] = [q_nope · W_UK[h] | RoPE(q_pe)] bf16; ``rows`` =
    (kv, norm_w, eps, cache, slots): also the new tokens' cache rows (``mla_kv_rows_small``)."""
    t, h, d = q.shape
    nope = d - ROPE
    q_att = np.empty((t, h, LAT + ROPE), dtype=bfloat16) if out is None else out
    mla_head_gemm(q[:, :, :nope], w_uk, False, out=q_att[:, :, :LAT])
    q_att[:, :, LAT:] = q[:, :, nope:]
    if rows is not None:
        kv, norm_w, eps, cache, slots = rows
        mla_kv_rows_small(kv, norm_w, eps, positions, inv_freq, rope_scale, cache, slots)
    return rope(q_att, positions, inv_freq, LAT, ROPE, "interleaved", rope_scale)


def mla_kv_rows_small(kv, norm_w, eps: float, positions, inv_freq, rope_scale: float, cache, slots):
    """kv [T, 576] -> cache rows slots[t] = [RMSNorm(c) * norm_w | RoPE(k_pe)]; returns ``cache``."""
    rows = np.array(kv, dtype=bfloat16)
    rows[:, :LAT] = rmsnorm(np.ascontiguousarray(rows[:, :LAT]), norm_w, eps)
    rope(rows, positions, inv_freq, LAT, ROPE, "interleaved", rope_scale)
    return kv_cache_write(cache, rows, slots)


def mla_qkv_a_small(x, w_qa, w_kva, out_q=None, out_kv=None):
    """(x w_qa^T, x w_kva^T) bf16: the two linears of the general path."""
    return linear(x, w_qa, out=out_q), linear(x, w_kva, out=out_kv)
