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


FORMS = {"default": [], "weight_shape_int64": ["--weight-shape-dtype", "int64"],
         "router_fp32": ["--router-dtype", "fp32"], "bias_bf16": ["--bias-dtype", "bf16"],
         "all": ["--weight-shape-dtype", "int64", "--router-dtype", "fp32", "--bias-dtype", "bf16"]}
STORED = {"default": ("I32", "BF16", "F32"), "weight_shape_int64": ("I64", "BF16", "F32"),
          "router_fp32": ("I32", "F32", "F32"), "bias_bf16": ("I32", "BF16", "BF16"), "all": ("I64", "F32", "BF16")}


def _write_form(directory, form):
    from click.testing import CliRunner

    from ddtree_rtc.cli import main

    res = CliRunner().invoke(main, ["make-model", "--preset", "tiny", "--seed", "4", "--out", str(directory)]
                             + FORMS[form])
    assert res.exit_code == 0, res.output
    return directory


def _logits(directory):
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.engine.kv_cache import PagedKVCache
    from ddtree_rtc.model.target import ForwardBatch, TargetModel

    model = TargetModel.load(directory, Backend("numpy", quiet=True))
    cache = PagedKVCache(model.backend, model.num_layers, 4, 16)
    cache.allocator.reserve(0, 9)
    out = model.forward(ForwardBatch.causal([0], [0], [[3, 1, 4, 1, 5, 9, 2, 6, 5]], last_only=False), cache,
                        output="logits")
    return np.asarray(model.backend.to_host(out.logits)).astype(np.float32)


@pytest.fixture(scope="module")
def default_logits(tmp_path_factory):
    return _logits(_write_form(tmp_path_factory.mktemp("default"), "default"))


@pytest.mark.parametrize("form", [f for f in FORMS if f != "default"])
def test_checkpoint_forms_load_and_run(tmp_path, form, default_logits):
    """Each stored form real checkpoints use loads and runs: int64 weight_shape (compressed-tensors 0.20),
    an fp32 router (saved from an fp32 model), a bf16 correction bias."""
    _write_form(tmp_path, form)
    table, _ = read_header(next(tmp_path.glob("model-00002-*.safetensors")))
    got = tuple(table[f"model.layers.1.mlp.{t}"]["dtype"] for t in
                ("experts.0.gate_proj.weight_shape", "gate.weight", "gate.e_score_correction_bias"))
    assert got == STORED[form]
    CheckpointReader(tmp_path).check(expected_tensors(load_config(tmp_path)))
    logits = _logits(tmp_path)
    assert np.isfinite(logits).all()
    if STORED[form][2] == "F32":
        # the fp32 router holds the bf16 router's values exactly (drawn, then rounded to bf16), so the
        # logits are the default form's bit for bit: the fp32 weights take the fp32 routing path unchanged
        assert np.array_equal(logits, default_logits)
    else:  # the bias rounded to bf16 may move a near-tied expert choice, not the whole output
        assert np.corrcoef(logits.ravel(), default_logits.ravel())[0, 1] > 0.9


def _rewrite(path, name, value):
    from ddtree_rtc.model.safetensors_io import open_tensor

    table, start = read_header(path)
    tensors = {k: np.asarray(open_tensor(path, k, e, start)) for k, e in table.items() if k != "__metadata__"}
    tensors[name] = value
    write_file(path, tensors, {"format": "pt"})


def test_weight_shape_checked_against_packed_and_scale(tmp_path):
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.model.target import TargetModel

    _write_form(tmp_path, "weight_shape_int64")
    shard = next(tmp_path.glob("model-00002-*.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight_shape"
    cfg = load_config(tmp_path)
    _rewrite(shard, name, np.array([cfg.moe_intermediate_size, cfg.hidden_size * 2], dtype=np.int64))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".* says .*weight_packed"):
        TargetModel.load(tmp_path, Backend("numpy", quiet=True))
    _rewrite(shard, name, np.array([cfg.moe_intermediate_size, cfg.hidden_size], dtype=np.int16))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*I16.*expected I32 or I64"):
        CheckpointReader(tmp_path).check(expected_tensors(cfg))


def test_quantized_is_decided_by_weight_packed_not_the_ignore_list(tmp_path, default_logits):
    """The loader reads the experts as INT4 because weight_packed is there, whatever the ignore list says."""
    _write_form(tmp_path, "default")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"]["ignore"] = ["re:.*"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert np.array_equal(_logits(tmp_path), default_logits)



def _tensors(path):
    from ddtree_rtc.model.safetensors_io import open_tensor

    header, start = read_header(path)
    return {k: open_tensor(path, k, e, start) for k, e in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("head", ["random", "decisive"])
def test_decisive_head_keeps_greedy_choices_far_from_ties(tmp_path, head):
    """make-model --head decisive: lm_head = the embedding of a fixed permutation over sqrt(H), so on
    any context the greedy choice leads its runner-up by most of the logit range (the random head
    leaves near-ties that bf16 noise flips on the GPU)."""
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.engine.kv_cache import PagedKVCache
    from ddtree_rtc.model.target import ForwardBatch, TargetModel

    cfg = preset_config("tiny")
    make_model(cfg, tmp_path, seed=0, head=head)
    model = TargetModel.load(tmp_path, Backend("numpy", quiet=True))
    seq = np.random.default_rng(1).integers(3, cfg.vocab_size, 60).tolist()
    cache = PagedKVCache(model.backend, model.num_layers, 16, 16)
    cache.allocator.reserve(0, len(seq))
    logits = model.forward(ForwardBatch.causal([0], [0], [seq], last_only=False), cache, output="logits").logits
    logits = np.asarray(logits, np.float32)
    top2 = np.sort(logits, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) / np.abs(logits).max(axis=1)
    if head == "decisive":
        assert margin.min() > 0.4, margin.min()
    else:
        assert np.quantile(margin, 0.1) < 0.05  # the random head's near-ties, which the decisive one removes


def test_decisive_head_changes_only_the_lm_head(tmp_path):
    cfg = preset_config("tiny")
    for head in ("random", "decisive"):
        make_model(cfg, tmp_path / head, seed=4, head=head)
    names = sorted(p.name for p in (tmp_path / "random").glob("*.safetensors"))
    assert names == sorted(p.name for p in (tmp_path / "decisive").glob("*.safetensors"))
    for name in names:
        a, b = _tensors(tmp_path / "random" / name), _tensors(tmp_path / "decisive" / name)
        assert sorted(a) == sorted(b)
        for k in a:
            same = np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8))
            assert same == (k != "lm_head.weight"), k
    with pytest.raises(ValueError, match="head 'peaked'"):
        make_model(cfg, tmp_path / "bad", head="peaked")
