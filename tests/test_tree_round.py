"""The tree half of a round through ddtree_rtc.engine.decode.tree (top-k -> build -> accept) on both
backends, chain mode, and (GPU) capture of the whole step in a CUDA graph."""

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.decode.tree import TreeBuffers, TreeShape
from ddtree_rtc.reference.topk import topk_logprobs
from ddtree_rtc.reference.tree_accept import tree_accept
from ddtree_rtc.reference.tree_build import tree_build


def drafter_logits(rng, batch, depth, vocab):
    ranks = np.stack([rng.permutation(vocab) for _ in range(batch * depth)]) + 1.0
    x = -1.2 * np.log(ranks) + 0.2 * rng.standard_normal(ranks.shape)
    return x.reshape(batch, depth, vocab).astype(bfloat16)


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def first_child_choices(tree):
    """Choices that follow every node's first child, so the walk goes to the deepest rank-0 path."""
    t, fc = host(tree.tokens), host(tree.first_child)
    return np.where(fc >= 0, np.take_along_axis(t, np.maximum(fc, 0), 1), 7).astype(np.int32)


def test_numpy_round_matches_the_references(rng):
    be = Backend("numpy")
    shape = TreeShape(batch=3, budget=20, depth=5, vocab=300)
    bufs = TreeBuffers(be, shape)
    bufs.set_limits(budgets=[20, 3, 0], depths=[5, 2, 5])
    logits = drafter_logits(rng, 3, 5, 300)
    roots, prefix = np.array([1, 2, 3], np.int32), np.array([10, 0, 99], np.int32)
    tree = bufs.build(logits, roots, prefix)
    logq, ids = topk_logprobs(logits, 20)
    ref = tree_build(logq, ids, roots, np.array([20, 3, 0], np.int32), np.array([5, 2, 5], np.int32), prefix, 20)
    assert np.array_equal(tree.tokens, ref.tokens) and np.array_equal(tree.mask, ref.mask)
    assert tree.num_nodes.tolist() == [21, 4, 1]
    acc = bufs.accept(first_child_choices(tree))
    want = tree_accept(ref, first_child_choices(ref))
    assert acc is bufs.result and np.array_equal(acc.accepted, want.accepted)
    assert acc.accept_len[2] == 1 and (acc.accept_len[:2] >= 2).all()


def test_chain_mode_is_the_top1_path(rng):
    be = Backend("numpy")
    bufs = TreeBuffers(be, TreeShape(batch=2, budget=64, depth=7, vocab=500, chain=True))
    assert bufs.shape.k == 1 and bufs.shape.max_budget == 7
    logits = drafter_logits(rng, 2, 7, 500)
    tree = bufs.build(logits, np.array([4, 5], np.int32), np.zeros(2, np.int32))
    top1 = np.argmax(logits.astype(np.float32), axis=-1)
    assert np.array_equal(tree.tokens[:, 1:], top1) and tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5, 6]


def test_limits_go_to_the_device_only_when_they_change(rng):
    """A round sets the limits every time, mostly to the same values: those make no copy (each is
    host time while the device may wait); other values are copied and the next build uses them."""
    be = Backend("numpy")
    copies = []
    asarray = be.asarray
    be.asarray = lambda a: copies.append(np.array(a)) or asarray(a)
    bufs = TreeBuffers(be, TreeShape(batch=2, budget=8, depth=3, vocab=40))
    logits = drafter_logits(rng, 2, 3, 40)
    roots, prefix = np.array([1, 2], np.int32), np.zeros(2, np.int32)
    for budgets, copied, nodes in (([8, 8], 2, [9, 9]), ([8, 8], 2, [9, 9]), ([2, 8], 4, [3, 9]),
                                   ([2, 8], 4, [3, 9]), ([2, 5], 6, [3, 6])):
        bufs.set_limits(budgets=np.array(budgets))
        assert len(copies) == copied, budgets  # the first two at construction: the maxima
        assert bufs.budgets.tolist() == budgets and bufs.build(logits, roots, prefix).num_nodes.tolist() == nodes


def test_limits_and_shape_are_validated():
    with pytest.raises(ValueError, match="depth=17"):
        TreeShape(batch=1, budget=8, depth=17, vocab=10)
    with pytest.raises(ValueError, match="budget=600"):
        TreeShape(batch=1, budget=600, depth=7, vocab=10)
    bufs = TreeBuffers(Backend("numpy"), TreeShape(batch=2, budget=8, depth=3, vocab=10))
    assert bufs.shape.k == 8
    with pytest.raises(ValueError, match=r"budgets: values must be in 0..8"):
        bufs.set_limits(budgets=[9, 1])
    with pytest.raises(ValueError, match="depths: expected 2 integers"):
        bufs.set_limits(depths=[1, 2, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [False, True])
def test_cuda_round_matches_the_references(rng, chain):
    be = Backend("cuda")
    b, depth, vocab = 8, 7, 163_840
    bufs = TreeBuffers(be, TreeShape(batch=b, budget=64, depth=depth, vocab=vocab, chain=chain))
    limits = rng.integers(0, bufs.shape.max_budget + 1, b)
    bufs.set_limits(budgets=limits)
    logits = drafter_logits(rng, b, depth, vocab)
    roots, prefix = rng.integers(0, vocab, b).astype(np.int32), rng.integers(0, 4096, b).astype(np.int32)
    tree = bufs.build(be.asarray(logits), be.asarray(roots), be.asarray(prefix))
    logq, ids = host(bufs.logq), host(bufs.ids)
    assert np.array_equal(ids, topk_logprobs(logits, bufs.shape.k)[1])
    ref = tree_build(logq, ids, roots, limits.astype(np.int32), np.full(b, depth, np.int32), prefix,
                     bufs.shape.max_budget)  # the GPU's own log-probs: the builder must match exactly
    for name in ("tokens", "parents", "positions", "num_nodes", "mask", "first_child", "next_sibling"):
        assert np.array_equal(host(getattr(tree, name)), getattr(ref, name)), name
    choices = first_child_choices(ref)
    acc = bufs.accept(be.asarray(choices))
    want = tree_accept(ref, choices)
    assert np.array_equal(host(acc.accepted), want.accepted) and np.array_equal(host(acc.emitted), want.emitted)


@pytest.mark.gpu
def test_cuda_round_replays_as_a_graph(rng):
    """Build and accept captured as CUDA graphs (no sync, no allocation inside) and replayed on new
    logits give the same trees as the references."""
    import cupy

    be = Backend("cuda")
    b, depth, vocab = 4, 7, 32_000
    bufs = TreeBuffers(be, TreeShape(batch=b, budget=32, depth=depth, vocab=vocab))
    logits = cupy.empty((b, depth, vocab), dtype=cupy.uint16)
    roots, prefix = cupy.arange(b, dtype=cupy.int32), cupy.full((b,), 50, dtype=cupy.int32)
    choices = cupy.zeros((b, 33), dtype=cupy.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        logits[...] = cupy.asarray(drafter_logits(rng, b, depth, vocab).view(np.uint16))
        bufs.build(logits, roots, prefix)  # eager first: loads the modules, raises shared-memory limits
        bufs.accept(choices)
        stream.synchronize()
        stale = host(bufs.tree.tokens).copy()
        stream.begin_capture()
        bufs.build(logits, roots, prefix)
        build_graph = stream.end_capture()
        stream.begin_capture()
        bufs.accept(choices)
        accept_graph = stream.end_capture()
        fresh = drafter_logits(rng, b, depth, vocab)
        logits[...] = cupy.asarray(fresh.view(np.uint16))
        build_graph.launch(stream)
        stream.synchronize()
        choices[...] = cupy.asarray(first_child_choices(bufs.tree))
        accept_graph.launch(stream)
        stream.synchronize()
    _, ids = topk_logprobs(fresh, 32)
    assert np.array_equal(host(bufs.ids), ids)
    ref = tree_build(host(bufs.logq), ids, np.arange(b, dtype=np.int32), np.full(b, 32, np.int32),
                     np.full(b, depth, np.int32), np.full(b, 50, np.int32), 32)
    assert np.array_equal(host(bufs.tree.tokens), ref.tokens) and np.array_equal(host(bufs.tree.mask), ref.mask)
    assert not np.array_equal(stale, ref.tokens), "the replay read the new logits"
    want = tree_accept(ref, first_child_choices(ref))
    assert np.array_equal(host(bufs.result.emitted), want.emitted)
