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


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_vs_reference(rng, m, n, k):
    from ddtree_rtc.kernels.linear import linear

    x, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    out = nan_bf16_bits((m, n))
    got = linear(to_device_bf16(x), to_device_bf16(w), out=out)
    assert got is out
    assert_close(got, ref_linear(x, w), "bf16_accum")


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


def test_kernel_and_reference_signatures_match():
    import inspect

    from ddtree_rtc.kernels import linear as kern
    from ddtree_rtc.reference import linear as refm

    for op in "linear".split(","):
        assert inspect.signature(getattr(kern, op)) == inspect.signature(getattr(refm, op)), op
