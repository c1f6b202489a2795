"""The packed tree verify (engine.runner.plan_tree / fill_tree / per_slot): each request's root and
nodes one after another, unequal row counts (a request with its root alone included), the bucket's
other rows padding in the requests' spare slots. Every real row gives the logits of a causal
forward along its root-to-node path, padding leaves the committed cache alone, and per_slot lays
the rows out per request and slot."""

import types

import numpy as np
import pytest

from ddtree_rtc.engine.kv_cache import PagedKVCache
from ddtree_rtc.engine.runner import ModelRunner, spread_rows
from ddtree_rtc.model.target import ForwardBatch
from ddtree_rtc.reference.mla_attention import tree_mask_from_parents
from ddtree_rtc.reference.tree_build import mask_words


def test_spread_rows_pads_the_spare_slots_in_request_order():
    assert spread_rows([5, 1, 4], 6, 10).tolist() == [5, 1, 4]
    assert spread_rows([5, 1, 4], 6, 14).tolist() == [6, 4, 4]
    assert spread_rows([1, 1], 3, 6).tolist() == [3, 3]
    for rows, width, total in (([5, 1, 4], 6, 9), ([5, 1, 4], 6, 19), ([7, 1], 6, 8), ([0, 2], 6, 4)):
        with pytest.raises(ValueError, match="cannot hold rows"):
            spread_rows(rows, width, total)


def trees(rng, parents_of, width, vocab, prefix):
    """TreeArrays-like host arrays [B, width] of the given parent lists (slot 0 the root)."""
    b, words = len(parents_of), mask_words(width - 1)
    tokens = np.zeros((b, width), np.int32)
    positions = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width, words), np.uint64)
    for i, parents in enumerate(parents_of):
        n = len(parents)
        tokens[i, :n] = rng.integers(3, vocab, n)
        depth = [0]
        for p in parents[1:]:
            depth.append(depth[p] + 1)
        positions[i, :n] = prefix[i] + np.array(depth)
        mask[i, :n] = tree_mask_from_parents(np.array(parents), words)
        tokens[i, n:] = rng.integers(3, vocab, width - n)  # garbage past the tree: never verified
    num_nodes = np.array([len(p) for p in parents_of], np.int32)
    return types.SimpleNamespace(tokens=tokens, positions=positions, mask=mask, num_nodes=num_nodes)


def path_tokens(tree, parents, b, i):
    out, u = [], i
    while u >= 0:
        out.append(int(tree.tokens[b, u]))
        u = parents[u]
    return out[::-1]


def test_packed_rows_equal_causal_forwards_and_padding_is_harmless(tiny, rng):
    be = tiny.backend
    prompts = [rng.integers(3, 1000, n).tolist() for n in (9, 5, 12)]
    parents_of = [[-1, 0, 0, 1, 3], [-1], [-1, 0, 1, 1]]  # 5, 1 (autoregressive) and 4 rows
    width = 6
    cache = PagedKVCache(be, tiny.num_layers, 16, 16)
    for i, p in enumerate(prompts):
        cache.allocator.reserve(i, len(p) + width)
    tiny.forward(ForwardBatch.causal([0, 1, 2], [0, 0, 0], prompts, last_only=False), cache, output="none")
    prefix = np.array([len(p) for p in prompts])
    before = be.to_host(cache.data).copy()
    runner = ModelRunner(tiny, cache, 64)
    tree = trees(rng, parents_of, width, 1000, prefix)
    rows = np.array([len(p) for p in parents_of])
    for total in (10, 14):  # exact, and a bucket with 4 padding rows (in requests 0 and 1's spare slots)
        step = runner.plan_tree([0, 1, 2], prefix, rows, width, total)
        assert step.key == (3, total, width) and step.rows.sum() == total
        runner.fill_tree(step, tree)
        out = runner.verify(step, "logits")
        logits = be.to_host(out.logits)
        assert logits.shape[0] == total
        for b, parents in enumerate(parents_of):
            for i in range(len(parents)):
                c2 = PagedKVCache(be, tiny.num_layers, 16, 16)
                c2.allocator.reserve(0, 32)
                want = be.to_host(tiny.forward(ForwardBatch.causal([0], [0], [prompts[b] + path_tokens(
                    tree, parents, b, i)]), c2, output="logits").logits)
                assert np.array_equal(logits[step.q_start[b] + i], want[0]), (total, b, i)
        data = be.to_host(cache.data)
        flat, flat0 = (d.reshape(d.shape[0], -1, d.shape[-1]) for d in (data, before))
        for b in range(3):  # the committed prefix of every request is untouched
            slots = cache.allocator.slots(b, np.arange(prefix[b]))
            assert np.array_equal(flat[:, slots], flat0[:, slots]), b
        toks = np.arange(total, dtype=np.int32) * 7
        per = be.to_host(runner.per_slot(step, be.asarray(toks)))
        for b in range(3):
            n = int(step.rows[b])
            assert per[b, :n].tolist() == toks[step.q_start[b]:step.q_start[b] + n].tolist()
            assert (per[b, n:] == -1).all()


def test_plan_tree_slots_come_from_each_requests_pages_and_a_row_past_them_is_named(tiny):
    """The verify's cache slots, from the page table in one lookup, are each request's own
    (PageAllocator.slots of its positions), and a row past a request's reserved pages is an error
    naming the request."""
    cache = PagedKVCache(tiny.backend, tiny.num_layers, 16, 16)
    for rid, n in ((7, 40), (3, 20), (9, 33)):
        cache.allocator.reserve(rid, n)
    runner = ModelRunner(tiny, cache, 64)
    prefix, rows = np.array([30, 5, 20]), np.array([4, 9, 13])
    step = runner.plan_tree([7, 3, 9], prefix, rows, 13, 32)
    want = np.concatenate([cache.allocator.slots(r, np.arange(p, p + n))
                           for r, p, n in zip([7, 3, 9], prefix, step.rows)])
    assert np.array_equal(tiny.backend.to_host(step.inputs.slots), want)
    with pytest.raises(ValueError, match="sequence 3: positions 25..33 outside its reserved pages"):
        runner.plan_tree([7, 3], [30, 25], [4, 9], 9)  # its 20 rows hold 2 pages: 32


@pytest.mark.gpu
def test_packed_verify_equals_ar_through_graphs():
    """With CUDA graphs on the small-M path: a packed verify of chains of unequal lengths (one a
    root alone), in a bucket with padding rows, gives every real row exactly the logits of the AR
    decode step that feeds the same token at the same position; a replay with other lengths in
    the same bucket too (the graph replays any spread of its rows)."""
    import cupy
    from test_small_m_gpu import _decode_cache, _seeded, tp8_model

    model = tp8_model()
    rng = _seeded("packed verify")
    cache, ctx = _decode_cache(model, 4, rng)
    runner = ModelRunner(model, cache, 4200, graphs=True)
    width, total = 16, 40
    for rows in ([7, 1, 16, 9], [1, 1, 12, 3], [16, 16, 1, 5]):
        b = len(rows)
        ids = list(range(b))
        toks = rng.integers(0, 20480, (b, width)).astype(np.int32)
        bits = np.zeros((width, mask_words(width - 1)), np.uint64)
        for i in range(width):
            for j in range(i + 1):  # a chain: every earlier slot is an ancestor
                bits[i, j // 64] |= np.uint64(1) << np.uint64(j % 64)
        tree = types.SimpleNamespace(
            tokens=cupy.asarray(toks), positions=cupy.asarray((ctx[:b, None] + np.arange(width)).astype(np.int32)),
            num_nodes=cupy.asarray(np.array(rows, np.int32)), mask=cupy.asarray(np.tile(bits[None], (b, 1, 1))))
        step = runner.plan_tree(ids, ctx[:b], rows, width, total)
        runner.fill_tree(step, tree)
        got = model.backend.to_host(runner.verify(step).logits, bf16=False).copy()
        assert np.isfinite(got).all()
        for j in range(max(rows)):
            ar = ForwardBatch.causal(ids, ctx[:b] + j, [[int(toks[r, j])] for r in ids])
            want = model.backend.to_host(runner.decode(ar), bf16=False)
            for r in ids:
                if j < rows[r]:
                    assert np.array_equal(want[r], got[step.q_start[r] + j]), f"rows {rows}: request {r} slot {j}"
    assert runner.captures >= 2 and (4, total, width) in runner._shapes


@pytest.mark.parametrize("heads,bm", [(64, 64), (8, 64), (16, 16), (128, 64)])
def test_a_replay_template_holds_any_spread_of_its_rows(rng, heads, bm):
    """kernels/mla_attention.build_plan sizes a replay template's work list for ``cdiv(T * H, BM) + B``
    query tiles plus one item per CTA: every spread of T rows over B requests (a packed verify)
    fits, at any contexts (the CUDA graph replays the plans written into it)."""
    from ddtree_rtc.kernels.mla_attention import split_work
    from ddtree_rtc.reference.mla_attention import validate_batch

    for _ in range(40):
        b = int(rng.integers(1, 9))
        width = int(rng.integers(1, 40))
        total = int(rng.integers(b, b * width + 1))
        rows = np.ones(b, np.int64)
        for _ in range(total - b):  # a random spread of the total, at most width each
            rows[rng.choice(np.flatnonzero(rows < width))] += 1
        ctx = rng.integers(0, 5000, b)
        grid = int(rng.integers(1, 140))
        batch = validate_batch(ctx, rows, np.zeros((b, 1 + int((ctx + rows).max())), np.int32), heads, 1, 1)
        work, *_ = split_work(batch, bm, 64, grid)
        assert len(work) <= -(-total * heads // bm) + b + grid


def test_tree_rows_equal_their_autoregressive_twins_on_numpy(tiny, rng):
    """test_small_m_gpu.tree_verify_vs_twins (the GPU test's tree verify against every node's AR twin,
    whose context holds the node's ancestors' rows by depth) on the numpy backend: the twins are
    built right, and a node's logits are its twin's (float64 attention)."""
    from test_small_m_gpu import tree_verify_vs_twins

    be = tiny.backend
    for budget, b in ((8, 3), (32, 1)):
        cache = PagedKVCache(be, tiny.num_layers, (b + b * (budget + 1)) * 8, 16)
        cache.data[...] = rng.standard_normal(cache.data.shape).astype(cache.data.dtype)
        runner = ModelRunner(tiny, cache, 120, graphs=False)
        bad, compared = tree_verify_vs_twins(tiny, cache, runner, budget, b, rng, vocab=500, ctx_lo=20, ctx_hi=80)
        assert compared > budget and not bad, f"budget {budget}: nodes {bad[:8]} differ from their twins"
