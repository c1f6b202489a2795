"""The backend's op table: every op has a CUDA wrapper and a numpy reference taking the same arguments,
so model code calls ``backend.<op>(...)`` the same way on either."""

import importlib
import inspect
import time

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import OPS, Backend, Op

# Kernel-only launch options with no meaning in numpy; only kernel code passes them (moe_gemm's own align).
KERNEL_ONLY = {"moe_align": {"pdl"}, "moe_route": {"selection"}}  # tuning / test knobs of the kernel alone


def _params(fn, skip=()):
    """(name, kind, default) of each parameter; annotations differ where the plan types do."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in skip]


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_and_reference_signatures_match(op):
    kern = getattr(importlib.import_module(f"ddtree_rtc.kernels.{OPS[op]}"), op)
    refm = getattr(importlib.import_module(f"ddtree_rtc.reference.{OPS[op]}"), op)
    k, r = _params(kern, KERNEL_ONLY.get(op, ())), _params(refm)
    if r and r[-1][1] is inspect.Parameter.VAR_KEYWORD:  # the reference takes the kernel's tuning knobs
        r = r[:-1]
        k = k[:len(r)]
    assert k == r, op


def test_op_table_is_real_attributes():
    """Every op is a declared class attribute (no lookup by attribute name): readers and tools find
    it on Backend, and an instance gives the implementation its kind runs."""
    be = Backend("numpy", quiet=True)
    for name, family in OPS.items():
        row = getattr(Backend, name)
        assert isinstance(row, Op) and row.family == family and name in vars(Backend)
        assert getattr(be, name) is getattr(importlib.import_module(f"ddtree_rtc.reference.{family}"), name)
        assert row.cuda == f"ddtree_rtc.kernels.{family}.{name}"
    assert not hasattr(Backend, "__getattr__")
    with pytest.raises(AttributeError):
        be.no_such_op  # noqa: B018
    with pytest.raises(KeyError, match="backend has no op 'no_such_op'"):
        be.op("no_such_op")


def _bf16_cases(rng) -> np.ndarray:
    """Random fp32 plus the rounding edge cases: ties to even both ways, NaN, +-inf, +-0, overflow."""
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1e-40], np.float32)
    ties = (np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32)).view(np.float32)  # exactly halfway
    return np.concatenate([rng.standard_normal(997).astype(np.float32) * 7, special, ties])


def test_to_bf16_rounds_to_nearest_even(rng):
    be = Backend("numpy", quiet=True)
    x = _bf16_cases(rng)
    s = rng.standard_normal(x.size).astype(np.float32)
    got = be.to_bf16(x)
    assert got.dtype == bfloat16 and np.array_equal(got.view(np.uint16), x.astype(bfloat16).view(np.uint16))
    want = (x + s.astype(bfloat16).astype(np.float32)).astype(bfloat16)
    assert np.array_equal(be.to_bf16(x, plus_rounded=s).view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
def test_to_bf16_cuda_matches_numpy(rng):
    import cupy

    be, ref = Backend("cuda"), Backend("numpy", quiet=True)
    x = _bf16_cases(rng)
    s = _bf16_cases(rng)[::-1].copy()
    for got, want in ((be.to_bf16(cupy.asarray(x)), ref.to_bf16(x)),
                      (be.to_bf16(cupy.asarray(x), plus_rounded=cupy.asarray(s)), ref.to_bf16(x, plus_rounded=s))):
        g, w = got.get(), want.view(np.uint16)
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(g.view(bfloat16).astype(np.float32)), nan)  # any NaN payload
        assert np.array_equal(g[~nan], w[~nan])


def test_copy_in_checks_the_shape():
    be = Backend("numpy", quiet=True)
    dst = be.zeros((3, 4), "int32")
    be.copy_in(dst, np.arange(12, dtype=np.int64).reshape(3, 4))
    assert dst.dtype == np.int32 and dst.ravel().tolist() == list(range(12))
    with pytest.raises(ValueError, match=r"copy_in: shape \(4, 3\) != destination \(3, 4\)"):
        be.copy_in(dst, np.zeros((4, 3)))


def _copy_cases(rng):
    """(dtype, host array) pairs: casts to the destination's dtype (int64 -> int32, float64 -> fp32),
    bf16 bits, 64-bit words, odd shapes."""
    return [("int32", rng.integers(-2**31, 2**31, 17)), ("int32", rng.integers(0, 9, (3, 33)).astype(np.int32)),
            ("uint64", rng.integers(0, 2**63, (5, 2), dtype=np.uint64)), ("fp32", rng.standard_normal((7, 9))),
            ("bf16", rng.standard_normal(65).astype(bfloat16)), ("int64", np.array([-5]))]


@pytest.mark.gpu
def test_cuda_copy_in_matches_numpy(rng):
    """Page-locked staged copies give the numpy backend's contents, the first copy into a destination
    and a later one (its staging buffer reused) alike."""
    be, ref = Backend("cuda"), Backend("numpy", quiet=True)
    for dtype, host in _copy_cases(rng):
        dst, want = be.empty(host.shape, dtype), ref.empty(host.shape, dtype)
        for values in (host, host[::-1].copy()):
            be.copy_in(dst, values)
            ref.copy_in(want, values)
            got = be.to_host(dst, bf16=False)
            assert got.dtype == (np.uint16 if dtype == "bf16" else want.dtype), dtype
            assert np.array_equal(got, want.view(np.uint16) if dtype == "bf16" else want), dtype


@pytest.mark.gpu
def test_cuda_copy_in_does_not_wait_for_the_stream():
    """Behind queued device work a copy returns at once (the host does not wait for the stream) and
    lands in stream order; a second copy into the same destination waits for the first to have read
    its staging buffer, so neither is torn."""
    import cupy

    from ddtree_rtc.testing import busy_device

    be = Backend("cuda")
    dst, other = be.zeros((4096,), "int32"), be.zeros((100,), "int32")
    first, second = np.arange(4096), np.arange(4096)[::-1].copy()
    be.copy_in(dst, first)  # the staging buffers exist before the timed calls
    be.copy_in(other, np.zeros(100, np.int64))
    busy_device()
    be.synchronize()
    t0 = time.perf_counter()
    busy_device()
    be.synchronize()
    busy_s = time.perf_counter() - t0
    assert busy_s > 2e-3, busy_s
    stream = cupy.cuda.get_current_stream()
    reader = busy_device()
    t0 = time.perf_counter()
    be.copy_in(dst, first)
    be.copy_in(other, np.full(100, 7))
    queued_s = time.perf_counter() - t0
    assert not stream.done, "the copies are queued behind the matmuls"
    t0 = time.perf_counter()
    be.copy_in(dst, second)
    again_s = time.perf_counter() - t0
    total = dst.sum() + other.sum() + reader[0, 0].astype(cupy.int32)  # read after the copies, in stream order
    be.synchronize()
    assert queued_s < busy_s / 4 < again_s, (queued_s, again_s, busy_s)
    assert np.array_equal(be.to_host(dst), second) and be.to_host(other).tolist() == [7] * 100
    assert int(total) == int(second.sum()) + 700 + 1


@pytest.mark.gpu
def test_cuda_copy_in_refuses_a_capturing_stream():
    """A captured copy would read its staging buffer at replay, after later copies wrote it: refused."""
    import cupy

    be = Backend("cuda")
    dst = be.zeros((8,), "int32")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            dst += 1  # a node, so the capture ends in a graph
            with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
                be.copy_in(dst, np.arange(8))
        finally:
            stream.end_capture()
    be.copy_in(dst, np.arange(8))
    assert be.to_host(dst).tolist() == list(range(8))
