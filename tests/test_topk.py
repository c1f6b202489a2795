"""Vocabulary top-k: the reference against a float64 full sort and its rules (CPU), then the four
kernel variants against the reference: ids exactly, log-probs to fp32 tolerance, on every path
(vectorised or not, one or several blocks per row, chunk sizes, the stream kernel's compactions and
its restart on NaN / +inf, candidate-buffer overflow of the radix kernels)."""

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.reference.topk import FLT_MAX, topk_logprobs
from ddtree_rtc.testing import assert_close

KINDS = ("normal", "zipf_sorted", "zipf_perm", "equal", "quant", "zeros", "weird")


def make_logits(rng, rows, vocab, kind):
    """Peaked (Zipf, popular tokens at low ids as in real vocabularies, or shuffled), flat, heavily
    tied (integers; bf16 adds more ties), signed zeros at the threshold and non-finite rows."""
    if kind == "normal":
        x = rng.standard_normal((rows, vocab)) * 3
    elif kind == "zipf_sorted":
        x = -1.1 * np.log(np.arange(vocab) + 1.0)[None] + 0.3 * rng.standard_normal((rows, vocab))
    elif kind == "zipf_perm":
        ranks = np.stack([rng.permutation(vocab) for _ in range(rows)]) + 1.0
        x = -1.1 * np.log(ranks) + 0.3 * rng.standard_normal((rows, vocab))
    elif kind == "equal":
        x = np.zeros((rows, vocab))
    elif kind == "quant":
        x = np.round(rng.standard_normal((rows, vocab)) * 2)
    elif kind == "zeros":  # the k-th value is often 0, with -0.0 and +0.0 mixed
        x = rng.choice(np.array([-0.0, 0.0, -1.0, -2.0]), size=(rows, vocab), p=[0.1, 0.02, 0.5, 0.38])
    elif kind == "weird":
        x = rng.standard_normal((rows, vocab)) * 3
        for val, p in ((np.nan, 0.05), (np.inf, 0.01), (-np.inf, 0.2), (-0.0, 0.05), (0.0, 0.05)):
            x[rng.random((rows, vocab)) < p] = val
        x[0] = -np.inf
        if rows > 1:
            x[1] = np.nan
    else:
        raise ValueError(kind)
    return x


def full_sort_reference(x):
    """float64 log-softmax and a full (value desc, id asc) sort, written independently."""
    x = np.asarray(x, dtype=np.float64)
    x = np.where(np.isnan(x) | (x == np.inf), -np.inf, x)
    out_ids = np.empty(x.shape, np.int64)
    logq = np.empty(x.shape)
    for r in range(x.shape[0]):
        order = sorted(range(x.shape[1]), key=lambda i: (-x[r, i], i))
        out_ids[r] = order
        m = x[r].max()
        lse = m + np.log(np.exp(x[r] - m).sum()) if m > -np.inf else 0.0
        logq[r] = np.maximum(x[r, order] - lse, -FLT_MAX)
    return logq, out_ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_reference_against_full_sort(rng, kind, dtype):
    x = make_logits(rng, 3, 777, kind).astype(dtype)
    for k in (1, 5, 64, 512):
        logq, ids = topk_logprobs(x, k)
        want_logq, want_ids = full_sort_reference(x)
        assert ids.dtype == np.int32 and logq.dtype == np.float32 and logq.shape == (3, k)
        assert np.array_equal(ids, want_ids[:, :k])
        assert_close(logq, want_logq[:, :k], "fp32", "logq")
        assert (np.diff(logq, axis=-1) <= 0).all(), "log-probs sorted descending"


def test_reference_rules():
    x = np.array([[1.0, np.nan, 3.0, np.inf, 3.0, -np.inf, -0.0, 0.0]], np.float32)
    logq, ids = topk_logprobs(x, 8)
    assert ids[0].tolist() == [2, 4, 0, 6, 7, 1, 3, 5], "ties by id; -0 == 0; NaN/+inf/-inf last, by id"
    assert (logq[0, 5:] == -FLT_MAX).all() and np.isfinite(logq).all()
    lse = np.log(2 * np.exp(3.0) + np.exp(1.0) + 2.0)
    assert np.allclose(logq[0, :5], [3 - lse, 3 - lse, 1 - lse, -lse, -lse], rtol=1e-6)
    logq, ids = topk_logprobs(np.full((2, 4), -np.inf, np.float32), 3)
    assert ids.tolist() == [[0, 1, 2]] * 2 and (logq == -FLT_MAX).all()
    x = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)
    logq, _ = topk_logprobs(x, 50)
    assert np.allclose(np.log(np.exp(logq.astype(np.float64)).sum(-1)), 0.0, atol=1e-6)


def test_reference_leading_dims_and_out():
    x = np.random.default_rng(1).standard_normal((2, 3, 100)).astype(bfloat16)
    lq, ids = np.empty((2, 3, 7), np.float32), np.empty((2, 3, 7), np.int32)
    got = topk_logprobs(x, 7, out_logq=lq, out_ids=ids)
    assert got[0] is lq and got[1] is ids
    flat = topk_logprobs(x.reshape(6, 100), 7)
    assert np.array_equal(ids.reshape(6, 7), flat[1]) and np.array_equal(lq.reshape(6, 7), flat[0])


def test_reference_bad_k():
    x = np.zeros((2, 10), np.float32)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        topk_logprobs(x, 11)
    with pytest.raises(ValueError, match="out of range"):
        topk_logprobs(np.zeros((1, 1000), np.float32), 513)
    with pytest.raises(ValueError, match="out of range"):
        topk_logprobs(x, 0)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        topk_logprobs(x.astype(np.float16), 2)


def _radix_model(row, k, vec, cvec, cap=8192):
    """The radix kernels' selection argument in numpy (ddtree_rtc/cuda_src/topk.cu, radix variant): order keys,
    per-vector largest bins, per-chunk floors raised after steps 1, 2, 4, ... of 1024 vectors, the
    K-th vector bin of the row histogram, the flagged 8-vector groups, the candidates reaching the
    bin's lower edge and the overflow loop. Returns the ids, the bin found and that of the full
    histogram (every vector counted)."""
    x = np.asarray(row, np.float32)
    x = np.where(x <= FLT_MAX, x, np.float32(-np.inf)).astype(np.float32) + np.float32(0.0)
    nvec = -(-x.size // vec)
    pad = np.full(nvec * vec, -np.inf, np.float32)
    pad[:x.size] = x
    b = pad.view(np.uint32).astype(np.uint64)
    o = np.where(b & 0x80000000, ~b & 0xFFFFFFFF, b | 0x80000000)
    vbin = (o.reshape(nvec, vec).max(1) >> 20).astype(np.int64)

    def kth_bin(h):
        hit = np.flatnonzero(np.cumsum(h[::-1])[::-1] >= k)
        return int(hit.max()) if hit.size else 0

    hist = np.zeros(4096, np.int64)
    for v0 in range(0, nvec, cvec):
        n, h, floor = min(cvec, nvec - v0), np.zeros(4096, np.int64), 0
        for step, base in enumerate(range(0, n, 1024), start=1):
            part = vbin[v0 + base:v0 + min(n, base + 1024)]
            h += np.bincount(part[part >= floor], minlength=4096)
            if step & (step - 1) == 0 and base + 1024 < n:
                floor = max(floor, kth_bin(h))
        hist += h
    tb = kth_bin(hist)
    groups = np.zeros(-(-nvec // 8) * 8, np.int64)
    groups[:nvec] = vbin
    flagged = np.repeat(groups.reshape(-1, 8).max(1) >= tb, 8 * vec)[:x.size]
    keys = (o[:x.size] << np.uint64(32)) | (~np.arange(x.size, dtype=np.uint64) & np.uint64(0xFFFFFFFF))
    thr = np.uint64(tb << 20) << np.uint64(32)
    assert not (keys[~flagged] >= thr).any(), "an element reaching the threshold in an unflagged group"
    cand = keys[flagged & (keys >= thr)]
    while cand.size > cap:  # the kernel keeps the first cap appended; any cap of them will do
        thr = np.sort(cand[:cap])[::-1][k - 1]
        cand = keys[flagged & (keys >= thr)]
    assert cand.size >= k
    top = np.sort(cand)[::-1][:k]
    return (~top & np.uint64(0xFFFFFFFF)).astype(np.int32), tb, kth_bin(np.bincount(vbin, minlength=4096))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_radix_selection_model(rng, kind, dtype):
    """The radix variant's argument holds on every kind of row (CPU): the floors never change the
    K-th vector bin, no candidate lies outside the flagged groups, and the ids are the reference's."""
    x = make_logits(rng, 2, 30_011, kind).astype(dtype)
    vec = 8 if dtype == bfloat16 else 4
    for k in (1, 64, 512):
        _, want = topk_logprobs(x, k)
        for cvec in (256, 1280, 4096):
            for r in range(2):
                ids, tb, full_bin = _radix_model(x[r].astype(np.float32), k, vec, cvec, cap=2048)
                assert tb == full_bin and np.array_equal(ids, want[r]), (k, cvec, r)


# ---------------------------------------------------------------- GPU


def run_gpu(x, k, offset=0, repeat=1, variant=None, vectors=None, chunk=None):
    """Kernel on host logits ``x``; outputs pre-filled with NaN / -1. ``offset`` elements in front
    of the data make the rows unaligned (the scalar path); the tail behind the data is NaN."""
    import cupy

    from ddtree_rtc.kernels import topk

    bits = x.view(np.uint16) if x.dtype == bfloat16 else x
    flat = cupy.full(bits.size + offset + 64, np.nan, dtype=np.float32)
    if bits.dtype == np.uint16:
        flat = flat.view(cupy.uint16)  # NaN bits (0x7fc0) in each half
    flat[offset:offset + bits.size] = cupy.asarray(bits.ravel())
    dev = flat[offset:offset + bits.size].reshape(x.shape)
    ws = topk.topk_workspace(x.shape, k, variant=variant, vectors=vectors, chunk=chunk)
    assert ws.variant == (variant or ws.variant)
    logq = cupy.full((*x.shape[:-1], k), np.nan, dtype=cupy.float32)
    ids = cupy.full((*x.shape[:-1], k), -1, dtype=cupy.int32)
    for _ in range(repeat):  # the arrival counters must be back to zero after every launch
        got = topk.topk_logprobs(dev, k, out_logq=logq, out_ids=ids, workspace=ws)
        assert got[0] is logq and got[1] is ids
    if ws.count is not None:
        assert int(ws.count.sum()) == 0
    if ws.hist is not None:  # radix: the select launch zeroes the row histograms again
        assert int(ws.hist.sum()) == 0
    return logq.get(), ids.get()


def check_gpu(x, k, want=None, **kw):
    """``want``: the reference's (logq, ids) for (x, k) when the caller has it already."""
    want_logq, want_ids = topk_logprobs(x, k) if want is None else want
    logq, ids = run_gpu(x, k, **kw)
    if not np.array_equal(ids, want_ids):
        bad = np.argwhere(ids != want_ids)[:3].tolist()
        raise AssertionError(f"ids differ at {bad} ({kw})")
    assert_close(logq, want_logq, "fp32", "logq")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["stream", "radix"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 4099, 20_000, 163_840])
def test_kernel_matches_reference(rng, kind, dtype, vocab, variant):
    x = make_logits(rng, 3, vocab, kind).astype(dtype)
    for k in sorted({1, min(vocab, 64), min(vocab, 256 if variant == "stream" else 512)}):
        check_gpu(x, k, variant=variant, repeat=2)
        check_gpu(x, k, offset=1, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [8192, 16384, 57344])
@pytest.mark.parametrize("kind", ["zipf_sorted", "zipf_perm", "equal", "quant", "zeros", "weird"])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_kernel_stream_chunks(rng, chunk, kind, dtype):
    """Stream: one to many chunks per row, a last chunk shorter than k, rows whose buffer is
    compacted many times (zipf_sorted: the best tokens first; equal / zeros: ties that force the
    exact select), a NaN / +inf restart, the scalar path and repeated launches."""
    from ddtree_rtc.kernels import topk

    for vocab, ks in ((3 * chunk + 100, (1, 100, 256)), (chunk + 1, (37, 256)), (163_840, (16, 64, 256))):
        x = make_logits(rng, 4, vocab, kind).astype(dtype)
        for k in ks:
            if -(-vocab // chunk) * k > topk._STREAM_MERGE_KEYS:  # the wrapper refuses: merge too big
                continue
            check_gpu(x, k, variant="stream", chunk=chunk, repeat=2)
            check_gpu(x, k, variant="stream", chunk=chunk, offset=3)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["stream", "radix"])
@pytest.mark.parametrize("batch", [1, 8])
def test_kernel_batch_of_drafter_rows(rng, variant, batch):
    x = make_logits(rng, batch * 7, 163_840, "zipf_perm").astype(bfloat16).reshape(batch, 7, 163_840)
    for k in (64, 256 if variant == "stream" else 512):
        check_gpu(x, k, variant=variant, repeat=2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["zipf_perm", "zipf_sorted", "normal", "quant", "equal", "zeros", "weird"])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
@pytest.mark.parametrize("vocab", [4099, 163_840, 163_837])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_kernel_radix(rng, kind, dtype, vocab, batch):
    """Radix: drafter-shaped batches (depth 7) of Zipf, random and heavily tied rows, odd vocabularies
    (the element-load path), k 1..512, the default split and one-vector-step chunks (the most chunks
    per row), repeated launches (the row histograms are zeroed again), NaN-filled outputs."""
    if batch == 32 and (vocab != 163_840 or kind not in ("zipf_perm", "quant")):
        pytest.skip("batch 32: the two main kinds on the drafter vocabulary only (the reference is slow)")
    x = make_logits(rng, batch * 7, vocab, kind).astype(dtype).reshape(batch, 7, vocab)
    for k in (1, 16, 64, 256, 512):
        want = topk_logprobs(x, k)
        check_gpu(x, k, want, variant="radix", repeat=2)
        if k in (64, 512):
            check_gpu(x, k, want, variant="radix", vectors=256)
            check_gpu(x, k, want, variant="radix", vectors=1280, offset=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_kernel_radix_ties_and_overflow(rng, dtype):
    """Radix: the threshold bin holds far more than the 8192-key buffer (few distinct values, one
    value everywhere, one finite value among -inf, ties at the k-th value across groups and chunks),
    and rows with fewer vectors than k."""
    vocab = 163_840
    x = np.round(rng.standard_normal((6, vocab)) * 0.5)  # ~5 distinct values
    x[1] = 0.0
    x[2] = -np.inf
    x[2, vocab - 3] = 1.0
    x[3] = np.where(rng.random(vocab) < 0.01, 2.0, 1.0)  # ~1600 at the top, the rest tied just below
    x[4, ::2] = 7.0  # 81920 ties at the top
    x[5] = -1.5
    x = x.astype(dtype)
    for k in (1, 37, 64, 256, 512):
        want = topk_logprobs(x, k)
        check_gpu(x, k, want, variant="radix", repeat=2)
        check_gpu(x, k, want, variant="radix", vectors=512, offset=1)
    small = make_logits(rng, 3, 600, "quant").astype(dtype)  # 75 / 150 vectors < k = 512
    check_gpu(small, 512, variant="radix")
    check_gpu(small, 200, variant="radix", offset=3)


def test_default_variant():
    """The dispatch rule (CPU): radix up to RADIX_MAX_ROWS rows (batch 8 x depth 7) and for every
    k > 256, stream for more rows at k <= 256."""
    from ddtree_rtc.kernels.topk import RADIX_MAX_ROWS, default_variant

    assert RADIX_MAX_ROWS == 8 * 7
    assert default_variant(7, 16) == default_variant(56, 256) == "radix"
    assert default_variant(57, 256) == default_variant(32 * 7, 16) == "stream"
    assert default_variant(32 * 7, 257) == default_variant(64 * 7, 512) == "radix"


@pytest.mark.gpu
def test_kernel_default_variant():
    from ddtree_rtc.kernels.topk import topk_workspace

    assert topk_workspace((8, 7, 163_840), 64).variant == "radix"
    assert topk_workspace((32, 7, 163_840), 256).variant == "stream"
    assert topk_workspace((32, 7, 163_840), 512).variant == "radix"
    assert topk_workspace((1, 2**27), 64, variant="stream").chunks * 64 <= 6144  # larger chunks keep the merge
    assert topk_workspace((2, 7, 163_840), 64, variant="stream").variant == "stream"


@pytest.mark.gpu
def test_kernel_rejects_bad_input():
    import cupy

    from ddtree_rtc.kernels.topk import _STREAM_STEP, topk_workspace
    from ddtree_rtc.kernels.topk import topk_logprobs as gpu_topk

    x = cupy.zeros((4, 1000), dtype=cupy.float32)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        gpu_topk(cupy.zeros((4, 100), dtype=cupy.float32), 101)
    with pytest.raises(ValueError, match="out of range"):
        gpu_topk(x, 513)
    with pytest.raises(TypeError, match="bf16 .uint16 bits. or float32"):
        gpu_topk(x.astype(cupy.float16), 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        gpu_topk(cupy.zeros((1000, 4), dtype=cupy.float32).T, 4)
    with pytest.raises(ValueError, match="workspace: made for"):
        gpu_topk(x, 4, workspace=topk_workspace((4, 1000), 8))
    with pytest.raises(ValueError, match="out_logq: expected shape"):
        gpu_topk(x, 4, out_logq=cupy.empty((4, 5), dtype=cupy.float32))
    with pytest.raises(ValueError, match="variant='heap'"):
        topk_workspace((4, 1000), 4, variant="heap")
    with pytest.raises(ValueError, match="k <= 256"):
        topk_workspace((4, 1000), 300, variant="stream")
    with pytest.raises(ValueError, match="chunk=1000"):
        topk_workspace((4, 1000), 4, variant="stream", chunk=1000)
    with pytest.raises(ValueError, match="exceed the merge buffer"):
        topk_workspace((1, 327_680), 256, variant="stream", chunk=_STREAM_STEP)
    with pytest.raises(ValueError, match="vectors belongs"):
        topk_workspace((4, 1000), 4, variant="stream", vectors=256)
    with pytest.raises(ValueError, match="vectors=300 .* for 'radix'"):
        topk_workspace((4, 1000), 4, variant="radix", vectors=300)
    with pytest.raises(ValueError, match="chunk belongs"):
        topk_workspace((4, 1000), 4, variant="radix", chunk=8192)
    with pytest.raises(ValueError, match="at most 65535"):
        topk_workspace((65536, 10), 4, variant="radix")
