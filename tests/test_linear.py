import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.reference.linear import linear as ref_linear
from ddtree_rtc.testing import assert_close, nan_bf16_bits, random_bf16, to_device_bf16

SHAPES = [(1, 7168, 7168), (8, 576, 7168), (3, 33, 17), (64, 1001, 513), (129, 40, 96), (0, 16, 8), (2, 5, 1)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_reference_vs_float64(rng, m, n, k):
    x, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    y = ref_linear(x, w)
    assert y.dtype == bfloat16 and y.shape == (m, n)
    assert_close(y, x.astype(np.float64) @ w.astype(np.float64).T, "bf16_accum")


def test_reference_rejects_mismatch(rng):
    with pytest.raises(ValueError, match="expected x"):
        ref_linear(random_bf16(rng, (2, 3)), random_bf16(rng, (4, 5)))


def test_cublas_handle_keeps_its_workspace_on_every_stream(monkeypatch):
    """cublasSetStream resets the handle to cuBLAS's default workspace pool, which allocates on its
    own (per captured graph, kept by the graph memory pool): every call that binds a stream binds
    the persistent workspace after it, one raw allocation per handle made once, on every stream a
    capture brings (a new one each)."""
    import sys
    from types import SimpleNamespace

    from ddtree_rtc.kernels import _cublas

    calls, made = [], []

    class Lib:
        def cublasSetStream_v2(self, h, s):
            calls.append(("stream", h, s))
            return 0

        def cublasSetPointerMode_v2(self, h, mode):
            calls.append(("mode", h, mode))
            return 0

        def cublasSetWorkspace_v2(self, h, ptr, size):
            calls.append(("workspace", h, ptr, size))
            return 0

    class Memory:  # a raw device allocation, outside every pool
        def __init__(self, size):
            self.ptr, self.size = 0x1000 * (len(made) + 1), size
            made.append(self)

    stream = SimpleNamespace(ptr=0)
    cuda = SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 7), memory=SimpleNamespace(Memory=Memory),
                           get_current_stream=lambda: stream)
    pooled = []  # an array from the pool current at the first call (a graph's private pool, maybe)

    def empty(n, dtype):
        pooled.append(SimpleNamespace(data=SimpleNamespace(ptr=0x9000), nbytes=n))
        return pooled[-1]

    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda, empty=empty, uint8=np.uint8))
    monkeypatch.setattr(_cublas, "_lib", Lib)
    monkeypatch.setattr(_cublas, "_workspaces", {})
    for ptr in (11, 12, 13, 11):  # e.g. the caller's stream, then one capture stream per captured forward
        stream.ptr = ptr
        assert _cublas.handle() == 7
    bound = [i for i, c in enumerate(calls) if c[0] == "stream"]
    assert [calls[i][2] for i in bound] == [11, 12, 13, 11]
    for i, j in zip(bound, bound[1:] + [len(calls)]):  # each stream bound, then the workspace before the next
        assert [c for c in calls[i:j] if c[0] == "workspace"], f"stream {calls[i][2]}: no workspace bound after it"
    assert not pooled and len(made) == 1 and made[0].size == _cublas._WORKSPACE_BYTES
    assert {c[2:] for c in calls if c[0] == "workspace"} == {(made[0].ptr, _cublas._WORKSPACE_BYTES)}


# Skinny-kernel shapes: M in 1..16 (odd ones too), N and K odd-ish multiples of 8 (partial k32
# chunks, partial 8-row tiles), and the K2.6 decode linears.
K26_SHAPES = [(1536, 7168), (12288, 1536), (576, 7168), (7168, 8192), (4096, 7168), (7168, 2048), (384, 7168)]
SKINNY_SHAPES = ([(m, 584, 1048) for m in (1, 3, 7, 8, 9, 16)] + [(2, 8, 8), (5, 13, 24), (16, 1000, 776)]
                 + [(m, n, k) for m in (1, 7, 16) for n, k in K26_SHAPES])
IMPLS = ("auto", "skinny", "cublas")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_vs_reference(rng, m, n, k, impl):
    from ddtree_rtc.kernels.linear import linear

    x, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    out = nan_bf16_bits((m, n))
    got = linear(to_device_bf16(x), to_device_bf16(w), out=out, impl=impl)
    assert got is out
    assert_close(got, ref_linear(x, w), "bf16_accum")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ("skinny", "cublas"))
@pytest.mark.parametrize("m,n,k", SKINNY_SHAPES)
def test_skinny_vs_reference(rng, m, n, k, impl):
    from ddtree_rtc.kernels.linear import linear, route

    x, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    xd, wd = to_device_bf16(x), to_device_bf16(w)
    assert route(xd, wd, impl) == impl
    out = nan_bf16_bits((m, n))
    got = linear(xd, wd, out=out, impl=impl)
    assert got is out
    assert_close(got, ref_linear(x, w), "bf16_accum")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 576, 7168), (16, 7168, 2048), (7, 1000, 776)])
def test_skinny_deterministic(rng, m, n, k):
    from ddtree_rtc.kernels.linear import linear

    xd, wd = to_device_bf16(random_bf16(rng, (m, k))), to_device_bf16(random_bf16(rng, (n, k)))
    a = linear(xd, wd, impl="skinny").get()
    b = linear(xd, wd, out=nan_bf16_bits((m, n)), impl="skinny").get()
    assert np.array_equal(a, b)


@pytest.mark.gpu
def test_skinny_routes_to_cublas_where_it_cannot_run(rng):
    import cupy

    from ddtree_rtc.kernels.linear import linear, route

    x, w = random_bf16(rng, (3, 17)), random_bf16(rng, (33, 17))
    assert route(to_device_bf16(x), to_device_bf16(w), "skinny") == "cublas"  # K % 8 != 0
    xs, ws = random_bf16(rng, (4, 64)), random_bf16(rng, (40, 64))
    wd = to_device_bf16(ws)
    xm = cupy.empty(4 * 64 + 1, dtype=cupy.uint16)[1:].reshape(4, 64)  # contiguous, 2-byte aligned
    xm[...] = to_device_bf16(xs)
    assert xm.data.ptr % 16 != 0 and route(xm, wd, "skinny") == "cublas"
    got = linear(xm, wd, out=nan_bf16_bits((4, 40)), impl="skinny")
    assert_close(got, ref_linear(xs, ws), "bf16_accum")
    assert route(to_device_bf16(random_bf16(rng, (17, 64))), wd, "skinny") == "cublas"  # M > 16
    with pytest.raises(ValueError, match="impl="):
        linear(to_device_bf16(xs), wd, impl="fast")


@pytest.mark.gpu
def test_skinny_graph_capture(rng):
    import cupy

    from ddtree_rtc.kernels.linear import linear

    x, w = random_bf16(rng, (3, 1048)), random_bf16(rng, (584, 1048))
    xd, wd = to_device_bf16(x), to_device_bf16(w)
    out = nan_bf16_bits((3, 584))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        linear(xd, wd, out=out, impl="skinny")  # loads the module and plans outside the capture
        stream.begin_capture()
        linear(xd, wd, out=out, impl="skinny")
        graph = stream.end_capture()
        out.fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    assert_close(out, ref_linear(x, w), "bf16_accum")


@pytest.mark.gpu
def test_kernel_k_zero_and_bad_input():
    import cupy

    from ddtree_rtc.kernels.linear import linear

    y = linear(cupy.zeros((3, 0), dtype=cupy.uint16), cupy.zeros((4, 0), dtype=cupy.uint16),
               out=nan_bf16_bits((3, 4)))
    assert bool((y == 0).all())
    with pytest.raises(ValueError, match="weight: expected"):
        linear(cupy.zeros((3, 8), dtype=cupy.uint16), cupy.zeros((4, 7), dtype=cupy.uint16))
    with pytest.raises(TypeError, match="x: expected dtype bf16"):
        linear(cupy.zeros((3, 8), dtype=cupy.float32), cupy.zeros((4, 8), dtype=cupy.uint16))


@pytest.mark.parametrize("m,n,k", [(3, 33, 17), (64, 1001, 513)])
def test_reference_fp32_out_is_the_unrounded_sum(rng, m, n, k):
    """An fp32 ``out`` (a tensor-parallel partial) gets the float64 sum rounded once to fp32; the
    bf16 output is that value rounded to bf16."""
    x, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    out = np.full((m, n), np.nan, np.float32)
    got = ref_linear(x, w, out=out)
    assert got is out
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.array_equal(got, exact.astype(np.float32))
    assert np.array_equal(got.astype(bfloat16), ref_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,n,k", [(1, 7168, 1024), (7, 584, 1048), (64, 1001, 513), (3, 33, 17)])
def test_kernel_fp32_out(rng, m, n, k, impl):
    import cupy

    from ddtree_rtc.kernels.linear import linear

    x, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    out = cupy.full((m, n), np.nan, np.float32)
    got = linear(to_device_bf16(x), to_device_bf16(w), out=out, impl=impl)  # any impl: cuBLAS, fp32 C
    assert got is out
    want = np.full((m, n), np.nan, np.float32)
    assert_close(got, ref_linear(x, w, out=want), "fp32_accum")


def test_token_buckets_and_the_invariant_plan_ignore_m():
    """M picks only the entry's token rows (8, 16, 32, 64) and with them the grid; (warps_n, split)
    come from the shape alone, for the invariant linears and the skinny pairs (q_a + kv_a, router +
    shared gate_up at the K2.6 TP8 shard), and every bucket of each pair is a compiled entry of its
    family."""
    from ddtree_rtc.kernels.linear import BUCKET_NTILES, bucket_grid, invariant_plan, skinny_plan, token_bucket
    from ddtree_rtc.kernels.registry import SPECS

    assert [token_bucket(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, 64, 64]
    for bad in (0, 65):
        with pytest.raises(ValueError, match=f"moe_small_dense: M = {bad} outside 1..64"):
            token_bucket(bad, "moe_small_dense")
    pairs = (("mla_small", "mla_qkv_a_small", 1536 + 576), ("moe_small", "moe_small_dense", 384 + 512))
    for family, prefix, n in pairs:
        pair = skinny_plan(8, n, 7168, 132)
        plans = {(p.warps_n, p.split) for p in (invariant_plan(m, n, 7168, 132) for m in range(1, 65))}
        assert plans == {(pair.warps_n, pair.split)}
        for m in range(1, 65):  # the grid covers every row block once with the bucket's weight tiles a warp
            rows = token_bucket(m)
            grid = invariant_plan(m, n, 7168, 132).grid
            assert grid == bucket_grid(n, pair.warps_n, pair.split, rows)
            per_cta = 8 * pair.warps_n * BUCKET_NTILES[rows]
            assert (grid // pair.split - 1) * per_cta < n <= grid // pair.split * per_cta
        for mt in (8, 16, 32, 64):
            assert f"{prefix}_m{mt}_s{pair.split}" in SPECS[family].entries
