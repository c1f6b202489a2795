"""INT4 dequant and the GPU repack, checked on the CPU: round trips, and a lane-by-lane emulation
of how ddtree_rtc/cuda_src/moe_gemm.cu reads the repacked blocks into mma.m16n8k16 fragments."""

import functools

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.model.int4_repack import (
    Int4Experts,
    check_dims,
    fuse_gate_up_rows,
    permute_nibbles,
    random_compressed_experts,
    repack_experts,
    repack_matrix,
    unpermute_nibbles,
    unrepack_matrix,
)
from ddtree_rtc.reference.moe_gemm import dequant_int4


def random_matrix(rng, n, k):
    p = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32).view(np.int32)
    s = rng.uniform(-2, 2, size=(n, k // 32)).astype(bfloat16)
    return p, s


def test_dequant_matches_the_formula_element_by_element(rng):
    p, s = random_matrix(rng, 5, 64)
    p[0, 0] = np.uint32(0xF0F0F0F0).view(np.int32)  # nibbles 0 and 15: values -8 and 7
    w = dequant_int4(p, s)
    u = p.view(np.uint32)
    for n in range(5):
        for k in range(64):
            q = int((int(u[n, k >> 3]) >> (4 * (k & 7))) & 0xF) - 8
            assert w[n, k] == np.float32(q) * np.float32(s[n, k // 32]), (n, k)
    assert w[0, 0] == -8 * np.float32(s[0, 0]) and w[0, 1] == 7 * np.float32(s[0, 0])


def test_nibble_permutation_round_trip(rng):
    w = rng.integers(0, 2**32, size=1000, dtype=np.uint32)
    assert np.array_equal(unpermute_nibbles(permute_nibbles(w)), w)
    # value i of 0x76543210 lands at nibble [0, 4, 1, 5, 2, 6, 3, 7][i]
    assert permute_nibbles(np.array([0x76543210], dtype=np.uint32))[0] == 0x75316420


@pytest.mark.parametrize("n,k", [(16, 128), (48, 384), (64, 256)])
def test_repack_round_trip_then_dequant_is_exact(rng, n, k):
    p, s = random_matrix(rng, n, k)
    blob = repack_matrix(p, s)
    assert blob.shape == (n // 16, k // 128, 1152)
    p2, s2 = unrepack_matrix(blob, n, k)
    assert np.array_equal(p2, p) and np.array_equal(s2.view(np.uint16), s.view(np.uint16))
    assert np.array_equal(dequant_int4(p2, s2), dequant_int4(p, s))


# ---- lane emulation: read the blob exactly as a lane of moe_gemm.cu does ----

@functools.cache
def _bf16(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint16).view(bfloat16).astype(np.float32)[0]


def _dequant2(v: int, scale_bits: int, scale_after: bool) -> tuple:
    """One bf16x2 A register as the mma multiplies it, times the scale it ends up with.
    nt4 (dequant2()): LOP3 (v & 0x000F000F) | 0x43004300, bf16x2 fma * 1 - 136, then * scale rounded
    to bf16. nt1 (mma_chunk_post()): the raw 128 + u goes into the mma, the -136 comes from the corr
    mma and the scale is an fp32 multiply afterwards, so the weight is (raw - 136) * scale exactly."""
    return _dequant2_nibbles(v & 0x000F000F, scale_bits, scale_after)


# a pure function of (two nibbles, scale, numerics): memoized, since the emulation asks it the same
# few thousand questions hundreds of thousands of times
@functools.cache
def _dequant2_nibbles(nibbles: int, scale_bits: int, scale_after: bool) -> tuple:
    raw = nibbles | 0x43004300
    out = []
    for half in (raw & 0xFFFF, raw >> 16):
        q = _bf16(half) - np.float32(136.0)
        prod = q * _bf16(scale_bits)
        out.append(prod if scale_after else np.float32(bfloat16(prod)))
    return tuple(out)


def _b_kmap(kbase: int, chunk: int, h: int) -> list[int]:
    """Logical mma row r of the B fragment -> k, from the kernel's activation loads: lane (n, t)
    loads x[n, kbase + 32*chunk + 8t .. +8] as 4 words; step h uses words 2h (b0) and 2h+1 (b1);
    PTX: b0 holds rows 2t, 2t+1 and b1 rows 2t+8, 2t+9."""
    kmap = [0] * 16
    for t in range(4):
        for j in range(2):
            kmap[2 * t + j] = kbase + 32 * chunk + 8 * t + 2 * (2 * h) + j
            kmap[2 * t + 8 + j] = kbase + 32 * chunk + 8 * t + 2 * (2 * h + 1) + j
    return kmap


def emulate_weights(blob: np.ndarray, n: int, k: int, scale_after: bool = False) -> np.ndarray:
    """The weight matrix the kernel's mma instructions multiply, rebuilt lane by lane from the
    16-byte pieces each lane reads out of its shared-memory copy of the block (the same bytes at the
    same offsets as in global memory). ``scale_after``: the nt1 kernels' numerics (see _dequant2)."""
    tn, kc = n // 16, k // 128
    b = blob.reshape(tn, kc, 1152)
    w = np.full((n, k), np.nan, dtype=np.float32)
    hits = np.zeros((n, k), dtype=np.int32)
    for tile in range(tn):
        for c in range(kc):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                w0 = b[tile, c, 16 * lane:16 * lane + 16].view("<u4")  # lds128(ws + 16 * lane)
                w1 = b[tile, c, 512 + 16 * lane:528 + 16 * lane].view("<u4")
                sc = b[tile, c, 1024 + 16 * g:1040 + 16 * g].view("<u4")  # lds128(ws + 1024 + 16 * g)
                for chunk in range(4):
                    wv = (w0, w1)[chunk >> 1]
                    wg, wg8 = (int(wv[2]), int(wv[3])) if chunk & 1 else (int(wv[0]), int(wv[1]))
                    sw, sw8 = (int(sc[0]), int(sc[2])) if chunk < 2 else (int(sc[1]), int(sc[3]))
                    s = sw >> 16 if chunk & 1 else sw & 0xFFFF
                    s8 = sw8 >> 16 if chunk & 1 else sw8 & 0xFFFF
                    for h in range(2):
                        regs = (_dequant2(wg >> (8 * h), s, scale_after), _dequant2(wg8 >> (8 * h), s8, scale_after),
                                _dequant2(wg >> (8 * h + 4), s, scale_after),
                                _dequant2(wg8 >> (8 * h + 4), s8, scale_after))
                        kmap = _b_kmap(128 * c, chunk, h)
                        for ri, (lo, hi) in enumerate(regs):
                            # PTX A layout: a{2ri}, a{2ri+1}: row g (+8 for ri odd), cols 2t, 2t+1 (+8 for ri >= 2)
                            row = 16 * tile + g + 8 * (ri & 1)
                            col = 2 * t + 8 * (ri >> 1)
                            for r, v in ((col, lo), (col + 1, hi)):
                                w[row, kmap[r]] = v
                                hits[row, kmap[r]] += 1
    assert (hits == 1).all(), "every weight must feed exactly one mma element"
    return w


@pytest.mark.parametrize("scale_after", [False, True])
@pytest.mark.parametrize("n,k", [(16, 128), (32, 256)])
def test_lane_emulation_reconstructs_the_weights(rng, n, k, scale_after):
    p, s = random_matrix(rng, n, k)
    p[3, 5] = np.uint32(0x0F0F0F0F).view(np.int32)
    want = dequant_int4(p, s)  # exact in fp32
    if not scale_after:
        want = want.astype(bfloat16).astype(np.float32)  # the nt4 kernels round q * s to bf16 once
    got = emulate_weights(repack_matrix(p, s), n, k, scale_after)
    assert np.array_equal(got, want)


def test_lane_emulation_of_fused_gate_up_rows(rng):
    """The gate_up epilogue takes tile rows g / g + 8 as gate / up of intermediate 8 * tile + g."""
    inter, hidden = 128, 128
    ex = random_compressed_experts(rng, 1, hidden, inter)
    blob = repack_experts(ex).w13[0]
    w = emulate_weights(blob, 2 * inter, hidden)
    full = dequant_int4(ex.w13[0], ex.w13_scale[0]).astype(bfloat16).astype(np.float32)
    gate, up = full[:inter], full[inter:]
    for tile in range(2 * inter // 16):
        for g in range(8):
            i = 8 * tile + g
            assert np.array_equal(w[16 * tile + g], gate[i]) and np.array_equal(w[16 * tile + 8 + g], up[i])
    # the split-K reduce reads gate / up of i at fused columns (i // 8) * 16 + i % 8 (+ 8)
    for i in range(inter):
        ng = (i >> 3) * 16 + (i & 7)
        assert np.array_equal(w[ng], gate[i]) and np.array_equal(w[ng + 8], up[i])


def test_fuse_gate_up_rows_order():
    gate = np.arange(16)[:, None] * np.ones((1, 2), dtype=np.int64)
    up = gate + 100
    f = fuse_gate_up_rows(gate, up)[:, 0]
    assert f.tolist() == [*range(8), *range(100, 108), *range(8, 16), *range(108, 116)]


def test_repack_experts_round_trip(rng):
    ex = random_compressed_experts(rng, 3, 256, 128)
    r = repack_experts(ex)
    assert r.layout == "mma" and r.w13.shape == (3, 16, 2, 1152) and r.w2.shape == (3, 16, 1, 1152)
    for e in range(3):
        p, s = unrepack_matrix(r.w2[e], 256, 128)
        assert np.array_equal(p, ex.w2[e]) and np.array_equal(s.view(np.uint16), ex.w2_scale[e].view(np.uint16))
        p, s = unrepack_matrix(r.w13[e], 256, 256)
        assert np.array_equal(p, fuse_gate_up_rows(ex.w13[e][:128], ex.w13[e][128:]))
    assert r.nbytes() == ex.nbytes() == 3 * ex.expert_nbytes()


def test_random_experts_hold_extreme_values(rng):
    ex = random_compressed_experts(rng, 2, 128, 128)
    for p, s in ((ex.w13, ex.w13_scale), (ex.w2, ex.w2_scale)):
        for e in range(2):
            q = np.round(dequant_int4(p[e], s[e]) / np.repeat(s[e].astype(np.float32), 32, axis=1))
            assert q.min() == -8 and q.max() == 7


def test_shape_rules_are_named():
    with pytest.raises(ValueError, match="hidden size 200 must be a positive multiple of 128"):
        check_dims(200, 256)
    with pytest.raises(ValueError, match="intermediate size 48 must be a positive multiple of 32"):
        check_dims(256, 48, 32)
    with pytest.raises(ValueError, match="unknown layout"):
        Int4Experts("marlin", 1, 128, 128, None, None, None, None)
    p, s = random_matrix(np.random.default_rng(0), 24, 128)
    with pytest.raises(ValueError, match="N=24 must be a multiple of 16"):
        repack_matrix(p, s)
    p, s = random_matrix(np.random.default_rng(0), 16, 128)
    with pytest.raises(ValueError, match="scale shape"):
        repack_matrix(p, s[:, :2])
