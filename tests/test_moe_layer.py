"""The MoE layer API ``ddtree_rtc.model.moe.moe`` on both backends, config parsing, and loading a
whole layer (router, bias, INT4 experts, shared expert) from a safetensors checkpoint."""

import numpy as np
import pytest
from ml_dtypes import bfloat16
from test_moe_gemm import loop_moe
from test_moe_quant import write_checkpoint
from test_moe_routing import f64_route

from ddtree_rtc.backend import Backend
from ddtree_rtc.model.checkpoint import CheckpointReader
from ddtree_rtc.model.int4_repack import prepare_experts, random_compressed_experts
from ddtree_rtc.model.moe import MoELayerWeights, RoutingConfig, load_moe_layer, moe
from ddtree_rtc.testing import assert_close, random_bf16

K26_TEXT = {"n_routed_experts": 384, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "n_shared_experts": 1, "moe_intermediate_size": 2048}


def test_routing_config_from_k26():
    rc = RoutingConfig.from_config({"text_config": K26_TEXT})
    assert rc == RoutingConfig(384, 8, 1, 1, True, 2.827)
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        RoutingConfig.from_config(dict(K26_TEXT, scoring_func="softmax"))
    with pytest.raises(ValueError, match="topk_method='greedy'"):
        RoutingConfig.from_config(dict(K26_TEXT, topk_method="greedy"))
    with pytest.raises(ValueError, match="missing MoE field 'num_experts_per_tok'"):
        RoutingConfig.from_config({"n_routed_experts": 8})
    with pytest.raises(ValueError, match="n_group must divide"):
        RoutingConfig(10, 2, n_group=3)


def make_layer(rng, e, h, i, i_shared):
    ex = random_compressed_experts(rng, e, h, i)
    gate = random_bf16(rng, (e, h), 1 / np.sqrt(h))
    bias = rng.uniform(-0.2, 0.2, e).astype(np.float32)
    w13 = random_bf16(rng, (2 * i_shared, h), 1 / np.sqrt(h)) if i_shared else None
    w2 = random_bf16(rng, (h, i_shared), 1 / np.sqrt(i_shared)) if i_shared else None
    return ex, gate, bias, w13, w2


def f64_layer(x, ex, gate, bias, w13, w2, rc):
    logits = (x.astype(np.float64) @ gate.astype(np.float64).T).astype(np.float32)
    ids, w, margin = f64_route(logits, bias, rc.top_k, rc.n_group, rc.topk_group, rc.norm_topk_prob,
                               rc.routed_scaling_factor)
    shared = None
    if w13 is not None:
        gu = x.astype(np.float64) @ w13.astype(np.float64).T
        i_s = w2.shape[1]
        hh = (gu[:, :i_s] / (1 + np.exp(-gu[:, :i_s])) * gu[:, i_s:]).astype(bfloat16)
        shared = (hh.astype(np.float64) @ w2.astype(np.float64).T).astype(bfloat16)
    return loop_moe(x, ids, w, ex, shared), margin


@pytest.mark.parametrize("rc,i_shared", [(RoutingConfig(12, 4, 1, 1, True, 2.5), 128),
                                         (RoutingConfig(16, 4, 4, 2, False, 1.0), 0)])
def test_numpy_moe_vs_float64(rng, rc, i_shared):
    h, i, m = 128, 128, 6
    ex, gate, bias, w13, w2 = make_layer(rng, rc.num_experts, h, i, i_shared)
    lw = MoELayerWeights(gate, bias, ex, w13, w2)
    x = random_bf16(rng, (m, h))
    y = moe(x, lw, rc, Backend("numpy"))
    want, margin = f64_layer(x, ex, gate, bias, w13, w2, rc)
    clear = margin > 1e-4  # a near tie may route differently in fp32 than in fp64
    assert clear.sum() >= m - 1
    assert y.dtype == bfloat16 and y.shape == (m, h)
    assert_close(y[clear], want[clear], "bf16_accum")


def test_layer_weights_are_checked(rng):
    ex, gate, bias, w13, w2 = make_layer(rng, 4, 128, 128, 128)
    with pytest.raises(ValueError, match=r"gate_weight: expected \[4, 128\]"):
        MoELayerWeights(gate[:2], bias, ex)
    with pytest.raises(ValueError, match="e_score_correction_bias: expected fp32"):
        MoELayerWeights(gate, bias.astype(np.float64), ex)
    with pytest.raises(ValueError, match="give both shared_w13 and shared_w2"):
        MoELayerWeights(gate, bias, ex, w13, None)
    lw = MoELayerWeights(gate, bias, ex, w13, w2)
    with pytest.raises(ValueError, match="M >= 1"):
        moe(random_bf16(rng, (0, 128)), lw, RoutingConfig(4, 2), Backend("numpy"))
    with pytest.raises(ValueError, match="routing config has 8 experts"):
        moe(random_bf16(rng, (1, 128)), lw, RoutingConfig(8, 2), Backend("numpy"))


def write_layer(tmp_path, rng, prefix, e=6, h=128, i=128, i_shared=128):
    ex, gate, bias, w13, w2 = make_layer(rng, e, h, i, i_shared)
    stem = f"{prefix}model.layers.3.mlp."
    extra = {stem + "gate.weight": gate, stem + "gate.e_score_correction_bias": bias,
             stem + "shared_experts.gate_proj.weight": w13[:i_shared],
             stem + "shared_experts.up_proj.weight": w13[i_shared:],
             stem + "shared_experts.down_proj.weight": w2}
    path = write_checkpoint(tmp_path, ex, 3, prefix, shards=2, extra=extra)
    return path, (ex, gate, bias, w13, w2)


@pytest.mark.parametrize("prefix", ["language_model.", ""])
def test_load_layer_and_run(rng, tmp_path, prefix):
    path, (ex, gate, bias, w13, w2) = write_layer(tmp_path / "ck", rng, prefix)
    rc = RoutingConfig(6, 2, 1, 1, True, 2.827)
    lw = load_moe_layer(CheckpointReader(path), 3, rc, 128, 128, Backend("numpy"))
    assert np.array_equal(lw.shared_w13.view(np.uint16), w13.view(np.uint16))
    assert np.array_equal(lw.e_score_correction_bias, bias) and np.array_equal(lw.experts.w2, ex.w2)
    x = random_bf16(rng, (4, 128))
    direct = moe(x, MoELayerWeights(gate, bias, ex, w13, w2), rc, Backend("numpy"))
    assert np.array_equal(moe(x, lw, rc, Backend("numpy")).view(np.uint16), direct.view(np.uint16))


def test_load_layer_checks_dense_tensors(rng, tmp_path):
    ex, gate, bias, _, _ = make_layer(rng, 6, 128, 128, 0)
    extra = {"model.layers.3.mlp.gate.weight": gate[:, :64], "model.layers.3.mlp.gate.e_score_correction_bias": bias}
    ck = CheckpointReader(write_checkpoint(tmp_path / "ck", ex, 3, "", extra=extra))
    with pytest.raises(ValueError, match=r"gate\.weight in model-00001-of-00001\.safetensors: BF16 \[6, 64\], "
                                         r"expected BF16 or F32 \[6, 128\]"):
        load_moe_layer(ck, 3, RoutingConfig(6, 2), 128, 128, Backend("numpy"))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 33, 256])
@pytest.mark.parametrize("rc,i_shared", [(RoutingConfig(32, 8, 1, 1, True, 2.827), 256),
                                         (RoutingConfig(64, 6, 8, 3, True, 1.5), 0)])
def test_cuda_moe_vs_numpy_moe(rng, m, rc, i_shared):
    h, i = 512, 256
    ex, gate, bias, w13, w2 = make_layer(rng, rc.num_experts, h, i, i_shared)
    # Tokens whose expert choice is a near-tie are not compared (cuBLAS and numpy sum the router
    # logits in different orders); redraw the tokens until at most 5% of them are (with m = 3 one
    # near-tie in a draw is a ~1% event, and the comparison must cover the tokens).
    for _ in range(10):
        x = random_bf16(rng, (m, h))
        logits = (x.astype(np.float64) @ gate.astype(np.float64).T).astype(np.float32)
        *_, margin = f64_route(logits, bias, rc.top_k, rc.n_group, rc.topk_group, True, 1.0)
        clear = margin > 1e-4
        if clear.sum() >= 0.95 * m:
            break
    assert clear.sum() >= 0.95 * m
    y_ref = moe(x, MoELayerWeights(gate, bias, ex, w13, w2), rc, Backend("numpy"))
    be = Backend("cuda")
    dev = be.asarray
    lw = MoELayerWeights(dev(gate), dev(bias), prepare_experts(ex, be), dev(w13) if i_shared else None,
                         dev(w2) if i_shared else None)
    y1 = moe(dev(x), lw, rc, be)
    y2 = moe(dev(x), lw, rc, be)
    assert np.array_equal(y1.get(), y2.get())
    assert_close(y1.get()[clear], y_ref[clear].view(np.uint16), "bf16_accum")


@pytest.mark.parametrize("e,tp", [(16, False), (16, True), (392, False)])
def test_small_path_routes_beside_the_shared_down(rng, e, tp):
    """On the small-M path a layer of up to 384 experts routes in the shared down's launch
    (moe_small_route_shared), one over more in moe_route with the down a linear of its own; the
    numpy output is the general path's either way, on one rank and into a rank's fp32 partials."""
    from ddtree_rtc.testing import OpRecorder

    rc = RoutingConfig(e, 4, 4, 2, True, 2.5)
    ex, gate, bias, w13, w2 = make_layer(rng, e, 128, 128, 64)
    lw = MoELayerWeights(gate, bias, ex, w13, w2)
    x = random_bf16(rng, (5, 128))
    outs = {}
    for small in (True, False):
        rec = OpRecorder()
        parts = np.full((2, 5, 128), np.nan, np.float32) if tp else None
        y = moe(x, lw, rc, rec, out=None if parts is None else parts[0], shared_out=None if parts is None else parts[1],
                small=small)
        outs[small] = (y if parts is None else parts).view(np.uint16 if parts is None else np.uint32)
        if small:
            fused = ["moe_small_route_shared"] if e <= 384 else ["moe_route", "linear"]
            assert [name for name, _ in rec.ops] == ["moe_small_dense", *fused, "moe_small_experts"]
    assert np.array_equal(outs[True], outs[False])
