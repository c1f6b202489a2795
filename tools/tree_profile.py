"""TREE_PROFILE stamps of the tree_build kernel (ddtree_rtc/cuda_src/tree_build.cu): SM cycles per
phase of each request (staged, built, written) at one batch and budget, on bench tree's Zipf drafter
log-probs (depth 7). A diagnostics build (TREE_PROFILE=1), GPU only:

    PYTHONPATH=. python tools/tree_profile.py --batch 32 --budget 64

Stamps sit at tree_prof[32 * request + i]: 0 start, 1 staged, 2 built, 3 written (one block per
request); 4 and 5 the heap loop's start and end where a request fell back to it.
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args(argv)
    if not 1 <= args.batch <= 1024:
        raise SystemExit("--batch: 1..1024 (the stamps hold 1024 requests)")

    import cupy

    from ddtree_rtc.backend import Backend
    from ddtree_rtc.bench.tree import DEPTH, VOCAB, zipf_logits
    from ddtree_rtc.engine.decode.tree import TreeBuffers, TreeShape
    from ddtree_rtc.kernels import registry
    from ddtree_rtc.kernels import tree_build as tb

    tb.module = lambda name, **p: registry.module(name, TREE_PROFILE=1, **p)  # the diagnostics build
    be = Backend("cuda")
    bufs = TreeBuffers(be, TreeShape(batch=args.batch, budget=args.budget, depth=DEPTH, vocab=VOCAB))
    logits = zipf_logits(args.batch, DEPTH, VOCAB, seed=args.batch * 1000 + args.budget)
    rng = np.random.default_rng(0)
    roots = cupy.asarray(rng.integers(0, VOCAB, args.batch).astype(np.int32))
    prefix = cupy.asarray(rng.integers(100, 4000, args.batch).astype(np.int32))
    bufs.build(logits, roots, prefix)  # top-k into bufs.logq / bufs.ids (and a default build)
    inputs = (bufs.logq, bufs.ids, roots, bufs.budgets, bufs.depths, prefix, args.budget)
    prof_ptr = tb.module("tree_build")._module.get_global_var("tree_prof")
    prof_dev = cupy.ndarray((1024, 32), dtype=cupy.int64, memptr=prof_ptr)
    for _ in range(3):  # the last run's stamps
        prof_dev.fill(0)
        tb.tree_build(*inputs, out=bufs.tree)
    cupy.cuda.runtime.deviceSynchronize()
    p = prof_dev.get()[: args.batch]
    staged, built, written = p[:, 1] - p[:, 0], p[:, 2] - p[:, 1], p[:, 3] - p[:, 2]
    print(f"batch {args.batch} budget {args.budget}: SM cycles per request, "
          f"mean (max) over the batch")
    for name, v in (("staged", staged), ("built", built), ("written", written), ("total", p[:, 3] - p[:, 0])):
        print(f"  {name:8s} {v.mean():9.0f} ({v.max()})")


if __name__ == "__main__":
    main()
