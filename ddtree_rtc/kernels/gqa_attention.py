"""The DFlash drafter's GQA attention on the GPU (cuda_src/gqa_attention.cu).

One CTA per (request, kv head, 64-row query tile, context split); the query tile is the block's Q
rows x the Hq / Hkv query heads of the kv head. The number of splits comes from host-known shapes
only (the page table's capacity, the batch, the heads, the SM count), never from the lengths, so the
wrapper neither copies the int32 metadata to the host nor synchronises; the kernel deals the window's
64-row chunks to the splits from the device-side lengths. With more than one split the CTAs write
fp32 partials and log2-sum-exps to a workspace and a merge kernel writes the bf16 output.

Checked here: shapes, dtypes, contiguity. Not checked (the values stay on the device): page ids and
lengths; the kernel clamps len to the page table's capacity and start to [0, len], and reads only the
page-table entries of rows [start, len), but a bad page id inside that range is read as given. The
numpy reference (ddtree_rtc.reference.gqa_attention) checks the values.
"""

from __future__ import annotations

import numpy as np

from ..reference.gqa_attention import check_shapes, check_softmax_scale
from ._args import BF16, allow_dynamic_smem, check
from ._launch import sm_count
from .registry import module

BM = 64  # query rows per CTA (mirrors cuda_src/gqa_attention.cu)
BN = 64  # keys per chunk
THREADS = 128
ROWS_PER_SPLIT = 1024  # one split per this many rows of page-table capacity ...
MERGE_THREADS = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def smem_bytes(d: int) -> int:
    """Q [64][D] + 2 stages of K, V [64][D], bf16 (Tile<D>::SMEM in the .cu)."""
    return (BM * d + 4 * BN * d) * 2


def num_splits(batch: int, hkv: int, m_tiles: int, capacity: int, num_sms: int) -> int:
    """Context splits per (request, kv head, query tile): one per ROWS_PER_SPLIT rows of capacity,
    capped at the fewest that make the grid cover ``num_sms`` SMs. A pure function of shapes."""
    by_rows = max(1, _cdiv(capacity, ROWS_PER_SPLIT))
    fill = max(1, _cdiv(num_sms, batch * hkv * m_tiles))
    return min(by_rows, fill)


def split_chunks(n_rows: int, splits: int, s: int) -> tuple[int, int]:
    """Chunks [c0, c1) of a window of ``n_rows`` context rows that split ``s`` takes (mirrors
    split_chunks() in the .cu; the last split also takes the block's own rows)."""
    chunks = _cdiv(n_rows, BN)
    per = _cdiv(chunks, splits)
    c0 = min(s * per, chunks)
    return c0, min(c0 + per, chunks)


def _is_bf16(dt) -> bool:
    return np.dtype(dt) == BF16


def _is_int32(dt) -> bool:
    return np.dtype(dt) == np.dtype(np.int32)


def gqa_attention(q, k_cache, v_cache, page_table, context_lens, k_block, v_block, softmax_scale,
                  context_starts=None, out=None):
    """q [B, Q, Hq, D] bf16; k_cache / v_cache [num_pages, page_size, Hkv, D] bf16; page_table
    int32 [B, max_pages]; context_lens int32 [B]; k_block / v_block [B, Q, Hkv, D] bf16;
    context_starts int32 [B] or None -> out [B, Q, Hq, D] bf16 (cupy arrays; bf16 as uint16 bits).
    No host copy, no synchronisation; allocates only ``out`` (if not given) and, with splits, the
    fp32 workspace (from CuPy's pool)."""
    import cupy

    arrays = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table),
              ("context_lens", context_lens), ("k_block", k_block), ("v_block", v_block),
              ("context_starts", context_starts), ("out", out))
    for name, a in arrays:
        if a is not None and not isinstance(a, cupy.ndarray):
            raise TypeError(f"{name}: expected a cupy array on the GPU, got {type(a).__name__}")
    b, nq, hq, d, _, page_size, hkv, max_pages = check_shapes(
        q, k_cache, v_cache, page_table, context_lens, k_block, v_block, context_starts, out, _is_bf16, _is_int32)
    scale = check_softmax_scale(softmax_scale)
    for name, a in arrays:
        if a is not None:
            check(name, a)  # contiguity
    if out is None:
        out = cupy.empty((b, nq, hq, d), dtype=BF16)

    m_tiles = _cdiv(nq * (hq // hkv), BM)
    splits = num_splits(b, hkv, m_tiles, max_pages * page_size, sm_count())
    rows = b * nq * hq
    if splits > 1:
        o_part = cupy.empty((splits, rows, d), dtype=cupy.float32)
        lse_part = cupy.empty((splits, rows), dtype=cupy.float32)
    else:
        o_part = lse_part = np.uint64(0)
    mod = module("gqa_attention")
    fn = mod.fn(f"gqa_attention_d{d}_kernel")
    smem = smem_bytes(d)
    allow_dynamic_smem(fn, smem)
    starts = context_starts if context_starts is not None else np.uint64(0)
    fn((b * hkv, m_tiles, splits), (THREADS,),
       (q, k_cache, v_cache, page_table, context_lens, starts, k_block, v_block, np.int32(nq), np.int32(hq),
        np.int32(hkv), np.int32(page_size), np.int32(max_pages), np.float32(scale * np.log2(np.e)), out,
        o_part, lse_part), shared_mem=smem)
    if splits > 1:
        mod.fn("gqa_attention_merge_kernel")(
            (_cdiv(rows * (d // 4), MERGE_THREADS),), (MERGE_THREADS,),
            (o_part, lse_part, np.int32(splits), np.int64(rows), np.int32(d), out))
    return out
