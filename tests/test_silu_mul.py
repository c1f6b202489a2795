import numpy as np
import pytest

from ddtree_rtc.reference.silu_mul import silu_mul as ref_silu_mul
from ddtree_rtc.testing import assert_close, nan_bf16_bits, random_bf16, to_device_bf16

SHAPES = [(1, 2 * 2048), (3, 2 * 18432), (5, 2 * 7), (2, 3, 2 * 100), (4, 2), (17, 2 * 24)]


def f64_silu_mul(x):
    i = x.shape[-1] // 2
    g, u = x[..., :i].astype(np.float64), x[..., i:].astype(np.float64)
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_vs_float64(rng, shape):
    x = random_bf16(rng, shape, 4.0)
    x.reshape(-1)[:3] = np.float32([-100.0, 100.0, -30.0])  # saturated gates
    assert_close(ref_silu_mul(x), f64_silu_mul(x), "bf16")


def test_reference_rejects_odd_width(rng):
    with pytest.raises(ValueError, match="last dim must be even"):
        ref_silu_mul(random_bf16(rng, (2, 7)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_vs_reference(rng, shape):
    from ddtree_rtc.kernels.silu_mul import silu_mul

    x = random_bf16(rng, shape, 4.0)
    x.reshape(-1)[:3] = np.float32([-100.0, 100.0, -30.0])
    out = nan_bf16_bits((*shape[:-1], shape[-1] // 2))
    got = silu_mul(to_device_bf16(x), out=out)
    assert got is out
    assert_close(got, ref_silu_mul(x), "bf16")


@pytest.mark.gpu
def test_kernel_bad_input():
    import cupy

    from ddtree_rtc.kernels.silu_mul import silu_mul

    with pytest.raises(ValueError, match="last dim must be even"):
        silu_mul(cupy.zeros((2, 7), dtype=cupy.uint16))
    with pytest.raises(TypeError, match="x: expected dtype bf16"):
        silu_mul(cupy.zeros((2, 8), dtype=cupy.float32))
    assert silu_mul(cupy.zeros((0, 8), dtype=cupy.uint16)).shape == (0, 4)
