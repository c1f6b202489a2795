import math

import numpy as np
import pytest

from ddtree_rtc.reference.rope import rope as ref_rope
from ddtree_rtc.reference.rope import rope_inv_freq, yarn_mscale
from ddtree_rtc.testing import assert_close, random_bf16

K26_YARN = {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def yarn_f64(dim, theta, factor, orig, beta_fast, beta_slow):
    """DESIGN.md section 2, literally, in float64."""
    i = np.arange(dim // 2, dtype=np.float64)
    f = theta ** (-2 * i / dim)

    def cd(r):
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(theta))

    low, high = math.floor(cd(beta_fast)), math.ceil(cd(beta_slow))
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0, 1)
    return f / factor * ramp + f * (1 - ramp)


def test_plain_inv_freq():
    for dim, theta in ((64, 50000.0), (128, 1e6), (6, 10000.0)):
        want = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        got = rope_inv_freq(dim, theta, None)
        assert got.dtype == np.float32
        assert_close(got, want, "fp32")
        assert np.array_equal(rope_inv_freq(dim, theta, {"rope_type": "default"}), got)


@pytest.mark.parametrize("dim,theta,factor,orig,bf,bs", [
    (64, 50000.0, 64, 4096, 32, 1),      # K2.6 MLA rope
    (128, 50000.0, 64, 4096, 32, 1),     # the drafter's rotate-half rope
    (64, 10000.0, 40, 4096, 32, 1),      # DeepSeek-V3
    (96, 1e6, 4, 32768, 16, 2),
])
def test_yarn_inv_freq_matches_design_formula(dim, theta, factor, orig, bf, bs):
    cfg = {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig, "beta_fast": bf,
           "beta_slow": bs}
    want = yarn_f64(dim, theta, factor, orig, bf, bs)
    assert_close(rope_inv_freq(dim, theta, cfg), want, "fp32")


def test_yarn_k26_ramp_edges():
    f = 50000.0 ** (-np.arange(32) * 2 / 64)
    got = rope_inv_freq(64, 50000.0, K26_YARN).astype(np.float64)
    # cd(32) = 8.9 -> low 8, cd(1) = 19.2 -> high 20: pure extrapolation below 8, /64 from 20 on
    assert_close(got[:9], f[:9], "fp32")
    assert_close(got[20:], f[20:] / 64, "fp32")
    assert np.all(np.diff(got) < 0)


def test_yarn_mscale_and_k26_softmax_scale():
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0
    assert math.isclose(yarn_mscale(64), 1 + 0.1 * math.log(64))
    assert math.isclose(yarn_mscale(64, 0.707), 1 + 0.0707 * math.log(64))
    assert math.isclose(192 ** -0.5 * yarn_mscale(64) ** 2, 0.14467963, rel_tol=1e-7)


def test_inv_freq_bad_config():
    with pytest.raises(ValueError, match="'linear' is not supported"):
        rope_inv_freq(64, 1e4, {"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="needs 'original_max_position_embeddings'"):
        rope_inv_freq(64, 1e4, {"type": "yarn", "factor": 2})
    with pytest.raises(ValueError, match="positive even"):
        rope_inv_freq(63, 1e4)


def rotate_f64(x, positions, inv_freq, off, rd, layout, scale):
    """Rotation as complex multiplication in float64 (angle = fp32(pos) * inv_freq in fp32)."""
    x = x.astype(np.float64).reshape(x.shape[0], -1, x.shape[-1]).copy()
    angle = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    rot = (scale * np.exp(1j * angle))[:, None, :]
    seg = x[..., off:off + rd]
    h = rd // 2
    if layout == "interleaved":
        c = (seg[..., 0::2] + 1j * seg[..., 1::2]) * rot
        seg[..., 0::2], seg[..., 1::2] = c.real, c.imag
    else:
        c = (seg[..., :h] + 1j * seg[..., h:]) * rot
        seg[..., :h], seg[..., h:] = c.real, c.imag
    return x


CASES = [  # shape, rot_offset, rot_dim, layout
    ((3, 64, 64), 0, 64, "interleaved"),     # MLA q_pe
    ((5, 7, 192), 128, 64, "interleaved"),   # q = [nope 128 | pe 64]
    ((4, 576), 512, 64, "interleaved"),      # k_pe inside the latent cache row, one head
    ((2, 64, 128), 0, 128, "half"),          # the drafter
    ((9, 3, 10), 3, 6, "half"),              # odd heads, odd offset
    ((6, 5, 11), 1, 8, "interleaved"),       # odd offset: no paired accesses
    ((1, 1, 2), 0, 2, "half"),
]


@pytest.mark.parametrize("shape,off,rd,layout", CASES)
def test_reference_vs_complex_rotation(rng, shape, off, rd, layout):
    x = random_bf16(rng, shape)
    pos = rng.integers(0, 200_000, shape[0]).astype(np.int32)
    inv = rope_inv_freq(rd, 50000.0, K26_YARN if rd == 64 else None)
    scale = 1.0 + 0.1 * math.log(64) if layout == "half" else 1.0
    want = rotate_f64(x, pos, inv, off, rd, layout, scale).reshape(shape)
    before = x.copy()
    got = ref_rope(x, pos, inv, off, rd, layout, scale)
    assert got is x
    assert_close(got, want, "bf16")
    keep = np.ones(shape[-1], bool)
    keep[off:off + rd] = False
    assert np.array_equal(got[..., keep].view(np.uint16), before[..., keep].view(np.uint16))


def test_half_layout_is_hf_rotate_half(rng):
    x = random_bf16(rng, (4, 3, 16))
    pos = np.arange(4, dtype=np.int32) * 1000
    inv = rope_inv_freq(16, 10000.0)
    ang = (pos.astype(np.float32)[:, None] * inv[None]).astype(np.float64)
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    q = x.astype(np.float64)
    rotated = np.concatenate([-q[..., 8:], q[..., :8]], -1)
    assert_close(ref_rope(x, pos, inv, 0, 16, "half"), q * cos + rotated * sin, "bf16")


def test_interleaved_is_half_on_deinterleaved_pairs(rng):
    """MLA's interleaved k_pe vs HF's permuted rotate-half: the same rotation of permuted data."""
    x = random_bf16(rng, (5, 2, 64))
    pos = rng.integers(0, 5000, 5).astype(np.int32)
    inv = rope_inv_freq(64, 50000.0, K26_YARN)
    perm = np.concatenate([np.arange(0, 64, 2), np.arange(1, 64, 2)])
    y = ref_rope(x[..., perm].copy(), pos, inv, 0, 64, "half")
    z = ref_rope(x.copy(), pos, inv, 0, 64, "interleaved")
    assert np.array_equal(z[..., perm].view(np.uint16), y.view(np.uint16))


def test_reference_rejects_bad_args(rng):
    x = random_bf16(rng, (2, 4, 8))
    pos, inv = np.zeros(2, np.int32), np.ones(2, np.float32)
    with pytest.raises(ValueError, match="does not fit head_dim"):
        ref_rope(x, pos, inv, 6, 4, "half")
    with pytest.raises(ValueError, match="layout must be one of"):
        ref_rope(x, pos, inv, 0, 4, "gptj")
    with pytest.raises(ValueError, match="inv_freq: expected shape"):
        ref_rope(x, pos, np.ones(3, np.float32), 0, 4, "half")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,off,rd,layout", CASES)
def test_kernel_vs_reference(rng, shape, off, rd, layout):
    import cupy

    from ddtree_rtc.kernels.rope import rope

    x = random_bf16(rng, shape, 2.0)
    keep = np.ones(shape[-1], bool)
    keep[off:off + rd] = False
    x[..., keep] = np.nan  # never read: a stray read turns the rotated slice into NaN
    pos = rng.integers(0, 200_000, shape[0]).astype(np.int32)
    inv = rope_inv_freq(rd, 50000.0, K26_YARN if rd == 64 else None)
    scale = 1.25 if layout == "half" else 1.0
    n = x.size
    buf = cupy.full(n + 64, 0x7FC0, dtype=cupy.uint16)  # NaN past the end: a stray write shows
    buf[:n] = cupy.asarray(x.view(np.uint16).ravel())
    dx = buf[:n].reshape(shape)
    got = rope(dx, cupy.asarray(pos), cupy.asarray(inv), off, rd, layout, scale)
    assert got is dx
    want = ref_rope(x.copy(), pos, inv, off, rd, layout, scale)
    assert_close(got, want, "bf16")
    assert np.array_equal(got.get()[..., keep], x.view(np.uint16)[..., keep]), "bytes outside the slice changed"
    assert bool((buf[n:] == 0x7FC0).all()), "wrote past the end of x"


@pytest.mark.gpu
def test_kernel_rejects_bad_input():
    import cupy

    from ddtree_rtc.kernels.rope import rope

    x = cupy.zeros((2, 4, 8), dtype=cupy.uint16)
    pos, inv = cupy.zeros(2, dtype=cupy.int32), cupy.ones(2, dtype=cupy.float32)
    with pytest.raises(TypeError, match="positions: expected dtype int32"):
        rope(x, pos.astype(cupy.int64), inv, 0, 4, "half")
    with pytest.raises(ValueError, match="does not fit head_dim"):
        rope(x, pos, inv, 6, 4, "half")
    with pytest.raises(ValueError, match="inv_freq: expected shape"):
        rope(x, pos, cupy.ones(3, dtype=cupy.float32), 0, 4, "half")
