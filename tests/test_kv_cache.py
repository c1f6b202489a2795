"""Paged KV cache: host bookkeeping, the numpy write/commit against their definitions (the commit
against one-row-at-a-time moves in increasing order), bad commit metadata, and both kernels on
the GPU against the references."""

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.kv_cache import PAGE_SENTINEL, CacheFullError, PagedKVCache
from ddtree_rtc.reference.kv_cache import check_commit, kv_cache_commit, kv_cache_write, slots_of
from ddtree_rtc.testing import assert_close, random_bf16


def test_cache_bookkeeping():
    cache = PagedKVCache(Backend("numpy", quiet=True), num_layers=2, num_pages=6, page_size=4, row=16)
    assert cache.data.shape == (2, 6, 4, 16) and cache.data.dtype == bfloat16
    alloc = cache.allocator
    alloc.reserve("a", 5)
    alloc.reserve("b", 1)
    assert alloc.capacity("a") == 8 and alloc.capacity("b") == 4 and alloc.num_free_pages == 3
    alloc.reserve("a", 8)  # fits what it holds
    assert alloc.num_free_pages == 3
    with pytest.raises(CacheFullError, match="needs 4 more pages"):
        alloc.reserve("b", 17)
    assert alloc.num_free_pages == 3 and alloc.capacity("b") == 4, "a failed reservation allocates nothing"
    pa = alloc.pages("a")
    slots = alloc.slots("a", [0, 3, 4, 7])
    assert slots.dtype == np.int32
    assert slots.tolist() == [pa[0] * 4, pa[0] * 4 + 3, pa[1] * 4, pa[1] * 4 + 3]
    with pytest.raises(ValueError, match="outside its capacity 8"):
        alloc.slots("a", [8])
    table = alloc.page_table(["b", "a"], width=4)
    assert table.shape == (2, 4) and table[0, 0] == alloc.pages("b")[0]
    assert table[1, :2].tolist() == pa and (table[0, 1:] == PAGE_SENTINEL).all()
    with pytest.raises(ValueError, match="width 1 < 2"):
        alloc.page_table(["a"], width=1)
    alloc.trim("a", 3)
    assert alloc.pages("a") == pa[:1] and alloc.num_free_pages == 4
    alloc.free("a")
    assert "a" not in alloc and alloc.num_free_pages == 5
    with pytest.raises(KeyError, match="no pages"):
        alloc.capacity("a")
    alloc.reserve("c", 20)
    assert alloc.num_free_pages == 0 and len(set(alloc.pages("c")) | set(alloc.pages("b"))) == 6


def test_write_reference(rng):
    cache = np.zeros((3, 4, 8), bfloat16)
    rows = random_bf16(rng, (5, 8))
    slots = np.array([11, -1, 0, 12, 5], np.int32)  # -1 and 12 (past capacity) are skipped
    kv_cache_write(cache, rows, slots)
    flat = cache.reshape(-1, 8).astype(np.float32)
    assert np.array_equal(flat[[11, 0, 5]], rows[[0, 2, 4]].astype(np.float32))
    assert np.count_nonzero(np.abs(flat).sum(1)) == 3


def sequential_commit(cache, page_table, prefix, accepted, num_accepted):
    """The definition: move accepted rows one at a time in increasing order (each target is at or
    before its source and past every row still to be read)."""
    ps = cache.shape[2]
    flat = cache.reshape(cache.shape[0], -1, cache.shape[-1])
    for b in range(len(prefix)):
        for j in range(int(num_accepted[b])):
            src = slots_of(page_table[b], [prefix[b] + accepted[b, j]], ps)[0]
            dst = slots_of(page_table[b], [prefix[b] + j], ps)[0]
            flat[:, dst] = flat[:, src]
    return cache


def random_commit_case(rng, layers=3, page_size=3, width=16, batch=4, max_nodes=40):
    n_nodes = rng.integers(1, max_nodes, size=batch)
    prefix = rng.integers(0, 20, size=batch)
    need = -(-(prefix + n_nodes) // page_size)
    num_pages = int(need.sum()) + 2
    perm = rng.permutation(num_pages)
    pt = np.full((batch, int(need.max()) + 1), PAGE_SENTINEL, np.int32)
    off = 0
    for b in range(batch):
        pt[b, :need[b]] = perm[off:off + need[b]]
        off += need[b]
    max_acc = int(n_nodes.max())
    accepted = np.full((batch, max_acc), -7, np.int32)
    num_accepted = np.zeros(batch, np.int32)
    for b in range(batch):
        k = int(rng.integers(0, n_nodes[b] + 1))
        pick = np.sort(rng.choice(np.arange(1, n_nodes[b]), size=max(k - 1, 0), replace=False)) if k else []
        acc = ([0] + list(pick))[:k]
        accepted[b, :k] = acc
        num_accepted[b] = k
    cache = random_bf16(rng, (layers, num_pages, page_size, width))
    return cache, pt, prefix.astype(np.int32), accepted, num_accepted


def test_commit_reference_equals_sequential_moves(rng):
    for _ in range(20):
        cache, pt, prefix, acc, na = random_commit_case(rng)
        want = sequential_commit(cache.copy(), pt, prefix, acc, na)
        got = kv_cache_commit(cache.copy(), pt, prefix, acc, na)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_commit_overlapping_chain():
    """Accepted [0, 2, 3, 5]: rows 2->1, 3->2, 5->3; row 3 is read before it is overwritten."""
    cache = np.arange(8, dtype=np.float32).reshape(1, 1, 8, 1).repeat(2, axis=3).astype(bfloat16)
    kv_cache_commit(cache, np.array([[0]], np.int32), np.array([0], np.int32), np.array([[0, 2, 3, 5]], np.int32),
                    np.array([4], np.int32))
    assert cache[0, 0, :, 0].astype(int).tolist() == [0, 2, 3, 5, 4, 5, 6, 7]


def test_commit_rejects_bad_metadata():
    pt = np.array([[0, 1]], np.int32)
    args = dict(num_pages=2, page_size=4)
    check_commit(pt, [2], np.array([[0, 1, 3]]), [3], **args)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_commit(pt, [2], np.array([[0, 3, 3]]), [3], **args)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_commit(pt, [2], np.array([[-1, 3, 4]]), [3], **args)
    with pytest.raises(ValueError, match="beyond its page table"):
        check_commit(pt, [6], np.array([[0, 1, 3]]), [3], **args)
    with pytest.raises(ValueError, match="accepts 4 nodes"):
        check_commit(pt, [2], np.array([[0, 1, 3]]), [4], **args)
    with pytest.raises(ValueError, match="page ids out of range"):
        check_commit(np.array([[0, 9]], np.int32), [2], np.array([[0, 1, 3]]), [3], **args)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_write_kernel(rng):
    import cupy

    from ddtree_rtc.kernels.kv_cache import kv_cache_write as gpu_write
    from ddtree_rtc.testing import to_device_bf16

    cache = random_bf16(rng, (7, 5, 576))
    full = random_bf16(rng, (40, 600))  # rows are a strided view [:, :576] of wider rows
    rows = full[:, :576]
    slots = rng.permutation(35)[:40 - 5].tolist() + [-1, 35, 2**31 - 1, -5, 999]
    slots = np.array(slots, np.int32)
    want = kv_cache_write(cache.copy(), rows, slots)
    d_cache = to_device_bf16(cache)
    got = gpu_write(d_cache, to_device_bf16(full)[:, :576], cupy.asarray(slots))
    assert got is d_cache
    assert np.array_equal(got.get(), want.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("device_meta", [False, True])
def test_commit_kernel(rng, device_meta):
    import cupy

    from ddtree_rtc.kernels.kv_cache import kv_cache_commit as gpu_commit
    from ddtree_rtc.testing import to_device_bf16

    cases = [random_commit_case(rng, layers=5, page_size=3, width=576, batch=6, max_nodes=70),
             random_commit_case(rng, layers=61, page_size=64, width=576, batch=3, max_nodes=9),
             random_commit_case(rng, layers=2, page_size=1, width=64, batch=2, max_nodes=200)]
    for cache, pt, prefix, acc, na in cases:
        want = kv_cache_commit(cache.copy(), pt, prefix, acc, na)
        meta = (pt, prefix, acc, na)
        if device_meta:
            meta = tuple(cupy.asarray(a) for a in meta)
        d_cache = to_device_bf16(cache)
        assert gpu_commit(d_cache, *meta) is d_cache
        assert np.array_equal(d_cache.get(), want.view(np.uint16)), "commit moved rows differently"


@pytest.mark.gpu
def test_commit_kernel_rejects_host_metadata_errors():
    import cupy

    from ddtree_rtc.kernels.kv_cache import kv_cache_commit as gpu_commit

    cache = cupy.zeros((2, 2, 4, 576), cupy.uint16)
    with pytest.raises(ValueError, match="strictly increasing"):
        gpu_commit(cache, np.array([[0, 1]], np.int32), np.array([1], np.int32), np.array([[0, 2, 2]], np.int32),
                   np.array([3], np.int32))


@pytest.mark.gpu
def test_cache_object_on_gpu(rng):
    """PagedKVCache.write / commit through the CUDA backend match the numpy backend."""
    outs = []
    rows = random_bf16(rng, (6, 576))
    for kind in ("numpy", "cuda"):
        be = Backend(kind)
        cache = PagedKVCache(be, num_layers=3, num_pages=8, page_size=4)
        cache.allocator.reserve(0, 9)
        for layer in range(3):
            cache.write(layer, be.asarray(rows), be.asarray(cache.allocator.slots(0, np.arange(3, 9))))
        cache.commit(cache.allocator.page_table([0]), np.array([3], np.int32), np.array([[0, 2, 5]], np.int32),
                     np.array([3], np.int32))
        outs.append(be.to_host(cache.data).astype(np.float32))
    assert_close(outs[1], outs[0], "bf16", "cache")
    assert np.array_equal(outs[1], outs[0])
