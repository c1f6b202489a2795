"""MLA attention: the numpy reference against a float64 non-absorbed MLA (absorption algebra, masks,
paging), the CUDA plan's work split emulated on the CPU, bad input, and the kernels on the GPU with
poisoned caches (NaN in every slot no query may read, huge sentinels in unused page-table entries)."""

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.kernels.mla_attention import (
    _VARIANTS,
    MIN_SPLIT,
    _pick_variant,
    _smem_bytes,
    item_keys,
    partial_row,
    split_work,
)
from ddtree_rtc.reference import mla_attention as ref
from ddtree_rtc.reference.mla import decompressed_attention_f64
from ddtree_rtc.testing import assert_close, random_bf16

SENTINEL = np.iinfo(np.int32).max
K26_SCALE = 0.14467963


def random_parents(rng, n):
    """A random tree in DDTree order (parents precede children), mostly local so trees get deep."""
    return np.array([0] + [int(rng.integers(max(0, i - 6), i)) for i in range(1, n)], dtype=np.int64)


def ancestors_visible(parents):
    """bool [n, n] by walking parent links (independent of tree_mask_from_parents)."""
    n = len(parents)
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while True:
            vis[i, j] = True
            if j == 0:
                break
            j = int(parents[j])
    return vis


class Batch:
    """Random paged batch: pages scattered over a cache whose unused slots hold NaN."""

    def __init__(self, rng, ctx, n, heads, page_size, tree=False, words=None, q_scale=0.3, dtype=bfloat16,
                 extra_pages=3):
        self.ctx, self.n = np.array(ctx, dtype=np.int64), np.array(n, dtype=np.int64)
        self.heads, self.page_size = heads, page_size
        kv = self.ctx + self.n
        need = -(-kv // page_size)
        self.num_pages = int(need.sum()) + extra_pages
        perm = rng.permutation(self.num_pages)
        self.page_table = np.full((len(kv), int(need.max()) + 2), SENTINEL, dtype=np.int32)
        self.cache = np.full((self.num_pages, page_size, ref.ROW), np.nan, dtype=np.float32)
        flat = self.cache.reshape(-1, ref.ROW)
        self.rows, off = [], 0
        for b in range(len(kv)):
            pages = perm[off:off + need[b]]
            off += need[b]
            self.page_table[b, :need[b]] = pages
            pos = np.arange(kv[b])
            rows = random_bf16(rng, (kv[b], ref.ROW)).astype(np.float32)
            flat[pages[pos // page_size] * page_size + pos % page_size] = rows
            self.rows.append(rows)
        self.cache = self.cache.astype(dtype)
        t = int(self.n.sum())
        self.q = random_bf16(rng, (t, heads, ref.ROW), q_scale).astype(dtype)
        self.parents = [random_parents(rng, int(m)) for m in self.n] if tree else None
        self.mask = None
        if tree:
            words = words or max(1, -(-int(self.n.max()) // 64))
            self.mask = np.concatenate([ref.tree_mask_from_parents(p, words) for p in self.parents])

    def visible(self, b):
        ctx, n = int(self.ctx[b]), int(self.n[b])
        vis = np.ones((n, ctx + n), dtype=bool)
        vis[:, ctx:] = ancestors_visible(self.parents[b]) if self.parents else np.tri(n, dtype=bool)
        return vis

    def plan_args(self):
        return (self.ctx, self.n, self.page_table, self.heads, self.page_size, self.num_pages, self.mask)

    def ref_plan(self):
        return ref.mla_attention_plan(*self.plan_args())

    def f64(self, scale):
        """Absorbed-domain attention in float64, straight from the per-request rows."""
        o, lse, start = [], [], 0
        for b in range(len(self.n)):
            n = int(self.n[b])
            rows = self.rows[b].astype(np.float64)
            s = np.einsum("thd,jd->thj", self.q[start:start + n].astype(np.float64), rows) * scale
            s = np.where(self.visible(b)[:, None, :], s, -np.inf)
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            o.append(p @ rows[:, :ref.DV] / p.sum(-1, keepdims=True))
            lse.append((m + np.log(p.sum(-1, keepdims=True)))[..., 0])
            start += n
        return np.concatenate(o), np.concatenate(lse)


CASES = [  # ctx, n, heads, page_size, tree
    ([37], [1], 64, 16, False),  # decode
    ([0, 5, 130, 64], [1, 1, 1, 1], 8, 16, False),  # ragged decode batch, empty prefix
    ([100], [17], 4, 7, False),  # causal prefill chunk
    ([0], [9], 3, 4, False),  # prefill from nothing, odd heads
    ([50, 3], [12, 30], 5, 16, True),  # tree verify, ragged
    ([20], [70], 2, 32, True),  # two mask words
]


@pytest.mark.parametrize("ctx,n,heads,page_size,tree", CASES)
def test_reference_matches_float64(rng, ctx, n, heads, page_size, tree):
    bt = Batch(rng, ctx, n, heads, page_size, tree)
    o, lse = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
    o64, lse64 = bt.f64(K26_SCALE)
    assert o.dtype == bfloat16
    assert_close(o, o64, "bf16", "o_lat")
    assert_close(lse, lse64, "fp32", "lse")


@pytest.mark.parametrize("tree", [False, True])
def test_absorbed_equals_decompressed_mla(rng, tree):
    """q_att = [q_nope·W_UK | q_pe] against [c | k_pe] rows, then W_UV, equals ordinary per-head
    attention with K = c·W_UK^T, V = c·W_UV^T (float64, non-absorbed)."""
    heads, dn, dv, scale = 3, 24, 40, 0.11
    ctx, n = [9, 30], [6, 11]
    bt = Batch(rng, ctx, n, heads, 8, tree, dtype=np.float32)
    kv_b = rng.standard_normal((heads * (dn + dv), ref.DV)) * 0.05
    kvb = kv_b.reshape(heads, dn + dv, ref.DV)
    t = int(sum(n))
    q_nope = rng.standard_normal((t, heads, dn))
    q_pe = rng.standard_normal((t, heads, ref.ROW - ref.DV))
    q_att = np.concatenate([np.einsum("thd,hdc->thc", q_nope, kvb[:, :dn]), q_pe], axis=-1)
    o_lat, lse = ref.attend_f32(bt.ref_plan(), q_att.astype(np.float32), bt.cache, scale)
    o = np.einsum("thc,hdc->thd", o_lat.astype(np.float64), kvb[:, dn:])
    start = 0
    for b in range(len(n)):
        rows = bt.rows[b].astype(np.float64)
        sl = slice(start, start + n[b])
        o64, lse64 = decompressed_attention_f64(q_nope[sl], q_pe[sl], rows[:, :ref.DV], rows[:, ref.DV:], kv_b,
                                                heads, bt.visible(b), scale)
        assert_close(o[sl], o64, "fp32", f"o of request {b}")
        assert_close(lse[sl], lse64, "fp32", f"lse of request {b}")
        start += n[b]


def test_tree_mask_helpers(rng):
    parents = random_parents(rng, 150)
    packed = ref.tree_mask_from_parents(parents, 4)
    assert packed.shape == (150, 4) and packed.dtype == np.uint64
    assert np.array_equal(ref.mask_bits(packed, 150), ancestors_visible(parents))
    ref.check_tree_mask(ancestors_visible(parents), 0)
    vis = rng.random((5, 100)) < 0.5
    assert np.array_equal(ref.mask_bits(ref.pack_mask(vis, 2), 100), vis)
    with pytest.raises(ValueError, match="must precede"):
        ref.tree_mask_from_parents([0, 2, 0])


def emulate_kernel(batch, q, cache, scale, bm, bn, num_sms, min_split=MIN_SPLIT):
    """The CUDA dataflow in numpy: work items -> direct rows or normalised partials -> the merge
    kernel's items."""
    work, cta_work, merge, n_part = split_work(batch, bm, bn, num_sms, min_split)
    assert cta_work[0] == 0 and cta_work[-1] == len(work) and (np.diff(cta_work) >= 0).all()
    h = batch.num_heads
    qf = q.astype(np.float32).reshape(-1, ref.ROW)
    out = np.full((len(qf), ref.DV), np.nan, np.float32)
    lse = np.full(len(qf), np.nan, np.float32)
    o_part = np.full((max(n_part, 1), bm, ref.DV), np.nan, np.float32)
    lse_part = np.full((max(n_part, 1), bm), np.nan, np.float32)
    for item in work:
        req, m0, mc, part = (int(v) for v in item[[0, 1, 2, 5]])
        start = int(batch.q_start[req])
        _, _, pos = item_keys(batch, item)  # a tree row under split="shape" reads its path
        rows = ref.gather_rows(batch, cache, req)[pos].astype(np.float32)
        g0 = start * h + m0
        s = qf[g0:g0 + mc] @ rows.T * np.float32(scale)
        vis = ref.visibility(batch, req)[(m0 + np.arange(mc)) // h][:, pos]
        s = np.where(vis, s, -np.inf)
        m = s.max(-1, keepdims=True, initial=-np.inf)  # (a tree row's spare pieces have no keys)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        l = p.sum(-1, keepdims=True)
        o = np.where(l > 0, p @ rows[:, :ref.DV] / np.where(l > 0, l, 1), 0)
        ls = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)[:, 0]
        if part < 0:
            out[g0:g0 + mc], lse[g0:g0 + mc] = o, ls
        else:
            r0 = partial_row(item)  # a tree token's rows in a shared group's partial slots
            o_part[part, r0:r0 + mc], lse_part[part, r0:r0 + mc] = o, ls
    for (p0, ns, g0, _), r0, r1 in [(m, 0, int(m[3])) for m in merge]:
        ls = lse_part[p0:p0 + ns, r0:r1]
        top = ls.max(0)
        w = np.exp(ls - top)
        assert np.isnan(out[g0 + r0:g0 + r1]).all(), "every merged row is written once"
        out[g0 + r0:g0 + r1] = (w[..., None] * o_part[p0:p0 + ns, r0:r1]).sum(0) / w.sum(0)[:, None]
        lse[g0 + r0:g0 + r1] = top + np.log(w.sum(0))
    return out.reshape(q.shape[0], h, ref.DV), lse.reshape(q.shape[0], h)


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
@pytest.mark.parametrize("num_sms", [1, 7, 132, 1000])
@pytest.mark.parametrize("case", [([3000], [1], 64, 64, False), ([700, 10, 2500], [1, 1, 1], 8, 16, False),
                                  ([900, 40], [20, 33], 4, 16, True), ([300], [40], 2, 8, False)])
def test_work_split_emulated(rng, variant, num_sms, case):
    bt = Batch(rng, *case, dtype=np.float32)
    batch = bt.ref_plan()
    v = _VARIANTS[variant]
    o, lse = emulate_kernel(batch, bt.q, bt.cache, K26_SCALE, v.bm, v.bn, num_sms, v.min_split)
    o_ref, lse_ref = ref.attend_f32(batch, bt.q, bt.cache, K26_SCALE)
    assert_close(o, o_ref, "fp32", "o_lat")
    assert_close(lse, lse_ref, "fp32", "lse")


@pytest.mark.parametrize("num_sms", [1, 16, 132, 5000])
def test_work_split_shape(rng, num_sms):
    ctx = rng.integers(0, 9000, size=6)
    n = rng.integers(1, 40, size=6)
    batch = ref.validate_batch(ctx, n, np.zeros((6, 1 + int((ctx + n).max())), np.int32), 8, 1, 1)
    bm, bn = 64, 64
    work, cta_work, merge, n_part = split_work(batch, bm, bn, num_sms)
    assert cta_work.shape == (num_sms + 1,) and cta_work[0] == 0 and cta_work[-1] == len(work)
    units = np.array([sum(-(-(ke - kb) // bn) for *_, kb, ke, _p, _, _ in work[a:b])
                      for a, b in zip(cta_work, cta_work[1:])])
    per_cta = max(-(-units.sum() // num_sms), MIN_SPLIT // bn)
    assert units.max() <= per_cta, "no CTA gets more than its equal share"
    assert (units[:-1][units[1:] > 0] == per_cta).all(), "CTAs fill in order, each a full share"
    assert sorted(work[work[:, 5] >= 0, 5].tolist()) == list(range(n_part))
    for req, m0, mc, _kb, _ke, part, g, _ in work:  # a partial item's merge item
        if part < 0:
            assert g == -1
        else:
            p0, ns, g0, rows = merge[g]
            assert p0 <= part < p0 + ns and g0 == batch.q_start[req] * 8 + m0 and rows == mc
    assert merge[:, 1].sum() == n_part and (merge[:, 1] >= 2).all() and len(merge) < num_sms
    assert n_part <= 2 * num_sms
    tiles = {}
    for req, m0, mc, kb, ke, part, _, _ in work:
        tiles.setdefault((req, m0, mc), []).append((kb, ke, part))
        assert kb % bn == 0 and ke > kb
    for (req, m0, mc), pieces in tiles.items():
        last_tok = (m0 + mc - 1) // 8
        assert pieces[0][0] == 0 and pieces[-1][1] == batch.ctx_lens[req] + last_tok + 1
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), "pieces tile the range in order"
        assert (len(pieces) == 1) == (pieces[0][2] < 0), "a tile is final iff it is not cut"


def test_decode_batch_fills_the_gpu():
    """Decode at batch 1 and 64k, batch 8 and 4k, batch 32 and 1k: every SM gets an equal share."""
    for ctx, b in ((65536, 1), (4096, 8), (1024, 32)):
        batch = ref.validate_batch([ctx] * b, [1] * b, np.zeros((b, ctx + 1), np.int32), 64, 1, 1)
        work, cta_work, _, _ = split_work(batch, 64, 64, 132)
        units = [sum(-(-(ke - kb) // 64) for *_, kb, ke, _p, _, _ in work[a:c]) for a, c in zip(cta_work, cta_work[1:])]
        assert max(units) == -(-sum(units) // 132), "the longest CTA is as short as possible"


@pytest.mark.parametrize("heads,busy", [(8, 65), (64, 129)])
def test_decode_variant_splits_finer(heads, busy):
    """d16 at batch 1 and 4k: its shorter minimum split spreads the context over many more SMs than
    the old 256-row minimum (17 of 132)."""
    v = _VARIANTS["d16"]
    batch = ref.validate_batch([4096], [1], np.zeros((1, 4097), np.int32), heads, 1, 1)
    _, cta_work, _, _ = split_work(batch, v.bm, v.bn, 132, v.min_split)
    assert int((np.diff(cta_work) > 0).sum()) == busy


def test_default_variant():
    big, sm120 = 227 * 1024, 99 * 1024
    assert _pick_variant(8, True, big) == "d16" and _pick_variant(64, True, big) == "d16"
    assert _pick_variant(8, True, big, batch=32) == "d16" and _pick_variant(64, True, big, batch=4) == "d16"
    assert _pick_variant(64, True, big, batch=8) == "m64"  # 32 tiles of 16 rows: m64 was faster
    assert _pick_variant(128, False, big) == "m64" and _pick_variant(12, False, big) == "m16"
    assert _pick_variant(8, True, sm120) == "d16" and _pick_variant(64, False, sm120) == "small"
    assert all(_smem_bytes(v) <= big for v in _VARIANTS) and _smem_bytes("small") <= sm120
    # sm_90a: the wgmma tile replaces m64, nothing else changes
    assert _pick_variant(64, True, big, batch=8, wgmma=True) == "w64"
    assert _pick_variant(128, False, big, wgmma=True) == "w64" and _pick_variant(12, False, big, wgmma=True) == "m16"
    assert _pick_variant(8, True, big, wgmma=True) == "d16" and _pick_variant(64, False, sm120, wgmma=True) == "small"
    assert _pick_variant(64, True, big, wgmma=True, max_ctx=4096) == "d16"  # 64-head decode, b1, short
    assert _pick_variant(64, True, big, wgmma=True, max_ctx=16384) == "w64"  # ... and long contexts
    assert _pick_variant(64, True, big, max_ctx=16384) == "d16"
    assert _pick_variant(8, True, big, wgmma=True, max_ctx=65536) == "d16"


def test_d16_mirrors_its_cuda_config():
    """Variant d16 is cuda_src/include/mla_split.cuh's CfgD16 (BN, warps, ring depth) and its
    D16_CTAS_PER_SM (the kernel's __launch_bounds__ minimum); _smem_bytes is SplitCfg::SMEM; two such
    CTAs (1 KB reserved each) share a 228 KB sm_90 / sm_100 SM, and one fits sm_120's 99 KB opt-in."""
    import re
    from pathlib import Path

    import ddtree_rtc

    src = (Path(ddtree_rtc.__file__).parent / "cuda_src" / "include" / "mla_split.cuh").read_text()
    bn, nw, stages = map(int, re.search(r"using CfgD16 = SplitCfg<(\d+), (\d+), (\d+)>;", src).groups())
    per_sm = int(re.search(r"constexpr int D16_CTAS_PER_SM = (\d+);", src).group(1))
    v = _VARIANTS["d16"]
    assert (v.bm, v.bn, v.warps, v.stages, v.split_k, v.ctas_per_sm) == (16, bn, nw, stages, True, per_sm)
    assert _smem_bytes("d16") == (16 * ref.ROW + stages * bn * ref.ROW) * 2 + nw * (bn // 8) * 32 * 16 == 100352
    assert v.ctas_per_sm * (_smem_bytes("d16") + 1024) <= 228 * 1024 and _smem_bytes("d16") <= 99 * 1024
    assert all(u.ctas_per_sm == 1 for name, u in _VARIANTS.items() if name != "d16")


def test_plan_rejects_bad_input(rng):
    bt = Batch(rng, [10, 4], [5, 3], 2, 4, tree=True)
    ok = bt.plan_args()
    ref.mla_attention_plan(*ok)
    ctx, n, pt, heads, ps, pages, mask = ok
    bad_pt = pt.copy()
    bad_pt[1, 0] = pages
    with pytest.raises(ValueError, match=r"request 1, entry 0 = \d+ is out of range"):
        ref.mla_attention_plan(ctx, n, bad_pt, heads, ps, pages, mask)
    with pytest.raises(ValueError, match="cache too small: request 0"):
        ref.mla_attention_plan(ctx, n, pt[:, :2], heads, ps, pages, mask)
    with pytest.raises(ValueError, match="no new tokens"):
        ref.mla_attention_plan(ctx, [5, 0], pt, heads, ps, pages, mask[:5])
    with pytest.raises(ValueError, match="one row per new token"):
        ref.mla_attention_plan(ctx, n, pt, heads, ps, pages, mask[:7])

    def with_bits(edit):
        vis = [ancestors_visible(p) for p in bt.parents]
        edit(vis)
        return np.concatenate([ref.pack_mask(v, 1) for v in vis])

    chain = ancestors_visible(np.arange(-1, 4))
    assert chain[4].sum() == 5

    def drop_diag(v):
        v[0][2, 2] = False

    def see_later(v):
        v[1][0, 2] = True

    def break_closure(v):
        v[0][:] = ancestors_visible(np.array([0, 0, 1, 2, 3]))
        v[0][4, 1] = False  # node 4 sees 3 but not 3's ancestor 1

    for edit, msg in ((drop_diag, "node 2 does not see itself"), (see_later, "node 0 sees later node 2"),
                      (break_closure, "node 4 is not ancestor-closed")):
        with pytest.raises(ValueError, match=msg):
            ref.mla_attention_plan(ctx, n, pt, heads, ps, pages, with_bits(edit))
    beyond = mask.copy()
    beyond[5, 0] |= np.uint64(1 << 40)
    with pytest.raises(ValueError, match="request 1 has bits set beyond its 3 nodes"):
        ref.mla_attention_plan(ctx, n, pt, heads, ps, pages, beyond)
    big = Batch(rng, [3], [70], 1, 8)
    with pytest.raises(ValueError, match="too many tree nodes for the mask"):
        ref.mla_attention_plan(*big.plan_args()[:-1], np.zeros((70, 1), np.uint64))
    huge = Batch(rng, [3], [257], 1, 8)
    with pytest.raises(ValueError, match="too many tree nodes: a request has 257"):
        ref.mla_attention_plan(*huge.plan_args()[:-1], np.zeros((257, 4), np.uint64))


def test_head_gemm_reference(rng):
    x = random_bf16(rng, (5, 3, 24))
    w_nk, w_kn = random_bf16(rng, (3, 16, 24)), random_bf16(rng, (3, 24, 16))
    want = np.stack([x[:, h].astype(np.float64) @ w_nk[h].astype(np.float64).T for h in range(3)], 1)
    assert_close(ref.mla_head_gemm(x, w_nk, True), want, "bf16")
    want = np.stack([x[:, h].astype(np.float64) @ w_kn[h].astype(np.float64) for h in range(3)], 1)
    out = np.zeros((5, 3, 20), bfloat16)
    ref.mla_head_gemm(x, w_kn, False, out=out[:, :, 2:18])
    assert_close(out[:, :, 2:18], want, "bf16")
    assert not out[:, :, :2].astype(np.float32).any() and not out[:, :, 18:].astype(np.float32).any()


# ---------------------------------------------------------------------------------------- GPU
GPU_CASES = [  # ctx, n, heads, page_size, tree
    ([4999], [1], 64, 64, False),  # decode, long context: split-K
    ([1, 300, 2049, 0, 77], [1, 1, 1, 1, 1], 64, 16, False),  # ragged decode batch
    ([6000, 33], [1, 1], 8, 64, False),  # TP8 rank decode (m16)
    ([5], [1], 3, 1, False),  # odd heads, page size 1
    ([1000], [64], 64, 64, True),  # tree verify, 64 heads
    ([700, 2], [16, 100], 8, 16, True),  # ragged tree verify, 8 heads, 2 words
    ([129], [256], 2, 37, True),  # the largest tree, odd page size
    ([0, 90], [200, 33], 4, 64, False),  # causal prefill chunks, ragged
    ([10], [300], 1, 16, False),  # causal beyond the tree limit
]


def _skip_unless_built_for(variant):
    from ddtree_rtc.kernels.mla_attention import WGMMA_ARCH
    from ddtree_rtc.rtc.arch import detect_arch

    if _VARIANTS[variant].wgmma and detect_arch() != WGMMA_ARCH:
        pytest.skip(f"{variant} runs on {WGMMA_ARCH} only")


def _run_kernel(bt, scale=K26_SCALE, num_sms=None, variant=None, words=None, split=None):
    import cupy

    from ddtree_rtc.kernels import mla_attention as k
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    batch = ref.validate_batch(*bt.plan_args())
    plan = k.build_plan(batch, num_sms=num_sms, variant=variant, split=split)
    t = int(bt.n.sum())
    out = nan_bf16_bits((t, bt.heads, ref.DV))
    lse = cupy.full((t, bt.heads), np.nan, dtype=cupy.float32)
    o, l = k.mla_attention(plan, to_device_bf16(bt.q), to_device_bf16(bt.cache), scale, out=out, lse=lse)
    assert o is out and l is lse
    return plan, o, l


@pytest.mark.gpu
@pytest.mark.parametrize("ctx,n,heads,page_size,tree", GPU_CASES)
def test_kernel_vs_reference(rng, ctx, n, heads, page_size, tree):
    bt = Batch(rng, ctx, n, heads, page_size, tree)
    o_ref, lse_ref = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
    for num_sms in (None, 3):
        plan, o, lse = _run_kernel(bt, num_sms=num_sms)
        assert_close(o, o_ref, "bf16", f"o_lat ({plan.variant}, {plan.num_work} items, {plan.num_merge} merges)")
        assert_close(lse, lse_ref, "fp32", f"lse ({plan.variant})")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(_VARIANTS))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (0, 1, 2, 3, 5, 7)])
def test_every_variant(rng, variant, case):
    _skip_unless_built_for(variant)
    bt = Batch(rng, *case)
    o_ref, lse_ref = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
    for num_sms in (1, 64):
        _, o, lse = _run_kernel(bt, num_sms=num_sms, variant=variant)
        assert_close(o, o_ref, "bf16", f"o_lat ({variant}, num_sms={num_sms})")
        assert_close(lse, lse_ref, "fp32", f"lse ({variant}, num_sms={num_sms})")


@pytest.mark.gpu
def test_kernel_masks_tree_rows(rng):
    """Non-ancestor tree rows hold huge values: any leak moves o_lat far off the reference."""
    bt = Batch(rng, [40], [48], 8, 16, tree=True)
    flat = bt.cache.reshape(-1, ref.ROW).astype(np.float32)
    vis_any = bt.visible(0)[:, 40:]
    for j in range(48):
        if not vis_any[:, j].all():  # rows some node must not see: make them loud
            slot = bt.page_table[0, (40 + j) // 16] * 16 + (40 + j) % 16
            flat[slot, :ref.DV] *= 30.0
    bt.cache = flat.reshape(bt.cache.shape).astype(bfloat16)
    o_ref, lse_ref = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
    _, o, lse = _run_kernel(bt)
    # Nodes that may see the loud rows get outputs ~30x larger, and the bf16 rounding of the softmax
    # weights scales with them: compare each (node, head) relative to its own magnitude. A leak of a
    # loud row into a node that must not see it is still off by the row's whole scale.
    o_ref32 = o_ref.astype(np.float32)
    scale = np.abs(o_ref32).max(axis=-1, keepdims=True)
    o_dev = o.get().view(bfloat16).astype(np.float32)
    assert_close(o_dev / scale, o_ref32 / scale, "bf16", "o_lat / row scale")
    assert_close(lse, lse_ref, "fp32", "lse")


@pytest.mark.gpu
def test_device_mask_and_graph_replay(rng):
    """A device mask used in place, the run captured in a CUDA graph, and a later plan written
    into the same buffers replayed by that graph (tree verify)."""
    import cupy

    from ddtree_rtc.kernels import mla_attention as k
    from ddtree_rtc.testing import to_device_bf16

    first = Batch(rng, [3000, 100], [24, 24], 8, 16, tree=True)
    second = Batch(rng, [2500, 190], [24, 24], 8, 16, tree=True)
    second.page_table = np.pad(second.page_table, ((0, 0), (0, first.page_table.shape[1]
                                                            - second.page_table.shape[1])),
                               constant_values=SENTINEL)
    second.num_pages = first.num_pages = max(first.num_pages, second.num_pages)
    mask_dev = cupy.asarray(first.mask)
    plan = k.mla_attention_plan(first.ctx, first.n, first.page_table, 8, 16, first.num_pages, mask_dev, num_sms=40)
    assert plan.mask is mask_dev and not plan.owns_mask

    def pad_cache(bt):
        c = np.full((bt.num_pages, 16, ref.ROW), np.nan, np.float32)
        c[:bt.cache.shape[0]] = bt.cache.astype(np.float32)
        bt.cache = c.astype(bfloat16)
        return to_device_bf16(bt.cache)

    q, cache = to_device_bf16(first.q), pad_cache(first)
    out = cupy.empty((48, 8, ref.DV), cupy.uint16)
    lse = cupy.empty((48, 8), cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        k.mla_attention(plan, q, cache, K26_SCALE, out=out, lse=lse)  # warm-up outside the capture
        stream.begin_capture()
        k.mla_attention(plan, q, cache, K26_SCALE, out=out, lse=lse)
        graph = stream.end_capture()
        out.fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    o_ref, lse_ref = ref.mla_attention(first.ref_plan(), first.q, first.cache, K26_SCALE)
    assert_close(out, o_ref, "bf16", "o_lat (graph)")
    assert_close(lse, lse_ref, "fp32", "lse (graph)")

    mask_dev.set(second.mask)
    k.mla_attention_plan(second.ctx, second.n, second.page_table, 8, 16, second.num_pages, mask_dev,
                         num_sms=40, into=plan)
    q.set(second.q.view(np.uint16))
    cache[...] = pad_cache(second)
    cupy.cuda.get_current_stream().synchronize()  # the plan's copies are queued there; the graph runs on another
    with stream:
        out.fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    o_ref, lse_ref = ref.mla_attention(second.ref_plan(), second.q, second.cache, K26_SCALE)
    assert_close(out, o_ref, "bf16", "o_lat (replayed plan)")
    assert_close(lse, lse_ref, "fp32", "lse (replayed plan)")
    with pytest.raises(ValueError, match="does not fit"):
        big = Batch(rng, [90000], [1], 8, 16)
        k.mla_attention_plan(big.ctx, big.n, big.page_table, 8, 16, big.num_pages, num_sms=40, into=plan)


def _replay_batches(rng, lens, heads):
    """Two decode batches of three requests (lengths ``lens[0]``, ``lens[1]``) on one page-table width
    and one cache size, unused pages NaN, so the second's plan can be written into the first's
    buffers; with each batch's cache on the device."""
    from ddtree_rtc.testing import to_device_bf16

    first = Batch(rng, lens[0], [1, 1, 1], heads, 64)
    second = Batch(rng, lens[1], [1, 1, 1], heads, 64)
    width = max(first.page_table.shape[1], second.page_table.shape[1])
    pages = max(first.num_pages, second.num_pages)
    caches = []
    for bt in (first, second):
        bt.page_table = np.pad(bt.page_table, ((0, 0), (0, width - bt.page_table.shape[1])),
                               constant_values=SENTINEL)
        c = np.full((pages, 64, ref.ROW), np.nan, np.float32)
        c[:bt.num_pages] = bt.cache.astype(np.float32)
        bt.num_pages, bt.cache = pages, c.astype(bfloat16)
        caches.append(to_device_bf16(bt.cache))
    return first, second, caches


def _captured(k, plan, q, cache, out, lse):
    """One eager call, then the same call captured on a non-blocking stream: (stream, graph)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        k.mla_attention(plan, q, cache, K26_SCALE, out=out, lse=lse)
        stream.begin_capture()
        k.mla_attention(plan, q, cache, K26_SCALE, out=out, lse=lse)
        graph = stream.end_capture()
    return stream, graph


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [([3000, 100, 4100], [40, 5000, 1]), ([1, 2, 3], [40, 5000, 1])],
                         ids=["split-then-split", "unsplit-template"])
@pytest.mark.parametrize("variant", ["d16", "m64", "w64"])
def test_decode_graph_replay(rng, variant, lens):
    """A decode step captured in a CUDA graph from a replay template, then a later decode plan (other
    lengths, so another split and merge layout) written into the same buffers and replayed. The
    unsplit template cuts no tile itself: the replayed plan's merge and its larger work list must
    still fit (the engine's runner makes its templates this way)."""
    import cupy

    _skip_unless_built_for(variant)

    from ddtree_rtc.kernels import mla_attention as k
    from ddtree_rtc.testing import to_device_bf16

    first, second, caches = _replay_batches(rng, lens, 8)
    plan = k.build_plan(ref.validate_batch(*first.plan_args()), num_sms=50, variant=variant, replay=True)
    q, cache = to_device_bf16(first.q), caches[0].copy()
    out = cupy.empty((3, 8, ref.DV), cupy.uint16)
    lse = cupy.empty((3, 8), cupy.float32)
    stream, graph = _captured(k, plan, q, cache, out, lse)
    for bt, dev_cache in ((first, caches[0]), (second, caches[1])):
        if bt is second:
            k.build_plan(ref.validate_batch(*second.plan_args()), into=plan)
            q.set(second.q.view(np.uint16))
            cache[...] = dev_cache
            cupy.cuda.get_current_stream().synchronize()  # the plan's copies are queued there, not on `stream`
        with stream:
            out.fill(0x7FC0)
            lse.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
        o_ref, lse_ref = ref.mla_attention(bt.ref_plan(), bt.q, bt.cache, K26_SCALE)
        assert_close(out, o_ref, "bf16", f"o_lat ({variant}, graph)")
        assert_close(lse, lse_ref, "fp32", f"lse ({variant}, graph)")


@pytest.mark.gpu
def test_kernel_rejects_bad_input(rng):
    import cupy

    from ddtree_rtc.kernels import mla_attention as k
    from ddtree_rtc.testing import to_device_bf16

    bt = Batch(rng, [10, 4], [5, 3], 2, 4, tree=True)
    plan = k.mla_attention_plan(*bt.plan_args())
    q, cache = to_device_bf16(bt.q), to_device_bf16(bt.cache)
    with pytest.raises(ValueError, match="q: expected shape"):
        k.mla_attention(plan, q[:7], cache, K26_SCALE)
    with pytest.raises(ValueError, match="cache: expected shape"):
        k.mla_attention(plan, q, cache[1:], K26_SCALE)
    with pytest.raises(TypeError, match="tree_mask: expected dtype uint64"):
        k.mla_attention_plan(*bt.plan_args()[:-1], cupy.zeros((8, 1), cupy.int64))
    bad = bt.mask.copy()
    bad[2, 0] = np.uint64(0b1111)  # node 2 sees 0, 1, 2 and the later node 3
    with pytest.raises(ValueError, match="sees later node 3"):
        k.mla_attention_plan(*bt.plan_args()[:-1], cupy.asarray(bad))
    with pytest.raises(ValueError, match="out of range"):
        k.mla_attention_plan(bt.ctx, bt.n, np.where(bt.page_table == SENTINEL, 0, bt.page_table + 100), 2, 4,
                             bt.num_pages, bt.mask)


@pytest.mark.gpu
@pytest.mark.parametrize("trans_w", [False, True])
def test_head_gemm_kernel(rng, trans_w):
    """W_UK absorption and W_UV expansion shapes, on strided views like the model's."""
    import cupy

    from ddtree_rtc.kernels.mla_attention import mla_head_gemm
    from ddtree_rtc.testing import to_device_bf16

    for t, h, dn, dv in ((1, 64, 128, 128), (37, 5, 24, 40)):
        kv_b = random_bf16(rng, (h, dn + dv, ref.DV), 0.05)
        if trans_w:  # expansion: o_lat [T, H, 512] x W_UV[h]^T -> [T, H, dv]
            x = random_bf16(rng, (t, h, ref.DV))
            want = ref.mla_head_gemm(x, kv_b[:, dn:], True)
            got = mla_head_gemm(to_device_bf16(x), to_device_bf16(kv_b)[:, dn:], True)
        else:  # absorption: q[:, :, :dn] of [T, H, dn+64] x W_UK[h] -> q_att[:, :, :512] of [T, H, 576]
            qfull = random_bf16(rng, (t, h, dn + 64))
            want = ref.mla_head_gemm(qfull[:, :, :dn], kv_b[:, :dn], False)
            q_att = cupy.full((t, h, ref.ROW), 0x7FC0, cupy.uint16)
            got = mla_head_gemm(to_device_bf16(qfull)[:, :, :dn], to_device_bf16(kv_b)[:, :dn], False,
                                out=q_att[:, :, :ref.DV])
            assert np.isnan(q_att[:, :, ref.DV:].get().view(bfloat16).astype(np.float32)).all()
        assert_close(got, want, "bf16", f"head gemm t={t} h={h}")
