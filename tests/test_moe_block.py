"""The fused MoE layer (cuda_src/moe_block.cu: the small-M path's MoE layer in one launch). CPU: its
numpy twin is the composition of the separate small-M references (bitwise: one rank, an expert shard,
the fp32 partials of a tensor-parallel rank, grouped routing). GPU: the kernel against its twin (NaN-
prefilled outputs and scratch, odd M, tokens at a routing near-tie left out), and bit for bit against
the separate small-M kernels at one rank's TP8 and EP8 share of K2.6."""

import os

import numpy as np
import pytest
from test_moe_layer import make_layer
from test_moe_routing import f64_route

from ddtree_rtc.backend import Backend
from ddtree_rtc.model.moe import MoELayerWeights, RoutingConfig, fused_layer_fits, moe
from ddtree_rtc.reference.moe_block import moe_block_small
from ddtree_rtc.testing import assert_close, random_bf16

K26 = RoutingConfig(384, 8, 1, 1, True, 2.827)
GROUPED = RoutingConfig(64, 6, 8, 3, True, 1.5)


def _seeded(name):
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{name} seed={seed}")
    return np.random.default_rng(seed)


def _shard(ex, lo: int, n: int):
    """Experts lo .. lo + n - 1 of compressed experts ``ex`` (an expert-parallel rank's)."""
    from ddtree_rtc.model.int4_repack import Int4Experts

    return Int4Experts(ex.layout, n, ex.hidden, ex.intermediate, ex.w13[lo:lo + n], ex.w13_scale[lo:lo + n],
                       ex.w2[lo:lo + n], ex.w2_scale[lo:lo + n])


def _fused_args(lw, rc):
    return (lw.gate_weight, lw.e_score_correction_bias, lw.shared_w13, lw.shared_w2, lw.experts, rc.top_k,
            rc.n_group, rc.topk_group, rc.norm_topk_prob, rc.routed_scaling_factor, lw.expert_offset)


@pytest.mark.parametrize("rc,shard,parts", [(GROUPED, None, False), (GROUPED, (16, 32), False), (GROUPED, None, True),
                                            (RoutingConfig(16, 4, 4, 2, True, 2.5), None, False)])
def test_twin_is_the_separate_small_path(rc, shard, parts):
    """The numpy twin equals moe(..., small=True) (the separate small-M steps) bit for bit."""
    rng = _seeded("moe twin")
    h, i, i_s = 256, 128, 128
    ex, gate, bias, w13, w2 = make_layer(rng, rc.num_experts, h, i, i_s)
    lo = 0
    if shard:
        lo, n = shard
        ex = _shard(ex, lo, n)
    lw = MoELayerWeights(gate, bias, ex, w13, w2, lo)
    assert fused_layer_fits(lw)
    be = Backend("numpy")
    x = random_bf16(rng, (7, h))
    if parts:
        a, b = np.full((2, 7, h), np.nan, np.float32), np.full((2, 7, h), np.nan, np.float32)
        moe(x, lw, rc, be, out=a[0], shared_out=a[1], small=True)
        moe_block_small(x, *_fused_args(lw, rc), out=b[0], shared_out=b[1])
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    else:
        want = moe(x, lw, rc, be, small=True)
        got = moe_block_small(x, *_fused_args(lw, rc))
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("plus", [False, True])
def test_prologue_twin_is_to_bf16_rmsnorm_then_the_layer(plus):
    """With a prologue (a tensor-parallel rank) the twin equals the unfused path's to_bf16 + rmsnorm and
    then the separate small-M steps into the fp32 partials, bit for bit: both partials, x and the new
    residual."""
    from ddtree_rtc.reference.rmsnorm import NormPrologue

    rng = _seeded("moe prologue twin")
    rc, h = GROUPED, 256
    ex, gate, bias, w13, w2 = make_layer(rng, rc.num_experts, h, 128, 128)
    lw = MoELayerWeights(gate, bias, ex, w13, w2, 0)
    be = Backend("numpy")
    pro = NormPrologue(rng.standard_normal((7, h)).astype(np.float32),
                       rng.standard_normal((7, h)).astype(np.float32) if plus else None,
                       random_bf16(rng, (7, h)), random_bf16(rng, (h,), 1.0), 1e-5)
    a, b = np.full((2, 7, h), np.nan, np.float32), np.full((2, 7, h), np.nan, np.float32)
    _, x, r = moe_block_small(None, *_fused_args(lw, rc), out=b[0], shared_out=b[1], prologue=pro)
    x_sep, r_sep = be.rmsnorm(be.to_bf16(pro.sum, plus_rounded=pro.plus), pro.weight, pro.eps, residual=pro.residual)
    moe(x_sep, lw, rc, be, out=a[0], shared_out=a[1], small=True)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(x.view(np.uint16), x_sep.view(np.uint16)) and np.array_equal(r.view(np.uint16),
                                                                                        r_sep.view(np.uint16))
    with pytest.raises(ValueError, match="prologue"):
        moe_block_small(x_sep, *_fused_args(lw, rc), out=b[0], shared_out=b[1], prologue=pro)


def test_layers_the_fused_kernel_does_not_take():
    rng = _seeded("fits")
    ex, gate, bias, w13, w2 = make_layer(rng, 16, 128, 128, 128)
    assert fused_layer_fits(MoELayerWeights(gate, bias, ex, w13, w2))
    assert not fused_layer_fits(MoELayerWeights(gate, bias, ex))  # no shared expert
    assert not fused_layer_fits(MoELayerWeights(gate.astype(np.float32), bias, ex, w13, w2))  # an fp32 router
    with pytest.raises(ValueError, match="fused layer runs only"):
        moe(random_bf16(rng, (2, 128)), MoELayerWeights(gate, bias, ex), RoutingConfig(16, 4), Backend("numpy"),
            small=True, block_plan=None)


MS = (1, 3, 17, 33, 64)


def _nan(a):
    a.fill(np.nan if a.dtype == np.float32 else (0x7FC0 if a.dtype == np.uint16 else -1))
    return a


def _run_fused(be, x, lw, rc, parts):
    import cupy

    m, h = x.shape
    e = lw.gate_weight.shape[0]
    plan = be.moe_block_plan(m, e, lw.experts.num_experts, rc.top_k, h, lw.experts.intermediate,
                             lw.shared_w2.shape[1], rc.n_group, parts)
    for buf in (plan.logits, plan.hs, plan.ids, plan.topk_w, plan.shared, plan.h):
        _nan(buf)
    if parts:
        out = _nan(cupy.empty((2, m, h), cupy.float32))
        be.moe_block_small(x, *_fused_args(lw, rc), out=out[0], shared_out=out[1], plan=plan)
        return out.get()
    return be.moe_block_small(x, *_fused_args(lw, rc), out=_nan(cupy.empty((m, h), cupy.uint16)), plan=plan).get()


def _run_separate(be, x, lw, rc, parts):
    import cupy

    m, h = x.shape
    plan = be.moe_small_plan(m, lw.experts.num_experts, rc.top_k, h, lw.experts.intermediate)
    if parts:
        out = _nan(cupy.empty((2, m, h), cupy.float32))
        moe(x, lw, rc, be, plan=plan, out=out[0], shared_out=out[1], small=True)
        return out.get()
    return moe(x, lw, rc, be, plan=plan, small=True).get()


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ep8-like", "grouped"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("parts", [False, True])
def test_fused_moe_vs_twin(config, m, parts):
    """Against the numpy twin: a 384-expert router over 48 local experts of K2.6's hidden size and the
    TP8 expert intermediate (the rest of the router's ids out of this shard), and a grouped router
    over 64. Tokens whose expert choice is a near-tie are left out (the twin sums the router in
    float64)."""
    rng = _seeded(f"fused moe twin {config} M={m}")
    if config == "ep8-like":
        rc, (h, i, i_s), lo, n = K26, (7168, 256, 256), 48, 48
    else:
        rc, (h, i, i_s), lo, n = GROUPED, (512, 256, 256), 0, 64
    ex, gate, bias, w13, w2 = make_layer(rng, n, h, i, i_s)
    gate = random_bf16(rng, (rc.num_experts, h), 1 / np.sqrt(h))
    bias = rng.uniform(-0.2, 0.2, rc.num_experts).astype(np.float32)
    x = random_bf16(rng, (m, h))
    logits = (x.astype(np.float64) @ gate.astype(np.float64).T).astype(np.float32)
    *_, margin = f64_route(logits, bias, rc.top_k, rc.n_group, rc.topk_group, True, 1.0)
    clear = margin > 1e-4
    ref = MoELayerWeights(gate, bias, ex, w13, w2, lo)
    if parts:
        want = np.stack([np.empty((m, h), np.float32)] * 2)
        moe_block_small(x, *_fused_args(ref, rc), out=want[0], shared_out=want[1])
    else:
        want = np.asarray(moe_block_small(x, *_fused_args(ref, rc))).view(np.uint16)
    from ddtree_rtc.model.int4_repack import prepare_experts

    be = Backend("cuda")
    d = be.asarray
    lw = MoELayerWeights(d(gate), d(bias), prepare_experts(ex, be), d(w13), d(w2), lo)
    got = _run_fused(be, d(x), lw, rc, parts)
    if parts:
        assert_close(got[0][clear], want[0][clear], "fp32_accum", "routed partial")
        assert_close(got[1], want[1], "fp32_accum", "shared partial")
    else:
        assert_close(got[clear], want[clear], "bf16_accum", "y")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", ["tp8", "ep8", "grouped64"])
@pytest.mark.parametrize("parts", [False, True])
def test_fused_moe_is_bitwise_the_separate_kernels(shard, parts):
    """One rank's share of K2.6's MoE layer (TP8: 384 experts of intermediate 256; EP8: 48 whole experts
    of the router's 384, the others' ids out of range), and a grouped router over 64 (routed by the
    kernel's 384-expert routing, by moe_route_e64 on the separate path): the fused layer gives the
    separate small-M kernels' bits, for M = 1, 3, 17, 33, 64, bf16 and as the fp32 partials."""
    import cupy

    from ddtree_rtc.bench.moe import int4_experts_device

    rng = _seeded(f"fused moe bitwise {shard}")
    be = Backend("cuda")
    h, i_s = 7168, 256
    rc = GROUPED if shard == "grouped64" else K26
    local, inter, lo = {"tp8": (384, 256, 0), "ep8": (48, 2048, 96), "grouped64": (64, 256, 0)}[shard]
    gate = be.asarray(random_bf16(rng, (rc.num_experts, h), 1 / np.sqrt(h)))
    bias = cupy.asarray(rng.uniform(-0.2, 0.2, rc.num_experts).astype(np.float32))
    w13 = be.asarray(random_bf16(rng, (2 * i_s, h), 1 / np.sqrt(h)))
    w2 = be.asarray(random_bf16(rng, (h, i_s), 1 / np.sqrt(i_s)))
    lw = MoELayerWeights(gate, bias, int4_experts_device(local, h, inter, int(rng.integers(1 << 30))), w13, w2, lo)
    x = be.asarray(random_bf16(rng, (64, h)))
    for m in MS:
        xi = cupy.ascontiguousarray(x[:m])
        got, want = _run_fused(be, xi, lw, rc, parts), _run_separate(be, xi, lw, rc, parts)
        assert np.isfinite(got).all() if parts else (got != 0x7FC0).all(), f"M={m}: outputs left unwritten"
        bits = np.uint32 if parts else np.uint16
        assert np.array_equal(got.view(bits), want.view(bits)), \
            f"M={m}: the fused layer differs from the separate small-M kernels"
        if not parts:  # one rank: the layer ending with the decoder's next residual norm
            resid, norm_w = be.asarray(random_bf16(rng, (m, h))), be.asarray(random_bf16(rng, (h,), 1.0))
            y, r = be.moe_block_small(xi, *_fused_args(lw, rc), residual=resid, norm_weight=norm_w, norm_eps=1e-5)
            y_sep, r_sep = be.rmsnorm(cupy.asarray(want), norm_w, 1e-5, residual=resid)
            assert np.array_equal(y.get(), y_sep.get()) and np.array_equal(r.get(), r_sep.get()), f"M={m}: norm"


@pytest.mark.gpu
@pytest.mark.parametrize("plus", [False, True])
def test_fused_moe_prologue_is_bitwise_to_bf16_and_rmsnorm(plus):
    """The prologue phase at one rank's TP8 share of K2.6's MoE layer, for M = 1, 3, 17, 33, 64: x and
    the new residual (NaN-prefilled buffers) the same bits as the separate to_bf16 + rmsnorm kernels on
    the same all-reduced sum, and the layer's fp32 partials the same bits as the layer run on that x."""
    import cupy

    from ddtree_rtc.bench.moe import int4_experts_device
    from ddtree_rtc.reference.rmsnorm import NormPrologue

    rng = _seeded("fused moe prologue")
    be = Backend("cuda")
    h, i_s, rc = 7168, 256, K26
    gate = be.asarray(random_bf16(rng, (rc.num_experts, h), 1 / np.sqrt(h)))
    bias = cupy.asarray(rng.uniform(-0.2, 0.2, rc.num_experts).astype(np.float32))
    w13 = be.asarray(random_bf16(rng, (2 * i_s, h), 1 / np.sqrt(h)))
    w2 = be.asarray(random_bf16(rng, (h, i_s), 1 / np.sqrt(i_s)))
    lw = MoELayerWeights(gate, bias, int4_experts_device(384, h, 256, int(rng.integers(1 << 30))), w13, w2, 0)
    for m in MS:
        pro = NormPrologue(cupy.asarray(rng.standard_normal((m, h)).astype(np.float32)),
                           cupy.asarray(rng.standard_normal((m, h)).astype(np.float32)) if plus else None,
                           be.asarray(random_bf16(rng, (m, h))), be.asarray(random_bf16(rng, (h,), 1.0)), 1e-5,
                           _nan(cupy.empty((m, h), cupy.uint16)), _nan(cupy.empty((m, h), cupy.uint16)))
        plan = be.moe_block_plan(m, rc.num_experts, 384, rc.top_k, h, 256, i_s, rc.n_group, True)
        got = _nan(cupy.empty((2, m, h), cupy.float32))
        _, x, r = be.moe_block_small(None, *_fused_args(lw, rc), out=got[0], shared_out=got[1], plan=plan,
                                     prologue=pro)
        x_sep, r_sep = be.rmsnorm(be.to_bf16(pro.sum, plus_rounded=pro.plus), pro.weight, pro.eps,
                                  residual=pro.residual)
        assert np.array_equal(x.get(), x_sep.get()), f"M={m}: x differs from to_bf16 + rmsnorm's"
        assert np.array_equal(r.get(), r_sep.get()), f"M={m}: the new residual differs from to_bf16 + rmsnorm's"
        want = _nan(cupy.empty((2, m, h), cupy.float32))
        be.moe_block_small(x_sep, *_fused_args(lw, rc), out=want[0], shared_out=want[1], plan=plan)
        assert np.isfinite(got.get()).all(), f"M={m}: outputs left unwritten"
        assert np.array_equal(got.get().view(np.uint32), want.get().view(np.uint32)), f"M={m}: the partials differ"
