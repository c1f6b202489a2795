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
        rmsnorm(x.astype(cupy.float16), cupy.zeros((64,), dtype=cupy.uint16), 1e-5)
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm(cupy.zeros((64, 4), dtype=cupy.uint16).T, cupy.zeros((64,), dtype=cupy.uint16), 1e-5)


def test_reference_fp32_input_is_rounding_then_norm(rng):
    """fp32 x (a TP rank's all-reduced sum, plus the MoE shared expert's): rounded as Backend.to_bf16
    rounds it (rounded_sum), then the bf16 norm, bit for bit."""
    from ddtree_rtc.reference.rmsnorm import rounded_sum

    for d in (64, 7168, 100):
        x = (rng.standard_normal((5, d)) * 3).astype(np.float32)
        s = (rng.standard_normal((5, d)) * 0.1).astype(np.float32)
        r = rng.standard_normal((5, d)).astype(bfloat16)
        w = (1 + 0.1 * rng.standard_normal(d)).astype(bfloat16)
        for plus in (None, s):
            y, h = ref_rmsnorm(x, w, 1e-6, residual=r, plus=plus)
            y2, h2 = ref_rmsnorm(rounded_sum(x, plus), w, 1e-6, residual=r)
            assert np.array_equal(y.view(np.uint16), y2.view(np.uint16))
            assert np.array_equal(h.view(np.uint16), h2.view(np.uint16))
        assert np.array_equal(ref_rmsnorm(x, w, 1e-6).view(np.uint16),
                              ref_rmsnorm(rounded_sum(x), w, 1e-6).view(np.uint16))
    with pytest.raises(TypeError, match="plus"):
        ref_rmsnorm(x.astype(bfloat16), w, 1e-6, plus=s)


@pytest.mark.gpu
def test_kernel_fp32_input_equals_rounding_then_norm(rng):
    """The _f32 entries against Backend.to_bf16 followed by the bf16 norm (the two launches they
    replace), bit for bit, and against the reference (the residual sum bit for bit, y within bf16
    tolerance as the bf16 kernel's own test): warp rows (d <= 1024) and block rows (7168),
    16-byte and scalar paths, with and without the shared part and the residual; NaN-prefilled outputs."""
    import cupy

    from ddtree_rtc.backend import Backend
    from ddtree_rtc.kernels.rmsnorm import rmsnorm

    be = Backend("cuda")
    for rows, d in ((1, 7168), (3, 7168), (17, 7168), (33, 512), (64, 1024), (5, 100), (2, 3000), (2, 8200)):
        x = (rng.standard_normal((rows, d)) * 4).astype(np.float32)
        s = (rng.standard_normal((rows, d)) * 0.2).astype(np.float32)
        r = rng.standard_normal((rows, d)).astype(bfloat16)
        w = (1 + 0.1 * rng.standard_normal(d)).astype(bfloat16)
        dx, ds, dr, dw = cupy.asarray(x), cupy.asarray(s), to_device_bf16(r), to_device_bf16(w)
        for plus in (None, s):
            dp = None if plus is None else ds
            out = cupy.full((rows, d), 0x7FC0, dtype=cupy.uint16)  # NaN
            r_out = cupy.full((rows, d), 0x7FC0, dtype=cupy.uint16)
            y, h = rmsnorm(dx, dw, 1e-6, residual=dr, out=out, residual_out=r_out, plus=dp)
            rounded = be.to_bf16(dx) if dp is None else be.to_bf16(dx, plus_rounded=dp)
            y2, h2 = rmsnorm(rounded, dw, 1e-6, residual=dr)
            assert cupy.array_equal(y, y2) and cupy.array_equal(h, h2), (rows, d, plus is None)
            y_ref, h_ref = ref_rmsnorm(x, w, 1e-6, residual=r, plus=plus)
            # the residual sum is exact (one bf16 rounding of the rounded input plus r); y's sum of
            # squares runs in another order than numpy's, so within bf16 tolerance, as the bf16 kernel
            assert np.array_equal(cupy.asnumpy(h), h_ref.view(np.uint16)), (rows, d)
            assert_close(y, y_ref, "bf16")
        out = cupy.full((rows, d), 0x7FC0, dtype=cupy.uint16)
        y = rmsnorm(dx, dw, 1e-6, out=out, plus=ds)
        y2 = rmsnorm(be.to_bf16(dx, plus_rounded=ds), dw, 1e-6)
        assert cupy.array_equal(y, y2), (rows, d)
        assert_close(y, ref_rmsnorm(x, w, 1e-6, plus=s), "bf16")
    with pytest.raises(TypeError, match="plus: only taken with fp32 x"):
        rmsnorm(to_device_bf16(r), dw, 1e-6, plus=ds)
