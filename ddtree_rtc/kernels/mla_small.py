"""The small-M path's row-invariant MLA head GEMM (cuda_src/mla_small.cu): ``mla_head_gemm(...,
impl="invariant")`` runs it instead of the strided-batched cuBLAS GEMM, whose kernel and summation
order follow the token count. Same contract and numbers (up to fp32 summation order) as
``ddtree_rtc.reference.mla_attention.mla_head_gemm``."""

from __future__ import annotations

import numpy as np

from ._args import BF16, check
from .registry import module

MAX_TOKENS = 64


def _strides(name: str, a) -> tuple[int, ...]:
    if any(s % a.itemsize or s < 0 for s in a.strides):
        raise ValueError(f"{name}: strides {a.strides} are not whole non-negative elements")
    return tuple(s // a.itemsize for s in a.strides)


def mla_head_gemm_small(x, w, trans_w: bool, out):
    """Per head h: out[:, h] = x[:, h] @ (w[h].T if trans_w else w[h]); x [T, H, K] (T <= 64), w
    [H, N, K] (trans_w) or [H, K, N], out [T, H, N] bf16; views with a contiguous last dim (x, out)."""
    t, h, k = x.shape
    n = out.shape[2]
    if t > MAX_TOKENS:
        raise ValueError(f"mla_head_gemm impl='invariant': T = {t} tokens > {MAX_TOKENS} (the small-M path)")
    xs, ws, os_ = _strides("x", x), _strides("w", w), _strides("out", out)
    if (xs[2] != 1 and k > 1) or (os_[2] != 1 and n > 1):
        raise ValueError(f"x / out: the last dim must be contiguous (strides {x.strides}, {out.strides})")
    check("out", out, BF16, shape=(t, h, n), contiguous=False)
    w_k, w_n = (ws[2], ws[1]) if trans_w else (ws[1], ws[2])
    module("mla_small").fn("mla_head_gemm_small")(
        (-(-n // 32), h, -(-t // 8)), (32, 8),
        (x, np.int64(xs[0]), np.int64(xs[1]), w, np.int64(ws[0]), np.int64(w_k), np.int64(w_n), out,
         np.int64(os_[0]), np.int64(os_[1]), np.int32(t), np.int32(k), np.int32(n)))
    return out
