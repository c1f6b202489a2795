"""RoPE reference (in place on a slice of each head) and the host helpers both backends use:
``rope_inv_freq`` (plain or YaRN inverse frequencies) and ``yarn_mscale``."""

from __future__ import annotations

import math

import numpy as np
from ml_dtypes import bfloat16

LAYOUTS = ("interleaved", "half")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention factor 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_dim(rot_dim: int, theta: float, orig_max: float, rotations: float) -> float:
    return rot_dim * math.log(orig_max / (2 * math.pi * rotations)) / (2 * math.log(theta))


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """fp32 [rot_dim/2] inverse frequencies theta^(-2i/rot_dim), YaRN-blended when ``scaling`` is
    ``{"type" (or "rope_type"): "yarn", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow"}`` (docs/architecture.md section 2; low/high are clamped to [0, rot_dim-1] as HF does, which
    changes nothing for K2.6). None or type "default" gives the plain frequencies."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    if theta <= 1:
        raise ValueError(f"rope theta must be > 1, got {theta}")
    i = np.arange(rot_dim // 2, dtype=np.float64)
    freq = theta ** (-2.0 * i / rot_dim)
    kind = None if scaling is None else scaling.get("type", scaling.get("rope_type"))
    if kind in (None, "default"):
        return freq.astype(np.float32)
    if kind != "yarn":
        raise ValueError(f"rope scaling type {kind!r} is not supported (use 'yarn' or none)")
    try:
        factor = float(scaling["factor"])
        orig = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"yarn rope scaling needs {e.args[0]!r}; got keys {sorted(scaling)}") from None
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))
    low = max(math.floor(_yarn_correction_dim(rot_dim, theta, orig, beta_fast)), 0)
    high = min(math.ceil(_yarn_correction_dim(rot_dim, theta, orig, beta_slow)), rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    return (freq / factor * ramp + freq * (1.0 - ramp)).astype(np.float32)


def check_rope_args(shape, rot_offset: int, rot_dim: int, layout: str) -> int:
    """Validate the slice and layout; returns head_dim."""
    if len(shape) not in (2, 3):
        raise ValueError(f"x: expected [tokens, heads, head_dim] or [tokens, head_dim], got shape {tuple(shape)}")
    head_dim = shape[-1]
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    if rot_offset < 0 or rot_offset + rot_dim > head_dim:
        raise ValueError(f"rotated slice [{rot_offset}, {rot_offset + rot_dim}) does not fit head_dim {head_dim}")
    return head_dim


def rope(x, positions, inv_freq, rot_offset: int, rot_dim: int, layout: str, scale: float = 1.0):
    """x [tokens, heads, head_dim] (or [tokens, head_dim]) bf16, rotated IN PLACE and returned;
    positions int32 [tokens]; inv_freq fp32 [rot_dim/2]."""
    check_rope_args(x.shape, rot_offset, rot_dim, layout)
    half = rot_dim // 2
    positions, inv_freq = np.asarray(positions), np.asarray(inv_freq)
    if positions.shape != x.shape[:1]:
        raise ValueError(f"positions: expected shape {x.shape[:1]}, got {positions.shape}")
    if inv_freq.shape != (half,):
        raise ValueError(f"inv_freq: expected shape ({half},), got {inv_freq.shape}")
    if not x.flags.c_contiguous:
        raise ValueError("x: must be C-contiguous (it is rotated in place)")
    xs = x.reshape(x.shape[0], -1, x.shape[-1])
    angle = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    cos = (np.cos(angle.astype(np.float64)).astype(np.float32) * np.float32(scale))[:, None, :]
    sin = (np.sin(angle.astype(np.float64)).astype(np.float32) * np.float32(scale))[:, None, :]
    seg = xs[..., rot_offset:rot_offset + rot_dim].astype(np.float32)
    if layout == "interleaved":
        a, b = seg[..., 0::2], seg[..., 1::2]
    else:
        a, b = seg[..., :half], seg[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(seg)
    if layout == "interleaved":
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    xs[..., rot_offset:rot_offset + rot_dim] = out.astype(bfloat16)
    return x
