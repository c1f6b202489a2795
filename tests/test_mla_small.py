"""The small-M path's attention pieces: the row-invariant attention schedule (split="shape",
kernels/mla_attention.split_work_by_shape) emulated against the reference and checked to give a
token the same pieces in any batch (CPU); the row-invariant MLA head GEMM (cuda_src/mla_small.cu)
against the reference, on the model's strided views, bitwise over T; and the MLA attention with
split="shape" bitwise over the batch (GPU)."""

import os

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.kernels.mla_attention import (
    _VARIANTS,
    item_keys,
    partial_row,
    shape_piece_rows,
    shape_pieces,
    split_work_by_shape,
)
from ddtree_rtc.reference import mla_attention as ref
from ddtree_rtc.testing import assert_close, random_bf16

K26_SCALE = 192 ** -0.5


@pytest.mark.parametrize("variant", ["d16", "small"])
@pytest.mark.parametrize("num_sms", [1, 264])  # 264: two d16 CTAs per SM of an H100
@pytest.mark.parametrize("case", [([3000], [1], 8, 64, False), ([2047, 2049, 4097], [1, 1, 2], 8, 64, False),
                                  ([700, 10, 2500], [1, 1, 1], 64, 16, False),
                                  ([900, 40], [20, 33], 8, 16, True), ([300], [40], 2, 8, False),
                                  ([900, 1500, 3], [20, 33, 5], 8, 16, True)])
def test_shape_split_emulated(rng, monkeypatch, variant, num_sms, case):
    """The CUDA dataflow (test_mla_attention.emulate_kernel) on split_work_by_shape's schedule gives
    the reference's attention: every row written once, partials merged."""
    import test_mla_attention as tma

    monkeypatch.setattr(tma, "split_work", split_work_by_shape)
    bt = tma.Batch(rng, *case, dtype=np.float32)
    batch = bt.ref_plan()
    v = _VARIANTS[variant]
    o, lse = tma.emulate_kernel(batch, bt.q, bt.cache, K26_SCALE, v.bm, v.bn, num_sms, v.min_split)
    o_ref, lse_ref = ref.attend_f32(batch, bt.q, bt.cache, K26_SCALE)
    assert_close(o, o_ref, "fp32", "o_lat")
    assert_close(lse, lse_ref, "fp32", "lse")


@pytest.mark.parametrize("variant", ["d16", "small"])
def test_shape_split_work_ignores_the_grid(rng, variant):
    """split="shape" on any grid (1 CTA, 7, one or two per SM of 132, more CTAs than items): the same
    work rows (the pieces, their partial slots and merge items) and the same merges, so which CTA
    computes an item never changes a bit; the grid only deals the items to the CTAs, in order, every
    item once, as evenly as their count allows, the remainder to the first CTAs (with d16's two CTAs
    per SM, CTA c and c + SMs share an SM: fewer items than CTAs should not pair up)."""
    ctx = np.r_[rng.integers(0, 9000, 20), 4096, 1]
    n = np.r_[rng.integers(1, 4, 20), 1, 33]
    batch = ref.validate_batch(ctx, n, np.zeros((22, 1 + int((ctx + n).max())), np.int32), 8, 1, 1)
    v = _VARIANTS[variant]
    work, _, merge, parts = split_work_by_shape(batch, v.bm, v.bn, 132, v.min_split)
    for ctas in (1, 7, 132, 264, 100000):
        w, cta_work, m, p = split_work_by_shape(batch, v.bm, v.bn, ctas, v.min_split)
        assert np.array_equal(w, work) and np.array_equal(m, merge) and p == parts, f"{ctas} CTAs"
        assert cta_work.shape == (ctas + 1,) and cta_work[0] == 0 and cta_work[-1] == len(work)
        sizes = np.diff(cta_work)
        assert (sizes >= 0).all() and sizes.max() - sizes.min() <= 1, f"{ctas} CTAs: uneven deal"
        assert (np.diff(sizes) <= 0).all(), f"{ctas} CTAs: the remainder is not on the first CTAs"
    # b1, 8 heads, 4096 keys: 32 pieces on CTAs 0..31 (the first wave, one per SM), none in second slots
    alone = ref.validate_batch([4095], [1], np.zeros((1, 4096), np.int32), 8, 1, 1)
    w, cta_work, _, _ = split_work_by_shape(alone, v.bm, v.bn, 264, v.min_split)
    if variant == "d16":
        assert len(w) == 32 and np.array_equal(np.flatnonzero(np.diff(cta_work)), np.arange(32))


def _pieces(batch, bm, bn, ctas, min_split, req, tok):
    """A token's work items (rows, positions, cut or not) as split_work_by_shape lays them out."""
    work, cta_work, merge, _ = split_work_by_shape(batch, bm, bn, ctas, min_split)
    h = batch.num_heads
    mine = work[(work[:, 0] == req) & (work[:, 1] // h == tok)]
    return [(int(m0 % h), int(mc), int(kb), int(ke), bool(p >= 0)) for _, m0, mc, kb, ke, p, _, _ in mine]


@pytest.mark.parametrize("heads,variant", [(8, "d16"), (64, "d16"), (8, "small"), (128, "small")])
def test_shape_split_gives_a_token_the_same_pieces_in_any_batch(rng, heads, variant):
    """Token j of a request with context c: the same query tiles and the same position pieces
    whether it is decoded alone, among 63 other requests, as part of a multi-token (verify)
    forward, or on another grid; at most shape_pieces per tile."""
    v = _VARIANTS[variant]
    for ctx in (1, 63, 64, 700, 4095, 4096, 33000):
        alone = ref.validate_batch([ctx], [1], np.zeros((1, ctx // 16 + 3), np.int32), heads, 16, 1 << 20)
        want = _pieces(alone, v.bm, v.bn, 132, v.min_split, 0, 0)
        assert len(want) <= shape_pieces(heads, v.bm) * -(-heads // v.bm)
        others = rng.integers(1, 9000, 63)
        crowd = ref.validate_batch(np.r_[others[:20], ctx, others[20:]], np.ones(64, np.int64),
                                   np.zeros((64, 34000 // 16 + 3), np.int32), heads, 16, 1 << 20)
        assert _pieces(crowd, v.bm, v.bn, 7, v.min_split, 20, 0) == want
        # token 5 of a 9-token forward at context ctx - 5 sees the same positions [0, ctx]
        if ctx > 5:
            multi = ref.validate_batch([17, ctx - 5], [3, 9], np.zeros((2, ctx // 16 + 3), np.int32), heads, 16,
                                       1 << 20)
            assert _pieces(multi, v.bm, v.bn, 1000, v.min_split, 1, 5) == want


def _tree_and_twins(rng, ctx, n, heads, data=True):
    """One request at context ``ctx`` verifying a random n-node tree (parents before children, long
    paths likely), on a cache of single-row pages; and the autoregressive twins of its nodes as one
    decode batch: twin i at context ctx + depth(i), whose positions ctx .. hold node i's ancestors'
    rows, root first, then its own. Returns (tree batch, twin batch, q, cache [slots, 576] f32, paths);
    q and cache None unless ``data``."""
    parents = np.full(n, -1)
    for i in range(1, n):
        parents[i] = i - 1 if rng.random() < 0.5 else int(rng.integers(0, i))
    paths = []
    for i in range(n):
        path = [i]
        while path[-1] > 0:
            path.append(int(parents[path[-1]]))
        paths.append(path[::-1])
    words = max(1, -(-n // 64))
    slots = ctx + n
    tree = ref.validate_batch([ctx], [n], np.arange(slots, dtype=np.int32)[None], heads, 1, slots,
                              ref.tree_mask_from_parents(parents, words))
    width = ctx + max(len(p) for p in paths)
    table = np.zeros((n, width), np.int32)
    for i, path in enumerate(paths):
        table[i, :ctx + len(path)] = np.r_[np.arange(ctx), ctx + np.array(path)]
    twins = ref.validate_batch(ctx + np.array([len(p) - 1 for p in paths]), np.ones(n, np.int64), table, heads, 1,
                               slots)
    if not data:
        return tree, twins, None, None, paths
    cache = random_bf16(rng, (slots, ref.ROW)).astype(np.float32)
    q = random_bf16(rng, (n, heads, ref.ROW), 0.3).astype(np.float32)
    return tree, twins, q, cache, paths


def _identity(batch, item, paths=None):
    """An item's keys as what they are: committed position p as p, tree node i as -1 - i."""
    ctx = int(batch.ctx_lens[item[0]])
    _, _, keys = item_keys(batch, item)
    if paths is None:  # the tree: cache position ctx + j is node j
        return np.where(keys < ctx, keys, ctx - 1 - keys)
    path = np.asarray(paths[item[0]])
    base = ctx - (len(path) - 1)  # a twin: position base + k is the node at depth k of its path
    return np.where(keys < base, keys, -1 - path[np.maximum(keys - base, 0)])


def _row_pieces(batch, work, merge, row):
    """The work items that compute flattened query row ``row``, in the order the merge takes their
    partials (one item if the row is not cut), checking on the way that the row's partials sit in
    its merge item's slots p0 .. p0 + splits - 1 at the row the merge reads (partial_row)."""
    h = batch.num_heads
    g0 = batch.q_start[work[:, 0]] * h + work[:, 1]
    mine = work[(g0 <= row) & (row < g0 + work[:, 2])]
    assert len(mine), f"row {row}: no work item computes it"
    if (mine[:, 5] < 0).any():
        assert len(mine) == 1 and mine[0, 6] < 0, f"row {row}: a final item and others"
        return mine
    mine = mine[np.argsort(mine[:, 5])]
    p0, splits, m_g0, rows = merge[mine[0, 6]]
    assert (mine[:, 6] == mine[0, 6]).all() and (mine[:, 5] == p0 + np.arange(splits)).all(), \
        f"row {row}: its partials are not its merge item's {splits} slots in order"
    assert m_g0 <= row < m_g0 + rows
    item_g0 = batch.q_start[mine[:, 0]] * h + mine[:, 1]
    slot_row = np.array([partial_row(it) for it in mine]) + row - item_g0
    assert (slot_row == row - m_g0).all(), f"row {row}: written at partial rows {slot_row}, merged from {row - m_g0}"
    return mine


def _check_tree_rows_reduce_their_twins(rng, heads, variant, ctx, n):
    v = _VARIANTS[variant]
    tree, twins, _, _, paths = _tree_and_twins(rng, ctx, n, heads, data=False)
    tw, _, tm, _ = split_work_by_shape(tree, v.bm, v.bn, 132, v.min_split)
    aw, _, am, _ = split_work_by_shape(twins, v.bm, v.bn, 7, v.min_split)
    for i in range(n):
        for r in sorted({*range(0, heads, v.bm), heads - 1}):
            mine = _row_pieces(tree, tw, tm, i * heads + r)
            twin = _row_pieces(twins, aw, am, i * heads + r)
            got = [_identity(tree, it) for it in mine]
            want = [_identity(twins, it, paths) for it in twin]
            assert len(got) >= len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), \
                f"node {i} (depth {len(paths[i]) - 1}) row {r}: other pieces or keys"
            assert not any(len(a) for a in got[len(want):]), f"node {i}: pieces past its twin's are not empty"
    return tree, tw


@pytest.mark.parametrize("heads,variant", [(8, "d16"), (64, "d16"), (8, "small")])
@pytest.mark.parametrize("ctx,n", [(2040, 33), (1020, 9), (4090, 33), (1, 17), (700, 64)])
def test_tree_rows_reduce_what_their_autoregressive_twins_reduce(rng, heads, variant, ctx, n):
    """split="shape" on a tree verify: each row of node i reduces, piece by piece in its merge's
    order (as the kernel reads the plan: item_keys, the host mirror of path_item / key_position;
    partial_row), exactly the keys of its autoregressive twin in the twin's order and cut at the
    twin's piece boundaries (contexts chosen so the piece size changes between a tree's shallow and
    deep nodes, where tokens do not share); its extra pieces are empty and come last, so the merge
    adds only zeros after the twin's partials."""
    _check_tree_rows_reduce_their_twins(rng, heads, variant, ctx, n)


def _committed_reads(batch, work):
    """Cache rows below ctx the plan's items load (one load per item, whatever its rows)."""
    return sum(int((item_keys(batch, it)[2] < batch.ctx_lens[it[0]]).sum()) for it in work)


@pytest.mark.parametrize("n", [9, 17, 33, 64])
@pytest.mark.parametrize("ctx", [1, 63, 64, 1000, 4096, 4097, 40000])
@pytest.mark.parametrize("variant", ["d16", "small"])
def test_tree_tokens_share_committed_pieces_and_still_equal_their_twins(rng, variant, ctx, n):
    """At 8 heads (a TP8 rank) a d16 tile holds 2 tokens, a small one 4: tokens of a tree share
    the pieces wholly below ctx, and every row still reduces its twin's keys in its twin's pieces
    and merge order. The committed context is then read about n / g times instead of n (g tokens
    per tile): at most once per group plus, per token, the one piece that straddles ctx."""
    v = _VARIANTS[variant]
    g = v.bm // 8
    tree, tw = _check_tree_rows_reduce_their_twins(rng, 8, variant, ctx, n)
    reads = _committed_reads(tree, tw)
    per = int(shape_piece_rows(np.int64(ctx + 1), v.bn, -(-v.min_split // v.bn), shape_pieces(8, v.bm)))
    assert reads <= -(-n // g) * ctx + n * per, f"{reads} committed rows read by {n} tokens at ctx {ctx}"
    if per == shape_piece_rows(np.int64(ctx + n), v.bn, -(-v.min_split // v.bn), shape_pieces(8, v.bm)):
        # one piece size for every depth: every group shares, each token reads only its straddling piece
        assert reads == -(-n // g) * (ctx // per * per) + n * (ctx % per)


def test_tree_sharing_reads_the_context_about_g_times_less():
    """A 33-token tree at ctx 4096, 8 heads, d16: the committed rows read drop from 33 x 4096 (one
    tile per token) to 17 shared passes plus 33 straddling remainders."""
    v = _VARIANTS["d16"]
    rng = np.random.default_rng(4096)
    tree, _, _, _, _ = _tree_and_twins(rng, 4096, 33, 8, data=False)
    work = split_work_by_shape(tree, v.bm, v.bn, 132, v.min_split)[0]
    reads = _committed_reads(tree, work)
    assert reads == 17 * 4000 + 33 * 96  # pieces of 160 rows: 25 below ctx (4000 rows), 96 rows straddle
    assert 33 * 4096 / reads > 1.8


@pytest.mark.parametrize("heads,variant,ctx,n", [
    *[(h, "d16", c, n) for h in (8, 64) for c, n in ((2040, 33), (1020, 9))],
    (8, "d16", 4096, 33), (8, "d16", 4097, 17), (8, "small", 4096, 33), (8, "small", 1020, 9)])  # 8: shared
def test_tree_rows_emulated_bitwise_equal_their_twins(rng, monkeypatch, heads, variant, ctx, n):
    """The kernel's dataflow in fp32 numpy (test_mla_attention.emulate_kernel: per piece a softmax
    over the keys in the kernel's order, then the merge): a tree row's o_lat and lse the same bits as
    its autoregressive twin's, and close to the reference."""
    import test_mla_attention as tma

    monkeypatch.setattr(tma, "split_work", split_work_by_shape)
    v = _VARIANTS[variant]
    tree, twins, q, cache, _ = _tree_and_twins(rng, ctx, n, heads)
    o, lse = tma.emulate_kernel(tree, q, cache, K26_SCALE, v.bm, v.bn, 132, v.min_split)
    o_ar, lse_ar = tma.emulate_kernel(twins, q, cache, K26_SCALE, v.bm, v.bn, 7, v.min_split)
    assert np.array_equal(o, o_ar) and np.array_equal(lse, lse_ar)
    o_ref, lse_ref = ref.attend_f32(tree, q, cache.reshape(-1, 1, ref.ROW), K26_SCALE)
    assert_close(o, o_ref, "fp32", "o_lat")
    assert_close(lse, lse_ref, "fp32", "lse")


def test_head_gemm_plan_keeps_the_vector_promise():
    """The host side of the row-invariant head GEMMs (kernels/mla_small.head_gemm_plan): the model's
    views of kv_b [H, nope + 128, 512] take 16-byte loads (W_UV: k-contiguous rows, head_gemm_kc;
    W_UK: n-contiguous rows, head_gemm_nc); whatever would break the kernel's VEC promise (a row start
    off 16 bytes, K or N not a multiple of 8, n not contiguous) takes scalar loads; the grid covers
    every column and token, and the token group follows T alone."""
    from ddtree_rtc.kernels.mla_small import group_size, head_gemm_plan

    base = 1 << 20
    for heads, nope in ((8, 128), (64, 128), (4, 32)):
        rows = nope + 128
        kv_b = (rows * 512, 512, 1)
        x_uv = (heads * 512, 512, 1)
        uv = head_gemm_plan(5, heads, 512, 128, True, base, x_uv, base + nope * 512 * 2, kv_b)
        assert (uv.kc, uv.vec, uv.w_k, uv.w_n, uv.grid) == (True, True, 1, 512, (4, heads, 1))
        x_uk = (heads * (nope + 64), nope + 64, 1)  # q[:, :, :nope]
        uk = head_gemm_plan(33, heads, nope, 512, False, base, x_uk, base, kv_b)
        assert (uk.kc, uk.vec, uk.w_k, uk.w_n, uk.grid) == (False, True, 512, 1, (16, heads, 5))
    assert not head_gemm_plan(1, 2, 512, 128, True, base, (1024, 512, 1), base + 2, (65536, 512, 1)).vec
    assert not head_gemm_plan(1, 2, 512, 128, True, base + 2, (1024, 512, 1), base, (65536, 512, 1)).vec
    assert not head_gemm_plan(1, 2, 512, 128, True, base, (1000, 500, 1), base, (65536, 512, 1)).vec
    assert not head_gemm_plan(1, 2, 37, 40, True, base, (74, 37, 1), base, (1480, 37, 1)).vec
    assert not head_gemm_plan(1, 2, 128, 13, False, base, (256, 128, 1), base, (1664, 13, 1)).vec
    assert not head_gemm_plan(1, 2, 128, 512, False, base, (256, 128, 1), base, (65536, 512, 2)).vec
    assert not head_gemm_plan(1, 2, 128, 512, False, base, (256, 128, 1), base, (65536, 516, 1)).vec
    assert head_gemm_plan(1, 2, 128, 512, False, base, (256, 128, 1), base, (65536, 1, 128)).kc  # W^T view
    for t, g in ((1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (33, 8), (64, 8)):
        p = head_gemm_plan(t, 8, 512, 128, True, base, (4096, 512, 1), base, (131072, 512, 1))
        assert group_size(t) == p.group == g and p.grid[2] * g >= t > (p.grid[2] - 1) * g


# ---- GPU ----

def _seeded(name):
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{name} seed={seed}")
    return np.random.default_rng(seed)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("t", [1, 3, 17, 33, 64])
def test_head_gemm_small_vs_reference_and_invariant(heads, t):
    """Both GEMMs on the model's views (q[:, :, :128] x W_UK, o_lat x W_UV^T out of kv_b [H, 256, 512]),
    outputs NaN-prefilled (and the rest of q_att poisoned: it must stay untouched), against the
    reference; and every token's rows the same bits as in a batch of 64."""
    import cupy

    from ddtree_rtc.kernels.mla_attention import mla_head_gemm
    from ddtree_rtc.reference.mla_attention import mla_head_gemm as ref_gemm
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"head gemm {heads} {t}")
    kv_b = random_bf16(rng, (heads, 256, 512), 512 ** -0.5)
    q = random_bf16(rng, (64, heads, 192))
    o_lat = random_bf16(rng, (64, heads, 512))
    kd, qd, od = to_device_bf16(kv_b), to_device_bf16(q), to_device_bf16(o_lat)

    def absorb(idx):
        q_att = cupy.full((len(idx), heads, 576), 0x7FC0, cupy.uint16)
        mla_head_gemm(cupy.ascontiguousarray(qd[idx])[:, :, :128], kd[:, :128], False, out=q_att[:, :, :512],
                      impl="invariant")
        host = q_att.get()
        assert (host[:, :, 512:] == 0x7FC0).all(), "wrote outside its output view"
        return host[:, :, :512]

    def expand(idx):
        out = cupy.full((len(idx), heads, 128), 0x7FC0, cupy.uint16)
        return mla_head_gemm(cupy.ascontiguousarray(od[idx]), kd[:, 128:], True, out=out, impl="invariant").get()

    idx = rng.permutation(64)[:t]
    assert_close(absorb(idx), ref_gemm(q[idx][:, :, :128], kv_b[:, :128], False), "bf16_accum", "q_lat")
    assert_close(expand(idx), ref_gemm(o_lat[idx], kv_b[:, 128:], True), "bf16_accum", "o")
    full_a, full_e = absorb(np.arange(64)), expand(np.arange(64))
    assert np.array_equal(absorb(idx), full_a[idx]) and np.array_equal(expand(idx), full_e[idx])


def _misaligned_copy(a):
    """A device copy of the bf16 array ``a`` that starts 2 bytes past a 16-byte boundary (the head
    GEMMs' scalar-load fallback)."""
    import cupy

    bits = np.ascontiguousarray(a).astype(bfloat16).view(np.uint16)
    buf = cupy.zeros(bits.size + 8, cupy.uint16)
    view = buf[1:1 + bits.size].reshape(bits.shape)
    view[...] = cupy.asarray(bits)
    assert view.data.ptr % 16 == 2
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("trans_w,k,n", [(True, 37, 40), (True, 600, 9), (True, 512, 32), (False, 32, 512),
                                         (False, 150, 13), (False, 40, 24)])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_head_gemm_small_odd_shapes_and_alignment(trans_w, k, n, t):
    """Generic shapes (K or N not a multiple of 8, K past one register pass, the tiny models' 32-wide
    heads) against the reference, outputs NaN-prefilled; weights and x 2 bytes off a 16-byte boundary
    (scalar loads) give the same bits as the aligned ones (16-byte loads where the shape allows);
    each token's rows the same bits as in a batch of 64."""
    import cupy

    from ddtree_rtc.kernels.mla_attention import mla_head_gemm
    from ddtree_rtc.reference.mla_attention import mla_head_gemm as ref_gemm
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"head gemm odd {trans_w} {k} {n} {t}")
    heads = 3
    w = random_bf16(rng, (heads, n, k) if trans_w else (heads, k, n), k ** -0.5)
    x = random_bf16(rng, (64, heads, k))
    wd, wm = to_device_bf16(w), _misaligned_copy(w)

    def run(idx, wdev, misaligned=False):
        xd = _misaligned_copy(x[idx]) if misaligned else to_device_bf16(x[idx])
        out = cupy.full((len(idx), heads, n), 0x7FC0, cupy.uint16)
        return mla_head_gemm(xd, wdev, trans_w, out=out, impl="invariant").get()

    idx = rng.permutation(64)[:t]
    got = run(idx, wd)
    assert_close(got, ref_gemm(x[idx], w, trans_w), "bf16_accum", "out")
    assert np.array_equal(got, run(idx, wm, misaligned=True)), "scalar loads give other bits"
    assert np.array_equal(got, run(np.arange(64), wd)[idx]), "rows differ from the same rows in a batch of 64"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 64])
def test_shape_split_attention_is_bitwise_invariant(heads):
    """mla_attention with split="shape": a decode token's o_lat and lse the same bits alone or among
    7, 33 or 64 requests (the multi-token case: test_small_m_gpu's chain verify)."""
    import cupy
    import test_mla_attention as tma

    from ddtree_rtc.kernels.mla_attention import mla_attention, mla_attention_plan

    rng = _seeded(f"shape split {heads}")
    ctx = rng.integers(1, 5000, 64)
    bt = tma.Batch(rng, ctx, np.ones(64, np.int64), heads, 64)
    cache = cupy.asarray(bt.cache.view(np.uint16))
    q = cupy.asarray(bt.q.view(np.uint16))

    def run(idx):
        plan = mla_attention_plan(bt.ctx[idx], bt.n[idx], bt.page_table[idx], heads, 64, bt.num_pages,
                                  split="shape")
        o, lse = mla_attention(plan, cupy.ascontiguousarray(q[idx]), cache, K26_SCALE)
        return o.get(), lse.get()

    full_o, full_l = run(np.arange(64))
    assert np.isfinite(full_l).all()
    for m in (1, 7, 33):
        idx = np.sort(rng.permutation(64)[:m])
        o, lse = run(idx)
        assert np.array_equal(o, full_o[idx]) and np.array_equal(lse, full_l[idx]), f"M={m}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 64])
def test_shape_split_attention_is_bitwise_invariant_over_the_grid(heads):
    """mla_attention with split="shape" (decode and a 3-token forward): the same bits on the default
    grid (d16: resident_ctas, two CTAs per SM where they fit) as on grids of 1, 7 and 66 SMs'
    worth; and the default grid is resident_ctas CTAs per SM, two for d16 on sm_90 / sm_100."""
    import cupy
    import test_mla_attention as tma

    from ddtree_rtc.kernels._launch import sm_count
    from ddtree_rtc.kernels.mla_attention import mla_attention, mla_attention_plan, resident_ctas
    from ddtree_rtc.testing import nan_bf16_bits

    rng = _seeded(f"shape split grid {heads}")
    ctx = rng.integers(1, 5000, 33)
    n = np.r_[np.ones(30, np.int64), 3, 3, 3]
    bt = tma.Batch(rng, ctx, n, heads, 64)
    cache = cupy.asarray(bt.cache.view(np.uint16))
    q = cupy.asarray(bt.q.view(np.uint16))

    def run(num_sms):
        plan = mla_attention_plan(bt.ctx, bt.n, bt.page_table, heads, 64, bt.num_pages, num_sms=num_sms,
                                  split="shape")
        out = nan_bf16_bits((len(q), heads, ref.DV))
        lse = cupy.full((len(q), heads), np.nan, dtype=cupy.float32)
        mla_attention(plan, q, cache, K26_SCALE, out=out, lse=lse)
        return plan, out.get(), lse.get()

    plan, full_o, full_l = run(None)
    per_sm = resident_ctas(plan.variant)
    assert plan.grid == per_sm * sm_count()
    smem_per_sm = cupy.cuda.Device().attributes["MaxSharedMemoryPerMultiprocessor"]
    if plan.variant == "d16" and smem_per_sm >= 2 * (plan.smem + 1024):
        assert per_sm == 2, f"d16: {per_sm} CTAs per SM with {smem_per_sm} B of shared memory per SM"
    assert np.isfinite(full_l).all()
    o_ref, lse_ref = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
    assert_close(full_o, o_ref, "bf16", "o_lat")
    assert_close(full_l, lse_ref, "fp32", "lse")
    for num_sms in (1, 7, 66):
        p, o, lse = run(num_sms)
        assert p.grid == per_sm * num_sms
        assert np.array_equal(o, full_o) and np.array_equal(lse, full_l), f"num_sms={num_sms}"


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["shape", "ctas"])
@pytest.mark.parametrize("heads,n", [(8, 1), (8, 3), (64, 1)])
def test_attention_across_2048_keys_vs_reference(rng, split, heads, n):
    """The small-M path's logits part from the general path's only in rows with more than 2048 keys
    (H100, 2026-12-07: rows of up to 1239 agree within 0.8%). Above 2048 keys the row-invariant
    split's pieces grow past 64 rows (96, 128, ...: shape_piece_rows), while the general split cuts
    by CTA count; so both schedules are checked against the reference on contexts either side of
    2048 (and of 3072, 4096), with NaN in every cache slot no page points to and NaN-filled
    outputs."""
    import test_mla_attention as tma

    from ddtree_rtc.testing import as_f64

    ctx = [100, 2047, 2048, 2049, 2500, 3071, 3100, 4095, 4097][: 9 if n == 1 else 5]
    bt = tma.Batch(rng, ctx, [n] * len(ctx), heads, 64)
    o_ref, lse_ref = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
    plan, o, lse = tma._run_kernel(bt, scale=K26_SCALE, split=split)  # this file's scale, as the reference's
    o, lse = as_f64(o), as_f64(lse)
    rows = np.repeat(np.array(ctx), n)
    for i, c in enumerate(rows):  # per row, so a failure names the context
        assert_close(o[i], o_ref[i], "bf16", f"o_lat, split={split}, {plan.variant}, row {i} (ctx {c})")
        assert_close(lse[i], lse_ref[i], "fp32", f"lse, split={split}, row {i} (ctx {c})")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,nope", [(8, 128), (64, 128), (4, 32), (1, 32)])
@pytest.mark.parametrize("t", [1, 3, 17, 33, 64])
def test_query_and_cache_rows_vs_twins_and_invariant(heads, nope, t):
    """mla_query_small (W_UK + RoPE(q_pe)), alone and with the cache rows (norm + RoPE + cache write)
    in the same launch, against the numpy twins (the general path's references): q_att NaN-prefilled,
    the cache poisoned with NaN where no slot points (it must stay so), a slot of -1 skipped; q_att the
    same bits with and without the rows; and each token's results the same bits as in a batch of 64.
    One head leaves the rows column fewer CTAs than blocks of 8 tokens at T = 64 (they loop)."""
    import cupy

    from ddtree_rtc.kernels.mla_small import mla_query_small
    from ddtree_rtc.reference.mla_small import mla_kv_rows_small as ref_rows
    from ddtree_rtc.reference.mla_small import mla_query_small as ref_query
    from ddtree_rtc.reference.rope import rope_inv_freq
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"query rows {heads} {nope} {t}")
    kv_b = random_bf16(rng, (heads, nope + 128, 512), 512 ** -0.5)
    q = random_bf16(rng, (64, heads, nope + 64))
    kv = random_bf16(rng, (64, 576))
    norm_w = random_bf16(rng, (512,), 1.0)
    pos = rng.integers(0, 100000, 64).astype(np.int32)
    inv_freq = np.asarray(rope_inv_freq(64, 50000.0, None), dtype=np.float32)
    kd = to_device_bf16(kv_b)

    def query(idx, slots=None):
        out = cupy.full((len(idx), heads, 576), 0x7FC0, cupy.uint16)
        cache = cupy.full((8, 16, 576), 0x7FC0, cupy.uint16)
        rows = None if slots is None else (to_device_bf16(kv[idx]), to_device_bf16(norm_w), 1e-6, cache,
                                           cupy.asarray(slots))
        got = mla_query_small(to_device_bf16(q[idx]), kd[:, :nope], cupy.asarray(pos[idx]), cupy.asarray(inv_freq),
                              1.0, out=out, rows=rows)
        return got.get(), cache.get()

    idx = rng.permutation(64)[:t]
    slots = rng.permutation(128)[:t].astype(np.int32)
    slots[0] = -1  # a padding token: skipped
    got_q, got_c = query(idx, slots)
    want_q = ref_query(q[idx], kv_b[:, :nope], pos[idx], inv_freq, 1.0)
    assert_close(got_q, want_q, "bf16_accum", "q_att")
    want_c = ref_rows(kv[idx], norm_w, 1e-6, pos[idx], inv_freq, 1.0, np.full((8, 16, 576), np.nan, bfloat16), slots)
    assert_close(got_c, want_c, "bf16", "cache")
    alone, untouched = query(idx)
    assert np.array_equal(alone, got_q), "the rows column changes no query bit"
    assert np.all(untouched == 0x7FC0), "without rows the cache is not written"
    all_slots = np.arange(64, dtype=np.int32) + 32
    full_q, full_c = query(np.arange(64), all_slots)
    assert np.array_equal(got_q, full_q[idx])
    flat_full, flat_got = full_c.reshape(-1, 576), got_c.reshape(-1, 576)
    for j, s in enumerate(slots[1:], 1):  # token idx[j]'s row, as in the batch of 64
        assert np.array_equal(flat_got[s], flat_full[all_slots[idx[j]]])


@pytest.mark.gpu
@pytest.mark.parametrize("q_lora,h", [(1536, 7168), (96, 256)])  # K2.6; tiny
@pytest.mark.parametrize("t", [1, 3, 12, 17, 33, 64])  # every token bucket (8, 16, 32, 64 rows)
def test_qkv_a_vs_twin_and_invariant(q_lora, h, t):
    """q_a and kv_a in one launch against the two reference linears (NaN-prefilled outputs), and
    each token's rows the same bits as in a batch of 64."""
    import cupy

    from ddtree_rtc.kernels.mla_small import mla_qkv_a_small
    from ddtree_rtc.reference.mla_small import mla_qkv_a_small as ref_qkv
    from ddtree_rtc.testing import check_rows_invariant, nan_bf16_bits, to_device_bf16

    rng = _seeded(f"qkv_a {q_lora} {t}")
    x = random_bf16(rng, (64, h))
    wq, wkv = random_bf16(rng, (q_lora, h), h ** -0.5), random_bf16(rng, (576, h), h ** -0.5)
    xd, wqd, wkvd = to_device_bf16(x), to_device_bf16(wq), to_device_bf16(wkv)

    def run(idx):
        oq, okv = nan_bf16_bits((len(idx), q_lora)), nan_bf16_bits((len(idx), 576))
        got = mla_qkv_a_small(cupy.ascontiguousarray(xd[idx]), wqd, wkvd, out_q=oq, out_kv=okv)
        assert got[0] is oq and got[1] is okv
        return oq.get(), okv.get()

    check_rows_invariant(run, lambda rows: ref_qkv(rows, wq, wkv), x, rng, t,
                         [("bf16_accum", "q_a"), ("bf16_accum", "kv_a")])


@pytest.mark.gpu
def test_qkv_a_plan_fits_in_one_wave_on_this_gpu():
    """K2.6's q_a + kv_a (2112 rows, H 7168): the plan mla_qkv_a_small launches puts all its clusters
    on the GPU at once in the 8-row bucket (the driver's cuOccupancyMaxActiveClusters), and it is
    the plan of every bucket; the other buckets' capacities are printed for the record."""
    import cupy

    from ddtree_rtc.kernels.linear import active_clusters, bucket_grid, pair_plan

    dev = cupy.cuda.Device().id
    plan = pair_plan(1536 + 576, 7168, dev, "mla_small", "mla_qkv_a_small")
    for mt in (8, 16, 32, 64):
        grid = bucket_grid(1536 + 576, plan.warps_n, plan.split, mt)
        at_once = active_clusters(dev, "mla_small", f"mla_qkv_a_small_m{mt}_s{plan.split}", plan.split)
        print(f"m{mt}: plan ({plan.warps_n}, {plan.split}), {grid // plan.split} clusters, {at_once} fit at once")
    assert -(-(1536 + 576) // (8 * plan.warps_n)) <= active_clusters(
        dev, "mla_small", f"mla_qkv_a_small_m8_s{plan.split}", plan.split)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("ctx,n", [(2040, 33), (1020, 9), (3000, 64), (1, 17), (4096, 33), (4097, 64)])
def test_tree_rows_equal_their_twins_on_the_gpu(heads, ctx, n):
    """mla_attention with split="shape" on a random tree verify (the mask on the device, unchecked,
    as the engine passes it; outputs NaN-prefilled, the cache's spare slots NaN): against the
    reference, and every node's o_lat and lse the same bits as its autoregressive twin's (a decode
    batch whose contexts hold each node's ancestors by depth). At 8 heads most cases share tiles
    between tokens below ctx (_tree_groups): a token's rows at rows 8..15 of a d16 tile there, at
    rows 0..7 of its twin's."""
    import cupy

    from ddtree_rtc.kernels.mla_attention import mla_attention, mla_attention_plan

    rng = _seeded(f"tree twins {heads} {ctx} {n}")
    tree, twins, q, cache, _ = _tree_and_twins(rng, ctx, n, heads)
    slots = cache.shape[0]
    cache_nan = np.full((slots + 64, ref.ROW), np.nan, np.float32)
    cache_nan[:slots] = cache
    cd = cupy.asarray(cache_nan.astype(bfloat16).view(np.uint16).reshape(-1, 1, ref.ROW))
    qd = cupy.asarray(q.astype(bfloat16).view(np.uint16))

    def run(batch, mask):
        plan = mla_attention_plan(batch.ctx_lens, batch.num_new, batch.page_table, heads, 1, slots + 64, mask,
                                  check_mask=False, split="shape")
        out = cupy.full((n, heads, ref.DV), 0x7FC0, cupy.uint16)
        lse = cupy.full((n, heads), np.nan, cupy.float32)
        mla_attention(plan, qd, cd, K26_SCALE, out=out, lse=lse)
        return out.get(), lse.get()

    o, lse = run(tree, cupy.asarray(tree.tree_mask))
    o_ar, lse_ar = run(twins, None)
    o_ref, lse_ref = ref.mla_attention(tree, q.astype(bfloat16), cache.astype(bfloat16).reshape(-1, 1, ref.ROW),
                                       K26_SCALE)
    assert_close(o, o_ref, "bf16", "o_lat")
    assert_close(lse, lse_ref, "fp32", "lse")
    bad = [i for i in range(n) if not (np.array_equal(o[i], o_ar[i]) and np.array_equal(lse[i], lse_ar[i]))]
    assert not bad, f"tree nodes {bad[:8]} (of {n}) differ from their autoregressive twins"
