#!/usr/bin/env python
"""Vocabulary top-k: the stream, chunked and slices kernels side by side on drafter-shaped logits.

Batch {1, 8, 32, 64} x k {16, 64, 256, 512}, depth 7, V = 163840, bf16 Zipf logits
(ddtree_rtc.bench.tree.zipf_logits), plus one fp32 case. Per case: each variant's median time
(L2 flushed between runs) and % of the streaming-read ceiling on the logits' bytes (stream takes
k <= 256 only), and whether every variant's ids and log-probs equal the slices kernel's.
Run from the repo root: PYTHONPATH=. python tools/topk_compare.py
"""

from __future__ import annotations

import argparse

import numpy as np

from ddtree_rtc.bench.harness import read_ceiling_gbs, time_gpu
from ddtree_rtc.bench.tree import DEPTH, VOCAB, zipf_logits
from ddtree_rtc.kernels import topk

BATCHES = (1, 8, 32, 64)
KS = (16, 64, 256, 512)
FP32_CASE = (32, 64)  # (batch, k)


def run_case(logits, k: int, iters: int, ceiling: float) -> dict:
    import cupy

    lead = logits.shape[:-1]
    out = {}
    results = {}
    for variant in topk.VARIANTS:
        if variant == "stream" and k > topk.STREAM_MAX_K:
            continue
        ws = topk.topk_workspace(logits.shape, k, variant=variant)
        logq = cupy.empty((*lead, k), dtype=cupy.float32)
        ids = cupy.empty((*lead, k), dtype=cupy.int32)

        def fn(ws=ws, logq=logq, ids=ids):
            topk.topk_logprobs(logits, k, out_logq=logq, out_ids=ids, workspace=ws)

        us = time_gpu(fn, iters=iters).median_us
        out[variant] = (us, logits.nbytes / us / 1e3 / ceiling * 100.0)
        results[variant] = (logq.get(), ids.get())
    lq_ref, id_ref = results["slices"]
    out["ids_equal"] = all(np.array_equal(ids, id_ref) for _, ids in results.values())
    out["max_logq_diff"] = max(float(np.abs(lq - lq_ref).max()) for lq, _ in results.values())
    return out


def cell(r: dict, variant: str) -> str:
    if variant not in r:
        return f"{'-':>9} {'-':>7}"
    us, pct = r[variant]
    return f"{us:>9.1f} {pct:>6.1f}%"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    ceiling = read_ceiling_gbs()
    print(f"read ceiling {ceiling:.0f} GB/s; depth {DEPTH}, vocab {VOCAB}")
    cases = [(b, k, "bf16") for b in BATCHES for k in KS] + [(*FP32_CASE, "fp32")]
    logits_by_batch = {}
    lines = []
    for batch, k, dtype in cases:
        if batch not in logits_by_batch:
            logits_by_batch[batch] = zipf_logits(batch, DEPTH, VOCAB, seed=batch)
        logits = logits_by_batch[batch]
        if dtype == "fp32":
            import cupy

            logits = (logits.astype(cupy.uint32) << 16).view(cupy.float32)
        r = run_case(logits, k, args.iters, ceiling)
        cells = " | ".join(cell(r, v) for v in topk.VARIANTS)
        lines.append(f"{batch:>5} {k:>4} {dtype:>5} {logits.nbytes / 1e6:>8.1f} | {cells} | "
                     f"{str(r['ids_equal']):>5} {r['max_logq_diff']:.1e}")
        print(lines[-1], flush=True)
    print()
    heads = " | ".join(f"{v + ' us':>9} {'%ceil':>7}" for v in topk.VARIANTS)
    print(f"batch    k dtype       MB | {heads} | ids== max|dlogq|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
