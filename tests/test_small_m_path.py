"""The small-M path's switch: the runtime keys, the model's choice of kernels per forward size (CPU,
through a backend that records its ops), the kernel launches per decoder layer it makes, and the numpy
backend's output unchanged by the path."""

from pathlib import Path

import numpy as np
import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.model.target import SMALL_M_MAX_TOKENS, ForwardBatch, TargetModel
from ddtree_rtc.pipeline.schema import parse_pipeline, parse_set_options
from ddtree_rtc.testing import OpRecorder, stage_launches

PIPE = """\
model:
  preset: tiny
runtime:
  backend: numpy
decode:
  mode: autoregressive
workload:
  synthetic: {count: 1, prompt_len: 4, output_len: 2}
"""


def test_runtime_keys_default_on_and_set_off():
    p = parse_pipeline(PIPE, "p.yaml")
    assert p.runtime.small_m_path is True and p.runtime.batch_invariant is True
    off = parse_pipeline(PIPE, "p.yaml", parse_set_options(("runtime.small_m_path=false",
                                                            "runtime.batch_invariant=false")))
    assert off.runtime.small_m_path is False and off.runtime.batch_invariant is False


def test_engine_takes_the_keys(tiny_dir, monkeypatch):
    from ddtree_rtc.pipeline import runner

    monkeypatch.setattr(runner, "model_dir", lambda pipe, ranks: Path(tiny_dir))
    for sets, want in (((), (True, True)), (("runtime.small_m_path=false",), (False, True)),
                       (("runtime.batch_invariant=false",), (True, False))):
        pipe = parse_pipeline(PIPE, "p.yaml", parse_set_options(sets))
        engine, _ = runner.build_engine(pipe, max_batch=1)
        assert (engine.model.small_m_path, engine.model.batch_invariant) == want, sets


def test_dummy_engine_takes_the_keys():
    """``model.load: dummy`` (no checkpoint) threads the keys the same way."""
    from ddtree_rtc.pipeline import runner

    for sets, want in ((("model.load=dummy",), (True, True)),
                       (("model.load=dummy", "runtime.small_m_path=false", "runtime.batch_invariant=false"),
                        (False, False))):
        pipe = parse_pipeline(PIPE, "p.yaml", parse_set_options(sets))
        engine, _ = runner.build_engine(pipe, max_batch=1)
        assert (engine.model.small_m_path, engine.model.batch_invariant) == want, sets


class RecordingBackend(Backend):
    """The numpy backend, counting each op's calls and the linears' ``impl``."""

    def __init__(self):
        super().__init__("numpy")
        self.calls: dict = {}

    def op(self, name):
        fn = super().op(name)

        def rec(*a, **kw):
            key = (name, kw.get("impl")) if name == "linear" else name
            self.calls[key] = self.calls.get(key, 0) + 1
            return fn(*a, **kw)

        return rec


@pytest.fixture(scope="module")
def recorded(tiny_dir):
    return TargetModel.load(tiny_dir, RecordingBackend())


def _forward(model, tokens):
    cache = PagedKVCache(model.backend, model.num_layers, 8, 16)
    cache.allocator.reserve("a", len(tokens))
    model.backend.calls.clear()
    out = model.forward(ForwardBatch.causal(["a"], [0], [tokens], last_only=False), cache, output="logits")
    return model.backend.to_host(out.logits), dict(model.backend.calls)


@pytest.mark.parametrize("small_m_path,batch_invariant", [(True, True), (True, False), (False, True)])
def test_path_selection_per_forward_size(recorded, rng, small_m_path, batch_invariant):
    model = recorded
    moe_layers = sum(1 for ly in model.layers if hasattr(ly.mlp, "experts"))
    assert moe_layers, "the tiny preset has MoE layers"
    model.small_m_path, model.batch_invariant = small_m_path, batch_invariant
    try:
        tokens = rng.integers(0, model.cfg.vocab_size, SMALL_M_MAX_TOKENS + 1).tolist()
        _, small = _forward(model, tokens[:7])
        _, large = _forward(model, tokens)
        assert model.small_m(7) == small_m_path and not model.small_m(SMALL_M_MAX_TOKENS + 1)
    finally:
        model.small_m_path, model.batch_invariant = True, True
    assert small.get("moe_small_experts", 0) == (moe_layers if small_m_path else 0)
    assert small.get("moe_experts", 0) == (0 if small_m_path else moe_layers)
    invariant = small_m_path and batch_invariant
    assert small.get(("linear", "invariant"), 0) > 0 if invariant else ("linear", "invariant") not in small
    if invariant:
        assert ("linear", "auto") not in small, "every linear of a small forward is the invariant one"
    n_layers = len(model.layers)
    # one launch each instead of 2 / 2 (the q_a norm, q_b) / 3 + 5 (query + cache rows)
    for op in ("mla_qkv_a_small", "norm_linear", "mla_query_small"):
        assert small.get(op, 0) == (n_layers if invariant else 0) and op not in large
    if invariant:
        assert "rope" not in small and "kv_cache_write" not in small and small["mla_head_gemm"] == n_layers
    shared = sum(1 for ly in model.layers if getattr(ly.mlp, "shared_w13", None) is not None)
    assert small.get("moe_small_dense", 0) == (shared if invariant else 0)
    assert "moe_small_dense" not in large
    # above 64 rows: today's kernels whatever the keys
    assert large.get("moe_experts") == moe_layers and "moe_small_experts" not in large
    assert ("linear", "invariant") not in large


def _cache(model, tokens):
    cache = PagedKVCache(model.backend, model.num_layers, 8, 16)
    cache.allocator.reserve("a", len(tokens))
    return cache


# launches per stage on the small-M path at one rank (tiny preset: MoE layers with a shared expert)
ATTENTION = 8  # q_a+kv_a, q_a norm + q_b, query + cache rows, attention + merge, W_UV, o_proj, residual norm
MOE = 5  # router + shared gate_up, routing + shared down, experts (2), the residual norm


def _check_launches(model, rng, attention: int, moe_launches: int) -> set[int]:
    """A 7-row forward's launches per stage (testing.stage_launches): ``attention`` per attention
    block, ``moe_launches`` per MoE layer's MLP, their sum per MoE decoder layer. Returns the MoE
    layers' indices."""
    tokens = rng.integers(0, 1024, 7).tolist()
    stages = stage_launches(model, ForwardBatch.causal(["a"], [0], [tokens], last_only=False), _cache(model, tokens))
    moe = {i for i, ly in enumerate(model.layers) if hasattr(ly.mlp, "experts")}
    for stage, layer, n in stages:
        if stage == "attention":
            assert n == attention, layer
        elif stage == "mlp" and layer in moe:
            assert n == moe_launches, layer
    per_layer = {i: sum(n for s, ly, n in stages if ly == i) for i in moe}
    assert set(per_layer.values()) == ({attention + moe_launches} if moe else set())
    return moe


def test_launches_per_decoder_layer(tiny_dir, rng):
    """Kernel launches per stage of a 7-row forward at one rank, counted from the ops it runs
    (testing.stage_launches): a MoE decoder layer on the small-M path is 13 launches."""
    moe = _check_launches(TargetModel.load(tiny_dir, OpRecorder()), rng, ATTENTION, MOE)
    assert moe, "the tiny preset has MoE layers"


# on a tensor-parallel rank each sublayer's norm gives way to its all-reduce and the norm, which takes the
# all-reduced fp32 sum and rounds it itself (rmsnorm's _f32 entries): one launch each
TP_ATTENTION = ATTENTION - 1 + 2
TP_MOE = MOE - 1 + 2


def test_tp_rank_launches_per_decoder_layer(tiny_dir, rng):
    """Rank 0 of 2 of the tiny preset (attention heads split, experts split by count: the tiny experts'
    intermediate split in two is below the small-M kernels' 128; a SimulatedRank, whose collectives
    leave this rank's partials as they are): a MoE decoder layer on the small-M path is 15 launches."""
    from ddtree_rtc.model.shard import Shard
    from ddtree_rtc.parallel.simulated import SimulatedRank

    model = TargetModel.load(tiny_dir, OpRecorder(), shard=Shard(0, 2, True), comm=SimulatedRank(0, 2))
    moe = _check_launches(model, rng, TP_ATTENTION, TP_MOE)
    assert moe and 0 not in moe, "the tiny preset: a dense layer 0, then MoE layers"
    assert model.comm.stats.calls["all_reduce"] >= 2 * model.num_layers


def test_numpy_output_is_the_same_on_both_paths(tiny_dir, rng):
    on = TargetModel.load(tiny_dir, Backend("numpy"))
    off = TargetModel.load(tiny_dir, Backend("numpy"), small_m_path=False)
    tokens = rng.integers(0, on.cfg.vocab_size, 9).tolist()
    outs = []
    for model in (on, off):
        cache = PagedKVCache(model.backend, model.num_layers, 8, 16)
        cache.allocator.reserve("a", len(tokens))
        outs.append(model.forward(ForwardBatch.causal(["a"], [0], [tokens], last_only=False), cache,
                                  output="logits").logits)
    assert np.array_equal(np.asarray(outs[0]).view(np.uint16), np.asarray(outs[1]).view(np.uint16))
