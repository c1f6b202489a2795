"""The small-M path's row-invariant INT4 expert step (cuda_src/moe_small.cu): its numpy twin and
limits (CPU), the kernels' work split transliterated against the reference (CPU), and on the GPU the
kernels against the reference (poisoned experts, NaN-prefilled buffers, odd M, the TP8 / EP8 shard
dims), bitwise row invariance over M, and PDL / graph replay."""

import os

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.model.int4_repack import random_compressed_experts, repack_experts
from ddtree_rtc.reference.moe_gemm import down_combine, expert_hidden
from ddtree_rtc.reference.moe_gemm import moe_experts as ref_moe
from ddtree_rtc.reference.moe_small import check_small_shape, moe_small_experts, moe_small_plan
from ddtree_rtc.testing import assert_close, random_bf16

MS = [1, 3, 17, 33, 64]


def random_routing(rng, m, num_experts, top_k, allowed=None):
    pool = np.arange(num_experts) if allowed is None else np.asarray(allowed)
    ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    return ids, rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32)


def test_twin_is_the_reference_composition(rng):
    ex = random_compressed_experts(rng, 6, 256, 128)
    x = random_bf16(rng, (5, 256))
    ids, w = random_routing(rng, 5, 6, 3)
    shared = random_bf16(rng, (5, 256), 0.5)
    assert moe_small_plan(5, 6, 3, 256, 128) is None
    got = moe_small_experts(x, ids, w, ex, shared=shared)
    assert np.array_equal(got.view(np.uint16), ref_moe(x, ids, w, ex, shared=shared).view(np.uint16))
    # an expert shard: the router's ids and the shard's first expert; ids of other shards count nothing
    shard = moe_small_experts(x, ids + 40, w, ex, shared=shared, id_offset=40, check_ids=False)
    assert np.array_equal(shard.view(np.uint16), got.view(np.uint16))
    away = moe_small_experts(x, ids + 7, w, ex, shared=shared, id_offset=40, check_ids=False)
    assert np.array_equal(away.view(np.uint16), shared.view(np.uint16))


def test_limits_name_the_value():
    with pytest.raises(ValueError, match="M = 65 tokens outside 1..64"):
        check_small_shape(65, 8, 2, 128, 128)
    with pytest.raises(ValueError, match="M = 0"):
        check_small_shape(0, 8, 2, 128, 128)
    with pytest.raises(ValueError, match="2000 experts"):
        check_small_shape(1, 2000, 2, 128, 128)
    with pytest.raises(ValueError, match="64 \\* 17 pairs"):
        check_small_shape(64, 384, 17, 128, 128)
    with pytest.raises(ValueError, match="intermediate size 100"):
        check_small_shape(1, 8, 2, 128, 100)
    with pytest.raises(ValueError, match="top_k = 33"):
        check_small_shape(1, 64, 33, 128, 128)


def test_down_ranges_cover_every_unit_once_evenly():
    """moe_small_down_x's split: every (touched rank, row group) unit in exactly one CTA's range, in
    order, the ranges' sizes within one unit of each other (all CTAs of the wave busy)."""
    for touched, ctas, groups in ((186, 264, 56), (115, 264, 56), (281, 264, 56), (3, 264, 4), (1, 1, 56),
                                  (0, 5, 56)):
        ranges = down_ranges(touched, ctas, groups)
        assert [u for lo, hi in ranges for u in range(lo, hi)] == list(range(touched * groups))
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1


# ---- the kernels' work split, transliterated (which CTA / warp computes what, in what order) ----

def emulate_small(x, ids, w, rex, shared=None, warps=8, down_x=False, ctas=264):
    """moe_small_gate_up + moe_small_down as cuda_src/moe_small.cu splits them, with the mma
    operands from the lane emulation of test_moe_repack (scale after the mma, as the kernels)."""
    from test_moe_repack import emulate_weights

    m, hid = x.shape
    top_k, e_all, inter = ids.shape[1], rex.num_experts, rex.intermediate
    flat = ids.reshape(-1)
    tokens = {}  # build_routing: token bitmask per expert (ids outside [0, E) route nowhere)
    for p, e in enumerate(flat):
        if 0 <= e < e_all:
            tokens.setdefault(int(e), set()).add(p // top_k)
    touched = sorted(tokens)
    h = np.full((m * top_k, inter), np.nan, np.float32)
    xf = x.astype(np.float32).astype(np.float64)
    for rank in range(min(e_all, m * top_k)):  # grid.y
        if rank >= len(touched):
            continue  # the CTA exits
        e = touched[rank]
        cols = sorted(tokens[e])
        w13 = emulate_weights(np.asarray(rex.w13[e]), 2 * inter, hid, scale_after=True).astype(np.float64)
        for tile in range(2 * inter // 16):  # grid.x
            part = np.zeros((warps, 16, len(cols)))
            for wp in range(warps):
                for kb in range(wp, hid // 128, warps):
                    ks = slice(128 * kb, 128 * kb + 128)
                    part[wp] += w13[16 * tile:16 * tile + 16, ks] @ xf[cols, ks].T
            v = part[0]
            for wp in range(1, warps):
                v = v + part[wp]
            for c, tok in enumerate(cols):
                for g in range(8):
                    val = v[g, c] / (1 + np.exp(-v[g, c])) * v[g + 8, c]
                    for s in range(top_k):
                        if flat[tok * top_k + s] == e:
                            h[tok * top_k + s, 8 * tile + g] = val
    hb = h.astype(bfloat16).astype(np.float64)
    if down_x:
        y = emulate_down_x(hb, flat, w, rex, tokens, touched, m, top_k, warps, ctas)
    else:
        y = emulate_down(hb, flat, w, rex, tokens, touched, m, top_k, warps)
    if shared is not None:
        y += shared.astype(np.float64)
    return y


def emulate_down(hb, flat, w, rex, tokens, touched, m, top_k, warps):
    """moe_small_down (up to 16 tokens): 16-row tiles of H, warp w taking touched ranks w, w + 8, ...,
    the CTA's combine in slot order."""
    from test_moe_repack import emulate_weights

    e_all, hid, inter = rex.num_experts, rex.hidden, rex.intermediate
    y = np.zeros((m, hid))
    w2 = {e: emulate_weights(np.asarray(rex.w2[e]), hid, inter, scale_after=True).astype(np.float64) for e in touched}
    for tile in range(hid // 16):  # grid.x
        d = np.full((m * top_k, 16), np.nan)
        for wp in range(warps):
            for e in touched[wp::warps]:
                for tok in sorted(tokens[e]):
                    first = next(tok * top_k + s for s in range(top_k) if flat[tok * top_k + s] == e)
                    val = w2[e][16 * tile:16 * tile + 16] @ hb[first]
                    for s in range(top_k):
                        if flat[tok * top_k + s] == e:
                            d[tok * top_k + s] = val
        for tok in range(m):
            a = np.zeros(16)
            for s in range(top_k):
                if 0 <= flat[tok * top_k + s] < e_all:
                    a = a + w[tok, s] * d[tok * top_k + s]
            y[tok, 16 * tile:16 * tile + 16] = a
    return y


def down_ranges(touched, ctas, groups):
    """moe_small_down_x's split (include/moe_small.cuh, range_lo): the (touched rank, 128-row group)
    units rank-major, CTA b taking [b U / C, (b + 1) U / C): only the schedule depends on it."""
    units = touched * groups
    return [(b * units // ctas, (b + 1) * units // ctas) for b in range(ctas)]


def emulate_down_x(hb, flat, w, rex, tokens, touched, m, top_k, warps, ctas):
    """moe_small_down_x + moe_small_combine (from 17 tokens): per CTA its range of (touched rank,
    128-row group) units, cut into segments (one expert's run of groups); per segment the expert's
    columns (first pair of each token, every slot with the expert), warp w taking its tiles t0 + w,
    t0 + w + 8, ... two at a time (a pair's second tile 8 on), each (pair, row) value written to d;
    then the combine in slot order."""
    from test_moe_repack import emulate_weights

    e_all, hid, inter = rex.num_experts, rex.hidden, rex.intermediate
    w2 = {e: emulate_weights(np.asarray(rex.w2[e]), hid, inter, scale_after=True).astype(np.float64) for e in touched}
    groups = hid // 128
    d = np.full((m * top_k, hid), np.nan)
    for lo, hi in down_ranges(len(touched), ctas, groups):
        u = lo
        while u < hi:
            e, g0 = touched[u // groups], u % groups
            g1 = min(groups, g0 + hi - u)
            cols = sorted(tokens[e])
            pcol = [next(tok * top_k + s for s in range(top_k) if flat[tok * top_k + s] == e) for tok in cols]
            for wp in range(warps):
                mine = list(range(8 * g0 + wp, 8 * g1, warps))
                for pair in range(0, len(mine), 2):
                    for tile in mine[pair:pair + 2]:
                        for tok, first in zip(cols, pcol):
                            val = w2[e][16 * tile:16 * tile + 16] @ hb[first]
                            for s in range(top_k):
                                if flat[tok * top_k + s] == e:
                                    d[tok * top_k + s, 16 * tile:16 * tile + 16] = val
            u += g1 - g0
    y = np.zeros((m, hid))
    for tok in range(m):
        for s in range(top_k):
            if 0 <= flat[tok * top_k + s] < e_all:
                y[tok] = y[tok] + w[tok, s] * d[tok * top_k + s]
    assert np.isfinite(y).all(), "a pair's down values were never written"
    return y


@pytest.mark.parametrize("m,e,top_k,bad,down_x,ctas", [
    (1, 5, 3, False, False, 264), (4, 3, 2, False, False, 264), (9, 7, 4, True, False, 264),
    (1, 5, 3, False, True, 264), (4, 3, 2, False, True, 2), (9, 7, 4, True, True, 5), (3, 4, 2, False, True, 1),
])
def test_emulated_kernels_match_reference(rng, m, e, top_k, bad, down_x, ctas):
    """The work split (touched-expert ranks, warp K split, first-slot h rows; the down as
    moe_small_down (round-robin experts per 16-row tile, per-pair down values, slot-order combine) or
    as moe_small_down_x + moe_small_combine over ``ctas`` CTAs) gives the reference's numbers; with
    ``bad`` some ids are outside [0, E) (another expert shard's) and contribute nothing."""
    hid, inter = 512, 256
    ex = random_compressed_experts(rng, e, hid, inter)
    x = random_bf16(rng, (m, hid))
    ids, w = random_routing(rng, m, e, top_k)
    if bad:
        ids[::2, 0] = -3
        ids[1::3, -1] = e + 1
    shared = random_bf16(rng, (m, hid), 0.5)
    got = emulate_small(x, ids, w, repack_experts(ex), shared, down_x=down_x, ctas=ctas)
    assert_close(got, ref_moe(x, ids, w, ex, shared=shared, check_ids=False), "bf16_accum")


def emulate_dense(x, gate, w13):
    """moe_small_dense's index logic (include/skinny_pair.cuh, MODE 0) transliterated: row block rb of
    a warp, its lanes' B rows (the
    router's 8 rows, or gate rows i0..i0+3 then up rows i0..i0+3), the C fragment's columns 2t, 2t+1,
    and the shared epilogue's pairing of lane t with lane t ^ 2."""
    e, inter = gate.shape[0], w13.shape[0] // 2
    xf = x.astype(np.float64)
    logits = np.full((x.shape[0], e), np.nan)
    hs = np.full((x.shape[0], inter), np.nan)
    router_blocks = e // 8
    for rb in range(router_blocks + inter // 4):
        i0 = (rb - router_blocks) * 4
        rows = [gate[8 * rb + g] if rb < router_blocks else w13[(0 if g < 4 else inter) + i0 + (g & 3)]
                for g in range(8)]  # B row (mma column) g
        d = xf @ np.stack(rows).astype(np.float64).T  # D[token][column]
        for t in range(4):
            for j in range(2):
                n = 2 * t + j
                if rb < router_blocks:
                    logits[:, 8 * rb + n] = d[:, n]
                elif t < 2:
                    up = d[:, 2 * (t ^ 2) + j]  # the value lane t ^ 2 holds in the same register
                    g_, u_ = (v.astype(np.float32).astype(bfloat16).astype(np.float32) for v in (d[:, n], up))
                    hs[:, i0 + n] = (g_ / (1 + np.exp(-g_)) * u_).astype(bfloat16).astype(np.float64)
    return logits, hs


def test_emulated_dense_matches_reference(rng):
    from ddtree_rtc.reference.moe_small import moe_small_dense as ref_dense

    x = random_bf16(rng, (5, 64))
    gate, w13 = random_bf16(rng, (16, 64), 0.125), random_bf16(rng, (24, 64), 0.125)
    logits, hs = emulate_dense(x, gate, w13)
    want_l, want_h = ref_dense(x, gate, w13)
    assert_close(logits, want_l, "fp32")
    assert_close(hs, want_h, "bf16")


# ---- GPU ----

def _seeded(name):
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{name} seed={seed}")
    return np.random.default_rng(seed)


# name -> (E of this rank, H, I, top_k, experts never routed whose scales are NaN on the GPU,
#          ids offset: an expert shard's ids come shifted, those of other ranks fall outside [0, E))
DIMS = {
    "small": (10, 256, 128, 4, 2, 0),
    "tp8": (384, 7168, 256, 8, 8, 0),     # K2.6 rank of TP8: every expert, intermediate 2048 / 8
    "ep8": (48, 7168, 2048, 8, 4, 48),    # K2.6 rank of EP8: 48 whole experts, ids of 384 shifted
    "deep": (6, 2048, 1024, 4, 1, 0),     # 16 / 8 k steps per warp ring: it wraps
}
_cache: dict = {}


def experts_for(name):
    if name not in _cache:
        import cupy

        from ddtree_rtc.model.int4_repack import Int4Experts

        e, h, i, _, poison, _ = DIMS[name]
        ex = random_compressed_experts(_seeded(name), e, h, i)
        r = repack_experts(ex)
        w13, w2 = cupy.asarray(r.w13), cupy.asarray(r.w2)
        nan = cupy.asarray(np.full(64, 0x7FC0, np.uint16).view(np.uint8))
        w13[e - poison:, :, :, 1024:] = nan
        w2[e - poison:, :, :, 1024:] = nan
        _cache[name] = (ex, Int4Experts("mma", e, h, i, w13, None, w2, None))
    return _cache[name]


def routing_for(rng, name, m):
    """ids of the rank's view: top_k distinct experts of the unpoisoned ones per token; on the EP8
    shard drawn from the whole 384 and shifted by the rank's offset (other ranks' ids out of range)."""
    e, _, _, top_k, poison, offset = DIMS[name]
    if offset:
        ids, w = random_routing(rng, m, 384, top_k, allowed=[v for v in range(384) if not
                                                            offset + e - poison <= v < offset + e])
        return (ids - offset).astype(np.int32), w
    return random_routing(rng, m, e, top_k, allowed=range(e - poison))


def run_gpu(rng, name, m, with_shared=True, f32=False, pdl=None, kernel_offset=False):
    """``kernel_offset``: the expert shard's ids go in unshifted, with ``id_offset`` (no subtraction)."""
    import cupy

    from ddtree_rtc.kernels.moe_small import moe_small_experts as gpu_moe
    from ddtree_rtc.kernels.moe_small import moe_small_plan as gpu_plan
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    ex, exg = experts_for(name)
    e, h, i, top_k, _, _ = DIMS[name]
    x = random_bf16(rng, (m, h))
    ids, w = routing_for(rng, name, m)
    shared = random_bf16(rng, (m, h), 0.5) if with_shared else None
    y_ref = ref_moe(x, ids, w, ex, shared=shared, out=np.empty((m, h), np.float32) if f32 else None,
                    check_ids=False)
    plan = gpu_plan(m, e, top_k, h, i, pdl=pdl)
    offset = DIMS[name][5] if kernel_offset else 0
    outs = []
    for _ in range(2):
        plan.h.fill(0x7FC0)
        if plan.d is not None:
            plan.d.fill(np.nan)  # down values the combine may read only where they were written
        out = cupy.full((m, h), np.nan, cupy.float32) if f32 else nan_bf16_bits((m, h))
        y = gpu_moe(to_device_bf16(x), cupy.asarray(ids + offset), cupy.asarray(w), exg,
                    shared=None if shared is None else to_device_bf16(shared), out=out, plan=plan, check_ids=False,
                    id_offset=offset)
        assert y is out
        outs.append(y.get())
    assert_close(outs[0] if f32 else outs[0].view(bfloat16), y_ref, "bf16_accum")
    assert np.array_equal(outs[0], outs[1]), "two runs must give bitwise the same result"
    # the down GEMM and combine exactly from the kernel's own h
    valid = ((ids >= 0) & (ids < e)).reshape(-1)
    h_gpu = plan.h.get()[valid]
    assert_h_close(h_gpu, x, ids, ex, e)
    h_own = np.zeros((m * top_k, i), np.float32)
    h_own[valid] = h_gpu.view(bfloat16).astype(np.float32)
    y_own = down_combine(h_own, ids, w, ex, shared=shared, out=np.empty((m, h), np.float32) if f32 else None)
    assert_close(outs[0] if f32 else outs[0].view(bfloat16), y_own, "fp32_accum" if f32 else "bf16")
    return x, ids, w, shared, outs[0]


def assert_h_close(h_gpu, x, ids, ex, e):
    """The kernel's h of the pairs the shard owns (uint16 rows, in pair order) against expert_hidden."""
    # h = bf16(silu(g) * u) rounds the kernel's fp32 mma sums and the reference's float64 ones: at a
    # rounding boundary they part by one bf16 ulp, which moves an fp32 output by ~1e-5. On an H100 that
    # was up to 0.3% of the elements at fresh random inputs (6 of 2048, 34 of 32768, 2026-12-07), so the
    # bound is 1%. h is checked to one ulp.
    valid = ((ids >= 0) & (ids < e)).reshape(-1)
    h_ref = expert_hidden(x, ids, ex, check_ids=False)[valid].astype(bfloat16).view(np.uint16)
    ulps = bf16_ulps(h_gpu, h_ref)
    # (an h near zero comes from a gate sum near zero, whose fp32 rounding is large relative to it: there
    # the difference is bounded absolutely, by the sums' error at the scale of h)
    a, b = h_gpu.view(bfloat16).astype(np.float64), h_ref.view(bfloat16).astype(np.float64)
    scale = np.sqrt(np.mean(b * b)) if b.size else 0.0  # no pair on this shard (EP8 at M = 1): nothing to compare
    far = (ulps > 1) & ~(np.abs(a - b) <= 1e-5 * scale)
    assert not far.any() and (ulps > 0).sum() <= max(8, 1e-2 * ulps.size), \
        f"h: {int((ulps > 0).sum())} of {ulps.size} elements differ, {int(far.sum())} by more than one bf16 ulp"


def bf16_ulps(a, b) -> np.ndarray:
    """|a - b| in bf16 ulps, elementwise (uint16 bits; +0 and -0 are the same number)."""
    def key(u):
        u = np.asarray(u, np.uint16).astype(np.int32)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)

    return np.abs(key(a) - key(b))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["small", "tp8", "ep8"])
@pytest.mark.parametrize("m", MS)
def test_kernel_vs_reference(rng, name, m):
    run_gpu(rng, name, m)


@pytest.mark.gpu
@pytest.mark.parametrize("name,m,with_shared,f32,pdl,kernel_offset", [
    ("tp8", 1, False, True, None, False), ("ep8", 33, True, True, None, True), ("ep8", 3, True, False, None, True),
    ("deep", 17, True, False, None, False), ("deep", 64, False, False, False, False),
    ("small", 64, True, False, False, False),
])
def test_kernel_variants(rng, name, m, with_shared, f32, pdl, kernel_offset):
    """fp32 partial output (tensor-parallel), an expert shard's unshifted ids with id_offset, no
    shared expert, a deep ring, plain launches."""
    run_gpu(rng, name, m, with_shared, f32, pdl, kernel_offset)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(384, 7168, 256), (16, 256, 12)])  # K2.6 TP8 (router, H, shared Is); small
@pytest.mark.parametrize("m", [*MS, 12])  # every token bucket (8, 16, 32, 64 rows)
def test_dense_vs_reference_and_invariant(m, dims):
    """moe_small_dense (router logits + the shared expert's SiLU * up): against the general path's
    references with NaN-prefilled outputs, and each token's values the same bits as at M = 64."""
    import cupy

    from ddtree_rtc.kernels.moe_small import moe_small_dense as gpu_dense
    from ddtree_rtc.reference.moe_small import moe_small_dense as ref_dense
    from ddtree_rtc.testing import check_rows_invariant, nan_bf16_bits, to_device_bf16

    e, h, inter = dims
    rng = _seeded(f"dense {m} {dims}")
    x = random_bf16(rng, (64, h))
    gate, w13 = random_bf16(rng, (e, h), h ** -0.5), random_bf16(rng, (2 * inter, h), h ** -0.5)
    gd, wd, xd = to_device_bf16(gate), to_device_bf16(w13), to_device_bf16(x)

    def run(idx):
        logits = cupy.full((len(idx), e), np.nan, cupy.float32)
        hs = nan_bf16_bits((len(idx), inter))
        out = gpu_dense(cupy.ascontiguousarray(xd[idx]), gd, wd, out_logits=logits, out_hs=hs)
        assert out[0] is logits and out[1] is hs
        return logits.get(), hs.get()

    check_rows_invariant(run, lambda rows: ref_dense(rows, gate, w13), x, rng, m,
                         [("fp32_accum", "logits"), ("bf16_accum", "hs")])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tp8", "ep8"])
def test_rows_are_bitwise_invariant_to_the_batch(name):
    """A token's output: the same bits alone, in a batch of 7, 33 or 64, wherever it sits in it."""
    import cupy

    from ddtree_rtc.kernels.moe_small import moe_small_experts as gpu_moe
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"invariance {name}")
    _, exg = experts_for(name)
    e, h, i, top_k, _, _ = DIMS[name]
    x = random_bf16(rng, (64, h))
    ids, w = routing_for(rng, name, 64)
    shared = random_bf16(rng, (64, h), 0.5)

    def rows(idx, f32):
        out = cupy.empty((len(idx), h), cupy.float32 if f32 else cupy.uint16)
        return gpu_moe(to_device_bf16(x[idx]), cupy.asarray(ids[idx]), cupy.asarray(w[idx]), exg,
                       shared=to_device_bf16(shared[idx]), out=out, check_ids=False).get()

    for f32 in (False, True):
        full = rows(np.arange(64), f32)
        for m in (1, 7, 17, 33):
            idx = rng.permutation(64)[:m]
            got = rows(idx, f32)
            bad = [int(r) for r, j in enumerate(idx) if not np.array_equal(got[r], full[j])]
            assert not bad, f"M={m} fp32={f32}: rows {bad[:5]} differ from the same tokens at M=64"


@pytest.mark.gpu
@pytest.mark.parametrize("name,pool", [("tp8", 12), ("tp8", 40), ("ep8", 10)])
def test_rows_are_bitwise_invariant_with_hot_experts(name, pool):
    """The same with every token's experts drawn from ``pool`` experts, so at 17..64 tokens an expert
    holds up to ~40 (tp8, 12) or ~13 (tp8, 40) tokens: moe_small_down_x's and moe_small_gate_up_t2's
    column passes repeat, and at I = 2048 (ep8) down_x reads the columns past its staged h rows from
    global memory; a row's bits must not move. Also against the reference at M = 64."""
    import cupy

    from ddtree_rtc.kernels.moe_small import moe_small_experts as gpu_moe
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"hot {name} {pool}")
    ex, exg = experts_for(name)
    e, h, i, top_k, poison, _ = DIMS[name]
    x = random_bf16(rng, (64, h))
    ids, w = random_routing(rng, 64, e, top_k, allowed=rng.permutation(e - poison)[:pool])
    shared = random_bf16(rng, (64, h), 0.5)

    def rows(idx):
        out = cupy.empty((len(idx), h), cupy.uint16)
        return gpu_moe(to_device_bf16(x[idx]), cupy.asarray(ids[idx]), cupy.asarray(w[idx]), exg,
                       shared=to_device_bf16(shared[idx]), out=out, check_ids=False).get()

    full = rows(np.arange(64))
    assert_close(full.view(bfloat16), ref_moe(x, ids, w, ex, shared=shared, check_ids=False), "bf16_accum")
    for m in (1, 7, 17, 33):
        idx = rng.permutation(64)[:m]
        got = rows(idx)
        bad = [int(r) for r, j in enumerate(idx) if not np.array_equal(got[r], full[j])]
        assert not bad, f"M={m}: rows {bad[:5]} differ from the same tokens at M=64"


@pytest.mark.gpu
@pytest.mark.parametrize("name,pool", [("tp8", None), ("ep8", None), ("tp8", 40), ("tp8", 12)])
@pytest.mark.parametrize("m", [33, 47, 64])
def test_gate_up_two_tiles_bitwise_equal_one_tile(name, pool, m):
    """moe_small_gate_up_t2 (the entry from 17 tokens) and moe_small_gate_up on the same inputs: h bitwise
    the same, the rows of other shards' pairs left as prefilled (NaN), every owned row written and within
    the reference's one-ulp rule. ``pool``: every token's experts drawn from that many, so an expert holds
    more than 8 tokens (two column tiles in a pass: ~13 at 40 of tp8) or more than 16 (several passes:
    ~22..43 at 12); else one column tile, the step of 33..64 rows on the full 384."""
    import cupy

    from ddtree_rtc.kernels.moe_small import launch_gate_up
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"gate_up tiles {name} {pool} {m}")
    ex, exg = experts_for(name)
    e, h, i, top_k, poison, _ = DIMS[name]
    x = random_bf16(rng, (m, h))
    if pool is None:
        ids, _ = routing_for(rng, name, m)
    else:
        ids, _ = random_routing(rng, m, e, top_k, allowed=rng.permutation(e - poison)[:pool])
    xd, idd = to_device_bf16(x), cupy.asarray(ids)
    got = {}
    for tiles in (1, 2):
        hd = cupy.full((m * top_k, i), 0x7FC0, cupy.uint16)
        launch_gate_up(xd, idd, exg, hd, tiles)
        got[tiles] = hd.get()
    valid = ((ids >= 0) & (ids < e)).reshape(-1)
    assert np.array_equal(got[2], got[1]), \
        f"rows {np.flatnonzero((got[2] != got[1]).any(axis=1))[:5]} of h differ between two tiles and one"
    assert (got[2][~valid] == 0x7FC0).all(), "a row of another shard's pair was written"
    assert not np.isnan(got[2][valid].view(bfloat16).astype(np.float32)).any(), "an owned row was not written"
    assert_h_close(got[2][valid], x, ids, ex, e)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [7, 17])  # both downs
def test_pdl_and_graph_replay_match_plain_launches(m):
    import cupy

    from ddtree_rtc.kernels.moe_small import moe_small_experts as gpu_moe
    from ddtree_rtc.kernels.moe_small import moe_small_plan as gpu_plan
    from ddtree_rtc.testing import to_device_bf16

    rng = _seeded(f"pdl {m}")
    _, exg = experts_for("tp8")
    e, h, i, top_k, _, _ = DIMS["tp8"]
    x, (ids, w) = random_bf16(rng, (m, h)), routing_for(rng, "tp8", m)
    xd, idd, wd = to_device_bf16(x), cupy.asarray(ids), cupy.asarray(w)
    plain = gpu_moe(xd, idd, wd, exg, plan=gpu_plan(m, e, top_k, h, i, pdl=False), check_ids=False).get()
    plan = gpu_plan(m, e, top_k, h, i)
    out = cupy.empty((m, h), cupy.uint16)
    assert np.array_equal(gpu_moe(xd, idd, wd, exg, out=out, plan=plan, check_ids=False).get(), plain)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gpu_moe(xd, idd, wd, exg, out=out, plan=plan, check_ids=False)
        graph = stream.end_capture()
        for _ in range(2):
            out.fill(0x7FC0)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(out.get(), plain)


@pytest.mark.gpu
@pytest.mark.parametrize("m,f32", [(5, False), (5, True), (17, False), (17, True)])
def test_no_pair_on_the_shard(m, f32):
    """An expert shard that no pair routes to: the output is the shared expert (zero without it), on
    both downs."""
    import cupy

    from ddtree_rtc.kernels.moe_small import moe_small_experts as gpu_moe
    from ddtree_rtc.kernels.moe_small import moe_small_plan as gpu_plan
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    rng = _seeded(f"empty shard {m} {f32}")
    _, exg = experts_for("ep8")
    e, h, i, top_k, _, _ = DIMS["ep8"]
    x, (ids, w) = random_bf16(rng, (m, h)), routing_for(rng, "ep8", m)
    ids = (ids % e) + e  # every id another shard's
    shared = random_bf16(rng, (m, h), 0.5)
    plan = gpu_plan(m, e, top_k, h, i)
    for sh in (shared, None):
        out = cupy.full((m, h), np.nan, cupy.float32) if f32 else nan_bf16_bits((m, h))
        gpu_moe(to_device_bf16(x), cupy.asarray(ids), cupy.asarray(w), exg, out=out, plan=plan, check_ids=False,
                shared=None if sh is None else to_device_bf16(sh))
        got = out.get() if f32 else out.get().view(bfloat16).astype(np.float32)
        want = np.zeros((m, h), np.float32) if sh is None else sh.astype(np.float32)
        assert np.array_equal(got, want)


def test_gate_up_tiles_per_item():
    """One fused tile per moe_small_gate_up item up to 16 tokens, two from 17 (the values do not depend
    on it: test_rows_are_bitwise_invariant_to_the_batch runs M = 1 and 7 against 64 on the GPU)."""
    from ddtree_rtc.kernels.moe_small import gate_up_smem, gate_up_tiles

    assert [gate_up_tiles(m) for m in (1, 16, 17, 64)] == [1, 1, 2, 2]
    assert gate_up_smem(2) >= 2 * gate_up_smem(1) - 1 and gate_up_smem(1) >= 8 * 2 * 4 * 32 * 16


# ---- moe_small_route_shared: the routing and the shared expert's down projection in one launch ----

def test_route_shared_twin_is_the_two_references(rng):
    """The numpy twin is today's two ops: moe_route, then linear (bf16 out, or fp32 into ``out``)."""
    from ddtree_rtc.reference.linear import linear
    from ddtree_rtc.reference.moe_routing import moe_route
    from ddtree_rtc.reference.moe_small import moe_small_route_shared

    m, e, h, inter = 7, 32, 96, 24
    logits = (rng.standard_normal((m, e)) * 2).astype(np.float32)
    bias = rng.uniform(-0.3, 0.3, e).astype(np.float32)
    hs, w2 = random_bf16(rng, (m, inter)), random_bf16(rng, (h, inter), inter ** -0.5)
    for args, out in (((8, 4, 2, True, 2.827), None), ((3, 1, 1, False, 1.0), np.full((m, h), np.nan, np.float32))):
        ids, w, sh = moe_small_route_shared(logits, bias, hs, w2, *args, out=out)
        want_ids, want_w = moe_route(logits, bias, *args)
        want_sh = linear(hs, w2, out=None if out is None else np.empty((m, h), np.float32))
        assert np.array_equal(ids, want_ids) and np.array_equal(w.view(np.uint32), want_w.view(np.uint32))
        assert sh.dtype == want_sh.dtype and np.array_equal(sh.view(np.uint16 if out is None else np.uint32),
                                                            want_sh.view(np.uint16 if out is None else np.uint32))
        assert out is None or sh is out


def test_route_shared_limits_name_the_value(rng):
    from ddtree_rtc.reference.moe_small import moe_small_route_shared

    hs, w2 = random_bf16(rng, (3, 16)), random_bf16(rng, (8, 16))
    with pytest.raises(ValueError, match="392 experts above 384"):
        moe_small_route_shared(np.zeros((3, 392), np.float32), None, hs, w2, 8)
    with pytest.raises(ValueError, match="M = 65 tokens"):
        moe_small_route_shared(np.zeros((65, 8), np.float32), None, hs, w2, 2)
    with pytest.raises(ValueError, match=r"\[8, 12\]: H must be >= 1 and Is a positive multiple of 8"):
        moe_small_route_shared(np.zeros((3, 8), np.float32), None, hs[:, :12], w2[:, :12], 2)
    with pytest.raises(ValueError, match=r"hs: expected \[3, 16\]"):
        moe_small_route_shared(np.zeros((3, 8), np.float32), None, hs[:2], w2, 2)
    with pytest.raises(ValueError, match="n_group must divide"):
        moe_small_route_shared(np.zeros((3, 8), np.float32), None, hs, w2, 2, n_group=3)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 12, 17, 33, 64])
@pytest.mark.parametrize("h,inter,sms", [(7168, 256, 132), (7168, 2048, 132), (7168, 2048, 78), (256, 2048, 132),
                                         (256, 16, 132)])
@pytest.mark.parametrize("f32", [False, True])
def test_route_shared_plan_is_the_linears_after_whole_clusters(m, h, inter, sms, f32):
    """The linear CTAs of moe_small_route_shared are linear(impl="invariant")'s own launch: its entry's
    bucket, (warps_n, split) and grid; the routing CTAs before them are the fewest whole clusters with a
    warp for every token, so CTA route_ctas + j sits at cluster rank j % split as CTA j of the linear does."""
    from ddtree_rtc.kernels.linear import invariant_plan
    from ddtree_rtc.kernels.moe_small import route_shared_plan
    from ddtree_rtc.kernels.registry import spec

    plan = route_shared_plan(m, h, inter, sms, f32)
    lin = invariant_plan(m, h, inter, sms, f32)
    assert (plan.warps_n, plan.split, plan.grid - plan.route_ctas) == (lin.warps_n, lin.split, lin.grid)
    assert plan.route_ctas % plan.split == 0 and 8 * plan.route_ctas >= m > 8 * (plan.route_ctas - plan.split)
    assert plan.entry == lin.entry.replace("linear_", "moe_small_route_shared_")
    assert plan.entry in spec("moe_small").entries


# name -> (E, top_k, n_group, topk_group, norm_topk_prob, scaling, bias, H, Is, fp32 out)
ROUTE_SHARED = {
    "tp8": (384, 8, 1, 1, True, 2.827, True, 7168, 256, True),  # K2.6 rank of TP8: Is 2048 / 8, an fp32 partial
    # K2.6 rank of EP8 (the shared expert splits as on TP8), logits on a 0.25 grid: ties everywhere
    "ep8": (384, 8, 1, 1, True, 2.827, True, 7168, 256, True),
    "whole": (384, 8, 1, 1, True, 2.827, True, 7168, 2048, False),  # one rank's whole shared expert: a cluster plan
    "grouped": (256, 8, 8, 4, True, 2.5, True, 7168, 2048, False),  # DeepSeek-V3's group-limited routing
    "s8": (64, 6, 1, 1, False, 1.0, False, 256, 2048, True),  # clusters of 8 CTAs: the routing padded to 8
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ROUTE_SHARED))
@pytest.mark.parametrize("m", [1, 3, 12, 17, 33, 64])  # every token bucket, and 1, 2, 3, 5, 8 routing CTAs
def test_route_shared_is_todays_two_launches(name, m):
    """moe_small_route_shared against today's launches (moe_route, then linear(impl="invariant")) on
    the same inputs: ids, weights and the shared down bitwise equal, nothing written outside the
    outputs (a guard row past each stays as filled); against the reference (the inputs' rows past M
    NaN, the outputs NaN-prefilled); and each row the same bits as in a batch of 64."""
    import cupy

    from ddtree_rtc.kernels.linear import linear as gpu_linear
    from ddtree_rtc.kernels.moe_routing import moe_route as gpu_route
    from ddtree_rtc.kernels.moe_small import moe_small_route_shared as gpu_fused
    from ddtree_rtc.reference.moe_small import moe_small_route_shared as ref_fused
    from ddtree_rtc.testing import to_device_bf16

    e, top_k, n_group, topk_group, norm, scaling, with_bias, h, inter, f32 = ROUTE_SHARED[name]
    rng = _seeded(f"route_shared {name} {m}")
    logits = (rng.standard_normal((64, e)) * 2).astype(np.float32)
    if name == "ep8":
        logits = (np.round(logits * 4) / 4).astype(np.float32)
    bias = rng.uniform(-0.3, 0.3, e).astype(np.float32) if with_bias else None
    hs, w2 = random_bf16(rng, (64, inter)), random_bf16(rng, (h, inter), inter ** -0.5)
    bias_d, w2_d = None if bias is None else cupy.asarray(bias), to_device_bf16(w2)
    route = (top_k, n_group, topk_group, norm, scaling)

    def run(idx, fused: bool):
        n = len(idx)
        lg = cupy.full((n + 8, e), np.nan, cupy.float32)  # rows past M: NaN, read by no launch
        lg[:n] = cupy.asarray(logits[idx])
        hd = cupy.full((n + 8, inter), 0x7FC0, cupy.uint16)
        hd[:n] = to_device_bf16(hs[idx])
        ids = cupy.full((n + 1, top_k), -7, cupy.int32)  # NaN-prefilled outputs and a guard row past each
        w = cupy.full((n + 1, top_k), np.nan, cupy.float32)
        sh = cupy.full((n + 1, h), np.nan, cupy.float32) if f32 else cupy.full((n + 1, h), 0x7FC0, cupy.uint16)
        if fused:
            got = gpu_fused(lg[:n], bias_d, hd[:n], w2_d, *route, out_ids=ids[:n], out_weights=w[:n], out=sh[:n])
            assert all(a.data.ptr == b.data.ptr for a, b in zip(got, (ids, w, sh)))
        else:
            gpu_route(lg[:n], bias_d, *route, out_ids=ids[:n], out_weights=w[:n])
            gpu_linear(hd[:n], w2_d, out=sh[:n], impl="invariant")
        return ids.get(), w.get().view(np.uint32), sh.get().view(np.uint32 if f32 else np.uint16)

    idx = rng.permutation(64)[:m]
    got, today = run(idx, True), run(idx, False)
    for g, t, what in zip(got, today, ("ids", "weights", "shared")):
        assert np.array_equal(g, t), f"{what}: not the bits of today's launches"
    nan_w, nan_sh = np.float32(np.nan).view(np.uint32), np.float32(np.nan).view(np.uint32) if f32 else 0x7FC0
    assert (got[0][m] == -7).all() and (got[1][m] == nan_w).all() and (got[2][m] == nan_sh).all()
    ids_ref, w_ref, sh_ref = ref_fused(logits[idx], bias, hs[idx], w2, *route,
                                       out=np.empty((m, h), np.float32) if f32 else None)
    assert np.array_equal(got[0][:m], ids_ref)
    assert_close(got[1][:m].view(np.float32), w_ref, "fp32", "weights")
    assert_close(got[2][:m].view(np.float32) if f32 else got[2][:m].view(bfloat16), sh_ref,
                 "fp32_accum" if f32 else "bf16_accum", "shared")
    full = run(np.arange(64), True)
    for g, f, what in zip(got, full, ("ids", "weights", "shared")):
        assert np.array_equal(g[:m], f[idx]), f"{what}: rows differ from the same rows in a batch of 64"
