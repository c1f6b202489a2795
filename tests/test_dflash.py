"""The native DFlash drafter on the numpy backend: z-lab's checkpoint format, the paged context
cache (incremental rounds equal one forward from scratch), lossless DDTree / chain decoding, and
refusals at load. The torch oracle against z-lab's own code is tests/test_dflash_oracle.py."""

import json

import numpy as np
import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.engine.request import Request
from ddtree_rtc.model.config import ConfigError, preset_config
from ddtree_rtc.model.dflash import DFlashModel, load_dflash_config, make_dflash
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.target import ForwardBatch, TargetModel
from ddtree_rtc.speculative.dflash import DFlashDrafter
from ddtree_rtc.testing import dflash_forward_once


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t, d = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("drafter")
    make_model(preset_config("tiny"), t, seed=0)
    make_dflash("dflash-tiny", d, seed=1)
    return TargetModel.load(t, Backend("numpy")), d


def test_preset_is_zlab_format(pair):
    _, d = pair
    cfg = load_dflash_config(d)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 1023, (0, 2))
    raw = json.loads((d / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == [0, 2]
    k26 = __import__("ddtree_rtc.model.dflash", fromlist=["x"]).dflash_config_from_dict(
        __import__("ddtree_rtc.model.dflash", fromlist=["x"]).random_dflash_dict("dflash-k2.6"))
    assert (k26.hidden_size, k26.num_attention_heads, k26.num_key_value_heads, k26.head_dim) == (7168, 64, 8, 128)
    assert k26.rope.kind == "yarn" and abs(k26.attention_factor - (1 + 0.1 * np.log(64))) < 1e-12


def _hidden(model, tokens, layers):
    cache = PagedKVCache(model.backend, model.num_layers, 8, 16)
    cache.allocator.reserve(0, len(tokens))
    out = model.forward(ForwardBatch.causal([0], [0], [tokens], last_only=False), cache, output="none",
                        hidden_layers=layers)
    return {i: np.asarray(h, np.float32) for i, h in out.hidden.items()}


def test_cached_rounds_equal_one_forward_from_scratch(pair):
    """Every draft of a chain run (context grown by prefill + accepted rows, paged) equals
    dflash_forward_once over the target's hidden states of the whole committed sequence."""
    model, d = pair
    drafter = DFlashDrafter.load(d, model)
    seen = []
    draft = drafter.draft

    def record(rids, roots, prefix_lens):
        out = draft(rids, roots, prefix_lens)
        seen.append((int(roots[0]), int(prefix_lens[0]), np.asarray(out[0], np.float32)))
        return out

    drafter.draft = record
    prompt = list(range(5, 19))
    eng = Engine(model, 2, 16, 128, mode="chain", drafter=drafter)
    out = eng.run([Request(0, prompt, 12)])[0].output
    assert len(seen) >= 2
    seq = prompt + out
    dm = drafter.model
    for root, prefix, logits in seen[:3]:
        assert seq[prefix] == root
        ctx = _hidden(model, seq[:prefix], dm.cfg.target_layer_ids)
        _, want = dflash_forward_once(dm, ctx, [root] + [dm.cfg.mask_token_id] * 7, prefix)
        np.testing.assert_allclose(logits, want, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_dflash_decoding_is_lossless(pair, mode):
    model, d = pair
    prompts = [list(range(3, 15)), list(range(40, 49))]
    ar = Engine(model, 2, 16, 128).run([Request(i, p, 10) for i, p in enumerate(prompts)])
    eng = Engine(model, 2, 16, 128, mode=mode, drafter=DFlashDrafter.load(d, model, window=6), budget=12)
    got = eng.run([Request(i, p, 10) for i, p in enumerate(prompts)])
    assert [r.output for r in got] == [r.output for r in ar]
    assert eng.round.stats.rounds == len(eng.round.stats.trace) > 0


def test_bad_drafters_are_refused(pair, tmp_path):
    model, d = pair
    raw = json.loads((d / "config.json").read_text())

    def with_cfg(**kw):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        out.mkdir()
        (out / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
        (out / "config.json").write_text(json.dumps({**raw, **kw}))
        return out

    with pytest.raises(ConfigError, match="dflash_config"):
        load_dflash_config(with_cfg(dflash_config=None))
    with pytest.raises(ConfigError, match="mask_token_id 5000"):
        load_dflash_config(with_cfg(dflash_config={"mask_token_id": 5000, "target_layer_ids": [0]}))
    with pytest.raises(ValueError, match=r"target_layer_ids \[3\]"):
        DFlashModel.load(with_cfg(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 3]}), model)
    with pytest.raises(ValueError, match="fc.weight"):
        DFlashModel.load(with_cfg(dflash_config={"mask_token_id": 1, "target_layer_ids": [0]}), model)
    with pytest.raises(ConfigError, match="block_size 40"):
        load_dflash_config(with_cfg(block_size=40))
    with pytest.raises(ValueError, match="hidden_size 128"):
        DFlashModel.load(with_cfg(hidden_size=128), model)
