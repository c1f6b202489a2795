"""The backend's op table: every op has a CUDA wrapper and a numpy reference taking the same arguments,
so model code calls ``backend.<op>(...)`` the same way on either."""

import importlib
import inspect

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
