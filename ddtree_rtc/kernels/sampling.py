"""Argmax and seeded temperature / top-p sampling on the GPU. See cuda_src/sampling.cu; the exact
rules (ties, NaN, the nucleus, the RNG) are in ddtree_rtc/reference/sampling.py, which the kernel
matches token for token."""

from __future__ import annotations

import numpy as np

from ._args import BF16, check, dtype_name, out_array
from .registry import module

_THREADS = 512  # fixed by the kernel (bins per thread)


def _logits(logits):
    import cupy

    if not isinstance(logits, cupy.ndarray):
        raise TypeError(f"logits: expected a cupy array on the GPU, got {type(logits).__name__}")
    if logits.dtype not in (BF16, np.float32):
        raise TypeError(f"logits: expected dtype bf16 (uint16 bits) or float32, got {dtype_name(logits.dtype)}")
    check("logits", logits, ndim=2)
    rows, vocab = logits.shape
    if vocab >= 2**31:
        raise ValueError(f"logits: vocabulary of {vocab} does not fit int32 indices")
    per16 = 16 // logits.dtype.itemsize
    vec = vocab % per16 == 0 and logits.data.ptr % 16 == 0
    return rows, vocab, int(logits.dtype == BF16), int(vec)


def argmax(logits, out=None):
    """logits [B, V] bf16 or fp32 -> int32 [B]; ties -> smallest index, NaN ignored, all-NaN -> -1."""
    rows, vocab, is_bf16, vec = _logits(logits)
    out = out_array("out", out, (rows,), np.int32)
    if rows == 0:
        return out
    if vocab == 0:
        out.fill(-1)
        return out
    module("sampling").fn("argmax_kernel")(
        (rows,), (_THREADS,), (logits, np.int64(vocab), np.int32(vocab), np.int32(is_bf16), np.int32(vec), out))
    return out


def _per_row(name: str, v, rows: int):
    """(device pointer or null, scalar) for a float or an fp32 [B] array."""
    import cupy

    if isinstance(v, cupy.ndarray):
        check(name, v, np.float32, shape=(rows,))
        return v, np.float32(0.0)
    if isinstance(v, np.ndarray) and v.ndim > 0:
        raise TypeError(f"{name}: pass a float or a cupy fp32 array, not a host array")
    return np.uint64(0), np.float32(v)


def sample(logits, temperature, top_p, seed: int, offset: int = 0, out=None, keys=None):
    """logits [B, V] bf16 or fp32 -> int32 [B]. temperature / top_p: floats or cupy fp32 [B];
    temperature 0 means argmax. ``keys``: per-row stream keys, cupy uint64 [B] (seed and offset are
    then unused). Same tokens as ddtree_rtc.reference.sampling.sample."""
    import cupy

    rows, vocab, is_bf16, vec = _logits(logits)
    if keys is not None:
        if not isinstance(keys, cupy.ndarray):
            raise TypeError("keys: pass a cupy uint64 array, not a host array")
        check("keys", keys, np.uint64, shape=(rows,))
    out = out_array("out", out, (rows,), np.int32)
    t_ptr, t_val = _per_row("temperature", temperature, rows)
    p_ptr, p_val = _per_row("top_p", top_p, rows)
    if rows == 0:
        return out
    if vocab == 0:
        out.fill(-1)
        return out
    args = (logits, np.int64(vocab), np.int32(vocab), np.int32(is_bf16), np.int32(vec), t_ptr, t_val, p_ptr,
            p_val, np.uint64(int(seed) % 2**64), np.uint64(int(offset) % 2**64),
            np.uint64(0) if keys is None else keys, out)
    module("sampling").fn("sample_kernel")((rows,), (_THREADS,), args)
    return out
