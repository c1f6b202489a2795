"""Argmax and seeded temperature / top-p sampling: the numpy twin of cuda_src/sampling.cu.

The kernel must return the same token ids, so every rule is defined here exactly (the .cu header
says the same):

- argmax: ties -> smallest index; NaN is never chosen; a row of only NaN gives -1.
- sample: temperature <= 0 (or NaN) -> argmax. ``z = l * fl32(1/T)``, ``m`` = max of the non-NaN
  z; if ``m`` is not finite (row all NaN or all -inf, or some z = +inf) -> argmax of the raw row.
  ``x = m - z`` (fp32, >= 0); its float bits ``key`` order tokens by probability, so equal keys are
  equal probabilities. Mass ``E = floor(exp(-x) * 2^32)`` with the exp below (0 for x >= 32), summed
  exactly as integers. With ``top_p < 1`` the nucleus is ``{key <= key*}`` where key* is the
  smallest key with ``sum(E[key_j <= key*]) >= max(1, ceil(top_p * S))``: the smallest
  highest-probability set reaching top_p of the mass, ties at the threshold included (top_p <= 0
  keeps just the most probable token(s); top_p >= 1 or NaN keeps every non-NaN token).
- The token is the argmax over the nucleus of ``z + g`` (fp32), ``g = -log(-log(u))``, with ``u``
  from a counter-based hash of (row key, token): Gumbel-max, i.e. a draw from softmax(z) restricted
  to the nucleus and renormalised. Score ties -> smallest index. The row key comes from (seed,
  offset, row) (``row_keys``), or is given per row (``keys``): the engine keys each draw by
  (seed, request stream, position) (``position_keys``), so a request's samples do not depend on its
  batch slot, its companions or how many tokens a round emitted.

exp and log are written out in fp32 steps (Cody-Waite + Taylor; atanh series) that numpy and CUDA
round identically (the kernel uses __f*_rn intrinsics, so no FMA contraction).
"""

from __future__ import annotations

import math

import numpy as np


def _f32(hex_literal: str) -> np.float32:
    return np.float32(float.fromhex(hex_literal))


# Same literals as cuda_src/sampling.cu (tests/test_sampling.py checks they agree).
FLOAT_CONSTANTS = {
    "C_LOG2E": "0x1.715476p+0", "C_LN2_HI": "0x1.62e4p-1", "C_LN2_LO": "0x1.7f7d1cp-20",
    "C_INV2": "0x1p-1", "C_INV6": "0x1.555556p-3", "C_INV24": "0x1.555556p-5",
    "C_INV120": "0x1.111112p-7", "C_INV720": "0x1.6c16c2p-10", "C_INV5040": "0x1.a01a02p-13",
    "C_LN2": "0x1.62e43p-1", "C_THIRD": "0x1.555556p-2", "C_FIFTH": "0x1.99999ap-3",
    "C_SEVENTH": "0x1.24924ap-3", "C_NINTH": "0x1.c71c72p-4",
}
_C = {k: _f32(v) for k, v in FLOAT_CONSTANTS.items()}
SQRT2_BITS = 0x3FB504F3
GAMMA = 0x9E3779B97F4A7C15
MIX_MUL = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
G_MAX, G_MIN = 17.0, -3.0  # bounds on the Gumbel noise the kernel uses to skip tokens
KEY_INF = 0x7F800000
_ONE, _HALF = np.float32(1.0), np.float32(0.5)


def mix64(z) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea & Flood 2014) on uint64 arrays, wrapping."""
    if not hasattr(z, "__cuda_array_interface__"):  # a cupy uint64 array is mixed on the device
        z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_MUL[0])
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_MUL[1])
    return z ^ (z >> np.uint64(31))


def row_keys(seed: int, offset: int, rows: int) -> np.ndarray:
    """Per-row stream keys: mix64(mix64(mix64(seed) ^ offset) + (row + 1) * GAMMA)."""
    stream = mix64(mix64(np.uint64(seed % 2**64)) ^ np.uint64(offset % 2**64))
    with np.errstate(over="ignore"):
        return mix64(stream + (np.arange(rows, dtype=np.uint64) + np.uint64(1)) * np.uint64(GAMMA))


def position_keys(seed: int, streams, positions) -> np.ndarray:
    """Row keys per (stream, position): ``row_keys(seed, stream, p + 1)[p]`` for each pair, i.e.
    mix64(mix64(mix64(seed) ^ stream) + (position + 1) * GAMMA), uint64 [N]. ``positions`` may be
    a device (cupy) array: the keys are then computed on the device, with no host sync."""
    streams = np.asarray(streams)
    streams = streams if streams.dtype == np.uint64 else streams.astype(np.int64).astype(np.uint64)
    if hasattr(positions, "__cuda_array_interface__"):
        import cupy

        if streams.shape != positions.shape or streams.ndim != 1:
            raise ValueError(f"streams and positions: expected two [N] arrays, got {streams.shape} and "
                             f"{positions.shape}")
        stream = cupy.asarray(mix64(mix64(np.uint64(seed % 2**64)) ^ streams))
        return mix64(stream + (positions.astype(cupy.uint64) + np.uint64(1)) * np.uint64(GAMMA))
    pos = np.asarray(positions, np.int64)
    if streams.shape != pos.shape or streams.ndim != 1:
        raise ValueError(f"streams and positions: expected two [N] arrays, got {streams.shape} and {pos.shape}")
    if pos.size and pos.min() < 0:
        raise ValueError("positions must be >= 0")
    with np.errstate(over="ignore"):
        stream = mix64(mix64(np.uint64(seed % 2**64)) ^ streams)
        return mix64(stream + (pos.astype(np.uint64) + np.uint64(1)) * np.uint64(GAMMA))


def _arr(a, dtype):
    """``a`` as ``dtype``: numpy arrays and scalars on the host, cupy arrays left on the device (the
    vocabulary-sharded sampler, ddtree_rtc.parallel.vocab, runs these helpers on either)."""
    if hasattr(a, "__cuda_array_interface__"):
        return a.astype(dtype, copy=False)
    return np.asarray(a, dtype)


def uniforms(row_key, tokens) -> np.ndarray:
    """u = (2k + 1) / 2^24 with k the top 23 bits of mix64(row_key + (token + 1) * GAMMA); in (0, 1)."""
    with np.errstate(over="ignore"):
        h = mix64(_arr(row_key, np.uint64)
                  + (_arr(tokens, np.int64).astype(np.uint64) + np.uint64(1)) * np.uint64(GAMMA))
    k = (h >> np.uint64(41)).astype(np.uint32)
    return (2 * k + 1).astype(np.float32) * np.float32(2.0**-24)


def log_pos(v) -> np.ndarray:
    """Natural log of positive normal fp32 values, exactly as the kernel computes it."""
    v = _arr(v, np.float32)
    bits = v.view(np.uint32)
    e = (bits >> 23).astype(np.int32) - 127
    fb = (bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)
    f = fb.view(np.float32)
    big = fb > SQRT2_BITS
    f = np.where(big, f * _HALF, f)
    e = e + big
    s = (f - _ONE) / (f + _ONE)
    s2 = s * s
    q = s2 * _C["C_NINTH"] + _C["C_SEVENTH"]
    q = q * s2 + _C["C_FIFTH"]
    q = q * s2 + _C["C_THIRD"]
    q = q * s2
    t = s + s
    return e.astype(np.float32) * _C["C_LN2"] + (t + t * q)


def gumbel(row_key, tokens) -> np.ndarray:
    return -log_pos(-log_pos(uniforms(row_key, tokens)))


def fixed_exp_neg(x) -> np.ndarray:
    """floor(exp(-x) * 2^32) as uint64 for fp32 x >= 0 (0 for x >= 32, inf or NaN)."""
    x = _arr(x, np.float32)
    ok = x < np.float32(32.0)
    xs = np.where(ok, x, np.float32(0.0))
    nf = np.rint(xs * _C["C_LOG2E"])
    r = (xs - nf * _C["C_LN2_HI"]) - nf * _C["C_LN2_LO"]
    t = -r
    p = np.full_like(t, _C["C_INV5040"])
    for c in ("C_INV720", "C_INV120", "C_INV24", "C_INV6", "C_INV2"):
        p = p * t + _C[c]
    p = p * t + _ONE
    p = p * t + _ONE
    scale = ((127 - nf.astype(np.int32)).astype(np.uint32) << 23).view(np.float32)
    y = p * scale
    e = (y * np.float32(2.0**32)).astype(np.uint64)
    return np.where(ok, e, np.uint64(0))


def _rows(logits) -> np.ndarray:
    a = np.asarray(logits)
    if a.ndim != 2:
        raise ValueError(f"logits: expected [B, V], got shape {a.shape}")
    return a.astype(np.float32)


def _argmax_f32(l: np.ndarray) -> np.ndarray:
    if l.shape[1] == 0:
        return np.full(l.shape[0], -1, dtype=np.int32)
    valid = ~np.isnan(l)
    m = np.where(valid, l, -np.inf).max(axis=1, initial=-np.inf)
    hit = valid & (l == m[:, None])
    return np.where(hit.any(axis=1), hit.argmax(axis=1), -1).astype(np.int32)


def _write(out, r):
    if out is not None:
        out[...] = r
        return out
    return r


def argmax(logits, out=None):
    """logits [B, V] bf16 or fp32 -> int32 [B]; ties -> smallest index, NaN ignored, all-NaN -> -1."""
    return _write(out, _argmax_f32(_rows(logits)))


def _per_row(name: str, v, rows: int) -> np.ndarray:
    a = np.asarray(v, dtype=np.float32)
    if a.ndim == 0:
        return np.full(rows, a, dtype=np.float32)
    if a.shape != (rows,):
        raise ValueError(f"{name}: expected a float or fp32 [{rows}], got shape {a.shape}")
    return a


def nucleus_keys(x: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """key* per row for x = m - z [B, V] fp32 (NaN = not a token); by sorting, unlike the kernel."""
    keys = np.where(np.isnan(x), np.uint32(0xFFFFFFFF), x.view(np.uint32))
    mass = fixed_exp_neg(x)
    total = mass.sum(axis=1, dtype=np.uint64)
    target = np.array([max(1, math.ceil(float(p) * float(s))) for p, s in zip(top_p, total)], dtype=np.uint64)
    order = np.argsort(keys, axis=1, kind="stable")
    cum = np.cumsum(np.take_along_axis(mass, order, axis=1), axis=1, dtype=np.uint64)
    pos = (cum >= target[:, None]).argmax(axis=1)
    return np.take_along_axis(keys, order, axis=1)[np.arange(len(x)), pos]


def sample(logits, temperature, top_p, seed: int, offset: int = 0, out=None, keys=None):
    """logits [B, V] bf16 or fp32 -> int32 [B]. temperature / top_p: floats or fp32 [B].
    Seeded and reproducible per (seed, offset, row), or per given row key (``keys``: uint64 [B],
    e.g. from ``position_keys``; seed and offset are then unused); see the module docstring."""
    l = _rows(logits)
    rows, vocab = l.shape
    given = None if keys is None else np.asarray(keys)
    if given is not None and (given.dtype != np.uint64 or given.shape != (rows,)):
        raise ValueError(f"keys: expected uint64 [{rows}], got {given.dtype} {given.shape}")
    temp = _per_row("temperature", temperature, rows)
    top_p = _per_row("top_p", top_p, rows)
    result = _argmax_f32(l)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv_t = np.float32(1.0) / temp
        z = l * inv_t[:, None]
    m = np.where(np.isnan(z), -np.inf, z).max(axis=1, initial=-np.inf).astype(np.float32)
    live = (temp > 0) & np.isfinite(m)
    if not live.any():
        return _write(out, result)
    z, m, top_p = z[live], m[live], top_p[live]
    with np.errstate(invalid="ignore"):
        x = (m[:, None] - z).astype(np.float32)
    in_nucleus = ~np.isnan(z)
    filt = top_p < 1
    if filt.any():
        thr = nucleus_keys(x[filt], top_p[filt])
        keys = np.where(np.isnan(x[filt]), np.uint32(0xFFFFFFFF), x[filt].view(np.uint32))
        in_nucleus[filt] &= keys <= thr[:, None]
    keys_rows = (row_keys(seed, offset, rows) if given is None else given)[live]
    g = gumbel(keys_rows[:, None], np.arange(vocab)[None, :])
    score = np.where(in_nucleus, z + g, -np.inf).astype(np.float32)
    result[live] = score.argmax(axis=1)
    return _write(out, result)
