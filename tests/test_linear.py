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


# clusters of 1, 2, 4, 8 CTAs of linear.cu's / skinny_pair.cuh's 8-row entries that fit at once on an
# H100 (132 SMs, 2 CTAs per SM; 62 and 30 from cuOccupancyMaxActiveClusters, benchmarks/README.md)
_H100_CLUSTERS = {1: 264, 2: 132, 4: 62, 8: 30}


def test_one_wave_plan_moves_only_a_plan_with_a_tail_wave():
    """A plan whose clusters fit at once stays; q_a + kv_a's (8, 8) (33 clusters of 8 against 30)
    moves to its nearest fitting plan (8, 4); a grid that no plan fits in one wave (the lm_head's 320
    clusters at warps_n 8) keeps its plan; a GPU with room for everything changes nothing."""
    from ddtree_rtc.kernels.linear import one_wave_plan, skinny_plan

    shapes = {"qkv_a": (1536 + 576, 7168), "moe_dense": (384 + 512, 7168), "q_b": (1536, 1536),
              "o_proj": (7168, 1024), "dense_w13": (4608, 7168), "dense_w2": (7168, 2304), "lm_head": (20480, 7168)}
    for name, (n, k) in shapes.items():
        today = skinny_plan(8, n, k, 132)
        roomy = one_wave_plan(n, k, 132, lambda s: 10**6)
        assert (roomy.warps_n, roomy.split) == (today.warps_n, today.split), name
        got = one_wave_plan(n, k, 132, _H100_CLUSTERS.get)
        clusters = -(-n // (8 * got.warps_n))
        if name == "qkv_a":
            assert (today.warps_n, today.split, -(-n // (8 * today.warps_n))) == (8, 8, 33)
            assert (got.warps_n, got.split) == (8, 4) and got.grid == 33 * 4
        elif name == "lm_head":
            assert (got.warps_n, got.split) == (today.warps_n, today.split) and clusters > _H100_CLUSTERS[got.split]
        else:
            assert (got.warps_n, got.split) == (today.warps_n, today.split), name
        if name != "lm_head":
            assert clusters <= _H100_CLUSTERS[got.split], name
    # nothing fits: today's plan, not the cost model's pick under some other rule
    tight = one_wave_plan(2112, 7168, 132, lambda s: 1)
    assert (tight.warps_n, tight.split) == (8, 8)


def test_pair_plan_asks_only_the_8_row_entries_so_every_bucket_launches_one_plan(monkeypatch):
    """The capacity comes from the pair's 8-row entries (compiled ones) whatever M is, once per
    (device, entry); every token bucket then launches the same (warps_n, split), so a row's sums
    (fixed by warps_n, split and K) agree across M = 1..64."""
    from ddtree_rtc.kernels import linear as lin
    from ddtree_rtc.kernels.registry import SPECS

    asked = []

    def stub(device_id, family, entry, split):
        asked.append((device_id, family, entry, split))
        return _H100_CLUSTERS[split]

    monkeypatch.setattr(lin, "active_clusters", stub)
    monkeypatch.setattr(lin, "sm_count", lambda device_id=None: 132)
    lin.pair_plan.cache_clear()
    try:
        plan = lin.pair_plan(1536 + 576, 7168, 0, "mla_small", "mla_qkv_a_small")
        assert (plan.warps_n, plan.split) == (8, 4)
        assert asked and all(e == f"mla_qkv_a_small_m8_s{s}" and d == 0 and f == "mla_small"
                             for d, f, e, s in asked)
        assert {e for _, _, e, _ in asked} <= set(SPECS["mla_small"].entries)
        n_asked = len(asked)
        assert lin.pair_plan(1536 + 576, 7168, 0, "mla_small", "mla_qkv_a_small") is plan
        assert len(asked) == n_asked  # cached per (shape, device, entry)
        for m in range(1, 65):
            rows = lin.token_bucket(m, "mla_qkv_a_small")
            assert f"mla_qkv_a_small_m{rows}_s{plan.split}" in SPECS["mla_small"].entries
            grid = lin.bucket_grid(1536 + 576, plan.warps_n, plan.split, rows)
            per_cta, clusters = 8 * plan.warps_n * lin.BUCKET_NTILES[rows], grid // plan.split
            assert grid % plan.split == 0 and (clusters - 1) * per_cta < 1536 + 576 <= clusters * per_cta
    finally:
        lin.pair_plan.cache_clear()


@pytest.mark.parametrize("n,k,at_once,match", [
    (0, 7168, 30, "N = 0 and K = 7168 must be >= 1"),
    (2112, 0, 30, "N = 2112 and K = 0 must be >= 1"),
    (2112, 7168, 0, "0 clusters of 8 CTAs fit at once; expected an int >= 1"),
    (2112, 7168, 2.5, "2.5 clusters of 8 CTAs fit at once; expected an int >= 1"),
    (2112, 7168, None, "None clusters of 8 CTAs fit at once; expected an int >= 1"),
])
def test_one_wave_plan_rejects_bad_input(n, k, at_once, match):
    from ddtree_rtc.kernels.linear import one_wave_plan

    with pytest.raises(ValueError, match=match):
        one_wave_plan(n, k, 132, lambda s: at_once)


# -- norm_linear: the small-M path's q_a RMSNorm and q_b in one launch (linear.cu's linear_norm_*) ------------

def test_norm_linear_reference_is_rmsnorm_then_linear(rng):
    """The numpy twin is the composition of today's references, bit for bit, into ``out`` too."""
    from ddtree_rtc.reference.linear import norm_linear
    from ddtree_rtc.reference.rmsnorm import rmsnorm

    x, g, w = random_bf16(rng, (5, 1536)), random_bf16(rng, (1536,)), random_bf16(rng, (96, 1536), 1536 ** -0.5)
    want = ref_linear(rmsnorm(x, g, 1e-6), w)
    assert np.array_equal(norm_linear(x, g, 1e-6, w).view(np.uint16), want.view(np.uint16))
    out = np.full((5, 96), np.nan, bfloat16)
    assert norm_linear(x, g, 1e-6, w, out=out) is out
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


def test_norm_linear_entries_cover_every_bucket_and_split():
    """Every (token bucket, split) the invariant plan can launch has a linear_norm entry, and the norm
    group follows the rmsnorm launch (a warp up to 1024 elements, a block above)."""
    from ddtree_rtc.kernels.linear import token_bucket
    from ddtree_rtc.kernels.registry import SPECS
    from ddtree_rtc.kernels.rmsnorm import row_group

    entries = set(SPECS["linear"].entries)
    assert {f"linear_norm_m{token_bucket(m)}_s{s}" for m in range(1, 65) for s in (1, 2, 4, 8)} <= entries
    assert [row_group(d) for d in (8, 512, 1024, 1032, 1536, 7168)] == [32, 32, 32, 256, 256, 256]


def _norm_linear_inputs(rng, m: int, n: int, k: int):
    """x [m, k], norm weight [k], weight [n, k] on the device as views whose next rows / elements are
    NaN (a read past M, K or N poisons the result), and their host copies."""
    import cupy

    x, g, w = random_bf16(rng, (m, k)), random_bf16(rng, (k,)), random_bf16(rng, (n, k), k ** -0.5)
    xb, gb, wb = (cupy.full(shape, 0x7FC0, cupy.uint16) for shape in ((m + 1) * k, k + 8, (n + 1) * k))
    xb[:m * k], gb[:k], wb[:n * k] = (to_device_bf16(a).ravel() for a in (x, g, w))
    return (x, g, w), (xb[:m * k].reshape(m, k), gb[:k], wb[:n * k].reshape(n, k))


def _two_launches(xd, gd, eps, wd):
    """Today's small-M q_a norm and q_b: the rmsnorm launch, then the invariant linear."""
    from ddtree_rtc.kernels.linear import linear
    from ddtree_rtc.kernels.rmsnorm import rmsnorm

    out = nan_bf16_bits((xd.shape[0], wd.shape[0]))
    return linear(rmsnorm(xd, gd, eps), wd, out=out, impl="invariant")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 64])  # q_b at the K2.6 TP8 shard (8 x 192 rows) and whole (64 heads)
@pytest.mark.parametrize("m", [1, 3, 5, 17, 33, 64])
def test_norm_linear_bits_equal_the_two_launches(rng, heads, m):
    """The fused launch against today's rmsnorm + invariant linear (bits), against the numpy twin, and
    each row the same bits as in a batch of 64 (NaN-prefilled outputs, NaN past every operand)."""
    from ddtree_rtc.kernels.linear import norm_linear
    from ddtree_rtc.reference.linear import norm_linear as ref_norm_linear

    n, k, eps = heads * 192, 1536, 1e-6
    (x, g, w), (xd, gd, wd) = _norm_linear_inputs(rng, 64, n, k)
    idx = rng.permutation(64)[:m]
    xs = xd[idx].copy()
    out = nan_bf16_bits((m, n))
    got = norm_linear(xs, gd, eps, wd, out=out)
    assert got is out
    assert np.array_equal(got.get(), _two_launches(xs, gd, eps, wd).get()), "bits differ from rmsnorm + linear"
    assert_close(got, ref_norm_linear(x[idx], g, eps, w), "bf16_accum")
    full = norm_linear(xd, gd, eps, wd, out=nan_bf16_bits((64, n))).get()
    assert np.array_equal(got.get(), full[idx]), f"{m} rows differ from the same rows in a batch of 64"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 40, 8), (3, 584, 1048), (5, 104, 520), (9, 8, 8200), (17, 1000, 776),
                                   (33, 13, 2056), (64, 1001, 1024), (64, 2112, 4104), (6, 12288, 1536)])
def test_norm_linear_odd_shapes(rng, m, n, k):
    """Odd M, N (partial 8-row tiles), K (partial k32 chunks; rows of one piece; a warp's and a block's
    norm; past 8192, the norm kernel's loop over pieces): bits equal the two launches, values the twin."""
    from ddtree_rtc.kernels.linear import norm_linear
    from ddtree_rtc.reference.linear import norm_linear as ref_norm_linear

    (x, g, w), (xd, gd, wd) = _norm_linear_inputs(rng, m, n, k)
    got = norm_linear(xd, gd, 1e-5, wd, out=nan_bf16_bits((m, n)))
    assert np.array_equal(got.get(), _two_launches(xd, gd, 1e-5, wd).get()), "bits differ from rmsnorm + linear"
    assert_close(got, ref_norm_linear(x, g, 1e-5, w), "bf16_accum")


@pytest.mark.gpu
def test_norm_linear_bad_input():
    import cupy

    from ddtree_rtc.kernels.linear import norm_linear

    x, g, w = (cupy.zeros(s, dtype=cupy.uint16) for s in ((65, 64), (64,), (16, 64)))
    with pytest.raises(ValueError, match="norm_linear: needs 1 <= M <= 64"):
        norm_linear(x, g, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight: expected shape"):
        norm_linear(x[:3], g[:32], 1e-6, w)
    with pytest.raises(ValueError, match=r"weight: expected \[N, 64\]"):
        norm_linear(x[:3], g, 1e-6, cupy.zeros((16, 32), dtype=cupy.uint16))
    with pytest.raises(ValueError, match="norm_linear: needs"):
        norm_linear(cupy.zeros((3, 12), dtype=cupy.uint16), cupy.zeros(12, dtype=cupy.uint16), 1e-6,
                    cupy.zeros((8, 12), dtype=cupy.uint16))


def test_invariant_plans_cover_every_split_and_hold_the_default():
    """bench linear --invariant-plans' enumeration: 16 (warps_n, split) plans a bucket, each an entry the
    linear family has, its grid the bucket's, the default invariant plan among them."""
    from ddtree_rtc.kernels import linear as lin
    from ddtree_rtc.kernels.registry import SPECS

    entries = set(SPECS["linear"].entries)
    for m, n, k in ((1, 20480, 7168), (17, 7168, 1024), (33, 1536, 1536), (64, 7168, 256)):
        plans = lin.invariant_plans(m, n, k, 132)
        assert len({(p.warps_n, p.split) for p in plans}) == 16
        for p in plans:
            assert p.entry in entries
            assert p.grid == lin.bucket_grid(n, p.warps_n, p.split, lin.token_bucket(m))
        d = lin.invariant_plan(m, n, k, 132)
        assert any((p.entry, p.grid, p.warps_n, p.split) == (d.entry, d.grid, d.warps_n, d.split) for p in plans)


def test_bench_linear_shard_shapes_and_best_plan():
    from ddtree_rtc.bench.harness import Row
    from ddtree_rtc.bench.linear import SHAPES, best_plans, shard_shapes

    tp8 = dict((name, (n, k)) for name, n, k in shard_shapes("tp8"))
    assert tp8["lm_head"] == (163840 // 8, 7168) and tp8["o_proj"] == (7168, 1024) and tp8["q_a"] == (1536, 7168)
    assert shard_shapes("none") == list(SHAPES)
    with pytest.raises(ValueError, match="shard 'ep8'"):
        shard_shapes("ep8")

    def row(wn, s, m, us, default=False):
        return Row("r", us, peer_us=10.0,
                   extra={"shape": "head", "M": m, "warps_n": wn, "split": s, "default": default})

    rows = [row(8, 1, 1, 5.0, True), row(8, 1, 33, 9.0, True), row(4, 2, 1, 4.0), row(4, 2, 33, 11.0),
            row(2, 1, 1, 6.0), row(2, 1, 33, 6.5)]
    got = best_plans(rows)["head"]
    assert got["default"] == [8, 1] and got["best"] == [2, 1]  # least summed time over M: 12.5
    assert got["best_us"] == {1: 6.0, 33: 6.5} and got["cublas_us"] == {1: 10.0, 33: 10.0}


@pytest.mark.gpu
def test_every_invariant_plan_matches_the_reference(rng):
    """What bench linear --invariant-plans launches: every (warps_n, split) plan gives the reference's
    values (another plan sums in another order: within tolerance) into a NaN-prefilled output, at odd M."""
    from ddtree_rtc.kernels import linear as lin
    from ddtree_rtc.kernels._launch import sm_count

    n, k = 1000, 1032
    w = random_bf16(rng, (n, k))
    for m in (1, 17, 33, 64):
        x = random_bf16(rng, (m, k))
        want = ref_linear(x, w)
        for plan in lin.invariant_plans(m, n, k, sm_count()):
            y = nan_bf16_bits((m, n))
            lin.launch_plan(to_device_bf16(x), to_device_bf16(w), y, plan)
            assert_close(y, want, "bf16_accum", name=f"M={m} wn{plan.warps_n} s{plan.split}")
