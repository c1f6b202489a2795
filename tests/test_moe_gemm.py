"""Fused INT4 MoE experts: the reference vs a plain per-token loop (CPU), and the CUDA kernels vs
the reference (GPU) for M in {1, 3, 8, 33, 256, 1000} at small, shard and K2.6 dims."""

import os

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.model.int4_repack import random_compressed_experts, repack_experts
from ddtree_rtc.reference.moe_gemm import dequant_int4
from ddtree_rtc.reference.moe_gemm import moe_experts as ref_moe
from ddtree_rtc.testing import assert_close, random_bf16

MS = [1, 3, 8, 33, 256, 1000]


def loop_moe(x, ids, w, ex, shared=None):
    """One (token, slot) at a time in float64, h rounded to bf16 like the kernels' down input."""
    m, h = x.shape
    y = np.zeros((m, h))
    for t in range(m):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            w13 = dequant_int4(ex.w13[e], ex.w13_scale[e]).astype(np.float64)
            w2 = dequant_int4(ex.w2[e], ex.w2_scale[e]).astype(np.float64)
            gu = w13 @ x[t].astype(np.float64)
            g, u = gu[:ex.intermediate], gu[ex.intermediate:]
            hh = (g / (1 + np.exp(-g)) * u).astype(bfloat16).astype(np.float64)
            y[t] += float(w[t, j]) * (w2 @ hh)
    if shared is not None:
        y += shared.astype(np.float64)
    return y


def random_routing(rng, m, num_experts, top_k, allowed=None, p=None):
    """Per token top_k distinct experts of ``allowed`` (default all), drawn with probabilities p."""
    pool = np.arange(num_experts) if allowed is None else np.asarray(allowed)
    ids = np.stack([rng.choice(pool, top_k, replace=False, p=p) for _ in range(m)]).astype(np.int32)
    return ids, rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32)


@pytest.mark.parametrize("m,e,h,i,top_k", [(1, 4, 128, 128, 2), (5, 6, 256, 128, 3), (9, 8, 128, 256, 8)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_reference_vs_per_token_loop(rng, m, e, h, i, top_k, with_shared):
    ex = random_compressed_experts(rng, e, h, i)
    x = random_bf16(rng, (m, h))
    ids, w = random_routing(rng, m, e, top_k)
    shared = random_bf16(rng, (m, h), 0.5) if with_shared else None
    out = np.full((m, h), np.nan, dtype=bfloat16)
    y = ref_moe(x, ids, w, ex, shared=shared, out=out)
    assert y is out
    assert_close(y, loop_moe(x, ids, w, ex, shared), "bf16_accum")


def test_reference_skips_out_of_range_slots_only_when_asked(rng):
    ex = random_compressed_experts(rng, 3, 128, 128)
    x = random_bf16(rng, (2, 128))
    ids, w = random_routing(rng, 2, 3, 2)
    bad = ids.copy()
    bad[1, 0] = 3
    with pytest.raises(ValueError, match="expert id 3 at pair 2"):
        ref_moe(x, bad, w, ex)
    y = ref_moe(x, bad, w, ex, check_ids=False)
    w0 = w.copy()
    w0[1, 0] = 0
    assert_close(y, loop_moe(x, np.where(bad < 3, bad, 0), w0, ex), "bf16_accum")


def test_reference_rejects_bad_input(rng):
    ex = random_compressed_experts(rng, 2, 128, 128)
    ids, w = random_routing(rng, 1, 2, 1)
    with pytest.raises(ValueError, match="M = 0"):
        ref_moe(random_bf16(rng, (0, 128)), ids[:0], w[:0], ex)
    with pytest.raises(ValueError, match=r"x: expected \[M, 128\]"):
        ref_moe(random_bf16(rng, (1, 256)), ids, w, ex)
    with pytest.raises(TypeError, match="layout 'compressed-tensors'"):
        ref_moe(random_bf16(rng, (1, 128)), ids, w, repack_experts(ex))


def test_plan_rejects_bad_ring_depths():
    pytest.importorskip("cupy")
    from ddtree_rtc.kernels.moe_gemm import default_stages, moe_plan

    assert all(2 <= v <= 16 for v in default_stages())
    for bad in ((1, 4), (4, 17), (4,)):
        with pytest.raises(ValueError, match="ring depths"):
            moe_plan(1, 8, 2, 128, 128, stages=bad)


def test_pdl_launch_params_keep_the_c_types():
    """cuLaunchKernelEx gets every numpy scalar with its C type; anything else is refused by position."""
    import ctypes

    from ddtree_rtc.kernels._launch import _params

    vals, types = _params((np.int32(-3), np.int64(1 << 40), np.uint64(0), np.float32(0.5)))
    assert vals == (-3, 1 << 40, 0, 0.5)
    assert types == (ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float)
    with pytest.raises(TypeError, match="argument 1: expected a cupy array or a numpy scalar"):
        _params((np.int32(1), 7))


def test_split_choice():
    from ddtree_rtc.kernels.moe_gemm import _pick_split

    # K2.6 at M=1: 8 experts x 32 CTAs of gate_up rows already cover 132 SMs
    assert _pick_split(7168, 8 * 32, 198, None, "gate_up") == 1
    # TP8 shard: 8 experts x 4 CTAs -> split the 56 k blocks until >= 198 CTAs
    assert _pick_split(7168, 8 * 4, 198, None, "gate_up") == 7
    assert _pick_split(256, 8, 198, None, "down") == 2  # capped by K/128
    with pytest.raises(ValueError, match="split 3 must divide K/128 = 56"):
        _pick_split(7168, 1, 1, 3, "gate_up")


def test_token_tile_choice():
    from ddtree_rtc.kernels.moe_gemm import NT4_ABOVE, pick_nt4_above

    assert pick_nt4_above(1, 8, None, None) == 8  # M=1: no expert can pass the threshold, no nt 4 list
    assert pick_nt4_above(NT4_ABOVE + 1, 8, None, None) == NT4_ABOVE
    assert pick_nt4_above(1024, 8, None, 16) == 16
    assert pick_nt4_above(1024, 8, 1, None) == 1024 * 8  # nt 1 forced: every expert in 8-pair blocks
    assert pick_nt4_above(1024, 8, 4, None) == 0  # nt 4 forced
    with pytest.raises(ValueError, match="not both"):
        pick_nt4_above(4, 8, 4, 8)
    with pytest.raises(ValueError, match="nt must be 1 or 4"):
        pick_nt4_above(4, 8, 2, None)


# ---- the CUDA launch logic transliterated (grid, blocks, warps, epilogues, reduce, combine) ----

def emulate_cuda_path(x, ids, w, rex, nt4_above, s13, s2, shared=None):
    """moe_experts as ddtree_rtc/cuda_src/moe_gemm.cu computes it, index by index, for both block lists (nt 1
    over the small, nt 4 over the large); the mma fragments come from the lane emulation in
    test_moe_repack (so this checks the launch and epilogue logic)."""
    from test_moe_repack import emulate_weights

    from ddtree_rtc.reference.moe_routing import moe_align

    m, hid = x.shape
    top_k, inter, p_all = ids.shape[1], rex.intermediate, ids.size
    al = moe_align(ids, rex.num_experts, 8, large_block=32, large_above=nt4_above)
    cs, bs = al.small_capacity, al.small_blocks
    # (nt, expert, the block's pairs) of every valid block of both lists; blocks past num_blocks exit
    blocks = [(1, int(al.block_expert[u]), al.sorted_pairs[8 * u:8 * u + 8]) for u in range(al.num_blocks[0])]
    blocks += [(4, int(al.block_expert[bs + u]), al.sorted_pairs[cs + 32 * u:cs + 32 * u + 32])
               for u in range(al.num_blocks[1])]
    h = np.full((p_all, inter), np.nan, np.float32)
    part13 = np.full((s13, p_all, 2 * inter), np.nan, np.float32)
    part2 = np.full((s2, p_all, hid), np.nan, np.float32)
    gemms = (("gate_up", rex.w13, 2 * inter, hid, x.astype(np.float32), top_k, s13),
             ("down", rex.w2, hid, inter, None, 1, s2))
    for kind, blobs, n_rows, k_tot, act, row_div, splits in gemms:
        if kind == "down":
            act = h.astype(bfloat16).astype(np.float32)
        mode_h = kind == "gate_up" and splits == 1
        n_ctas, k_split = -(-n_rows // 128), k_tot // splits
        wfull = {}
        for nt, e, blk in blocks:
            if (e, nt) not in wfull:
                wfull[e, nt] = emulate_weights(np.asarray(blobs[e]), n_rows, k_tot, scale_after=nt == 1)
            ntl = max(j + 1 for j in range(nt) if blk[8 * j] < p_all)
            for bx in range(n_ctas * splits):
                n_cta, split = bx % n_ctas, bx // n_ctas
                ks = slice(split * k_split, (split + 1) * k_split)
                for warp in range(4):
                    tile0 = (n_cta * 128 + warp * 32) // 16
                    if tile0 * 16 >= n_rows:
                        continue
                    for j in range(ntl):
                        # padding pairs are zero-filled in shared memory
                        b = np.stack([act[c // row_div, ks] if c < p_all else np.zeros(k_split, np.float32)
                                      for c in blk[8 * j:8 * j + 8]], axis=1)  # [k, 8]
                        acc = wfull[e, nt][16 * tile0:16 * tile0 + 32, ks].astype(np.float64) @ b
                        for col in range(8):  # col = 2t + j' of the C fragment
                            p = blk[8 * j + col]
                            if p >= p_all:
                                continue
                            for r in range(2):
                                for g in range(8):
                                    lo, hi = acc[16 * r + g, col], acc[16 * r + 8 + g, col]
                                    if mode_h:
                                        h[p, (tile0 + r) * 8 + g] = np.float32(lo / (1 + np.exp(-lo)) * hi)
                                    else:
                                        dst = part13 if kind == "gate_up" else part2
                                        dst[split, p, (tile0 + r) * 16 + g] = lo
                                        dst[split, p, (tile0 + r) * 16 + g + 8] = hi
        if kind == "gate_up" and splits > 1:  # moe_gate_up_reduce_kernel
            for i in range(inter):
                ng = (i >> 3) * 16 + (i & 7)
                gs, us = part13[:, :, ng].sum(0), part13[:, :, ng + 8].sum(0)
                h[:, i] = gs / (1 + np.exp(-gs)) * us
    y = np.zeros((m, hid))  # moe_combine_kernel
    for t in range(m):
        for j in range(top_k):
            y[t] += w[t, j] * part2[:, t * top_k + j].sum(0)
    if shared is not None:
        y += shared.astype(np.float64)
    return y


@pytest.mark.parametrize("nt", [1, 4])
def test_shared_memory_staging_gives_each_lane_its_fragments(nt):
    """The cp.async writes of one stage (thread -> shared offset, source) against the LDS reads of
    the mma loop (lane, chunk, n-tile -> shared offset), transliterated from moe_gemm(): every lane
    must read exactly the 16 bytes the emulation above assumes, and no two copies may overlap."""
    from ddtree_rtc.kernels.moe_gemm import BLOCK_BYTES, stage_bytes

    weight_bytes = 4 * 2 * BLOCK_BYTES
    stage = stage_bytes(nt)
    owner = {}  # shared byte offset (16-byte piece) -> what was copied there

    def put(off, what):
        assert off % 16 == 0 and 0 <= off < stage and off not in owner, (off, what)
        owner[off] = what

    for tid in range(128):
        warp, lane = tid >> 5, tid & 31
        for r in range(2):  # weights: ("w", warp, tile, byte offset in the 1152-byte block)
            put(warp * 2 * BLOCK_BYTES + r * BLOCK_BYTES + 16 * lane, ("w", warp, r, 16 * lane))
            put(warp * 2 * BLOCK_BYTES + r * BLOCK_BYTES + 512 + 16 * lane, ("w", warp, r, 512 + 16 * lane))
        if lane < 16:
            sc_tile, sc_off = (lane >> 3) & 1, 1024 + 16 * (lane & 7)
            put(warp * 2 * BLOCK_BYTES + sc_tile * BLOCK_BYTES + sc_off, ("w", warp, sc_tile, sc_off))
        q = tid & 15
        for m in range(nt):  # activations: ("x", pair slot, first k of the 8 copied)
            j = (tid >> 4) + 8 * m
            put(weight_bytes + ((q >> 2) * nt * 8 + j) * 64 + (q & 3) * 16, ("x", j, 8 * q))
    assert len(owner) * 16 == stage, "the stage is exactly covered"
    for warp in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            ws = warp * 2 * BLOCK_BYTES
            for r in range(2):
                for off in (16 * lane, 512 + 16 * lane, 1024 + 16 * g):
                    assert owner[ws + r * BLOCK_BYTES + off] == ("w", warp, r, off)
            for c in range(4):
                for ntile in range(nt):
                    got = owner[weight_bytes + ((c * nt + ntile) * 8 + g) * 64 + t * 16]
                    assert got == ("x", 8 * ntile + g, 32 * c + 8 * t)


@pytest.mark.slow
@pytest.mark.parametrize("m,nt4_above,s13,s2", [(1, 3, 1, 1), (3, 3, 2, 1), (11, 0, 1, 2), (13, 13 * 3, 2, 2),
                                                (40, 0, 2, 1), (40, 20, 1, 1), (21, 12, 2, 2)])
def test_emulated_cuda_path_matches_reference(rng, m, nt4_above, s13, s2):
    e, h, i, top_k = 5, 256, 256, 3
    ex = random_compressed_experts(rng, e, h, i)
    x = random_bf16(rng, (m, h))
    ids, w = random_routing(rng, m, e, top_k, p=[0.5, 0.2, 0.15, 0.1, 0.05])  # both lists busy
    shared = random_bf16(rng, (m, h), 0.5)
    got = emulate_cuda_path(x, ids, w, repack_experts(ex), nt4_above, s13, s2, shared)
    assert_close(got, ref_moe(x, ids, w, ex, shared=shared), "bf16_accum")


# ---- GPU ----

def _seeded(name):
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{name} seed={seed}")
    return np.random.default_rng(seed)


# name -> (E, H, I, top_k, unused experts poisoned with NaN scales)
DIMS = {
    "small": (10, 256, 128, 4, 2),
    "tp8": (16, 512, 256, 8, 2),
    "ep8": (48, 256, 256, 8, 4),
    "k26": (16, 7168, 2048, 8, 2),
    "deep": (6, 2048, 1024, 4, 1),  # 16 / 8 k steps: the cp.async ring wraps 4 / 2 times
}
_cache: dict = {}


def experts_for(name):
    """Host experts and their GPU repack, with the last ``poison`` experts' scales set to NaN on
    the GPU: tokens are never routed there, so a wrong expert index shows up as NaN."""
    if name not in _cache:
        import cupy

        from ddtree_rtc.model.int4_repack import Int4Experts

        e, h, i, _, poison = DIMS[name]
        ex = random_compressed_experts(_seeded(name), e, h, i)
        r = repack_experts(ex)
        w13, w2 = cupy.asarray(r.w13), cupy.asarray(r.w2)
        nan = cupy.asarray(np.full(64, 0x7FC0, np.uint16).view(np.uint8))
        w13[e - poison:, :, :, 1024:] = nan
        w2[e - poison:, :, :, 1024:] = nan
        _cache[name] = (ex, Int4Experts("mma", e, h, i, w13, None, w2, None))
    return _cache[name]


def run_gpu(rng, name, m, with_shared=True, skew=False, **plan_kw):
    import cupy

    from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    ex, exg = experts_for(name)
    e, h, i, top_k, poison = DIMS[name]
    x = random_bf16(rng, (m, h))
    pool = e - poison
    pr = None
    if skew:  # a few experts draw most pairs: both block lists busy
        pr = 1.0 / np.arange(1, pool + 1) ** 1.5
        pr = rng.permutation(pr / pr.sum())
    ids, w = random_routing(rng, m, e, top_k, allowed=range(pool), p=pr)
    shared = random_bf16(rng, (m, h), 0.5) if with_shared else None
    y_ref = ref_moe(x, ids, w, ex, shared=shared)
    plan = moe_plan(m, e, top_k, h, i, **plan_kw)
    outs = []
    for _ in range(2):
        plan.h.fill(0x7FC0)  # every buffer the kernels must write starts as NaN
        for part in (plan.part_gate_up, plan.part_down):
            if part is not None:
                part.fill(np.nan)
        out = nan_bf16_bits((m, h))
        y = moe_experts(to_device_bf16(x), cupy.asarray(ids), cupy.asarray(w), exg,
                        shared=None if shared is None else to_device_bf16(shared), out=out, plan=plan,
                        check_ids=False)
        assert y is out
        outs.append(y.get())
    assert_close(outs[0], y_ref, "bf16_accum")
    assert np.array_equal(outs[0], outs[1]), "two runs must give bitwise the same result"
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["small", "tp8", "ep8"])
@pytest.mark.parametrize("m", MS)
def test_kernel_vs_reference(rng, name, m):
    run_gpu(rng, name, m)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("m", MS)
def test_kernel_vs_reference_k26_dims(rng, m):
    from ddtree_rtc.kernels.moe_gemm import NT4_ABOVE

    plan = run_gpu(rng, "k26", m, skew=m > 8)
    assert plan.tiles == ("nt1" if m <= NT4_ABOVE else f"nt1+nt4>{NT4_ABOVE}")


@pytest.mark.gpu
@pytest.mark.parametrize("name,m,skew,plan_kw,tiles", [
    ("tp8", 1, False, {"nt": 4}, "nt4"),                                  # 32-pair blocks with one pair
    ("tp8", 33, False, {"nt": 1}, "nt1"),                                 # many 8-pair blocks per expert
    ("tp8", 3, False, {"split_gate_up": 2, "split_down": 2}, "nt1"),      # split-K reduce paths
    ("tp8", 256, False, {"split_gate_up": 4, "split_down": 1}, "nt1+nt4>8"),
    ("tp8", 1000, False, {"nt": 1, "split_down": 2}, "nt1"),
    ("ep8", 40, True, {}, "nt1+nt4>8"),                                   # per-expert tiles, both lists busy
    ("ep8", 40, True, {"nt4_above": 2, "split_gate_up": 2}, "nt1+nt4>2"),
    ("ep8", 300, True, {"nt4_above": 16, "split_down": 2}, "nt1+nt4>16"),
    ("ep8", 1000, True, {"nt4_above": 64}, "nt1+nt4>64"),
    ("deep", 1, False, {"nt": 1}, "nt1"),                                 # the 4-stage ring wraps 4 / 2 times
    ("deep", 21, False, {"nt": 1}, "nt1"),
    ("deep", 21, True, {}, "nt1+nt4>8"),                                  # (6 experts: mostly nt 4)
    ("deep", 50, False, {"nt": 4}, "nt4"),
    ("deep", 50, False, {"nt": 4, "split_gate_up": 2}, "nt4"),
    ("deep", 21, True, {"stages": (2, 3)}, "nt1+nt4>8"),                 # other ring depths (wrap often)
    ("deep", 21, True, {"stages": (7, 5)}, "nt1+nt4>8"),
])
def test_kernel_launch_variants(rng, name, m, skew, plan_kw, tiles):
    plan = run_gpu(rng, name, m, with_shared=False, skew=skew, **plan_kw)
    assert plan.tiles == tiles
    for k in ("split_gate_up", "split_down", "nt4_above"):
        if k in plan_kw:
            assert getattr(plan, k) == plan_kw[k]
    if name == "ep8":  # the skewed routing over 44 experts really used both lists
        assert all(int(v) > 0 for v in plan.align.num_blocks.get()), plan.align.num_blocks.get()


@pytest.mark.gpu
@pytest.mark.parametrize("name,m,skew,plan_kw", [
    ("tp8", 1, False, {"nt": 4}),                                  # one pair: N = 8
    ("small", 33, True, {}),
    ("tp8", 256, False, {"split_gate_up": 4, "split_down": 1}),   # split-K partials
    ("ep8", 40, True, {"nt4_above": 2, "split_gate_up": 2}),
    ("ep8", 300, True, {"nt4_above": 16, "split_down": 2}),
    ("ep8", 1000, True, {}),                                       # full blocks, every N
    ("deep", 50, False, {"nt": 4}),
    ("deep", 21, True, {"stages": (2, 2)}),                         # the ring wraps every step
    ("deep", 21, True, {"stages": (3, 5)}),
    ("k26", 256, True, {}),
])
def test_large_list_kernel(rng, name, m, skew, plan_kw):
    """The large list's kernel (nt 4, mma.sync, specialized per filled-tile count): against the
    reference, bitwise the same on two runs, every filled-tile count of a block, split-K, ring depths
    that wrap."""
    from ddtree_rtc.kernels.moe_gemm import LARGE_BLOCK

    plan = run_gpu(rng, name, m, with_shared=name != "deep", skew=skew, **plan_kw)
    assert plan.align.large_block == LARGE_BLOCK and "nt4" in plan.tiles


def skewed_inputs(rng, name, m):
    """Host x, ids, weights and their device copies for shape ``name``: top_k of the unpoisoned
    experts per token, drawn with Zipf-like (1.5) probabilities so both block lists are busy."""
    import cupy

    from ddtree_rtc.testing import to_device_bf16

    e, h, _, top_k, poison = DIMS[name]
    pr = 1.0 / np.arange(1, e - poison + 1) ** 1.5
    ids_h, w_h = random_routing(rng, m, e, top_k, allowed=range(e - poison), p=rng.permutation(pr / pr.sum()))
    x_h = random_bf16(rng, (m, h))
    return x_h, ids_h, w_h, (to_device_bf16(x_h), cupy.asarray(ids_h), cupy.asarray(w_h))


@pytest.mark.gpu
@pytest.mark.parametrize("name,m,plan_kw", [
    ("k26", 1, {}), ("tp8", 3, {"split_gate_up": 2, "split_down": 2}), ("deep", 21, {"concurrent": False}),
    ("tp8", 256, {"split_gate_up": 4, "concurrent": False}), ("ep8", 300, {"concurrent": False}),
])
def test_pdl_launches_match_plain_and_capture(name, m, plan_kw):
    """Programmatic dependent launches (the down GEMM's weights copied before its wait): bitwise the
    plain launches' result, eagerly and replayed from a CUDA graph, and close to the reference."""
    import cupy

    from ddtree_rtc.bench.moe import graphed
    from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan

    rng = np.random.default_rng(m)
    ex, exg = experts_for(name)
    e, h, i, top_k, _ = DIMS[name]
    x_h, ids_h, w_h, (x, ids, w) = skewed_inputs(rng, name, m)
    ys = {}
    for pdl in (False, True):
        plan = moe_plan(m, e, top_k, h, i, pdl=pdl, **plan_kw)
        assert plan.pdl == pdl
        ys[pdl] = moe_experts(x, ids, w, exg, plan=plan, check_ids=False).get()
        out = cupy.zeros_like(x)
        launch = graphed(lambda out=out, plan=plan: moe_experts(x, ids, w, exg, out=out, plan=plan, check_ids=False))
        for _ in range(2):
            out.fill(0x7FC0)
            launch()
            cupy.cuda.get_current_stream().synchronize()
            assert np.array_equal(out.get(), ys[pdl]), f"graph replay (pdl={pdl}) differs from the eager run"
    assert np.array_equal(ys[True], ys[False])
    assert_close(ys[True], ref_moe(x_h, ids_h, w_h, ex), "bf16_accum")


@pytest.mark.gpu
@pytest.mark.parametrize("name,m", [("ep8", 40), ("ep8", 300), ("k26", 64)])
def test_concurrent_lists_match_serial_and_capture(name, m):
    """The nt 4 launch on the side stream beside the nt 1 launch: bitwise the serial result, eagerly
    and replayed from a CUDA graph (the fork and join are captured as two branches)."""
    import cupy

    from ddtree_rtc.bench.moe import graphed
    from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan

    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    ex, exg = experts_for(name)
    e, h, i, top_k, _ = DIMS[name]
    x_h, ids_h, w_h, (x, ids, w) = skewed_inputs(rng, name, m)
    ys = {}
    for concurrent in (False, True):
        plan = moe_plan(m, e, top_k, h, i, concurrent=concurrent)
        assert (plan.side is not None) == concurrent, "both lists must be busy"
        y = moe_experts(x, ids, w, exg, plan=plan, check_ids=False)
        ys[concurrent] = y.get()
        if concurrent:
            out = cupy.zeros_like(y)
            launch = graphed(lambda out=out, plan=plan: moe_experts(x, ids, w, exg, out=out, plan=plan,
                                                                     check_ids=False))
            out.fill(0x7FC0)
            launch()
            cupy.cuda.get_current_stream().synchronize()
            assert np.array_equal(out.get(), ys[True])
    assert np.array_equal(ys[True], ys[False])
    assert_close(ys[True], ref_moe(x_h, ids_h, w_h, ex), "bf16_accum")


@pytest.mark.gpu
def test_kernel_heuristic_splits_small_shards():
    from ddtree_rtc.kernels.moe_gemm import moe_plan

    plan = moe_plan(1, 384, 8, 7168, 256, num_sms=132)  # TP8 shard at M=1: few CTAs without split-K
    assert plan.split_gate_up > 1 and plan.part_gate_up is not None
    plan = moe_plan(1024, 384, 8, 7168, 2048, num_sms=132)
    assert (plan.split_gate_up, plan.split_down, plan.tiles) == (1, 1, "nt1+nt4>8")
    assert plan.part_gate_up is None
    assert moe_plan(1, 384, 8, 7168, 2048, num_sms=132).tiles == "nt1"  # M=1: no nt 4 launches


@pytest.mark.gpu
def test_kernel_rejects_bad_input(rng):
    import cupy

    from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan
    from ddtree_rtc.testing import to_device_bf16

    ex, exg = experts_for("small")
    e, h, i, top_k, poison = DIMS["small"]
    x = to_device_bf16(random_bf16(rng, (3, h)))
    ids, w = random_routing(rng, 3, e, top_k, allowed=range(e - poison))
    dids, dw = cupy.asarray(ids), cupy.asarray(w)
    with pytest.raises(TypeError, match="expected layout 'mma'"):
        moe_experts(x, dids, dw, ex)
    bad = ids.copy()
    bad[2, 1] = e
    with pytest.raises(ValueError, match=f"expert id {e} at pair {2 * top_k + 1}"):
        moe_experts(x, cupy.asarray(bad), dw, exg)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="expert id -1"):
        moe_experts(x, cupy.asarray(bad), dw, exg)
    with pytest.raises(ValueError, match="M = 0"):
        moe_experts(x[:0], dids[:0], dw[:0], exg)
    with pytest.raises(ValueError, match=rf"x: expected \[M, {h}\]"):
        moe_experts(to_device_bf16(random_bf16(rng, (3, 128))), dids, dw, exg)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        moe_experts(x, dids, dw[:, :1], exg)
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32"):
        moe_experts(x, dids.astype(cupy.int64), dw, exg)
    with pytest.raises(ValueError, match="plan: made for"):
        moe_experts(x, dids, dw, exg, plan=moe_plan(4, e, top_k, h, i))
    with pytest.raises(ValueError, match="hidden size 200"):
        moe_plan(1, e, top_k, 200, i)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        moe_plan(0, e, top_k, h, i)
    # out-of-range ids without the host check: never a fault, those slots contribute nothing
    bad[2, 1] = e + 5
    y = moe_experts(x, cupy.asarray(bad), dw, exg, check_ids=False)
    w0 = w.copy()
    w0[2, 1] = 0
    y_ref = ref_moe(x.get().view(bfloat16), np.where(bad < e, bad, 0), w0, ex)
    assert_close(y, y_ref, "bf16_accum")


def test_reference_fp32_out_is_the_unrounded_combine(rng):
    """An fp32 ``out`` (a tensor-parallel partial) gets the combine before its bf16 rounding."""
    ex = random_compressed_experts(rng, 5, 128, 128)
    x = random_bf16(rng, (7, 128))
    ids, w = random_routing(rng, 7, 5, 3)
    shared = random_bf16(rng, (7, 128), 0.5)
    out = np.full((7, 128), np.nan, np.float32)
    got = ref_moe(x, ids, w, ex, shared=shared, out=out)
    assert got is out and np.isfinite(got).all()
    assert np.array_equal(got.astype(bfloat16), ref_moe(x, ids, w, ex, shared=shared))
    assert not np.array_equal(got, got.astype(bfloat16).astype(np.float32))  # not rounded


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 33])
def test_kernel_fp32_out(rng, m):
    import cupy

    from ddtree_rtc.kernels.moe_gemm import moe_experts
    from ddtree_rtc.testing import to_device_bf16

    ex, exg = experts_for("small")
    e, h, i, top_k, poison = DIMS["small"]
    x = random_bf16(rng, (m, h))
    ids, w = random_routing(rng, m, e, top_k, allowed=range(e - poison))
    shared = random_bf16(rng, (m, h), 0.5)
    want = ref_moe(x, ids, w, ex, shared=shared, out=np.empty((m, h), np.float32))
    out = cupy.full((m, h), np.nan, np.float32)
    got = moe_experts(to_device_bf16(x), cupy.asarray(ids), cupy.asarray(w), exg, shared=to_device_bf16(shared),
                      out=out, check_ids=False)
    assert got is out
    assert_close(got, want, "bf16_accum")  # h is bf16 in both; the sums differ by fp32 order only


@pytest.mark.parametrize("m,top_k", [(1, 2), (3, 3)])
def test_bench_mma_reference_matches_reference(rng, m, top_k):
    """bench moe --variants checks every variant against mma_reference (the reference rebuilt from
    the 'mma' blobs, in CuPy there); here in numpy against the compressed-tensors reference."""
    from ddtree_rtc.bench.moe import mma_reference

    e, h, i = 4, 256, 384
    ex = random_compressed_experts(rng, e, h, i)
    x = random_bf16(rng, (m, h))
    ids, w = random_routing(rng, m, e, top_k)
    ids[-1, -1] = e  # out of range: left out
    got = mma_reference(x.view(np.uint16), ids, w, repack_experts(ex))
    want = ref_moe(x, ids, w, ex, check_ids=False)
    assert_close(got, want.view(np.uint16), "bf16")
    assert np.mean(got == want.view(np.uint16)) > 0.98  # float64 vs fp32 slot sums: rare last-bit flips
