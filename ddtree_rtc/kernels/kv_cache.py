"""Paged KV cache row moves on the GPU (cuda_src/kv_cache.cu): write rows at slots, DDTree commit."""

from __future__ import annotations

import numpy as np

from ..reference.kv_cache import check_commit
from ._args import BF16, check

_THREADS = 256
_COMMIT_CHUNKS = 8 * _THREADS  # 16-byte chunks one commit step holds (COMMIT_ITEMS x COMMIT_THREADS)


def _row16(name: str, width: int) -> int:
    if width % 8:
        raise ValueError(f"{name}: row width {width} is not a multiple of 8 bf16 (16-byte accesses)")
    return width // 8


def kv_cache_write(cache, rows, slots):
    """In place: ``cache.reshape(-1, row)[slots[i]] = rows[i]``; slots outside [0, capacity) are
    skipped. cache [..., row] bf16 (one layer); rows [n, row] bf16 (row stride may exceed row);
    slots int32 [n], distinct. Returns ``cache``."""
    from .registry import module

    check("cache", cache, BF16)
    width = cache.shape[-1]
    row16 = _row16("cache", width)
    check("rows", rows, BF16, ndim=2, contiguous=False)
    n = rows.shape[0]
    if rows.shape[1] != width or rows.strides[1] != 2 or rows.strides[0] % 16:
        raise ValueError(f"rows: expected [n, {width}] with contiguous 16-byte-aligned rows, got shape "
                         f"{tuple(rows.shape)} strides {rows.strides}")
    if rows.data.ptr % 16 or cache.data.ptr % 16:
        raise ValueError("cache and rows must be 16-byte aligned")
    check("slots", slots, np.int32, shape=(n,))
    if n == 0:
        return cache
    capacity = cache.size // width
    total = n * row16
    grid = (min(-(-total // _THREADS), 1 << 16),)  # grid-stride loop beyond that
    module("kv_cache").fn("kv_cache_write_kernel")(
        grid, (_THREADS,), (cache, np.int64(capacity), rows, np.int64(rows.strides[0] // 16), slots,
                            np.int32(n), np.int32(row16)))
    return cache


def kv_cache_commit(cache, page_table, prefix_lens, accepted, num_accepted):
    """DDTree commit for every layer at once (one launch): request b's accepted node ``accepted[b, j]``
    moves from position prefix + accepted[b, j] to prefix + j, for j < num_accepted[b].
    cache [layers, num_pages, page_size, row] bf16. The int32 metadata — page_table [B, pages],
    prefix_lens [B], accepted [B, max_accepted] (strictly increasing per row), num_accepted [B] — may
    be host arrays (checked, then copied) or device arrays (trusted: graph-capturable, no sync).
    Returns ``cache``."""
    import cupy

    from .registry import module

    check("cache", cache, BF16, ndim=4)
    layers, num_pages, page_size, width = cache.shape
    row16 = _row16("cache", width)
    if row16 > _COMMIT_CHUNKS:
        raise ValueError(f"cache: rows of {width} values are too wide for the commit kernel")
    meta = (page_table, prefix_lens, accepted, num_accepted)
    if not all(isinstance(a, cupy.ndarray) for a in meta):
        host = [a.get() if isinstance(a, cupy.ndarray) else np.asarray(a) for a in meta]
        check_commit(*host, num_pages=num_pages, page_size=page_size)
        meta = tuple(cupy.asarray(a.astype(np.int32)) for a in host)
    page_table, prefix_lens, accepted, num_accepted = meta
    b = prefix_lens.shape[0] if prefix_lens.ndim == 1 else -1
    check("prefix_lens", prefix_lens, np.int32, shape=(b,))
    check("page_table", page_table, np.int32, shape=(b, None))
    check("accepted", accepted, np.int32, shape=(b, None))
    check("num_accepted", num_accepted, np.int32, shape=(b,))
    if b == 0 or layers == 0:
        return cache
    module("kv_cache").fn("kv_cache_commit_kernel")(
        (b, layers), (_THREADS,),
        (cache, np.int64(num_pages * page_size * row16), np.int32(row16), page_table,
         np.int32(page_table.shape[1]), np.int32(page_size), prefix_lens, accepted, np.int32(accepted.shape[1]),
         num_accepted))
    return cache
