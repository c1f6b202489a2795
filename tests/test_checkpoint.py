import json

import numpy as np
import pytest

from ddtree_rtc.model.checkpoint import CheckpointError, CheckpointReader, expected_tensors
from ddtree_rtc.model.config import load_config, preset_config
from ddtree_rtc.model.make_model import make_model, pack_int4
from ddtree_rtc.model.safetensors_io import read_header, write_file


def unpack_ref(packed, k):
    """Straight from the format spec: W[n,k] = ((P[n,k>>3] >> 4*(k&7)) & 0xF) - 8."""
    p = packed.view(np.uint32)
    ks = np.arange(k)
    return ((p[:, ks >> 3] >> (4 * (ks & 7)).astype(np.uint32)) & 0xF).astype(np.int64) - 8


def test_pack_int4_matches_spec(rng):
    q = rng.integers(-8, 8, size=(5, 64))
    q[0, :2] = [-8, 7]
    assert np.array_equal(unpack_ref(pack_int4(q), 64), q)


def test_make_model_tiny_roundtrip(tmp_path):
    cfg = preset_config("tiny")
    make_model(cfg, tmp_path, seed=3)
    assert load_config(tmp_path) == cfg
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["quantization_config"]["format"] == "pack-quantized"
    r = CheckpointReader(tmp_path)
    r.check(expected_tensors(cfg))
    bias = r.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == np.float32 and np.all(bias != 0)
    packed = r.get("model.layers.1.mlp.experts.0.gate_proj.weight_packed")
    vals = unpack_ref(np.asarray(packed), cfg.hidden_size)
    assert vals.min() == -8 and vals.max() == 7
    assert r.prefix == ""


def test_reader_prefix_and_errors(tmp_path):
    a = np.ones((2, 3), dtype=np.float32)
    write_file(tmp_path / "model.safetensors", {"language_model.model.norm.weight": a})
    r = CheckpointReader(tmp_path)
    assert r.prefix == "language_model." and r.names() == ["model.norm.weight"]
    assert np.array_equal(r.get("model.norm.weight"), a)
    with pytest.raises(CheckpointError, match="missing tensor language_model.lm_head.weight"):
        r.get("lm_head.weight")
    with pytest.raises(CheckpointError, match=r"has shape \(2, 3\), expected \(3,\)"):
        r.get("model.norm.weight", shape=(3,))
    with pytest.raises(CheckpointError, match="model directory not found"):
        CheckpointReader(tmp_path / "nope")


def test_reader_reports_mismatch_with_config(tmp_path):
    cfg = preset_config("tiny")
    make_model(cfg, tmp_path, seed=0)
    big = preset_config("tiny").with_layers(3)
    r = CheckpointReader(tmp_path)
    r.check(expected_tensors(big, layers=2))
    shard = next(tmp_path.glob("model-00001-*.safetensors"))
    table, _ = read_header(shard)
    assert "model.layers.0.input_layernorm.weight" in table
    wrong = json.loads((tmp_path / "config.json").read_text())
    wrong["hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match="does not match config.json"):
        r.check(expected_tensors(load_config(tmp_path)))
