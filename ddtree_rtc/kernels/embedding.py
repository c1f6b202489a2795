"""Embedding row gather on the GPU. See cuda_src/embedding.cu."""

from __future__ import annotations

import numpy as np

from ._args import BF16, check, out_array
from .registry import module

_THREADS = 256
_UNITS_PER_THREAD = 4


def embedding(ids, table, out=None):
    """ids int32 [n]; table bf16 [V, D] -> [n, D] bf16; an id outside [0, V) gives a NaN row."""
    check("ids", ids, np.int32, ndim=1)
    check("table", table, BF16, ndim=2)
    vocab, dim = table.shape
    n = ids.shape[0]
    y = out_array("out", out, (n, dim), BF16)
    if n == 0 or dim == 0:
        return y
    if vocab >= 2**31:
        raise ValueError(f"table: {vocab} rows do not fit int32 ids")
    vec = dim % 8 == 0 and table.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
    units = dim // 8 if vec else dim
    chunks = -(-units // (_THREADS * _UNITS_PER_THREAD))
    module("embedding").fn("embedding_kernel")(
        (n, chunks), (_THREADS,), (ids, table, y, np.int32(vocab), np.int32(dim), np.int32(vec)))
    return y
