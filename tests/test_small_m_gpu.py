"""The small-M path on the GPU, at one rank's TP8 share of K2.6 (8 heads, expert intermediate 256,
vocab / 8; random weights made on the GPU): the row-invariant linear against its reference, and
bitwise row invariance — a row's bits do not depend on the batch it is computed in (M = 1, 7, 33, 64)
— through the linears, the MoE layer, the whole model's decode forward (eager and the engine's CUDA
graph), and a verify row (of a causal chain, or of a DDTree tree) against its autoregressive twin."""

import os
import types

import numpy as np
import pytest

from ddtree_rtc.reference.linear import linear as ref_linear
from ddtree_rtc.testing import assert_close, random_bf16

MS = (1, 7, 33, 64)
# name -> (N, K) of one rank's TP8 decode linears (K2.6 dims)
TP8_LINEARS = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (1536, 1536), "o_proj": (7168, 1024),
               "router": (384, 7168), "shared_w13": (512, 7168), "shared_w2": (7168, 256),
               "dense_w13": (4608, 7168), "dense_w2": (7168, 2304), "lm_head": (20480, 7168)}


def _seeded(name):
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{name} seed={seed}")
    return np.random.default_rng(seed)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TP8_LINEARS))
@pytest.mark.parametrize("f32", [False, True])
def test_invariant_linear(name, f32):
    """Against the reference on odd M (NaN-prefilled outputs), and every row the same bits at M = 64
    as alone or in batches of 7 and 33."""
    import cupy

    from ddtree_rtc.kernels.linear import linear
    from ddtree_rtc.testing import nan_bf16_bits, to_device_bf16

    rng = _seeded(name)
    n, k = TP8_LINEARS[name]
    x = random_bf16(rng, (64, k))
    w = random_bf16(rng, (n, k), k ** -0.5)
    xd, wd = to_device_bf16(x), to_device_bf16(w)

    def run(idx):
        out = cupy.full((len(idx), n), np.nan, cupy.float32) if f32 else nan_bf16_bits((len(idx), n))
        return linear(cupy.ascontiguousarray(xd[idx]), wd, out=out, impl="invariant").get()

    full = run(np.arange(64))
    for m in (1, 3, 17, 33):
        idx = rng.permutation(64)[:m]
        got = run(idx)
        if m <= 3 or n * k <= 64 << 20:  # (the float64 reference of the lm_head at M = 33 takes long)
            expect = ref_linear(x[idx], w, out=np.empty((m, n), np.float32) if f32 else None)
            assert_close(got, expect, "fp32_accum" if f32 else "bf16_accum")
        assert np.array_equal(got, full[idx]), f"M={m}: rows differ from the same rows at M=64"


def tp8_model(moe_layers: int = 1):
    from ddtree_rtc.bench.decode import random_slice

    return random_slice(moe_layers, seed=3, shard="tp8")


@pytest.fixture(scope="module")
def model():
    return tp8_model()


@pytest.mark.gpu
@pytest.mark.parametrize("expert_shard", [False, True])
def test_moe_layer_rows_invariant(model, expert_shard):
    """The whole MoE layer (invariant router, routing, shared expert, moe_small experts; on an EP8
    rank 48 whole experts, the other ranks' ids out of range): a token's output, bf16 and as the fp32
    partials of a tensor-parallel rank, the same bits in any batch."""
    import cupy

    from ddtree_rtc.bench.moe import int4_experts_device
    from ddtree_rtc.model.moe import MoELayerWeights, moe
    from ddtree_rtc.testing import to_device_bf16

    be, rc = model.backend, model.routing
    lw = model.layers[1].mlp
    if expert_shard:
        lw = MoELayerWeights(lw.gate_weight, lw.e_score_correction_bias,
                             int4_experts_device(48, lw.experts.hidden, 2048, 11), lw.shared_w13, lw.shared_w2, 0)
    rng = _seeded(f"moe layer ep={expert_shard}")
    x = to_device_bf16(random_bf16(rng, (64, lw.experts.hidden)))

    def run(idx, parts):
        xi = cupy.ascontiguousarray(x[idx])
        m = len(idx)
        plan = be.moe_small_plan(m, lw.experts.num_experts, rc.top_k, lw.experts.hidden, lw.experts.intermediate)
        if not parts:
            return moe(xi, lw, rc, be, plan=plan, small=True).get()
        out = cupy.full((2, m, lw.experts.hidden), np.nan, cupy.float32)
        moe(xi, lw, rc, be, plan=plan, out=out[0], shared_out=out[1], small=True)
        return out.get()

    for parts in (False, True):
        full = run(np.arange(64), parts)
        for m in (1, 7, 33):
            idx = rng.permutation(64)[:m]
            got = run(idx, parts)
            ref = full[:, idx] if parts else full[idx]
            assert np.array_equal(got, ref), f"M={m} parts={parts}: rows differ from the same tokens at M=64"


def _decode_cache(model, n_seq, rng, max_ctx=4200):
    from ddtree_rtc.bench.harness import random_bf16_device
    from ddtree_rtc.engine.kv_cache import PagedKVCache

    page = 64
    ctx = rng.integers(100, 4096, n_seq)
    per = -(-max_ctx // page)
    cache = PagedKVCache(model.backend, model.num_layers, n_seq * per, page, model.dims.row)
    cache.data[...] = random_bf16_device(cache.data.shape, scale=1.0, seed=int(rng.integers(1 << 30)))
    for s in range(n_seq):
        cache.allocator.reserve(s, int(ctx[s]) + 20)
    return cache, ctx


def _decode_step(model, cache, ctx, tokens, idx, runner=None):
    """Logits (fp32, host) of a decode step of requests ``idx`` (their contexts ``ctx[idx]``, one token
    each from ``tokens``): eagerly, or through ``runner`` (engine.runner.ModelRunner: CUDA graphs)."""
    from ddtree_rtc.model.target import ForwardBatch

    b = ForwardBatch.causal([int(i) for i in idx], ctx[idx], [[int(tokens[i])] for i in idx])
    if runner is None:
        return model.backend.to_host(model.forward(b, cache, output="logits").logits, bf16=False)
    return model.backend.to_host(runner.decode(b), bf16=False).copy()


@pytest.mark.gpu
def test_decode_rows_invariant_eager_and_graph(model):
    """The whole model's decode forward (attention over each request's own context, MoE, lm_head):
    request r's logits the same bits in a decode batch of 1, 7, 33 or 64 requests, eagerly and
    through the engine's CUDA graphs (engine.runner)."""
    from ddtree_rtc.engine.runner import ModelRunner

    rng = _seeded("decode invariance")
    cache, ctx = _decode_cache(model, 64, rng)
    tokens = rng.integers(0, 20480, 64)

    def step(idx, runner=None):
        return _decode_step(model, cache, ctx, tokens, idx, runner)

    assert model.small_m(64)
    full = step(np.arange(64))
    runner = ModelRunner(model, cache, 4200, graphs=True)
    for m in MS:
        idx = np.sort(rng.permutation(64)[:m]) if m < 64 else np.arange(64)
        for how, got in (("eager", step(idx)), ("graph", step(idx, runner))):
            bad = [int(i) for r, i in enumerate(idx) if not np.array_equal(got[r], full[i])]
            assert not bad, f"{how} M={m}: requests {bad[:6]} get other logits than at M=64"


@pytest.mark.gpu
def test_chain_verify_rows_equal_their_autoregressive_twins(model):
    """A multi-token forward (a chain verify: n new tokens per request, causal) gives row j exactly
    the logits of the autoregressive step that feeds the same token at the same position."""
    from ddtree_rtc.model.target import ForwardBatch

    rng = _seeded("chain verify")
    cache, ctx = _decode_cache(model, 4, rng)
    for b, n in ((1, 7), (3, 11), (4, 16)):
        idx = list(range(b))
        toks = [rng.integers(0, 20480, n).tolist() for _ in idx]
        verify = ForwardBatch.causal(idx, ctx[:b], toks, last_only=False)
        rows = model.backend.to_host(model.forward(verify, cache, output="logits").logits, bf16=False)
        for j in range(n):
            ar = ForwardBatch.causal(idx, ctx[:b] + j, [[t[j]] for t in toks])
            got = model.backend.to_host(model.forward(ar, cache, output="logits").logits, bf16=False)
            for r in range(b):
                assert np.array_equal(got[r], rows[r * n + j]), f"b={b} n={n}: request {r} token {j} differs"


@pytest.mark.gpu
def test_engine_chain_verify_equals_ar_through_graphs(model):
    """Through the engine's model runner with CUDA graphs: a tree verify of a chain (plan_tree,
    fill_tree, verify; the tree mask on the device) gives slot j exactly the logits of the AR decode
    step (runner.decode) that feeds the same token at the same position."""
    import types

    import cupy

    from ddtree_rtc.engine.runner import ModelRunner
    from ddtree_rtc.model.target import ForwardBatch
    from ddtree_rtc.reference.tree_build import mask_words

    rng = _seeded("engine chain verify")
    cache, ctx = _decode_cache(model, 4, rng)
    runner = ModelRunner(model, cache, 4200, graphs=True)
    for b, n in ((1, 7), (3, 11), (4, 16)):
        ids = list(range(b))
        toks = rng.integers(0, 20480, (b, n)).astype(np.int32)
        words = mask_words(n - 1)
        bits = np.zeros((n, words), np.uint64)
        for i in range(n):
            for j in range(i + 1):  # a chain: every earlier slot is an ancestor
                bits[i, j // 64] |= np.uint64(1) << np.uint64(j % 64)
        tree = types.SimpleNamespace(
            tokens=cupy.asarray(toks), positions=cupy.asarray((ctx[:b, None] + np.arange(n)).astype(np.int32)),
            num_nodes=cupy.full(b, n, cupy.int32), mask=cupy.asarray(np.tile(bits[None], (b, 1, 1))))
        step = runner.plan_tree(ids, ctx[:b], n)
        runner.fill_tree(step, tree)
        rows = model.backend.to_host(runner.verify(step).logits, bf16=False).copy()
        for j in range(n):
            ar = ForwardBatch.causal(ids, ctx[:b] + j, [[int(toks[r, j])] for r in ids])
            got = model.backend.to_host(runner.decode(ar), bf16=False)
            for r in ids:
                assert np.array_equal(got[r], rows[r * n + j]), f"b={b} n={n}: request {r} slot {j} differs"


def _random_parents(rng, n, max_depth=16):
    """A random tree of n nodes, parents before children (node 0 the root): each node hangs under
    its predecessor half the time (long paths), else under a random earlier node, never deeper than
    ``max_depth``."""
    parents, depth = np.full(n, -1), np.zeros(n, np.int64)
    for i in range(1, n):
        p = i - 1 if rng.random() < 0.5 else int(rng.integers(0, i))
        while depth[p] >= max_depth:
            p = int(parents[p])
        parents[i], depth[i] = p, depth[p] + 1
    return parents, depth


def tree_verify_vs_twins(model, cache, runner, budget, b, rng, vocab=20480, ctx_lo=1000, ctx_hi=4096):
    """Verify random trees of ``budget`` nodes (plus the root) for b requests through ``runner``
    (plan_tree, fill_tree, verify; the mask on the device), then decode every node's autoregressive
    twin (runner.decode, batches of at most 33): the node's token at position ctx + depth over a
    sequence whose positions ctx .. ctx + depth - 1 hold copies of the node's ancestors' cache rows,
    root first (as the DDTree commit puts them). With b > 1 request 1's tree is short, so padding
    rows ride along. ``cache``: room for b + b * (budget + 1) sequences of ctx_hi + budget + 1
    positions. Returns the (request, node) pairs whose logits differ, and how many were compared."""
    from ddtree_rtc.model.target import ForwardBatch
    from ddtree_rtc.reference.mla_attention import tree_mask_from_parents
    from ddtree_rtc.reference.tree_build import mask_words

    be, xp = model.backend, model.backend.xp
    n = budget + 1
    ctx = rng.integers(ctx_lo, ctx_hi, b)
    alloc = cache.allocator
    for r in range(b):
        alloc.reserve(r, int(ctx[r]) + n)
    words = mask_words(n - 1)
    trees = [_random_parents(rng, n) for _ in range(b)]
    num_nodes = np.full(b, n)
    if b > 1:
        num_nodes[1] = int(rng.integers(1, n))  # a short tree: its spare slots are padding rows
    toks = rng.integers(0, vocab, (b, n)).astype(np.int32)
    tree = types.SimpleNamespace(
        tokens=xp.asarray(toks), positions=xp.asarray((ctx[:, None] + np.stack([d for _, d in trees])).astype(
            np.int32)), num_nodes=xp.asarray(num_nodes.astype(np.int32)),
        mask=xp.asarray(np.stack([tree_mask_from_parents(p, words) for p, _ in trees])))
    step = runner.plan_tree(list(range(b)), ctx, n)
    runner.fill_tree(step, tree)
    rows = be.to_host(runner.verify(step).logits, bf16=False).copy()

    flat = cache.data.reshape(cache.num_layers, -1, cache.row)
    twins = []
    for r in range(b):
        parents, depth = trees[r]
        for i in range(int(num_nodes[r])):
            path = [i]
            while path[-1] > 0:
                path.append(int(parents[path[-1]]))
            path = path[::-1][:-1]  # root .. parent of i
            sid = (r, i)
            alloc.reserve(sid, int(ctx[r] + depth[i]) + 1)
            src = np.concatenate([np.arange(ctx[r]), ctx[r] + np.array(path, np.int64)]).astype(np.int64)
            flat[:, xp.asarray(alloc.slots(sid, np.arange(len(src))))] = flat[:, xp.asarray(alloc.slots(r, src))]
            twins.append((sid, int(ctx[r] + depth[i]), int(toks[r, i]), r * n + i))
    bad = []
    for c in range(0, len(twins), 33):  # decode batches on the small-M path (<= 64 rows)
        part = twins[c:c + 33]
        ar = ForwardBatch.causal([t[0] for t in part], np.array([t[1] for t in part]), [[t[2]] for t in part])
        got = be.to_host(runner.decode(ar), bf16=False)
        bad += [t[0] for k, t in enumerate(part) if not np.array_equal(got[k], rows[t[3]])]
    return bad, len(twins)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("budget,b", [(8, 1), (8, 3), (32, 1)])
def test_engine_tree_verify_equals_ar_through_graphs(model, graphs, budget, b):
    """Through the engine's model runner, eagerly and with CUDA graphs: a verify of random DDTree
    trees (budget 8 or 32, contexts 1k-4k) gives each node exactly the logits of its autoregressive
    twin (tree_verify_vs_twins). Needs the attention to read a tree row's keys in its twin's order
    (split_work_by_shape, path_item in cuda_src/include/mla_split.cuh)."""
    from ddtree_rtc.bench.harness import random_bf16_device
    from ddtree_rtc.engine.kv_cache import PagedKVCache
    from ddtree_rtc.engine.runner import ModelRunner

    rng = _seeded(f"engine tree verify {budget} {b} graphs={graphs}")
    page, max_ctx = 64, 4200
    per = -(-max_ctx // page)
    cache = PagedKVCache(model.backend, model.num_layers, (b + b * (budget + 1)) * per, page, model.dims.row)
    cache.data[...] = random_bf16_device(cache.data.shape, scale=1.0, seed=int(rng.integers(1 << 30)))
    runner = ModelRunner(model, cache, max_ctx, graphs=graphs)
    bad, compared = tree_verify_vs_twins(model, cache, runner, budget, b, rng)
    assert not bad, f"{len(bad)} of {compared} tree nodes (request, node) differ from their AR twins: {bad[:8]}"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64])
def test_small_path_matches_the_general_path(model, load_tool, m):
    """The same decode batch (contexts up to 4096) through the small-M path and the general kernels,
    stage by stage (tools/small_vs_general.py's replay): each small stage fed the general path's input
    is within the bf16 tolerance of it (different sum orders, the same math); both paths' attention,
    router, routed experts and head are within tolerance of the numpy reference; neither writes cache
    rows outside its slots; model.forward is deterministic both ways; and every row of the two
    forwards' logits within 2e-2, except a row whose routing flipped at a near-tie (two valid sum
    orders pick different experts where the k-th margin is ~4e-4: the logits then part by ~20%, and
    only that row)."""
    svg = load_tool("small_vs_general")
    table, rep = svg.replay(model, m, seed=7, ctx_max=4096, pdl=True)
    found = svg.problems(table, rep)
    assert not found, "\n".join(found) + f"\n(the whole table: python tools/small_vs_general.py --m {m})"
