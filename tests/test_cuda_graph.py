"""Decode forwards through CUDA graphs (engine.runner) equal the eager forwards, on the tiny
preset: across batch sizes, ragged contexts, page boundaries and graph reuse; and the engine's
greedy output is the same with and without graphs."""

import numpy as np
import pytest

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.engine.request import Request
from ddtree_rtc.engine.runner import ModelRunner
from ddtree_rtc.model.config import preset_config
from ddtree_rtc.model.make_model import make_model
from ddtree_rtc.model.target import ForwardBatch, TargetModel


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_graph")
    make_model(preset_config("tiny"), d, seed=11)
    return d


def test_graphs_need_the_cuda_backend(tiny_dir):
    model = TargetModel.load(tiny_dir, Backend("numpy"))
    cache = PagedKVCache(model.backend, model.num_layers, 4, 16)
    with pytest.raises(ValueError, match="cuda backend"):
        ModelRunner(model, cache, 64, graphs=True)


@pytest.mark.gpu
def test_graph_decode_equals_eager(tiny_dir, rng):
    be = Backend("cuda")
    model = TargetModel.load(tiny_dir, be)
    max_ctx, page = 80, 16
    eager_cache = PagedKVCache(be, model.num_layers, 40, page)
    graph_cache = PagedKVCache(be, model.num_layers, 40, page)
    graphs = ModelRunner(model, graph_cache, max_ctx, graphs=True)
    seqs = list(range(5))
    lens = {s: int(rng.integers(3, 30)) for s in seqs}
    prompts = {s: rng.integers(0, model.cfg.vocab_size, lens[s]).tolist() for s in seqs}
    for cache in (eager_cache, graph_cache):
        for s in seqs:
            cache.allocator.reserve(s, max_ctx)
            model.forward(ForwardBatch.causal([s], [0], [prompts[s]]), cache, output="none")
    ctx = dict(lens)
    # batch sizes come and go (graphs are reused), contexts cross page boundaries
    for step, live in enumerate([[0, 1, 2], [0, 1, 2, 3, 4], [1, 3], [0, 1, 2], [4], [0, 1, 2, 3, 4]] * 3):
        toks = [[int(rng.integers(0, model.cfg.vocab_size))] for _ in live]
        batch = ForwardBatch.causal(live, [ctx[s] for s in live], toks)
        want = be.to_host(model.forward(batch, eager_cache, output="logits").logits).astype(np.float32)
        got = be.to_host(graphs.decode(batch)).astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}, live {live}")
        for s in live:
            ctx[s] += 1
    assert graphs.captures == 4 and graphs.replays == 18  # every forward launches its graph


@pytest.mark.gpu
def test_engine_greedy_same_with_and_without_graphs(tiny_dir, rng):
    be = Backend("cuda")
    model = TargetModel.load(tiny_dir, be)
    prompts = [rng.integers(0, model.cfg.vocab_size, int(rng.integers(2, 20))).tolist() for _ in range(7)]
    outs = []
    for graphs in (False, True):
        eng = Engine(model, max_batch=3, page_size=16, max_context=64, cuda_graphs=graphs)
        done = eng.run([Request(i, p, int(5 + i % 4)) for i, p in enumerate(prompts)])
        outs.append([r.output for r in done])
        if graphs:
            assert eng.graphs.replays > 0
    assert outs[0] == outs[1]
