"""GQA attention of the DFlash block-diffusion drafter, in numpy (float64 math, one bf16 rounding),
plus the shape checks the CUDA wrapper shares.

A batch holds B requests. Request b drafts a block of Q query rows (``q[b]``, Q = the drafter's block
size, 1..16) that attend NON-causally over the keys
  [context rows context_starts[b] .. context_lens[b]-1 of the paged cache ; the Q block rows]
with no mask: every block row sees every key of its request. Context row p of request b lives at
page ``page_table[b, p // page_size]``, row ``p % page_size`` of ``k_cache`` / ``v_cache``; page-table
entries outside the rows read (before the window's first page, past the context's last page) are
never looked at and may hold anything (the engine's PAGE_SENTINEL). Query head h uses kv head
h // (Hq // Hkv). Per (block row, query head): ``s_j = scale * q·k_j``, ``o = softmax(s) @ v``, fp32
or better softmax and accumulation, rounded once to bf16.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

MAX_BLOCK = 16  # block rows per request (Q) the kernel supports
HEAD_DIMS = (64, 128)  # head dims the kernel is built for


def _shape_of(name: str, a, ndim: int) -> tuple:
    shape = tuple(getattr(a, "shape", ()))
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {shape}")
    return shape


def _want(name: str, a, shape: tuple) -> None:
    got = tuple(a.shape)
    if got != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {got}")


def check_shapes(q, k_cache, v_cache, page_table, context_lens, k_block, v_block, context_starts, out,
                 is_bf16, is_int32) -> tuple[int, int, int, int, int, int, int, int]:
    """Shape and dtype checks shared by the reference and the CUDA wrapper (``is_bf16`` / ``is_int32``
    judge a dtype on that backend). Returns (B, Q, Hq, D, num_pages, page_size, Hkv, max_pages)."""
    b, nq, hq, d = _shape_of("q", q, 4)
    num_pages, page_size, hkv, dk = _shape_of("k_cache", k_cache, 4)
    if b < 1:
        raise ValueError(f"q: empty batch (shape {tuple(q.shape)})")
    if not 1 <= nq <= MAX_BLOCK:
        raise ValueError(f"q: {nq} block rows per request (shape {tuple(q.shape)}); 1..{MAX_BLOCK} supported")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head dim {d} (shape {tuple(q.shape)}); supported: {HEAD_DIMS}")
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"q / k_cache: {hq} query heads is not a positive multiple of {hkv} kv heads")
    if dk != d:
        raise ValueError(f"k_cache: expected shape (num_pages, page_size, {hkv}, {d}), got {tuple(k_cache.shape)} "
                         f"(head dim must equal q's {d})")
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"k_cache: expected at least one page of at least one row, got shape {tuple(k_cache.shape)}")
    _want("v_cache", v_cache, (num_pages, page_size, hkv, d))
    _want("k_block", k_block, (b, nq, hkv, d))
    _want("v_block", v_block, (b, nq, hkv, d))
    pt_shape = _shape_of("page_table", page_table, 2)
    if pt_shape[0] != b or pt_shape[1] < 1:
        raise ValueError(f"page_table: expected shape ({b}, max_pages >= 1), got {pt_shape}")
    _want("context_lens", context_lens, (b,))
    if context_starts is not None:
        _want("context_starts", context_starts, (b,))
    if out is not None:
        _want("out", out, (b, nq, hq, d))
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_block", k_block),
                    ("v_block", v_block), ("out", out)):
        if a is not None and not is_bf16(a.dtype):
            raise ValueError(f"{name}: expected dtype bf16, got {a.dtype}")
    for name, a in (("page_table", page_table), ("context_lens", context_lens), ("context_starts", context_starts)):
        if a is not None and not is_int32(a.dtype):
            raise ValueError(f"{name}: expected dtype int32, got {a.dtype}")
    if pt_shape[1] * page_size >= 2**31:
        raise ValueError(f"page_table: capacity {pt_shape[1]} pages x {page_size} rows does not fit int32")
    return b, nq, hq, d, num_pages, page_size, hkv, pt_shape[1]


def check_softmax_scale(softmax_scale) -> float:
    s = float(softmax_scale)
    if not np.isfinite(s):
        raise ValueError(f"softmax_scale: must be finite, got {softmax_scale!r}")
    return s


def check_metadata(page_table: np.ndarray, context_lens: np.ndarray, context_starts, page_size: int,
                   num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Value checks (host arrays): 0 <= start <= len <= capacity, and every page the rows
    [start, len) live on is a real page. Returns (starts, lens) as int64."""
    b, max_pages = page_table.shape
    cap = max_pages * page_size
    lens = np.asarray(context_lens).astype(np.int64)
    starts = np.zeros(b, np.int64) if context_starts is None else np.asarray(context_starts).astype(np.int64)
    bad = np.flatnonzero((lens < 0) | (lens > cap))
    if len(bad):
        r = int(bad[0])
        raise ValueError(f"context_lens: request {r} has {int(lens[r])} context rows; must be in [0, {cap}] "
                         f"(its page table holds {max_pages} pages of {page_size})")
    bad = np.flatnonzero((starts < 0) | (starts > lens))
    if len(bad):
        r = int(bad[0])
        raise ValueError(f"context_starts: request {r} starts at {int(starts[r])}; must be in [0, "
                         f"context_lens = {int(lens[r])}]")
    k = np.arange(max_pages)[None, :]
    used = (k >= (starts // page_size)[:, None]) & (k < (-(-lens // page_size))[:, None]) & (starts < lens)[:, None]
    pt = np.asarray(page_table)
    bad = used & ((pt < 0) | (pt >= num_pages))
    if bad.any():
        r, e = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"page_table: request {r}, entry {e} = {int(pt[r, e])} is out of range [0, {num_pages}) "
                         f"(it holds context rows it must read)")
    return starts, lens


def _is_bf16(dt) -> bool:
    return np.dtype(dt) == np.dtype(bfloat16)


def _is_int32(dt) -> bool:
    return np.dtype(dt) == np.dtype(np.int32)


def gqa_attention(q, k_cache, v_cache, page_table, context_lens, k_block, v_block, softmax_scale,
                  context_starts=None, out=None):
    """q [B, Q, Hq, D] bf16; k_cache / v_cache [num_pages, page_size, Hkv, D] bf16; page_table
    int32 [B, max_pages]; context_lens int32 [B]; k_block / v_block [B, Q, Hkv, D] bf16;
    context_starts int32 [B] or None (0) -> out [B, Q, Hq, D] bf16 (written into ``out`` if given)."""
    b, nq, hq, d, num_pages, page_size, hkv, _ = check_shapes(
        q, k_cache, v_cache, page_table, context_lens, k_block, v_block, context_starts, out, _is_bf16, _is_int32)
    scale = check_softmax_scale(softmax_scale)
    starts, lens = check_metadata(np.asarray(page_table), np.asarray(context_lens), context_starts, page_size,
                                  num_pages)
    group = hq // hkv
    kc = k_cache.reshape(-1, hkv, d)
    vc = v_cache.reshape(-1, hkv, d)
    res = np.empty((b, nq, hq, d), dtype=bfloat16)
    for r in range(b):
        pos = np.arange(starts[r], lens[r])
        slots = page_table[r, pos // page_size].astype(np.int64) * page_size + pos % page_size
        keys = np.concatenate([kc[slots], k_block[r]]).astype(np.float64)  # [n, Hkv, D]
        vals = np.concatenate([vc[slots], v_block[r]]).astype(np.float64)
        kh = np.repeat(keys, group, axis=1)  # [n, Hq, D]: query head h reads kv head h // group
        vh = np.repeat(vals, group, axis=1)
        s = np.einsum("qhd,nhd->qhn", q[r].astype(np.float64), kh) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        o = np.einsum("qhn,nhd->qhd", p, vh) / p.sum(axis=-1, keepdims=True)
        res[r] = o.astype(np.float32).astype(bfloat16)
    if out is not None:
        out[...] = res
        return out
    return res
