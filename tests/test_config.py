import json
import math

import pytest

from ddtree_rtc.model.config import PRESETS, ConfigError, config_from_dict, load_config, preset_config


def test_k26_softmax_scale_and_dims():
    cfg = preset_config("k2.6")
    assert math.isclose(cfg.softmax_scale, 0.14467963, rel_tol=1e-7)
    assert cfg.kv_cache_dim == 576 and cfg.qk_head_dim == 192
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)


def test_text_config_and_rope_parameters(tmp_path):
    raw = dict(PRESETS["tiny"])
    raw.pop("rope_theta")
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, **scaling}
    wrapped = {"model_type": "kimi_k25", "text_config": {**raw, "model_type": "kimi_k2"}}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    cfg = load_config(tmp_path)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 64.0 and cfg.rope.theta == 50000.0
    assert cfg == preset_config("tiny")


def test_roundtrip_hf_dict():
    cfg = preset_config("small")
    assert config_from_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("change,msg", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_group": 5}, "topk_group"),
    ({"hidden_size": 0}, "hidden_size must be positive"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
])
def test_bad_configs_name_the_field(change, msg):
    with pytest.raises(ConfigError, match=msg):
        config_from_dict({**PRESETS["tiny"], **change}, "x/config.json")


def test_missing_fields_and_files(tmp_path):
    raw = dict(PRESETS["tiny"])
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing field.*kv_lora_rank"):
        config_from_dict(raw)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("field,value,want", [("kv_lora_rank", 256, 512), ("qk_rope_head_dim", 32, 64)])
def test_unsupported_mla_dims_refused_at_load(tmp_path, field, value, want):
    raw = preset_config("tiny").to_hf_dict()
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"{field} {value} is not supported.*{field} = {want}"):
        load_config(tmp_path)
