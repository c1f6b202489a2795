"""Embedding gather reference: out[r] = table[ids[r]]; an id outside [0, V) gives a NaN row (the
engine validates ids on the host first; the NaN row makes a slip visible)."""

from __future__ import annotations

import numpy as np


def embedding(ids, table, out=None):
    """ids int32 [n]; table bf16 [V, D] -> [n, D] bf16."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids: expected [n], got shape {ids.shape}")
    if table.ndim != 2:
        raise ValueError(f"table: expected [V, D], got shape {table.shape}")
    vocab, dim = table.shape
    ok = (ids >= 0) & (ids < vocab)
    y = np.full((ids.shape[0], dim), np.nan, dtype=table.dtype)
    y[ok] = table[ids[ok]]
    if out is not None:
        out[...] = y
        return out
    return y
