"""DFlash drafter GQA attention: the numpy reference against an independent float64 restatement
(paging, windows, head groups, empty contexts), poisoned pages and page-table entries that must not
leak, bad input, the CUDA wrapper's split rule (a pure function of shapes), and the kernels on the
GPU against the reference with NaN in every cache row nobody may read, PAGE_SENTINEL in every
page-table entry nobody may look at, and NaN-prefilled outputs."""

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.reference import gqa_attention as ref
from ddtree_rtc.testing import random_bf16

SENTINEL = np.iinfo(np.int32).max  # ddtree_rtc.engine.kv_cache.PAGE_SENTINEL


class Case:
    """Random paged inputs. Request b's rows [start, len) sit on scattered pages; every other cache
    row (before the window in its first page, past the context in its last page, unused pages) is
    NaN, and every page-table entry the window does not touch is SENTINEL."""

    def __init__(self, rng, lens, nq, hq, hkv, d, page_size=16, starts=None, extra_cols=2, extra_pages=3,
                 q_scale=0.5):
        self.lens = np.array(lens, dtype=np.int32)
        b = len(self.lens)
        self.starts = None if starts is None else np.array(starts, dtype=np.int32)
        st = np.zeros(b, np.int64) if starts is None else self.starts.astype(np.int64)
        self.b, self.nq, self.hq, self.hkv, self.d, self.page_size = b, nq, hq, hkv, d, page_size
        first = st // page_size
        last = -(-self.lens.astype(np.int64) // page_size)
        need = np.maximum(last - first, 0)
        self.num_pages = int(need.sum()) + extra_pages
        perm = rng.permutation(self.num_pages)  # non-contiguous, shuffled page ids
        max_pages = int(last.max(initial=0)) + extra_cols
        self.page_table = np.full((b, max(max_pages, 1)), SENTINEL, dtype=np.int32)
        kc = np.full((self.num_pages, page_size, hkv, d), np.nan, np.float32)
        vc = np.full((self.num_pages, page_size, hkv, d), np.nan, np.float32)
        self.ctx_k, self.ctx_v, off = [], [], 0
        for r in range(b):
            pages = perm[off:off + need[r]]
            off += need[r]
            self.page_table[r, first[r]:last[r]] = pages
            pos = np.arange(st[r], self.lens[r])
            k = random_bf16(rng, (len(pos), hkv, d)).astype(np.float32)
            v = random_bf16(rng, (len(pos), hkv, d)).astype(np.float32)
            pg = self.page_table[r, pos // page_size]
            kc[pg, pos % page_size] = k
            vc[pg, pos % page_size] = v
            self.ctx_k.append(k)
            self.ctx_v.append(v)
        self.k_cache, self.v_cache = kc.astype(bfloat16), vc.astype(bfloat16)
        self.q = random_bf16(rng, (b, nq, hq, d), q_scale)
        self.k_block = random_bf16(rng, (b, nq, hkv, d))
        self.v_block = random_bf16(rng, (b, nq, hkv, d))
        self.scale = d ** -0.5

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.lens, self.k_block, self.v_block,
                self.scale)

    def f64(self):
        """Per request, per query head, straight from the rows as generated (no page table)."""
        o = np.zeros((self.b, self.nq, self.hq, self.d))
        group = self.hq // self.hkv
        for r in range(self.b):
            for h in range(self.hq):
                kv = h // group
                keys = np.concatenate([self.ctx_k[r][:, kv], self.k_block[r, :, kv].astype(np.float32)])
                vals = np.concatenate([self.ctx_v[r][:, kv], self.v_block[r, :, kv].astype(np.float32)])
                for i in range(self.nq):
                    s = keys.astype(np.float64) @ self.q[r, i, h].astype(np.float64) * self.scale
                    w = np.exp(s - s.max())
                    o[r, i, h] = w @ vals.astype(np.float64) / w.sum()
        return o


def _close(actual, expected, what="out"):
    """bf16 bound: |a - e| <= 2e-2 * max|e| everywhere (one bf16 rounding is 2^-9 relative to the
    element; the rest is fp32 accumulation order), and every element finite."""
    a = np.asarray(actual).astype(np.float64)
    assert np.isfinite(a).all(), f"{what}: {int((~np.isfinite(a)).sum())} non-finite elements"
    err = np.abs(a - expected).max()
    mag = np.abs(expected).max()
    assert err <= 2e-2 * mag, f"{what}: max abs err {err:.3e} > 2e-2 x {mag:.3e}"


HEADS = [(8, 1), (8, 2), (64, 8)]


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("nq", [1, 7, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_reference_matches_float64(rng, hq, hkv, nq, d):
    lens = [0, 17, 300] if nq != 7 else [1, 300, 17]
    c = Case(rng, lens, nq, hq, hkv, d)
    o = ref.gqa_attention(*c.args())
    assert o.dtype == bfloat16 and o.shape == (3, nq, hq, d)
    _close(o, c.f64())
    # one bf16 rounding of the float64 result: at most one ulp off almost everywhere
    assert np.abs(o.astype(np.float64) - c.f64()).max() <= 2 ** -7 * np.abs(c.f64()).max()


@pytest.mark.parametrize("hq,hkv", [(8, 2), (64, 8)])
def test_reference_window_starts(rng, hq, hkv):
    c = Case(rng, [300, 40, 17, 0, 64], 8, hq, hkv, 128, starts=[250, 33, 17, 0, 16])
    o = ref.gqa_attention(*c.args(), context_starts=c.starts)
    _close(o, c.f64())
    # starts = 0 explicitly equals None
    c0 = Case(rng, [37, 5], 7, 8, 1, 64)
    np.testing.assert_array_equal(ref.gqa_attention(*c0.args(), context_starts=np.zeros(2, np.int32)),
                                  ref.gqa_attention(*c0.args()))


def test_reference_empty_context_attends_block(rng):
    c = Case(rng, [0, 0], 8, 8, 2, 64)
    o = ref.gqa_attention(*c.args()).astype(np.float64)
    _close(o, c.f64())
    # by hand: softmax over the 8 block rows only
    q = c.q[1, 3, 5].astype(np.float64)
    k = c.k_block[1, :, 5 // 4].astype(np.float64)
    v = c.v_block[1, :, 5 // 4].astype(np.float64)
    w = np.exp(k @ q * c.scale - (k @ q * c.scale).max())
    np.testing.assert_allclose(o[1, 3, 5], w @ v / w.sum(), rtol=1e-2, atol=1e-2)


def test_reference_out_and_no_leak(rng):
    c = Case(rng, [33, 1, 100], 8, 64, 8, 128, starts=[16, 0, 99])
    assert np.isnan(c.k_cache.astype(np.float32)).any() and (c.page_table == SENTINEL).any()
    out = np.full(c.q.shape, np.nan, dtype=bfloat16)
    o = ref.gqa_attention(*c.args(), context_starts=c.starts, out=out)
    assert o is out
    _close(out, c.f64())


def test_reference_block_rows_are_keys_not_masked(rng):
    """Non-causal: the first block row sees the last block row (changing it changes the output)."""
    c = Case(rng, [20], 8, 8, 1, 64)
    a = ref.gqa_attention(*c.args()).astype(np.float64)
    c.v_block[0, 7] = (c.v_block[0, 7].astype(np.float32) + 4).astype(bfloat16)
    b = ref.gqa_attention(*c.args()).astype(np.float64)
    assert np.abs(a[0, 0] - b[0, 0]).max() > 1e-2


def _bad_inputs(c):
    """(expected message, kwargs overriding the good call) for every kind of bad input."""
    q, kc, vc, pt, lens, kb, vb, scale = c.args()
    bad_pt = pt.copy()
    bad_pt[0, 0] = c.num_pages  # a page the request reads
    neg_pt = pt.copy()
    neg_pt[1, 1] = -1
    return [
        ("q: expected 4 dims", dict(q=q[0])),
        ("q: 17 block rows", dict(q=np.zeros((2, 17, 8, 64), bfloat16))),
        ("q: head dim 96", dict(q=np.zeros((2, 7, 8, 96), bfloat16))),
        ("not a positive multiple of 2 kv heads", dict(q=np.zeros((2, 7, 7, 64), bfloat16))),
        ("q: expected dtype bf16", dict(q=q.astype(np.float32))),
        ("k_cache: expected shape", dict(k_cache=kc[..., :32])),
        ("v_cache: expected shape", dict(v_cache=vc[1:])),
        ("v_cache: expected dtype bf16", dict(v_cache=vc.astype(np.float16))),
        ("k_block: expected shape", dict(k_block=kb[:, :6])),
        ("v_block: expected shape", dict(v_block=vb[:1])),
        ("page_table: expected shape", dict(page_table=pt[:1])),
        ("page_table: expected dtype int32", dict(page_table=pt.astype(np.int64))),
        ("context_lens: expected shape", dict(context_lens=lens[:1])),
        ("context_lens: expected dtype int32", dict(context_lens=lens.astype(np.int64))),
        ("context_starts: expected shape", dict(context_starts=np.zeros(3, np.int32))),
        ("context_starts: expected dtype int32", dict(context_starts=np.zeros(2, np.uint32))),
        ("out: expected shape", dict(out=np.zeros((2, 7, 8, 32), bfloat16))),
        ("out: expected dtype bf16", dict(out=np.zeros(q.shape, np.float32))),
        ("softmax_scale: must be finite", dict(softmax_scale=float("nan"))),
        ("context_lens: request 1 has -1", dict(context_lens=np.array([lens[0], -1], np.int32))),
        ("context_lens: request 0 has 1000", dict(context_lens=np.array([1000, lens[1]], np.int32))),
        ("context_starts: request 0 starts at 41", dict(context_starts=np.array([41, 0], np.int32))),
        ("context_starts: request 1 starts at -2", dict(context_starts=np.array([0, -2], np.int32))),
        ("page_table: request 0, entry 0", dict(page_table=bad_pt)),
        ("page_table: request 1, entry 1 = -1", dict(page_table=neg_pt)),
    ]


def _call(fn, c, **kw):
    names = ["q", "k_cache", "v_cache", "page_table", "context_lens", "k_block", "v_block", "softmax_scale"]
    args = dict(zip(names, c.args()))
    args.update(kw)
    return fn(**args)


def test_reference_rejects_bad_input(rng):
    c = Case(rng, [40, 20], 7, 8, 2, 64)
    _call(ref.gqa_attention, c)  # the good call passes
    for msg, kw in _bad_inputs(c):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
            _call(ref.gqa_attention, c, **kw)
    # entries the rows never touch are not looked at: a window past page 0 ignores entry 0
    pt = c.page_table.copy()
    pt[0, 0] = SENTINEL
    with pytest.raises(ValueError, match="page_table: request 0, entry 0"):
        _call(ref.gqa_attention, c, page_table=pt)
    c2 = Case(rng, [40, 20], 7, 8, 2, 64, starts=[16, 0])
    assert c2.page_table[0, 0] == SENTINEL
    _call(ref.gqa_attention, c2, context_starts=c2.starts)


# ---- the CUDA wrapper's split rule (host only)

def test_split_rule_is_a_function_of_shapes():
    from ddtree_rtc.kernels.gqa_attention import ROWS_PER_SPLIT, num_splits

    # same shapes -> same splits, whatever the lengths (they are never an argument)
    assert num_splits(1, 8, 1, 64, 132) == 1  # capacity <= ROWS_PER_SPLIT
    assert num_splits(1, 8, 1, 4096, 132) == 4096 // ROWS_PER_SPLIT
    assert num_splits(1, 8, 1, 10**6, 132) == 17  # capped: 8 * 17 = 136 CTAs cover 132 SMs
    assert num_splits(32, 8, 1, 10**6, 132) == 1  # 256 CTAs already cover the GPU
    assert num_splits(4, 2, 2, 4097, 132) == 5
    for b in (1, 3, 32):
        for cap in (16, 1000, 4097, 65536):
            s = num_splits(b, 8, 1, cap, 132)
            assert 1 <= s <= max(1, -(-cap // ROWS_PER_SPLIT))
            assert s == num_splits(b, 8, 1, cap, 132)


def test_split_ranges_cover_the_window():
    """The kernel's per-split chunk ranges (mirrored here) tile [start, len) exactly, in order."""
    from ddtree_rtc.kernels.gqa_attention import split_chunks

    for n_rows in (0, 1, 63, 64, 65, 1000, 4097):
        for splits in (1, 2, 5, 17, 64):
            got = []
            for s in range(splits):
                c0, c1 = split_chunks(n_rows, splits, s)
                assert c0 <= c1
                got += list(range(c0, c1))
            assert got == list(range(-(-n_rows // 64)))


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_merge_emulated(rng, splits):
    """The kernel's schedule in numpy: each split attends to its chunks of the window (the last one
    also to the block rows), writes o / l and log2-sum-exp (empty: -inf), and the merge's weighted sum
    equals one softmax over all keys."""
    from ddtree_rtc.kernels.gqa_attention import BN, split_chunks

    c = Case(rng, [0, 1, 65, 300], 8, 8, 2, 64, starts=[0, 0, 1, 30])
    expect = c.f64()
    group = c.hq // c.hkv
    for r in range(c.b):
        n_rows = len(c.ctx_k[r])
        for h in range(c.hq):
            kv = h // group
            q = c.q[r, :, h].astype(np.float64)
            parts = []
            for s in range(splits):
                c0, c1 = split_chunks(n_rows, splits, s)
                keys = [c.ctx_k[r][c0 * BN:c1 * BN, kv]]
                vals = [c.ctx_v[r][c0 * BN:c1 * BN, kv]]
                if s == splits - 1:
                    keys.append(c.k_block[r, :, kv].astype(np.float32))
                    vals.append(c.v_block[r, :, kv].astype(np.float32))
                k, v = np.concatenate(keys).astype(np.float64), np.concatenate(vals).astype(np.float64)
                if len(k) == 0:
                    parts.append((np.zeros((c.nq, c.d)), np.full(c.nq, -np.inf)))
                    continue
                x = q @ k.T * c.scale * np.log2(np.e)
                m = x.max(-1, keepdims=True)
                p = np.exp2(x - m)
                parts.append((p @ v / p.sum(-1, keepdims=True), (m + np.log2(p.sum(-1, keepdims=True)))[:, 0]))
            top = np.max([lse for _, lse in parts], axis=0)
            w = [np.where(lse == -np.inf, 0, np.exp2(lse - top)) for _, lse in parts]
            o = sum(wi[:, None] * oi for wi, (oi, _) in zip(w, parts)) / sum(w)[:, None]
            np.testing.assert_allclose(o, expect[r, :, h], rtol=1e-9, atol=1e-9)


# ---- the kernels on the GPU

def _dev(a):
    """Host array -> device (bf16 as uint16 bits; other dtypes as they are, for the dtype checks)."""
    import cupy

    from ddtree_rtc.testing import to_device_bf16

    return to_device_bf16(a) if a.dtype == bfloat16 else cupy.asarray(a)


def _run_gpu(c, starts=True, out=True):
    from ddtree_rtc.kernels import gqa_attention as k
    from ddtree_rtc.testing import nan_bf16_bits

    args = [_dev(a) if isinstance(a, np.ndarray) else a for a in c.args()]
    kw = {}
    if starts and c.starts is not None:
        kw["context_starts"] = _dev(c.starts)
    if out:
        kw["out"] = nan_bf16_bits(c.q.shape)
    o = k.gqa_attention(*args, **kw)
    if out:
        assert o is kw["out"]
    return o.get().view(bfloat16)


GPU_CASES = [  # lens, starts, nq, hq, hkv, d, extra page-table columns (capacity -> splits)
    ([0, 1, 63, 64, 65, 1000, 4097], None, 8, 64, 8, 128, 2),
    ([0, 1, 63, 64, 65, 1000, 4097], None, 8, 8, 2, 64, 2),
    ([4097], None, 8, 64, 8, 128, 300),  # one request, many splits (capped by the SM count)
    ([1000, 0, 65], None, 8, 8, 2, 128, 100),  # splits past every context: empty partials
    ([1000, 4097, 65, 64, 3], [900, 1, 64, 10, 3], 8, 64, 8, 128, 40),  # windows
    ([1000, 4097, 65], [999, 4000, 0], 7, 8, 2, 64, 40),
    ([5, 300], None, 1, 64, 8, 128, 0),
    ([77, 130], [3, 129], 16, 8, 1, 64, 5),  # Q = 16, one kv head: 128 query rows, two m-tiles
    ([70, 0, 33], None, 3, 16, 16, 128, 3),  # MHA (group of 1)
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,starts,nq,hq,hkv,d,extra", GPU_CASES)
def test_kernel_vs_reference(rng, lens, starts, nq, hq, hkv, d, extra):
    c = Case(rng, lens, nq, hq, hkv, d, starts=starts, extra_cols=extra)
    o = _run_gpu(c)
    expect = ref.gqa_attention(*c.args(), context_starts=c.starts)
    _close(o, expect.astype(np.float64), "kernel vs reference")
    _close(o, c.f64(), "kernel vs float64")


@pytest.mark.gpu
def test_kernel_batch_32(rng):
    lens = rng.integers(0, 1500, 32)
    lens[:4] = [0, 1, 64, 4097]
    starts = np.minimum(lens, rng.integers(0, 200, 32))
    c = Case(rng, lens, 8, 64, 8, 128, starts=starts, extra_cols=4)
    o = _run_gpu(c, out=False)
    _close(o, ref.gqa_attention(*c.args(), context_starts=c.starts).astype(np.float64))


@pytest.mark.gpu
def test_kernel_metadata_stays_on_device(rng):
    """The same shapes give the same launch whatever the lengths; device metadata works without a
    host copy (lengths changed on the device between two calls are picked up)."""
    import cupy

    from ddtree_rtc.kernels import gqa_attention as k

    c = Case(rng, [300, 65], 8, 8, 2, 128, extra_cols=3)
    args = [_dev(a) if isinstance(a, np.ndarray) else a for a in c.args()]
    o1 = k.gqa_attention(*args).get().view(bfloat16)
    _close(o1, c.f64())
    args[4] = cupy.asarray(np.array([65, 0], np.int32))  # shorter windows, same page table
    o2 = k.gqa_attention(*args).get().view(bfloat16)
    short = ref.gqa_attention(c.q, c.k_cache, c.v_cache, c.page_table, np.array([65, 0], np.int32), c.k_block,
                              c.v_block, c.scale)
    _close(o2, short.astype(np.float64))


@pytest.mark.gpu
def test_kernel_rejects_bad_input(rng):
    from ddtree_rtc.kernels import gqa_attention as k

    c = Case(rng, [40, 20], 7, 8, 2, 64)
    shape_errors = [(m, kw) for m, kw in _bad_inputs(c) if not m.startswith(("context_lens: request",
                                                                               "context_starts: request",
                                                                               "page_table: request"))]
    dev = {n: _dev(a) for n, a in zip(["q", "k_cache", "v_cache", "page_table", "context_lens", "k_block",
                                          "v_block"], c.args()[:7])}

    def call(**kw):
        args = {**dev, "softmax_scale": c.scale}
        args.update({n: _dev(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()})
        return k.gqa_attention(**args)

    call()
    for msg, kw in shape_errors:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
            call(**kw)
    with pytest.raises(TypeError, match="q: expected a cupy array"):
        k.gqa_attention(c.q, *list(dev.values())[1:], c.scale)
