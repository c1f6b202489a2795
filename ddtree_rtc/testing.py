"""One comparison helper and the tolerances, named per dtype, used by every kernel test (and a few
input / model helpers the tests share).

First NaN/inf positions must match exactly (a poisoned read shows up as NaN), then the relative
error ||a - b|| / ||b|| must be under the dtype's tolerance and every element within atol+rtol|b|.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

# (relative-norm tolerance, elementwise rtol, elementwise atol)
TOLERANCES = {
    "fp64": (1e-12, 1e-10, 1e-12),
    "fp32": (1e-5, 1e-4, 1e-5),
    "bf16": (8e-3, 2e-2, 2e-2),  # one bf16 rounding is 2^-8 relative; allow a few
    "bf16_accum": (1e-2, 5e-2, 5e-2),  # long bf16-input dot products, fp32 accumulate
}


def to_host(a) -> np.ndarray:
    """A device or host array as numpy; GPU bf16 (uint16 bits) is NOT reinterpreted here."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def as_f64(a, bf16_bits: bool = False) -> np.ndarray:
    a = to_host(a)
    if bf16_bits or a.dtype == np.uint16:
        a = a.view(bfloat16) if a.dtype == np.uint16 else a
    return a.astype(np.float64)


def assert_close(actual, expected, kind: str, name: str = "output") -> None:
    """Compare ``actual`` (device or host; uint16 means bf16 bits) with ``expected`` (host)."""
    tol_norm, rtol, atol = TOLERANCES[kind]
    a, b = as_f64(actual), as_f64(expected)
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {a.shape} != expected {b.shape}")
    bad_a, bad_b = ~np.isfinite(a), ~np.isfinite(b)
    if not np.array_equal(bad_a, bad_b):
        idx = np.argwhere(bad_a != bad_b)[:5].tolist()
        raise AssertionError(f"{name}: non-finite positions differ (e.g. at {idx}); "
                             f"{int(bad_a.sum())} in actual, {int(bad_b.sum())} expected")
    if not np.array_equal(a[bad_a], b[bad_b], equal_nan=True):
        raise AssertionError(f"{name}: non-finite values differ (NaN vs inf)")
    a, b = np.where(bad_a, 0, a), np.where(bad_b, 0, b)
    denom = np.linalg.norm(b)
    rel = np.linalg.norm(a - b) / denom if denom > 0 else np.linalg.norm(a - b)
    if rel > tol_norm:
        raise AssertionError(f"{name}: relative error {rel:.3e} > {tol_norm:.1e} ({kind})")
    over = np.abs(a - b) > atol + rtol * np.abs(b)
    if over.any():
        i = tuple(np.argwhere(over)[0])
        raise AssertionError(f"{name}: {int(over.sum())} elements off beyond {kind} tolerance, "
                             f"first at {i}: {a[i]!r} vs {b[i]!r}")


def random_bf16(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """Random non-zero bf16 values (normal, no exact zeros)."""
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = scale
    return x.astype(bfloat16)


def nan_bf16_bits(shape):
    """A device array of bf16 NaNs (as uint16 bits) to pre-fill outputs."""
    import cupy

    return cupy.full(shape, 0x7FC0, dtype=cupy.uint16)


def to_device_bf16(a: np.ndarray):
    import cupy

    return cupy.asarray(np.ascontiguousarray(a).astype(bfloat16).view(np.uint16))


def last_logits(model, tokens, page_size: int = 16) -> np.ndarray:
    """A TargetModel's logits (float64, host) at the last of ``tokens``: one causal prefill on a
    fresh paged cache, the reference point tests use to judge a greedy divergence."""
    from .engine.kv_cache import PagedKVCache
    from .model.target import ForwardBatch

    tokens = list(tokens)
    cache = PagedKVCache(model.backend, model.num_layers, -(-len(tokens) // page_size), page_size)
    cache.reserve(0, len(tokens))
    out = model.forward(ForwardBatch.causal([0], [0], [tokens]), cache, output="logits").logits
    return model.backend.to_host(out).astype(np.float64).reshape(-1, model.cfg.vocab_size)[-1]
