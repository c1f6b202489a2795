"""Float64 MLA attention in the ordinary, NON-absorbed form: K and V are decompressed per head with
``kv_b_proj`` and attention runs over explicit masks. It shares no code with the absorbed path
(``model/mla.py`` + the attention kernel), so comparing the two checks the absorption algebra, the
RoPE layout and the masks at once.
"""

from __future__ import annotations

import numpy as np


def rmsnorm_f64(x, w, eps: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, dtype=np.float64)


def rope_interleaved_f64(x, positions, inv_freq, scale: float = 1.0) -> np.ndarray:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) as complex numbers by angle pos * inv_freq[i]."""
    x = np.asarray(x, dtype=np.float64)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    angle = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    rot = scale * np.exp(1j * angle).reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    z = z * rot
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def decompressed_attention_f64(q_nope, q_pe, c, k_pe, kv_b, num_heads: int, visible, scale: float):
    """q_nope [T, H, dn], q_pe [T, H, dr] (roped); c [L, kv_lora], k_pe [L, dr] (roped); kv_b
    [H*(dn+dv), kv_lora]; visible bool [T, L]. Returns (o [T, H, dv], lse [T, H]) in float64."""
    q_nope, q_pe = np.asarray(q_nope, np.float64), np.asarray(q_pe, np.float64)
    c, k_pe = np.asarray(c, np.float64), np.asarray(k_pe, np.float64)
    dn = q_nope.shape[-1]
    kvb = np.asarray(kv_b, np.float64).reshape(num_heads, -1, c.shape[-1])
    k_nope = np.einsum("lc,hdc->lhd", c, kvb[:, :dn])
    v = np.einsum("lc,hdc->lhd", c, kvb[:, dn:])
    s = (np.einsum("thd,lhd->thl", q_nope, k_nope) + np.einsum("thr,lr->thl", q_pe, k_pe)) * scale
    s = np.where(np.asarray(visible)[:, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    return np.einsum("thl,lhd->thd", p, v) / denom, (m + np.log(denom))[..., 0]


def mla_layer_f64(x, weights: dict, num_heads: int, dims: tuple[int, int, int, int], positions, inv_freq,
                  eps: float, visible, scale: float, rope_scale: float = 1.0) -> np.ndarray:
    """The attention block of a DeepSeek-V3 layer for tokens ``x [T, hidden]`` that attend to each
    other as ``visible [T, T]`` says. ``weights``: host arrays named q_a, q_a_norm (optional), q_b,
    kv_a, kv_a_norm, kv_b, o (HF layouts, see model/mla.MLAWeights); dims = (qk_nope, qk_rope, v_head,
    kv_lora). Returns [T, hidden] float64."""
    dn, dr, _, kvl = dims
    x = np.asarray(x, np.float64)
    w = {k: (None if v is None else np.asarray(v, np.float64)) for k, v in weights.items()}
    t = len(x)
    cq = x if w.get("q_a") is None else rmsnorm_f64(x @ w["q_a"].T, w["q_a_norm"], eps)
    q = (cq @ w["q_b"].T).reshape(t, num_heads, dn + dr)
    q_pe = rope_interleaved_f64(q[..., dn:], positions, inv_freq, rope_scale)
    kv = x @ w["kv_a"].T
    c = rmsnorm_f64(kv[:, :kvl], w["kv_a_norm"], eps)
    k_pe = rope_interleaved_f64(kv[:, kvl:], positions, inv_freq, rope_scale)
    o, _ = decompressed_attention_f64(q[..., :dn], q_pe, c, k_pe, w["kv_b"], num_heads, visible, scale)
    return o.reshape(t, -1) @ w["o"].T
