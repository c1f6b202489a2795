#!/usr/bin/env python
"""Tree build and accept, every kernel variant: time (CUDA events, L2 flushed, median) at batch
{1, 8, 32, 64} x budget {16, 64, 256, 512}, depth 7, V = 163840 Zipf drafter logits through
TreeBuffers, with the heapq reference's time, a bit-for-bit check of every build variant against
it, and the latency floor of one and of two back-to-back kernels of the same grid (launch plus one
dependent memory trip each; bench_ceiling.cu's latency_floor_kernel). Prints one table; about a
minute on an H200."""

from __future__ import annotations

import time

import numpy as np

from ddtree_rtc.backend import Backend
from ddtree_rtc.bench.harness import latency_floor_us, time_gpu
from ddtree_rtc.bench.tree import DEPTH, VOCAB, target_choices, zipf_logits
from ddtree_rtc.kernels.tree_accept import tree_accept
from ddtree_rtc.kernels.tree_build import VARIANTS, default_variant, tree_build_variant
from ddtree_rtc.reference.tree_build import tree_build as ref_tree_build
from ddtree_rtc.speculative.tree import TreeBuffers, TreeShape

BATCHES = (1, 8, 32, 64)
BUDGETS = (16, 64, 256, 512)
TREE_FIELDS = ("tokens", "parents", "node_depth", "positions", "num_nodes", "mask", "first_child",
               "next_sibling", "scores")


def same_tree(got, ref) -> bool:
    for name in TREE_FIELDS:
        g, r = getattr(got, name).get(), getattr(ref, name)
        if name == "scores":
            g, r = g.view(np.int64), r.view(np.int64)
        if not np.array_equal(g, r):
            return False
    return True


def case(batch: int, budget: int, rng) -> dict:
    import cupy

    be = Backend("cuda")
    bufs = TreeBuffers(be, TreeShape(batch=batch, budget=budget, depth=DEPTH, vocab=VOCAB))
    logits = zipf_logits(batch, DEPTH, VOCAB, seed=batch * 1000 + budget)
    roots = cupy.asarray(rng.integers(0, VOCAB, batch).astype(np.int32))
    prefix = cupy.asarray(rng.integers(100, 4000, batch).astype(np.int32))
    bufs.build(logits, roots, prefix)
    inputs = (bufs.logq, bufs.ids, roots, bufs.budgets, bufs.depths, prefix, budget)
    host = [a.get() for a in inputs[:6]] + [budget]
    t0 = time.perf_counter()
    ref = ref_tree_build(*host)
    ref_us = (time.perf_counter() - t0) * 1e6
    row = {"batch": batch, "budget": budget, "heapq_us": ref_us}
    for v in VARIANTS:
        row[f"build_{v}_us"] = time_gpu(lambda v=v: tree_build_variant(v, *inputs, out=bufs.tree)).median_us
        tree_build_variant(v, *inputs, out=bufs.tree)
        row[f"build_{v}_ok"] = same_tree(bufs.tree, ref)
    choices = cupy.asarray(target_choices(bufs.tree, rng))
    row["accept_us"] = time_gpu(lambda: tree_accept(bufs.tree, choices, out=bufs.result)).median_us
    row["floor1_us"], row["floor2_us"] = latency_floor_us(batch), latency_floor_us(batch, kernels=2)
    best = default_variant(budget)
    row["both_new_us"] = time_gpu(lambda: (tree_build_variant(best, *inputs, out=bufs.tree),
                                           tree_accept(bufs.tree, choices, out=bufs.result))).median_us
    return row


def main():
    rng = np.random.default_rng(0)
    rows = [case(b, n, rng) for b in BATCHES for n in BUDGETS]
    head = ("batch", "budget", "heapq us", *(f"build {v}" for v in VARIANTS), "accept",
            "default+table", "x heapq", "floor 1 / 2 kernels", f"exact {'/'.join(VARIANTS)}")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join((f"{r['batch']}", f"{r['budget']}", f"{r['heapq_us']:.0f}",
                          *(f"{r[f'build_{v}_us']:.2f}" for v in VARIANTS), f"{r['accept_us']:.2f}",
                          f"{r['both_new_us']:.2f}",
                          f"{r['heapq_us'] / r['both_new_us']:.0f}", f"{r['floor1_us']:.2f} / {r['floor2_us']:.2f}",
                          "/".join(str(r[f"build_{v}_ok"]) for v in VARIANTS))))


if __name__ == "__main__":
    main()
