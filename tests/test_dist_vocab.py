"""Sampling and the drafter's top-k over vocabulary slices (ddtree_rtc.parallel.vocab): the token and the
(log-prob, id) lists equal one rank's over the whole row bit for bit, and only (value, id) pairs and
per-row scalars cross ranks (the byte count of a round is checked exactly)."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16
from test_dist import NEW, _load, run_ranks

from ddtree_rtc.backend import Backend
from ddtree_rtc.engine.engine import Engine
from ddtree_rtc.engine.request import Request
from ddtree_rtc.parallel import vocab as dv
from ddtree_rtc.pipeline.runner import greedy_continuation
from ddtree_rtc.reference.sampling import position_keys, sample
from ddtree_rtc.reference.topk import topk_logprobs
from ddtree_rtc.speculative.drafters import OracleDrafter


@pytest.fixture(scope="module")
def one_rank(tiny_dir):
    from ddtree_rtc.model.target import TargetModel

    return TargetModel.load(tiny_dir, Backend("numpy", quiet=True))


@pytest.fixture(scope="module")
def prompts(one_rank):
    rng = np.random.default_rng(12)
    return [rng.integers(0, one_rank.cfg.vocab_size, n).tolist() for n in (9, 6, 12)]


def _logits(rng, rows, vocab, poison=True):
    l = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if poison:
        l[0] = np.nan  # all NaN: -1
        l[1, 5] = np.inf  # +inf: argmax of the raw row
        l[2, : vocab * 3 // 5] = -np.inf  # most of the row (rank 0's whole slice) impossible
        l[3, 7:9] = l[3].max() + 1  # a tie across the top: the smaller id
        l[4, vocab - 3] = np.nan
    return l.astype(bfloat16)


def _split(world, vocab):
    part = vocab // world
    return [(r * part, (r + 1) * part) for r in range(world)]


@pytest.mark.parametrize("vocab", [1024, 960, 48])
def test_sharded_sample_equals_the_whole_rows(rng, vocab):
    rows = 9
    l = _logits(rng, rows, vocab)
    temp = rng.choice([0.0, 0.3, 0.8, 1.7], rows).astype(np.float32)
    temp[5:] = 0.8
    top_p = rng.choice([1.0, 0.95, 0.5, 0.0], rows).astype(np.float32)
    keys = position_keys(11, rng.integers(0, 2**40, rows), rng.integers(0, 500, rows))
    want = sample(l, temp, top_p, 0, keys=keys)
    for world in (1, 2, 3, 4):
        if vocab % world:
            continue
        got, _ = vocab_run(world, vocab, lambda lo, hi: dv.sample_steps(np, l[:, lo:hi], lo, temp, top_p, keys))
        for r, g in enumerate(got):
            assert np.array_equal(g, want), f"{world} ranks, rank {r}: {g} vs {want}"


def vocab_run(world, n, make):
    return dv.simulate([make(lo, hi) for lo, hi in _split(world, n)])


@pytest.mark.parametrize("vocab,k", [(1024, 16), (1024, 200), (960, 7), (1024, 1)])
def test_sharded_topk_equals_the_whole_rows(rng, vocab, k):
    be = Backend("numpy", quiet=True)
    l = _logits(rng, 6, vocab, poison=False).reshape(2, 3, vocab)
    l[0, 0, :700] = -np.inf
    l[1, 2, 100:110] = l[1, 2].max()  # a ten-way tie at the top: ids ascending
    want_q, want_i = topk_logprobs(l, k)
    for world in (2, 4, 3):
        if vocab % world:
            continue
        got, _ = vocab_run(world, vocab, lambda lo, hi: dv.topk_steps(be, l[..., lo:hi], lo, vocab, k))
        exact = dv.pairwise_combine([0.0] * world, [lo for lo, _ in _split(world, vocab)] + [vocab])[1]
        for q, i in got:
            assert np.array_equal(i, want_i)
            if exact:  # the shards are whole blocks of numpy's pairwise sum: the same bits
                assert np.array_equal(q.view(np.uint32), want_q.view(np.uint32))
            else:
                np.testing.assert_allclose(q, want_q, rtol=1e-6)


def test_pairwise_combine_follows_numpys_summation(rng):
    x = np.exp(rng.standard_normal((4, 1024)))
    for world in (2, 4):
        b = [r * 1024 // world for r in range(world + 1)]
        total, exact = dv.pairwise_combine([x[:, lo:hi].sum(-1) for lo, hi in zip(b, b[1:])], b)
        assert exact and np.array_equal(total, x.sum(-1))
    assert not dv.pairwise_combine([1.0, 2.0, 3.0], [0, 100, 200, 300])[1]


def _sampled(comm, directory, prompts, mode, top_p):
    model = _load(comm, directory, False)
    cont = greedy_continuation(model, NEW + 4, page_size=16)
    drafter = OracleDrafter(model.backend, model.cfg.vocab_size, 4, cont, accept_p=0.7, seed=3)
    eng = Engine(model, max_batch=len(prompts), page_size=16, max_context=64, mode=mode, drafter=drafter,
                 budget=6, seed=2)
    per_round = []
    run = eng.round.run

    def counted(reqs, eos):
        before = dict(model.comm.stats.bytes)
        run(reqs, eos)
        per_round.append((len(reqs), {k: v - before.get(k, 0) for k, v in model.comm.stats.bytes.items()}))

    eng.round.run = counted
    reqs = [Request(i, p, NEW, temperature=0.8, top_p=top_p) for i, p in enumerate(prompts)]
    return [r.output for r in eng.run(reqs)], per_round


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_round_exchanges_only_pairs_and_matches_one_rank(tiny_dir, one_rank, prompts, top_p):
    """A DDTree round at T = 0.8 on 2 ranks: the same tokens as one rank; the all-gathers carry per
    sampled row (12 B: raw max and id, max of z) + (8 B: the winning (score, id)) and, with top_p < 1,
    8 B of mass + 8 x 16 prefix masses; per drafted row k (logit, id) pairs and the max (4 + 8k B),
    then one fp64 sum (8 B). No logits row (2 x 1024 B) is ever gathered."""
    cont = greedy_continuation(one_rank, NEW + 4, page_size=16)
    drafter = OracleDrafter(one_rank.backend, one_rank.cfg.vocab_size, 4, cont, accept_p=0.7, seed=3)
    eng = Engine(one_rank, max_batch=len(prompts), page_size=16, max_context=64, mode="ddtree", drafter=drafter,
                 budget=6, seed=2)
    want = [r.output for r in eng.run([Request(i, p, NEW, temperature=0.8, top_p=top_p)
                                       for i, p in enumerate(prompts)])]
    depth, k, slots = 4, 6, 7
    for outs, per_round in run_ranks(2, _sampled, tiny_dir, prompts, "ddtree", top_p):
        assert outs == want
        assert per_round
        for b, got in per_round:
            sample_rows, draft_rows = b * slots, b * depth
            per_sample = 12 + 8 + (8 + 8 * 16 * 8 if top_p < 1 else 0)
            assert got["all_gather"] == sample_rows * per_sample + draft_rows * (4 + 8 * k + 8)
            assert set(got) <= {"all_gather", "all_reduce"}  # all-reduces: the verify's activations


@pytest.mark.gpu
def test_sharded_sample_on_the_gpu_equals_the_kernel(rng):
    """The cupy run of the sharded sampler (the CUDA backend's path) against sampling.cu's kernel on
    the whole rows: the same tokens."""
    import cupy

    be = Backend("cuda")
    vocab, rows = 4096, 11
    l = be.asarray(_logits(rng, rows, vocab))
    temp = rng.choice([0.0, 0.7, 1.3], rows).astype(np.float32)
    top_p = rng.choice([1.0, 0.9, 0.3], rows).astype(np.float32)
    keys = cupy.asarray(position_keys(5, rng.integers(0, 2**40, rows), rng.integers(0, 500, rows)))
    want = be.sample(l, cupy.asarray(temp), cupy.asarray(top_p), 0, keys=keys).get()
    for world in (2, 4, 8):
        got, _ = dv.simulate([dv.sample_steps(cupy, cupy.ascontiguousarray(l[:, lo:hi]), lo, temp, top_p, keys)
                              for lo, hi in _split(world, vocab)], xp=cupy)
        for g in got:
            assert np.array_equal(g.get(), want), f"{world} ranks"


@pytest.mark.gpu
def test_sharded_topk_on_the_gpu_equals_the_kernel(rng):
    """The cupy run of the sharded top-k (each slice through the public top-k op) against topk.cu on
    the whole rows: the same ids; log-probs to fp32 rounding (the kernel sums exp in fp32)."""
    import cupy

    be = Backend("cuda")
    vocab, k = 163840 // 8 * 2, 64
    l = be.asarray(_logits(rng, 6, vocab, poison=False).reshape(2, 3, vocab))
    want_q, want_i = be.topk_logprobs(l, k)
    for world in (2, 8):
        got, _ = dv.simulate([dv.topk_steps(be, cupy.ascontiguousarray(l[..., lo:hi]), lo, vocab, k)
                              for lo, hi in _split(world, vocab)], xp=cupy)
        for q, i in got:
            assert np.array_equal(i.get(), want_i.get())
            np.testing.assert_allclose(q.get(), want_q.get(), rtol=2e-6, atol=2e-6)
