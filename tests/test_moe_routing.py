"""MoE routing: noaux_tc reference vs an independent float64 formula (n_group > 1 too), the tie and
NaN rules, the align step, a numpy emulation of the routing kernel's merge path (bitwise); on the GPU the
kernels vs the reference (ids exact, weights close) and the merge path vs the scan (bitwise)."""

import numpy as np
import pytest

from ddtree_rtc.reference.moe_routing import (
    align_capacities,
    limit_to_groups,
    moe_align,
    moe_route,
    router_logits,
    selection_scores,
)
from ddtree_rtc.testing import assert_close, random_bf16, to_host

# (E, top_k, n_group, topk_group): K2.6, DeepSeek-V3, an EP8 shard, small odd ones, and every
# register-capacity entry of the kernel (64, 128, 256, 384, 512, 1024 experts)
ROUTES = [(384, 8, 1, 1), (256, 8, 8, 4), (48, 8, 1, 1), (64, 6, 4, 2), (33, 3, 1, 1), (96, 8, 3, 2),
          (500, 8, 5, 2), (1000, 16, 1, 1)]


def f64_route(logits, bias, top_k, n_group, topk_group, norm, scale, in_order=False):
    """Per token, in float64, written from DESIGN.md section 2; also returns the selection margin:
    the gap at the kept groups' and the picked experts' boundaries (what decides the set), and with
    ``in_order`` every adjacent gap of the picks too (what decides their order)."""
    m, e = logits.shape
    ids, ws, margins = [], [], []
    for t in range(m):
        s = 1.0 / (1.0 + np.exp(-logits[t].astype(np.float64)))
        b = s + (bias.astype(np.float64) if bias is not None else 0.0)
        margin = np.inf
        if n_group > 1:
            gs = e // n_group
            gscore = [sum(sorted(b[j * gs:(j + 1) * gs], reverse=True)[:2]) for j in range(n_group)]
            order = sorted(range(n_group), key=lambda j: (-gscore[j], j))
            margin = gscore[order[topk_group - 1]] - gscore[order[topk_group]]
            keep = set(order[:topk_group])
            b = np.array([b[x] if x // gs in keep else -np.inf for x in range(e)])
        order = sorted(range(e), key=lambda x: (-b[x], x))
        first = 0 if in_order else top_k - 1
        gaps = [b[order[i]] - b[order[i + 1]] for i in range(first, top_k) if np.isfinite(b[order[i + 1]])]
        margin = min([margin, *gaps])
        w = s[order[:top_k]]
        if norm:
            w = w / w.sum()
        ids.append(order[:top_k])
        ws.append(w * scale)
        margins.append(margin)
    return np.array(ids), np.array(ws), np.array(margins)


def random_logits(rng, m, e):
    return (rng.standard_normal((m, e)) * 2).astype(np.float32)


@pytest.mark.parametrize("e,top_k,n_group,topk_group", ROUTES)
@pytest.mark.parametrize("norm", [True, False])
def test_reference_vs_float64(rng, e, top_k, n_group, topk_group, norm):
    m = 64
    logits = random_logits(rng, m, e)
    bias = rng.uniform(-0.3, 0.3, e).astype(np.float32)
    ids, w = moe_route(logits, bias, top_k, n_group, topk_group, norm, 2.827)
    # ids are compared in pick order, so the margin covers the order, not only the set
    ids64, w64, margin = f64_route(logits, bias, top_k, n_group, topk_group, norm, 2.827, in_order=True)
    clear = margin > 1e-6  # fp32 vs fp64 may swap a near tie (each fp32 score is off by < 2e-7)
    assert clear.mean() > 0.9
    assert ids.dtype == np.int32 and w.dtype == np.float32
    assert np.array_equal(ids[clear], ids64[clear])
    assert_close(w[clear], w64[clear], "fp32", "weights")
    if norm:
        assert np.allclose(w.sum(1), 2.827, rtol=1e-5)


def test_bias_selects_but_does_not_weigh(rng):
    e, m = 16, 8
    logits = random_logits(rng, m, e)
    bias = np.zeros(e, np.float32)
    bias[[3, 11]] = 10.0  # always selected, whatever the logits
    ids, w = moe_route(logits, bias, 4, norm_topk_prob=False)
    assert (np.sort(ids[:, :2], axis=1) == [3, 11]).all()
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    assert np.allclose(w, np.take_along_axis(s, ids, 1), rtol=1e-6)


def test_ties_go_to_the_lower_index_and_nan_counts_as_minus_inf():
    logits = np.zeros((2, 12), np.float32)
    logits[1, [0, 2, 5]] = np.nan
    ids, w = moe_route(logits, None, 4)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [1, 3, 4, 6]
    assert np.allclose(w, 0.25)
    logits = np.full((1, 4), np.nan, np.float32)  # nothing finite: lowest indices, NaN weights
    ids, w = moe_route(logits, None, 2)
    assert ids[0].tolist() == [0, 1] and np.isnan(w).all()


def test_group_limit_keeps_whole_groups(rng):
    e, n_group, topk_group = 32, 4, 2
    logits = random_logits(rng, 16, e)
    ids, _ = moe_route(logits, None, 6, n_group, topk_group)
    for row in ids:
        assert len(set((row // (e // n_group)).tolist())) <= topk_group


def test_route_rejects_bad_shapes():
    x = np.zeros((2, 12), np.float32)
    with pytest.raises(ValueError, match="n_group must divide"):
        moe_route(x, None, 2, n_group=5)
    with pytest.raises(ValueError, match="topk_group must be in"):
        moe_route(x, None, 2, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_route(x, None, 7, n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="logits: expected fp32"):
        moe_route(x.astype(np.float64), None, 2)


def test_router_logits_reference(rng):
    x, w = random_bf16(rng, (5, 64)), random_bf16(rng, (12, 64))
    assert_close(router_logits(x, w), x.astype(np.float64) @ w.astype(np.float64).T, "fp32")


def check_alignment(al, ids, num_experts, block, large_block=None, large_above=None):
    """Every in-range pair exactly once, ascending within its expert's run; an expert with more than
    ``large_above`` pairs in the large list, runs padded to their list's block, each list in expert
    order, block owners right, within the capacities."""
    flat = ids.reshape(-1)
    p = flat.size
    lb, la = (block, p) if large_block is None else (large_block, min(large_above, p))
    assert (al.block, al.large_block, al.large_above) == (block, lb, la)
    cap_s, cap_l = align_capacities(p, num_experts, block, lb, la)
    assert (al.small_capacity, al.large_capacity) == (cap_s, cap_l)
    counts = to_host(al.counts)
    offsets = to_host(al.offsets)
    nb = to_host(al.num_blocks)
    sp = to_host(al.sorted_pairs)
    be = to_host(al.block_expert)
    assert sp.shape == (cap_s + cap_l,) and be.shape == (cap_s // block + cap_l // lb,)
    valid = (flat >= 0) & (flat < num_experts)
    assert counts.tolist() == np.bincount(flat[valid], minlength=num_experts).tolist()
    ends = [0, cap_s]
    for e in range(num_experts):
        c = counts[e]
        large = int(c > la)
        b = lb if large else block
        assert offsets[e] == ends[large], f"expert {e}: runs follow each other in expert order"
        run = sp[offsets[e]:offsets[e] + -(-c // b) * b]
        assert run[:c].tolist() == np.flatnonzero(flat == e).tolist()
        assert (run[c:] == p).all() and len(run) == -(-c // b) * b
        b0 = cap_s // block + (offsets[e] - cap_s) // lb if large else offsets[e] // block
        assert (be[b0:b0 + len(run) // b] == e).all()
        ends[large] += len(run)
    assert nb.tolist() == [ends[0] // block, (ends[1] - cap_s) // lb]
    assert ends[0] <= cap_s and ends[1] <= cap_s + cap_l
    assert int(to_host(al.error)[0]) == int(not valid.all())


@pytest.mark.parametrize("m,top_k,e,block", [(1, 8, 384, 8), (33, 8, 384, 32), (7, 3, 5, 8), (300, 8, 48, 32)])
def test_align_reference(rng, m, top_k, e, block):
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    check_alignment(moe_align(ids, e, block), ids, e, block)


def skewed_ids(rng, m, top_k, e):
    """Per token top_k distinct experts, a few experts far more popular than the rest."""
    p = rng.pareto(1.0, e) + 0.01
    return np.stack([rng.choice(e, top_k, replace=False, p=p / p.sum()) for _ in range(m)]).astype(np.int32)


@pytest.mark.parametrize("m,top_k,e,large_above", [(40, 8, 64, 8), (200, 8, 384, 8), (200, 8, 384, 16),
                                                   (5, 3, 7, 0), (30, 4, 6, 2), (9, 8, 16, 100)])
def test_align_reference_two_lists(rng, m, top_k, e, large_above):
    ids = skewed_ids(rng, m, top_k, e)
    al = moe_align(ids, e, 8, large_block=32, large_above=large_above)
    check_alignment(al, ids, e, 8, 32, large_above)
    counts = np.bincount(ids.reshape(-1), minlength=e)
    assert int(al.num_blocks[1]) == sum(-(-c // 32) for c in counts if c > large_above)


def test_align_capacities_bound_the_worst_routing():
    # every count at the threshold, or all pairs on few experts: the lists must still fit
    for p, e, t in [(64, 8, 8), (64, 64, 8), (72, 8, 8), (2048, 384, 8), (2048, 384, 16), (30, 5, 0)]:
        cap_s, cap_l = align_capacities(p, e, 8, 32, t)
        for counts in ([t] * (p // max(t, 1)) + [p % max(t, 1)], [p // e] * e, [t + 1] * (p // (t + 1)), [p]):
            counts = [c for c in counts if c][:e]
            small = sum(-(-c // 8) * 8 for c in counts if c <= t)
            large = sum(-(-c // 32) * 32 for c in counts if c > t)
            assert small <= cap_s and large <= cap_l, (p, e, t, counts)
    assert align_capacities(8, 384, 8, 32, 8)[1] == 0  # M=1: no large list at all
    assert align_capacities(8, 384, 8, 32, 0)[0] == 0  # nt 4 forced: no small list


def test_align_out_of_range_ids(rng):
    ids = np.array([[0, 5], [2, 9]], np.int32)
    with pytest.raises(ValueError, match="expert id 9 at pair 3 .token 1. is out of range"):
        moe_align(ids, 6, 8)
    al = moe_align(ids, 6, 8, check_ids=False)
    check_alignment(al, ids, 6, 8)


# ---- GPU ----

# The merge path of moe_route_e* (include/moe_route.cuh: warp_top), step by step in numpy over all
# tokens at once: the same order keys, the same per-lane bitonic networks and butterfly rounds.
MERGE_K = 8


def order_keys(b):
    """Selection scores fp32 [..] -> the kernel's order_key: uint32 with the same order, -0 = +0,
    NaN = -inf."""
    b = np.where(np.isnan(b), np.float32(-np.inf), b).astype(np.float32)
    b = np.where(b == 0, np.float32(0), b).astype(np.float32)
    u = b.view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def order2(v, i, j):
    """v[..., i] <- max, v[..., j] <- min."""
    hi, lo = np.maximum(v[..., i], v[..., j]), np.minimum(v[..., i], v[..., j])
    v[..., i], v[..., j] = hi, lo


def bitonic_merge_desc(v):
    n = v.shape[-1]
    d = n // 2
    while d:
        for i in range(n):
            if not i & d:
                order2(v, i, i + d)
        d //= 2


def bitonic_sort_desc(v):
    n, k = v.shape[-1], 2
    while k <= n:
        d = k // 2
        while d:
            for i in range(n):
                if not i & d:
                    if (not i & k) or k == n:
                        order2(v, i, i + d)  # this k-run descending
                    else:
                        order2(v, i + d, i)
            d //= 2
        k *= 2


def top_of_two(a, b):
    """a (N, descending) and b (S <= N, descending) -> their top N, descending."""
    a = a.copy()
    s = b.shape[-1]
    a[..., -s:] = np.maximum(a[..., -s:], b[..., ::-1])
    bitonic_merge_desc(a)
    return a


def merge_route(logits, bias, top_k, n_group, topk_group, norm, scale):
    """The merge path's (ids, weights); the group limit is the reference's (the kernel's is unchanged)."""
    m, e = logits.shape
    s, b = selection_scores(logits, bias)
    if n_group > 1:
        b = limit_to_groups(b, n_group, topk_group)
    epl = next(c for c in (64, 128, 256, 384, 512, 1024) if c >= e) // 32
    idx = np.arange(32)[:, None] + 32 * np.arange(epl)[None, :]  # [lane, j] -> expert
    key = np.zeros((m, 32, epl), np.uint64)
    key[:, idx < e] = order_keys(b)[:, idx[idx < e]]
    pick = (key << np.uint64(32)) | (~idx.astype(np.uint32)).astype(np.uint64)  # absent experts: key 0
    top = np.zeros((m, 32, MERGE_K), np.uint64)
    for c in range(-(-epl // MERGE_K)):  # chunks of 8; a short last one sorted at the next power of two
        j = np.arange(c * MERGE_K, min(epl, (c + 1) * MERGE_K))
        t = np.zeros((m, 32, 1 << (j.size - 1).bit_length()), np.uint64)
        t[..., :j.size] = pick[..., j]
        bitonic_sort_desc(t)
        if c == 0:
            top[..., :t.shape[-1]] = t
        else:
            top = top_of_two(top, t)
    o = 16
    while o:
        top = top_of_two(top, top[:, np.arange(32) ^ o])
        o //= 2
    assert (top == top[:, :1]).all()  # every lane holds the same list
    ids = (~(top[:, 0, :top_k] & np.uint64(0xFFFFFFFF)).astype(np.uint32)).astype(np.int32)
    w = np.take_along_axis(s, ids, axis=-1)
    total = w[:, 0].copy()
    for i in range(1, top_k):
        total = total + w[:, i]
    if norm:
        w = w / (total[:, None] + np.float32(1e-20))
    return ids, (w * np.float32(scale)).astype(np.float32)


def tied_logits(rng, m, e):
    """A coarse grid (many equal scores), NaN logits, a token of all NaN, +-inf."""
    logits = (rng.integers(-2, 3, (m, e)) / 2).astype(np.float32)
    logits[1, ::3] = np.nan
    logits[2] = np.nan
    logits[3, :5] = np.inf
    logits[3, 5:9] = -np.inf
    return logits


@pytest.mark.parametrize("e,top_k,n_group,topk_group", [r for r in ROUTES if r[1] <= MERGE_K]
                         + [(384, 1, 1, 1), (384, 8, 8, 2), (384, 8, 12, 4), (5, 3, 1, 1), (8, 8, 2, 2)])
def test_merge_path_emulation_matches_reference_bitwise(rng, e, top_k, n_group, topk_group):
    m = 17
    biases = [None, rng.uniform(-0.3, 0.3, e).astype(np.float32),
              np.where(rng.random(e) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)]
    for logits in (random_logits(rng, m, e), tied_logits(rng, m, e)):
        for bias in biases:
            for norm in (True, False):
                ids_ref, w_ref = moe_route(logits, bias, top_k, n_group, topk_group, norm, 2.827)
                ids, w = merge_route(logits, bias, top_k, n_group, topk_group, norm, 2.827)
                assert np.array_equal(ids, ids_ref)
                assert np.array_equal(w.view(np.uint32), w_ref.view(np.uint32))


def test_route_kernel_wrapper_rejects_an_unknown_selection():
    from ddtree_rtc.kernels.moe_routing import moe_route as k_route

    with pytest.raises(ValueError, match="selection must be 'merge' or 'scan'"):
        k_route(np.zeros((1, 8), np.float32), None, 2, selection="radix")


def test_bitonic_networks_sort():
    rng = np.random.default_rng(0)
    v = rng.permutation(1 << 16).astype(np.uint64)[:4096].reshape(512, 8)
    t = v.copy()
    bitonic_sort_desc(t)
    assert np.array_equal(t, -np.sort(-v.astype(np.int64), axis=-1))
    a, b = t[:256], t[256:]
    assert np.array_equal(top_of_two(a, b), -np.sort(-np.concatenate([a, b], 1).astype(np.int64))[:, :8])
    assert np.array_equal(top_of_two(a, b[:, :4]), -np.sort(-np.concatenate([a, b[:, :4]], 1).astype(np.int64))[:, :8])


@pytest.mark.gpu
@pytest.mark.parametrize("e,top_k,n_group,topk_group", ROUTES)
@pytest.mark.parametrize("m", [1, 3, 7, 8, 17, 33, 64, 256, 1000])
def test_route_kernel_vs_reference(rng, e, top_k, n_group, topk_group, m):
    import cupy

    from ddtree_rtc.kernels.moe_routing import moe_route as k_route

    logits = random_logits(rng, m, e)
    logits[0, 1] = np.nan
    bias = rng.uniform(-0.3, 0.3, e).astype(np.float32)
    ids_ref, w_ref = moe_route(logits, bias, top_k, n_group, topk_group, True, 2.827)
    out_ids = cupy.full((m, top_k), -7, cupy.int32)
    out_w = cupy.full((m, top_k), np.nan, cupy.float32)
    ids, w = k_route(cupy.asarray(logits), cupy.asarray(bias), top_k, n_group, topk_group, True, 2.827,
                     out_ids=out_ids, out_weights=out_w)
    assert ids is out_ids and w is out_w
    assert np.array_equal(ids.get(), ids_ref)
    assert_close(w, w_ref, "fp32", "weights")
    ids2, w2 = k_route(cupy.asarray(logits), None, top_k, n_group, topk_group, False, 1.0)
    ids2_ref, w2_ref = moe_route(logits, None, top_k, n_group, topk_group, False, 1.0)
    assert np.array_equal(ids2.get(), ids2_ref)
    assert_close(w2, w2_ref, "fp32", "weights")


@pytest.mark.gpu
@pytest.mark.parametrize("e,top_k,n_group,topk_group", ROUTES)
def test_route_kernel_ties(rng, e, top_k, n_group, topk_group):
    """Logits on a coarse grid: many equal scores (ties to the lower index), -0.0 / +0.0 biases
    that must tie, NaN logits (count as -inf), and a token whose logits are all NaN."""
    import cupy

    from ddtree_rtc.kernels.moe_routing import moe_route as k_route

    m = 37
    logits = (rng.integers(-2, 3, (m, e)) / 2).astype(np.float32)
    logits[1, ::3] = np.nan
    logits[2] = np.nan
    for bias in (None, np.where(rng.random(e) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)):
        ids_ref, w_ref = moe_route(logits, bias, top_k, n_group, topk_group, True, 2.827)
        ids, w = k_route(cupy.asarray(logits), None if bias is None else cupy.asarray(bias), top_k, n_group,
                         topk_group, True, 2.827)
        assert np.array_equal(ids.get(), ids_ref)
        assert_close(w, w_ref, "fp32", "weights")


@pytest.mark.gpu
@pytest.mark.parametrize("e,top_k,n_group,topk_group", [r for r in ROUTES if r[1] <= MERGE_K]
                         + [(384, 1, 1, 1), (384, 8, 8, 2), (384, 8, 12, 4), (5, 3, 1, 1), (8, 8, 2, 2)])
@pytest.mark.parametrize("m", [1, 7, 17, 33, 64])
def test_route_kernel_merge_equals_scan_bitwise(rng, e, top_k, n_group, topk_group, m):
    """The merge path gives the scan's bits (ids, weights) on random, tied, NaN and inf logits, with
    and without a bias (-0.0 / +0.0 ones too), every output pre-filled with NaN / -7."""
    import cupy

    from ddtree_rtc.kernels.moe_routing import moe_route as k_route

    biases = [None, rng.uniform(-0.3, 0.3, e).astype(np.float32),
              np.where(rng.random(e) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)]
    for logits in (random_logits(rng, m, e), tied_logits(rng, max(m, 4), e)[:m]):
        for bias in biases:
            for norm in (True, False):
                args = (cupy.asarray(logits), None if bias is None else cupy.asarray(bias), top_k, n_group,
                        topk_group, norm, 2.827)
                got = {}
                for sel in ("merge", "scan"):
                    ids = cupy.full((m, top_k), -7, cupy.int32)
                    w = cupy.full((m, top_k), np.nan, cupy.float32)
                    k_route(*args, out_ids=ids, out_weights=w, selection=sel)
                    got[sel] = (ids.get(), w.get())
                assert np.array_equal(got["merge"][0], got["scan"][0])
                assert np.array_equal(got["merge"][1].view(np.uint32), got["scan"][1].view(np.uint32))
                ids_ref, w_ref = moe_route(logits, bias, top_k, n_group, topk_group, norm, 2.827)
                assert np.array_equal(got["merge"][0], ids_ref)
                assert_close(got["merge"][1], w_ref, "fp32", "weights")


@pytest.mark.gpu
@pytest.mark.parametrize("m,top_k,e,block", [(1, 8, 384, 8), (3, 8, 384, 8), (33, 8, 384, 32), (256, 8, 384, 32),
                                             (1000, 8, 384, 32), (1200, 8, 48, 32), (7, 3, 5, 8)])
@pytest.mark.parametrize("lists", ["one", "two", "skewed"])
def test_align_kernel_vs_reference(rng, m, top_k, e, block, lists):
    import cupy

    from ddtree_rtc.kernels.moe_routing import alignment_buffers
    from ddtree_rtc.kernels.moe_routing import moe_align as k_align

    if lists == "skewed":
        ids = skewed_ids(rng, m, top_k, e)
    else:
        ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    # two lists: 8-pair blocks up to a threshold near the mean count (both lists busy), 32 beyond
    kw = {} if lists == "one" else {"large_block": 32, "large_above": max(1, ids.size // e)}
    blk = block if lists == "one" else 8
    al = alignment_buffers(ids.size, e, blk, **kw)
    for a in (al.sorted_pairs, al.block_expert, al.counts, al.offsets, al.num_blocks, al.error):
        a.fill(-99)
    got = k_align(cupy.asarray(ids), e, blk, out=al, **kw)
    assert got is al
    check_alignment(al, ids, e, blk, kw.get("large_block"), kw.get("large_above"))
    ref = moe_align(ids, e, blk, **kw)
    assert np.array_equal(al.num_blocks.get(), ref.num_blocks)
    assert np.array_equal(al.offsets.get(), ref.offsets)
    nbs, nbl = (int(v) for v in ref.num_blocks)
    cs, bs = ref.small_capacity, ref.small_blocks
    sp, be = al.sorted_pairs.get(), al.block_expert.get()
    assert np.array_equal(sp[:nbs * blk], ref.sorted_pairs[:nbs * blk])
    assert np.array_equal(sp[cs:cs + nbl * ref.large_block], ref.sorted_pairs[cs:cs + nbl * ref.large_block])
    assert np.array_equal(be[:nbs], ref.block_expert[:nbs])
    assert np.array_equal(be[bs:bs + nbl], ref.block_expert[bs:bs + nbl])


@pytest.mark.gpu
def test_align_kernel_flags_out_of_range_ids():
    import cupy

    from ddtree_rtc.kernels.moe_routing import moe_align as k_align

    ids = cupy.asarray(np.array([[0, 5], [2, 9], [-1, 1]], np.int32))
    with pytest.raises(ValueError, match="expert id 9 at pair 3"):
        k_align(ids, 6, 8)
    al = k_align(ids, 6, 8, check_ids=False)
    check_alignment(al, ids.get(), 6, 8)
    assert int(al.error.get()[0]) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("m,h,e", [(1, 7168, 384), (37, 7168, 384), (5, 256, 48)])
def test_router_logits_kernel(rng, m, h, e):
    import cupy

    from ddtree_rtc.kernels.moe_routing import router_logits as k_logits
    from ddtree_rtc.testing import to_device_bf16

    x, w = random_bf16(rng, (m, h)), random_bf16(rng, (e, h), 0.02)
    out = cupy.full((m, e), np.nan, cupy.float32)
    y = k_logits(to_device_bf16(x), to_device_bf16(w), out=out)
    assert y is out
    assert_close(y, x.astype(np.float64) @ w.astype(np.float64).T, "fp32")
    with pytest.raises(ValueError, match="weight: expected shape"):
        k_logits(to_device_bf16(x), to_device_bf16(w[:, :64]))


@pytest.mark.gpu
@pytest.mark.parametrize("m,h,e", [(1, 7168, 384), (37, 7168, 384), (5, 256, 48)])
def test_router_logits_kernel_fp32_router(rng, m, h, e):
    """An fp32 router (checkpoints saved from an fp32 model): x widened exactly, fp32 products."""
    import cupy

    from ddtree_rtc.kernels.moe_routing import router_logits as k_logits
    from ddtree_rtc.testing import to_device_bf16

    x = random_bf16(rng, (m, h))
    w = (0.02 * rng.standard_normal((e, h))).astype(np.float32)
    out = cupy.full((m, e), np.nan, cupy.float32)
    y = k_logits(to_device_bf16(x), cupy.asarray(w), out=out)
    assert y is out
    assert_close(y, x.astype(np.float64) @ w.astype(np.float64).T, "fp32")
    assert_close(router_logits(x, w), x.astype(np.float64) @ w.astype(np.float64).T, "fp32")
