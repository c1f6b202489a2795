"""Paged KV cache row moves in numpy: write rows at slots, and the DDTree commit.

A layer's cache is ``[num_pages, page_size, row]``; slot ``s`` is row ``s`` of that array flattened
to ``[num_pages * page_size, row]``. Request b's position p lives at slot
``page_table[b, p // page_size] * page_size + p % page_size``.
"""

from __future__ import annotations

import numpy as np


def slots_of(page_table_row, positions, page_size: int) -> np.ndarray:
    """Cache slots of one request's positions."""
    positions = np.asarray(positions, dtype=np.int64)
    return np.asarray(page_table_row)[positions // page_size].astype(np.int64) * page_size + positions % page_size


def kv_cache_write(cache, rows, slots):
    """In place: ``cache.reshape(-1, row)[slots[i]] = rows[i]``; slots outside [0, capacity) are
    skipped (padding tokens). Slots must be distinct. Returns ``cache``."""
    flat = cache.reshape(-1, cache.shape[-1])
    slots = np.asarray(slots).astype(np.int64)
    keep = (slots >= 0) & (slots < flat.shape[0])
    flat[slots[keep]] = rows[keep]
    return cache


def check_commit(page_table, prefix_lens, accepted, num_accepted, num_pages: int, page_size: int) -> None:
    """Errors naming the request for commit metadata that the kernel cannot move safely."""
    pt, prefix = np.asarray(page_table), np.asarray(prefix_lens)
    acc, na = np.asarray(accepted), np.asarray(num_accepted)
    b = len(prefix)
    if pt.ndim != 2 or pt.shape[0] != b or acc.ndim != 2 or acc.shape[0] != b or na.shape != (b,):
        raise ValueError(f"commit: expected page_table [{b}, pages], accepted [{b}, max_accepted], "
                         f"num_accepted [{b}]; got {pt.shape}, {acc.shape}, {na.shape}")
    for r in range(b):
        n = int(na[r])
        if not 0 <= n <= acc.shape[1]:
            raise ValueError(f"commit: request {r} accepts {n} nodes; 0..{acc.shape[1]} fit in `accepted`")
        if prefix[r] < 0:
            raise ValueError(f"commit: request {r} has a negative prefix length {int(prefix[r])}")
        if n == 0:
            continue
        a = acc[r, :n].astype(np.int64)
        if a[0] < 0 or (np.diff(a) <= 0).any():
            raise ValueError(f"commit: request {r}: accepted node indices must be >= 0 and strictly "
                             f"increasing, got {a.tolist()}")
        last = int(prefix[r] + a[-1])
        pages = last // page_size + 1
        if pages > pt.shape[1]:
            raise ValueError(f"commit: request {r} reaches position {last}, beyond its page table "
                             f"({pt.shape[1]} pages of {page_size})")
        used = pt[r, :pages]
        if ((used < 0) | (used >= num_pages)).any():
            raise ValueError(f"commit: request {r} has page ids out of range [0, {num_pages}) in "
                             f"{used.tolist()}")


def kv_cache_commit(cache, page_table, prefix_lens, accepted, num_accepted):
    """DDTree commit, in place for every layer of ``cache [layers, num_pages, page_size, row]``:
    request b's accepted node ``accepted[b, j]`` (its row written at position prefix + accepted[b, j]
    during verify) moves to position prefix + j, for j < num_accepted[b]. Returns ``cache``."""
    layers, num_pages, page_size, width = cache.shape
    check_commit(page_table, prefix_lens, accepted, num_accepted, num_pages, page_size)
    flat = cache.reshape(layers, -1, width)
    for r in range(len(prefix_lens)):
        n = int(num_accepted[r])
        if n == 0:
            continue
        pos_from = int(prefix_lens[r]) + np.asarray(accepted[r, :n], dtype=np.int64)
        pos_to = int(prefix_lens[r]) + np.arange(n)
        pt = np.asarray(page_table[r])
        # fancy indexing gathers every source row before the scatter: overlapping moves are safe
        flat[:, slots_of(pt, pos_to, page_size)] = flat[:, slots_of(pt, pos_from, page_size)]
    return cache
