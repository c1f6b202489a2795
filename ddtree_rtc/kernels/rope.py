"""RoPE in place on a slice of each head, on the GPU. See cuda_src/rope.cu."""

from __future__ import annotations

import numpy as np

from ..reference.rope import check_rope_args
from ._args import BF16, check
from .registry import module

_THREADS = 256
_SMEM_LIMIT = 48 << 10


def rope(x, positions, inv_freq, rot_offset: int, rot_dim: int, layout: str, scale: float = 1.0):
    """x [tokens, heads, head_dim] (or [tokens, head_dim]) bf16, rotated IN PLACE and returned;
    positions int32 [tokens]; inv_freq fp32 [rot_dim/2]; layout "interleaved" or "half"."""
    check("x", x, BF16)
    head_dim = check_rope_args(x.shape, rot_offset, rot_dim, layout)
    tokens = x.shape[0]
    heads = 1 if x.ndim == 2 else x.shape[1]
    check("positions", positions, np.int32, shape=(tokens,))
    check("inv_freq", inv_freq, np.float32, shape=(rot_dim // 2,))
    smem = rot_dim * 4
    if smem > _SMEM_LIMIT:
        raise ValueError(f"rot_dim {rot_dim} is too large for the kernel's cos/sin table")
    if heads * (rot_dim // 2) >= 2**31:
        raise ValueError(f"x: {heads} heads x {rot_dim // 2} pairs overflow int32 indexing")
    if tokens == 0 or heads == 0:
        return x
    interleaved = layout == "interleaved"
    pair_vec = interleaved and head_dim % 2 == 0 and rot_offset % 2 == 0 and x.data.ptr % 4 == 0
    args = (x, positions, inv_freq, np.int32(heads), np.int32(head_dim), np.int32(rot_offset),
            np.int32(rot_dim), np.int32(interleaved), np.int32(pair_vec), np.float32(scale))
    module("rope").fn("rope_kernel")((tokens,), (_THREADS,), args, shared_mem=smem)
    return x
