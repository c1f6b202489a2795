import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.reference.rmsnorm import rmsnorm as ref_rmsnorm
from ddtree_rtc.testing import assert_close, nan_bf16_bits, random_bf16, to_device_bf16

# rows in registers (16-byte vectors, a block <= 8192 / a warp <= 1024 elements) and past them (8200, odd)
SHAPES = [(1, 7168), (3, 512), (5, 1536), (17, 128), (2, 3, 100), (33, 7), (4, 2051), (2, 2048), (2, 8200),
          (1, 1032)]


def f64_rmsnorm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_vs_float64(rng, shape):
    x, w = random_bf16(rng, shape), random_bf16(rng, shape[-1:])
    assert_close(ref_rmsnorm(x, w, 1e-5), f64_rmsnorm(x, w, 1e-5), "bf16")
    r = random_bf16(rng, shape)
    y, h = ref_rmsnorm(x, w, 1e-6, residual=r)
    h64 = (x.astype(np.float64) + r.astype(np.float64)).astype(bfloat16)
    assert_close(h, h64, "bf16", "residual_out")
    assert_close(y, f64_rmsnorm(h64, w, 1e-6), "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_vs_reference(rng, shape, with_residual):
    from ddtree_rtc.kernels.rmsnorm import rmsnorm

    x, w, r = random_bf16(rng, shape, 3.0), random_bf16(rng, shape[-1:]), random_bf16(rng, shape)
    out = nan_bf16_bits(shape)
    if with_residual:
        r_out = nan_bf16_bits(shape)
        y, h = rmsnorm(to_device_bf16(x), to_device_bf16(w), 1e-5, residual=to_device_bf16(r),
                       out=out, residual_out=r_out)
        y_ref, h_ref = ref_rmsnorm(x, w, 1e-5, residual=r)
        assert_close(h, h_ref, "bf16", "residual_out")
    else:
        y = rmsnorm(to_device_bf16(x), to_device_bf16(w), 1e-5, out=out)
        y_ref = ref_rmsnorm(x, w, 1e-5)
    assert y is out
    assert_close(y, y_ref, "bf16")


@pytest.mark.gpu
def test_kernel_in_place_residual(rng):
    from ddtree_rtc.kernels.rmsnorm import rmsnorm

    x, w, r = random_bf16(rng, (9, 7168)), random_bf16(rng, (7168,)), random_bf16(rng, (9, 7168))
    dr = to_device_bf16(r)
    y, h = rmsnorm(to_device_bf16(x), to_device_bf16(w), 1e-5, residual=dr, residual_out=dr)
    y_ref, h_ref = ref_rmsnorm(x, w, 1e-5, residual=r)
    assert h is dr
    assert_close(h, h_ref, "bf16", "residual_out")
    assert_close(y, y_ref, "bf16")


@pytest.mark.gpu
def test_kernel_rejects_bad_input():
    import cupy

    from ddtree_rtc.kernels.rmsnorm import rmsnorm

    x = cupy.zeros((4, 64), dtype=cupy.uint16)
    with pytest.raises(ValueError, match="weight: expected shape"):
        rmsnorm(x, cupy.zeros((32,), dtype=cupy.uint16), 1e-5)
    with pytest.raises(TypeError, match="x: expected dtype bf16"):
        rmsnorm(x.astype(cupy.float32), cupy.zeros((64,), dtype=cupy.uint16), 1e-5)
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm(cupy.zeros((64, 4), dtype=cupy.uint16).T, cupy.zeros((64,), dtype=cupy.uint16), 1e-5)
