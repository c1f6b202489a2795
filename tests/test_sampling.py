import math
import re

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.reference import sampling as ref
from ddtree_rtc.rtc.builder import source_dir

CU = source_dir() / "sampling.cu"
NB, LEVEL0_BASE, LEVEL0_SHIFT = 2048, 0x3A010000, 16


# ---- the bit-exact building blocks -------------------------------------------------------------

def test_constants_match_cuda_source():
    src = CU.read_text()
    for name, lit in ref.FLOAT_CONSTANTS.items():
        m = re.search(rf"constexpr float {name} = (\S+?)f;", src)
        assert m, f"{name} missing from sampling.cu"
        assert float.fromhex(m.group(1)) == float.fromhex(lit), name
    assert f"SQRT2_BITS = 0x{ref.SQRT2_BITS:08X}u" in src
    assert f"GAMMA = 0x{ref.GAMMA:016X}ull" in src
    for c in ref.MIX_MUL:
        assert f"0x{c:016X}ull" in src
    assert f"G_MAX = {ref.G_MAX}f" in src and f"G_MIN = {ref.G_MIN}f" in src
    assert f"NB = {NB};" in src and f"LEVEL0_BASE = 0x{LEVEL0_BASE:08X}u" in src
    assert f"LEVEL0_SHIFT = {LEVEL0_SHIFT};" in src


def test_log_pos_accuracy(rng):
    v = np.exp(rng.uniform(-40, 40, 200_000)).astype(np.float32)
    v = np.concatenate([v, np.float32([2.0**-24, 1 - 2.0**-24, 1.0, 2.0, 0.5, math.sqrt(2), 16.6])])
    got = ref.log_pos(v).astype(np.float64)
    want = np.log(v.astype(np.float64))
    assert np.all(np.abs(got - want) <= 4e-7 * np.maximum(np.abs(want), 1e-30) + 1e-7 * (np.abs(want) > 0.5))


def test_fixed_exp_accuracy(rng):
    x = np.concatenate([rng.uniform(0, 32, 200_000), rng.uniform(0, 1e-3, 1000), [0.0, 22.18, 31.99, 32.0, 1e9,
                                                                                   np.inf, np.nan]])
    x = x.astype(np.float32)
    got = ref.fixed_exp_neg(x).astype(np.float64)
    with np.errstate(invalid="ignore"):
        want = np.where(x < 32, np.exp(-x.astype(np.float64)) * 2.0**32, 0.0)
    assert got[np.argwhere(x == 0)[0, 0]] == 2.0**32
    assert np.all(np.abs(got - want) <= 2e-6 * want + 1.0)
    assert np.all(got[~(x < 32)] == 0)


def test_gumbel_within_kernel_bounds(rng):
    keys = ref.row_keys(int(rng.integers(2**63)), 3, 4)
    g = ref.gumbel(keys[:, None], np.arange(50_000)[None, :])
    assert g.min() > ref.G_MIN and g.max() < ref.G_MAX
    extremes = -ref.log_pos(-ref.log_pos(np.float32([2.0**-24, 1 - 2.0**-24])))
    assert ref.G_MIN + 0.1 < extremes[0] < -2.8 and 16.6 < extremes[1] < ref.G_MAX - 0.3


def test_uniforms_look_uniform_and_streams_differ(rng):
    seed = int(rng.integers(2**63))
    u = ref.uniforms(ref.row_keys(seed, 0, 1)[0], np.arange(200_000))
    assert 0 < u.min() and u.max() < 1
    counts = np.bincount((u * 64).astype(int), minlength=64)
    chi2 = ((counts - 200_000 / 64) ** 2 / (200_000 / 64)).sum()
    assert chi2 < _chi2_critical(63)
    a = ref.row_keys(seed, 0, 3)
    assert len({*a.tolist(), *ref.row_keys(seed, 1, 3).tolist(), *ref.row_keys(seed + 1, 0, 3).tolist()}) == 9
    assert np.array_equal(a, ref.row_keys(seed, 0, 3))


# ---- argmax ------------------------------------------------------------------------------------

def test_argmax_rules():
    nan, inf = np.nan, np.inf
    logits = np.array([
        [1.0, 3.0, 3.0, 2.0],        # tie -> smallest index
        [nan, -inf, nan, -inf],      # NaN never chosen, -inf is a value
        [nan, nan, nan, nan],        # all NaN -> -1
        [-5.0, nan, inf, inf],       # +inf wins, first one
        [-inf, -inf, -inf, -inf],
    ], dtype=np.float32)
    assert ref.argmax(logits).tolist() == [1, 1, -1, 2, 0]
    assert ref.argmax(logits.astype(bfloat16)).tolist() == [1, 1, -1, 2, 0]
    out = np.full(5, -7, dtype=np.int32)
    assert ref.argmax(logits, out=out) is out and out.tolist() == [1, 1, -1, 2, 0]
    assert ref.argmax(np.zeros((3, 0), np.float32)).tolist() == [-1, -1, -1]


def test_argmax_matches_float64_on_random(rng):
    l = rng.standard_normal((16, 3001)).astype(bfloat16)  # bf16: many exact ties
    l64 = l.astype(np.float64)
    want = [int(np.flatnonzero(r == r.max())[0]) for r in l64]
    assert ref.argmax(l).tolist() == want


# ---- the nucleus threshold: the kernel's radix select, transliterated, against the sort ---------

def radix_threshold(x: np.ndarray, top_p: float) -> int:
    """cuda_src/sampling.cu nucleus_threshold, step for step, for one row of x = m - z."""
    valid = ~np.isnan(x)
    keys = x.view(np.uint32).astype(np.int64)
    mass = ref.fixed_exp_neg(x)
    clo, chi, base, shift = 0, ref.KEY_INF, LEVEL0_BASE, LEVEL0_SHIFT
    above, target = 0, None
    for level in range(8):
        sel = valid & (keys >= clo) & (keys <= chi) & (mass != 0)
        bins = np.clip((keys[sel] - base) >> shift, 0, NB - 1)
        hist = np.zeros(NB, dtype=np.uint64)
        np.add.at(hist, bins, mass[sel])
        if level == 0:
            target = max(1, math.ceil(float(np.float32(top_p)) * float(int(hist.sum()))))
        cum = above + np.cumsum(hist, dtype=np.uint64).astype(object)
        crossing = [b for b in range(NB) if (cum[b] - int(hist[b])) < target <= cum[b]]
        assert len(crossing) == 1, "exactly one thread must find the crossing bin"
        b = crossing[0]
        above = cum[b] - int(hist[b])
        lo = clo if b == 0 else base + (b << shift)
        hi = chi if b == NB - 1 else base + ((b + 1) << shift) - 1
        clo, chi = max(lo, clo), min(hi, chi)
        if clo == chi:
            return clo
        base, shift = clo, 0
        while ((chi - clo) >> shift) >= NB:
            shift += 1
    raise AssertionError("radix select did not converge in 8 levels")


def _x_rows(rng):
    rows = [
        rng.standard_normal(5000) * 3,                                   # broad
        rng.standard_normal(5000).astype(bfloat16).astype(np.float32),   # bf16: heavy ties
        np.concatenate([rng.standard_normal(4000) * 2, [30.0] * 3]),     # a few dominant tokens
        np.full(3000, 1.25),                                             # all equal
        np.concatenate([rng.standard_normal(2000), [np.nan] * 50, [-np.inf] * 50]),
        np.concatenate([[10.0, 10.0 - 1e-4, 10.0 - 2e-4], rng.standard_normal(3000) - 20]),  # bin 0
        rng.standard_normal(7) * 40,                                     # wide range
    ]
    out = []
    for z in rows:
        z = np.asarray(z, dtype=np.float32)
        m = np.nanmax(np.where(np.isneginf(z), np.nan, z))
        with np.errstate(invalid="ignore"):
            out.append((m - z).astype(np.float32))
    return out


@pytest.mark.parametrize("top_p", [0.0, 1e-6, 0.3, 0.5, 0.9, 0.99, 0.999999])
def test_radix_select_matches_sorting(rng, top_p):
    for x in _x_rows(rng):
        want = int(ref.nucleus_keys(x[None, :], np.float32([top_p]))[0])
        assert radix_threshold(x, top_p) == want


# ---- sample ------------------------------------------------------------------------------------

def _chi2_critical(df: int, z: float = 4.753) -> float:
    """Chi-square quantile at p = 1e-6 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _nucleus_probs(logits: np.ndarray, temp: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) restricted to the top-p nucleus and renormalised, in float64."""
    z = logits.astype(np.float64) / temp
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    k = int(np.searchsorted(cum, top_p)) + 1 if top_p < 1 else len(p)
    keep = p >= p[order[min(k, len(p)) - 1]]  # ties at the threshold included
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _robust_logits(rng, vocab, temp, top_p, dtype):
    """Random logits (in ``dtype``) with >= 4 nucleus tokens and the nucleus boundary far (> 1e-3
    of the mass) from top_p, so rounding cannot move it."""
    while True:
        l = (rng.standard_normal(vocab) * 1.5).astype(dtype)
        z = l.astype(np.float64) / temp
        p = np.sort(np.exp(z - z.max()) / np.exp(z - z.max()).sum())[::-1]
        cum = np.cumsum(p)
        if np.abs(cum - top_p).min() > 1e-3 and int(np.searchsorted(cum, top_p)) >= 3:
            return l


def chi_square_check(sample_fn, rng, dtype):
    vocab, temp, top_p, rows, seeds = 12, 0.8, 0.85, 10_000, 4
    l = _robust_logits(rng, vocab, temp, top_p, dtype)
    want = _nucleus_probs(l.astype(np.float32), temp, top_p)
    batch = np.repeat(l[None, :], rows, axis=0)
    draws = np.concatenate([sample_fn(batch, temp, top_p, int(rng.integers(2**63)), i) for i in range(seeds)])
    counts = np.bincount(draws, minlength=vocab)
    assert counts[want == 0].sum() == 0, "sampled outside the nucleus"
    keep = want > 0
    expected = want[keep] * len(draws)
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    assert df >= 2
    assert chi2 < _chi2_critical(df), f"chi2 {chi2:.1f} with df {df}; counts {counts}, expected {expected}"


@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_reference_samples_follow_nucleus_softmax(rng, dtype):
    chi_square_check(lambda *a: ref.sample(*a), rng, dtype)


def test_threshold_ties_are_included(rng):
    l = np.float32([3.0, 1.0, 1.0, 1.0, -1.0])
    p = np.exp(l - 3.0) / np.exp(l - 3.0).sum()
    top_p = float(p[0] + 0.5 * p[1])  # reached inside the tie group: all three 1.0 tokens join
    draws = ref.sample(np.repeat(l[None], 30_000, axis=0), 1.0, top_p, int(rng.integers(2**63)))
    counts = np.bincount(draws, minlength=5)
    assert counts[4] == 0 and counts[1:4].min() > 0
    want = _nucleus_probs(l, 1.0, top_p) * 30_000
    assert np.allclose(want[:4], [p[0] / p[:4].sum() * 30_000] + [p[1] / p[:4].sum() * 30_000] * 3)
    chi2 = ((counts[:4] - want[:4]) ** 2 / want[:4]).sum()
    assert chi2 < _chi2_critical(3)


def test_sample_rules(rng):
    nan, inf = np.nan, np.inf
    l = rng.standard_normal((6, 50)).astype(np.float32)
    l[1] = nan
    l[2, :] = -inf
    l[3, 7] = inf
    l[4, 5] = l[4].max() + 10  # top_p 0 keeps just the best token
    out = ref.sample(l, np.float32([0.0, 1.0, 1.0, 1.0, 1.0, 0.7]), np.float32([1, 1, 0.5, 0.9, 0.0, 1]), 5)
    assert out[0] == ref.argmax(l[:1])[0]
    assert out[1] == -1 and out[2] == 0 and out[3] == 7 and out[4] == 5
    seed = int(rng.integers(2**63))
    a = ref.sample(l[5:].repeat(64, 0), 1.0, 0.95, seed, offset=3)
    assert np.array_equal(a, ref.sample(l[5:].repeat(64, 0), 1.0, 0.95, seed, offset=3))
    assert not np.array_equal(a, ref.sample(l[5:].repeat(64, 0), 1.0, 0.95, seed, offset=4))
    assert not np.array_equal(a, ref.sample(l[5:].repeat(64, 0), 1.0, 0.95, seed + 1, offset=3))
    with pytest.raises(ValueError, match="top_p: expected a float or fp32"):
        ref.sample(l, 1.0, np.float32([0.5, 0.5]), 0)


def test_sample_is_gumbel_max_over_the_nucleus(rng):
    """An independent float64 restatement: with top_p = 1 the draw is argmax(z + g)."""
    l = rng.standard_normal((5, 300)).astype(np.float32)
    seed = int(rng.integers(2**63))
    keys = ref.row_keys(seed, 9, 5)
    g = ref.gumbel(keys[:, None], np.arange(300)[None, :]).astype(np.float32)
    z = l * (np.float32(1) / np.float32(0.6))
    want = np.argmax(z + g, axis=1)
    assert ref.sample(l, 0.6, 1.0, seed, offset=9).tolist() == want.tolist()


def test_position_keys_are_row_keys_of_their_position(rng):
    """position_keys(seed, s, p) is row p of row_keys(seed, s, p + 1): a request's draw at a position
    is keyed the same whichever batch slot or round emits it."""
    seed = int(rng.integers(2**63))
    streams, pos = rng.integers(0, 2**40, 9), rng.integers(0, 300, 9)
    got = ref.position_keys(seed, streams, pos)
    assert got.dtype == np.uint64
    assert [int(k) for k in got] == [int(ref.row_keys(seed, int(s), int(p) + 1)[p]) for s, p in zip(streams, pos)]
    assert len(set(got.tolist())) == 9
    l = rng.standard_normal((9, 200)).astype(np.float32)
    a = ref.sample(l, 1.0, 0.9, 0, keys=got)
    perm = rng.permutation(9)
    assert np.array_equal(ref.sample(l[perm], 1.0, 0.9, 12345, keys=got[perm]), a[perm])
    with pytest.raises(ValueError, match="keys: expected uint64"):
        ref.sample(l, 1.0, 0.9, 0, keys=got[:4])
    with pytest.raises(ValueError, match="positions must be >= 0"):
        ref.position_keys(seed, [1], [-1])


# ---- GPU ---------------------------------------------------------------------------------------

def _device_logits(host: np.ndarray, poison: float = np.inf):
    """Host logits on the GPU as a view into a buffer whose tail past the end is +inf: a read past
    the last row would win the argmax."""
    import cupy

    bits = host.view(np.uint16) if host.dtype == bfloat16 else host
    tail = np.full(64, poison, dtype=np.float32).astype(host.dtype)
    buf = cupy.empty(bits.size + 64, dtype=bits.dtype)
    buf[bits.size:] = cupy.asarray(tail.view(bits.dtype))
    buf[:bits.size] = cupy.asarray(bits.ravel())
    return buf[:bits.size].reshape(bits.shape)


def _rows_for_gpu(rng, rows, vocab, dtype):
    l = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4.0, (rows, 1))).astype(np.float32)
    if rows > 2:
        l[1, rng.integers(0, vocab, max(1, vocab // 10))] = np.nan
        l[2, : vocab // 2] = -np.inf
    if rows > 4:
        l[3] = 0.75                                              # all equal
        l[4, rng.integers(0, vocab, 3)] = l[4].max() + 25        # peaked
    return l.astype(dtype)


GPU_SHAPES = [(1, 163840), (8, 163840), (3, 1000), (5, 1001), (6, 7), (4, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_argmax_kernel_matches_reference(rng, dtype, shape):
    import cupy

    from ddtree_rtc.kernels.sampling import argmax

    l = _rows_for_gpu(rng, *shape, dtype)
    if shape[0] > 5:
        l[5] = np.nan
    out = cupy.full(shape[0], -7, dtype=cupy.int32)
    got = argmax(_device_logits(l), out=out)
    assert got is out
    assert got.get().tolist() == ref.argmax(l).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_sample_kernel_matches_reference_exactly(rng, dtype, shape):
    import cupy

    from ddtree_rtc.kernels.sampling import sample

    rows, vocab = shape
    l = _rows_for_gpu(rng, rows, vocab, dtype)
    temps = rng.choice(np.float32([0.0, 0.3, 0.7, 1.0, 1.6]), rows).astype(np.float32)
    temps[: min(rows, 5)] = np.float32([1.0, 0.9, 1.2, 1.0, 0.8])[: min(rows, 5)]
    top_ps = rng.choice(np.float32([0.0, 0.2, 0.5, 0.9, 0.95, 0.999, 1.0]), rows).astype(np.float32)
    seed, offset = int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(2**40))
    dl = _device_logits(l)
    out = cupy.full(rows, -7, dtype=cupy.int32)
    got = sample(dl, cupy.asarray(temps), cupy.asarray(top_ps), seed, offset, out=out)
    assert got is out
    assert got.get().tolist() == ref.sample(l, temps, top_ps, seed, offset).tolist()
    for t, p in ((1.0, 0.9), (0.5, 1.0), (0.0, 0.5)):
        assert sample(dl, t, p, seed, offset).get().tolist() == ref.sample(l, t, p, seed, offset).tolist()
    keys = ref.position_keys(seed, rng.integers(0, 2**40, rows), rng.integers(0, 4096, rows))
    got = sample(dl, cupy.asarray(temps), cupy.asarray(top_ps), seed, offset, keys=cupy.asarray(keys))
    assert got.get().tolist() == ref.sample(l, temps, top_ps, seed, offset, keys=keys).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_sample_kernel_follows_nucleus_softmax(rng, dtype):
    from ddtree_rtc.kernels.sampling import sample

    def on_gpu(batch, t, p, seed, offset):
        got = sample(_device_logits(batch), t, p, seed, offset).get()
        assert got.tolist() == ref.sample(batch, t, p, seed, offset).tolist()
        return got

    chi_square_check(on_gpu, rng, dtype)


@pytest.mark.gpu
def test_sampling_kernels_reject_bad_input():
    import cupy

    from ddtree_rtc.kernels.sampling import argmax, sample

    with pytest.raises(TypeError, match="logits: expected dtype"):
        argmax(cupy.zeros((2, 8), dtype=cupy.float16))
    with pytest.raises(ValueError, match="logits: expected 2 dims"):
        argmax(cupy.zeros((8,), dtype=cupy.float32))
    with pytest.raises(ValueError, match="top_p: expected shape"):
        sample(cupy.zeros((2, 8), dtype=cupy.float32), 1.0, cupy.ones(3, dtype=cupy.float32), 0)
    with pytest.raises(TypeError, match="out: expected dtype int32"):
        argmax(cupy.zeros((2, 8), dtype=cupy.float32), out=cupy.zeros(2, dtype=cupy.int64))
