"""compressed-tensors INT4 loading: the config check, tensors from safetensors with and without the
language_model. prefix, sharded or single-file, and every refusal naming its reason."""

import copy
import json

import numpy as np
import pytest
from ml_dtypes import bfloat16
from safetensors.numpy import save_file

from ddtree_rtc.model.checkpoint import CheckpointError, CheckpointReader
from ddtree_rtc.model.int4_repack import random_compressed_experts
from ddtree_rtc.model.quant import (
    QuantConfigError,
    load_int4_linear,
    load_moe_experts,
    parse_quantization_config,
)

K26_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None, "observer": "minmax"},
        "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    "kv_cache_scheme": None,
}


def test_k26_config_is_accepted_top_level_nested_or_bare():
    for cfg in ({"quantization_config": K26_QUANT}, {"text_config": {"quantization_config": K26_QUANT}}, K26_QUANT):
        s = parse_quantization_config(cfg)
        assert (s.num_bits, s.group_size, s.symmetric, s.format) == (4, 32, True, "pack-quantized")


def _weights(**kw):
    q = copy.deepcopy(K26_QUANT)
    q["config_groups"]["group_0"]["weights"].update(kw)
    return q


@pytest.mark.parametrize("q,match", [
    (dict(K26_QUANT, quant_method="awq"), "quant_method 'awq' is not supported"),
    (dict(K26_QUANT, format="float-quantized"), "format 'float-quantized' is not supported"),
    (dict(K26_QUANT, format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (dict(K26_QUANT, quantization_status="frozen"), "quantization_status 'frozen'"),
    (dict(K26_QUANT, config_groups={}), "config_groups is empty"),
    (_weights(num_bits=8), "bit width num_bits=8"),
    (_weights(symmetric=False), "symmetric=False .*asymmetric schemes carry zero points"),
    (_weights(group_size=128), "group size group_size=128"),
    (_weights(strategy="channel"), "strategy strategy='channel'"),
    (_weights(type="float"), "type type='float'"),
    (_weights(actorder="group"), "actorder='group'"),
    (_weights(dynamic=True), "dynamic=True"),
])
def test_unsupported_schemes_are_refused_by_name(q, match):
    with pytest.raises(QuantConfigError, match=match):
        parse_quantization_config({"quantization_config": q}, "x/config.json")


def test_activation_quantization_and_missing_config_are_refused():
    q = copy.deepcopy(K26_QUANT)
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(QuantConfigError, match="input_activations are quantized"):
        parse_quantization_config(q)
    with pytest.raises(QuantConfigError, match="no quantization_config"):
        parse_quantization_config({"hidden_size": 7168})


def write_checkpoint(path, ex, layer, prefix, shards=1, extra=None, drop=()):
    """Experts of ``ex`` as compressed-tensors tensors of one layer, over ``shards`` files + index."""
    tensors = {}
    inter = ex.intermediate
    for e in range(ex.num_experts):
        base = f"{prefix}model.layers.{layer}.mlp.experts.{e}."
        mats = {"gate_proj": (ex.w13[e][:inter], ex.w13_scale[e][:inter]),
                "up_proj": (ex.w13[e][inter:], ex.w13_scale[e][inter:]),
                "down_proj": (ex.w2[e], ex.w2_scale[e])}
        for proj, (p, s) in mats.items():
            tensors[f"{base}{proj}.weight_packed"] = np.ascontiguousarray(p)
            tensors[f"{base}{proj}.weight_scale"] = np.ascontiguousarray(s)
            tensors[f"{base}{proj}.weight_shape"] = np.array([p.shape[0], p.shape[1] * 8], np.int32)
    tensors.update(extra or {})
    for name in drop:
        tensors.pop(name)
    names = sorted(tensors)
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("prefix,shards", [("language_model.", 2), ("", 1), ("", 3)])
def test_load_experts_round_trip(rng, tmp_path, prefix, shards):
    ex = random_compressed_experts(rng, 3, 128, 256)
    ck = CheckpointReader(write_checkpoint(tmp_path / "ck", ex, 2, prefix, shards))
    got = load_moe_experts(ck, 2, 3, 128, 256)
    assert got.layout == "compressed-tensors"
    for a, b in ((got.w13, ex.w13), (got.w2, ex.w2)):
        assert a.dtype == np.int32 and np.array_equal(a, b)
    for a, b in ((got.w13_scale, ex.w13_scale), (got.w2_scale, ex.w2_scale)):
        assert a.dtype == bfloat16 and np.array_equal(a.view(np.uint16), b.view(np.uint16))
    shard = load_moe_experts(ck, 2, 3, 128, 256, experts=range(1, 3))
    assert shard.num_experts == 2 and np.array_equal(shard.w2, ex.w2[1:])
    with pytest.raises(CheckpointError, match="layer 5 has no routed experts"):
        load_moe_experts(ck, 5, 3, 128, 256)


def test_single_file_checkpoint(rng, tmp_path):
    ex = random_compressed_experts(rng, 1, 128, 128)
    write_checkpoint(tmp_path / "ck", ex, 1, "")
    f = next((tmp_path / "ck").glob("*.safetensors"))
    got = load_moe_experts(CheckpointReader(f), 1, 1, 128, 128)
    assert np.array_equal(got.w13, ex.w13)


def _ck(rng, tmp_path, **kw):
    ex = random_compressed_experts(rng, 1, 128, 128)
    return CheckpointReader(write_checkpoint(tmp_path / "ck", ex, 1, "language_model.", **kw))


BASE = "language_model.model.layers.1.mlp.experts.0."


def test_missing_scale_is_named(rng, tmp_path):
    ck = _ck(rng, tmp_path, drop=[BASE + "up_proj.weight_scale"])
    with pytest.raises(CheckpointError, match=r"missing scale tensor .*experts\.0\.up_proj\.weight_scale"):
        load_moe_experts(ck, 1, 1, 128, 128)


def test_wrong_shapes_and_dtypes_are_named(rng, tmp_path):
    ck = _ck(rng, tmp_path)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_packed in model-00001-of-00001\.safetensors: "
                                               r"shape \[128, 16\], expected \[64, 16\]"):
        load_int4_linear(ck, BASE + "gate_proj.", 64, 128)
    with pytest.raises(CheckpointError, match="in-features 100 is not a multiple of the group size 32"):
        load_int4_linear(ck, BASE + "gate_proj.", 128, 100)
    bad = {BASE + "down_proj.weight_scale": np.ones((128, 4), np.float32)}
    ck = _ck(rng, tmp_path / "b", extra=bad)
    with pytest.raises(CheckpointError, match=r"down_proj\.weight_scale .*dtype F32, expected BF16"):
        load_moe_experts(ck, 1, 1, 128, 128)
    bad = {BASE + "down_proj.weight_shape": np.array([128, 256], np.int32)}
    ck = _ck(rng, tmp_path / "c", extra=bad)
    with pytest.raises(CheckpointError, match=r"weight_shape .* says \[128, 256\], but .*weight_packed is "
                                               r"\[128, 16\] and .*weight_scale \[128, 4\]"):
        load_moe_experts(ck, 1, 1, 128, 128)
    for dt in (np.int32, np.int64):  # Kimi's files and compressed-tensors 0.20 respectively
        ok = {BASE + "down_proj.weight_shape": np.array([128, 128], dt)}
        ck = _ck(rng, tmp_path / f"ok_{np.dtype(dt).name}", extra=ok)
        assert load_moe_experts(ck, 1, 1, 128, 128).num_experts == 1
    bad = {BASE + "down_proj.weight_shape": np.array([128, 128], np.float32)}
    with pytest.raises(CheckpointError, match=r"down_proj\.weight_shape .*dtype F32, expected I32 or I64"):
        load_moe_experts(_ck(rng, tmp_path / "d", extra=bad), 1, 1, 128, 128)


def test_asymmetric_and_unquantized_tensors_are_refused(rng, tmp_path):
    zp = {BASE + "gate_proj.weight_zero_point": np.zeros((128, 4), np.int32)}
    with pytest.raises(CheckpointError, match="weight_zero_point .*zero point .asymmetric scheme"):
        load_moe_experts(_ck(rng, tmp_path / "a", extra=zp), 1, 1, 128, 128)
    gi = {BASE + "gate_proj.weight_g_idx": np.zeros(128, np.int32)}
    with pytest.raises(CheckpointError, match="g_idx"):
        load_moe_experts(_ck(rng, tmp_path / "b", extra=gi), 1, 1, 128, 128)
    dense = {BASE + "up_proj.weight": np.zeros((128, 128), bfloat16)}
    ck = _ck(rng, tmp_path / "c", extra=dense, drop=[BASE + "up_proj.weight_packed"])
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_packed is bf16, not quantized"):
        load_moe_experts(ck, 1, 1, 128, 128)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json and no"):
        CheckpointReader(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="x.safetensors: too short to be a safetensors file"):
        CheckpointReader(tmp_path)
