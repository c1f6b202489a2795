#!/usr/bin/env python
"""Skinny-M bf16 linear (cuda_src/linear.cu) against cuBLAS gemmEx on the K2.6 decode shapes.

Shapes: MLA q_a / q_b / kv_a_proj / o_proj, MoE shared expert gate_up / down, router gate, dense MLP
gate_up / down, lm_head; M in {1, 2, 4, 8, 16, 32} (32 is past the skinny kernel: cuBLAS only).
Per case: median µs of both (L2 flushed between runs), % of the streaming-read ceiling on the
weight bytes, the speedup, the skinny plan, and the max |skinny - cublas| in bf16 ulps of the output
scale. Run from the repo root: PYTHONPATH=. python tools/linear_compare.py
"""

from __future__ import annotations

import argparse

import numpy as np

from ddtree_rtc.bench.harness import random_bf16_device, read_ceiling_gbs, time_gpu
from ddtree_rtc.kernels import linear as lin
from ddtree_rtc.kernels._launch import sm_count

SHAPES = (  # name, N, K
    ("q_a", 1536, 7168),
    ("q_b", 12288, 1536),
    ("kv_a", 576, 7168),
    ("o_proj", 7168, 8192),
    ("shared_w13", 4096, 7168),
    ("shared_w2", 7168, 2048),
    ("router", 384, 7168),
    ("dense_w13", 36864, 7168),
    ("dense_w2", 7168, 18432),
    ("lm_head", 163840, 7168),
)
MS = (1, 2, 4, 8, 16, 32)


def _f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def main(argv=None) -> None:
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated shape names")
    args = ap.parse_args(argv)
    ceiling = read_ceiling_gbs()
    sms = sm_count()
    print(f"read ceiling {ceiling:.0f} GB/s, {sms} SMs")
    want = set(args.shapes.split(","))
    lines = []
    for seed, (name, n, k) in enumerate(SHAPES):
        if name not in want:
            continue
        w = random_bf16_device((n, k), scale=0.02, seed=100 + seed)
        wbytes = w.nbytes
        for m in MS:
            x = random_bf16_device((m, k), seed=200 + m)
            res = {}
            for impl in ("skinny", "cublas"):
                if impl == "skinny" and lin.route(x, w, "skinny") != "skinny":
                    continue
                out = cupy.empty((m, n), dtype=cupy.uint16)
                us = time_gpu(lambda x=x, w=w, out=out, impl=impl: lin.linear(x, w, out=out, impl=impl),
                              iters=args.iters).median_us
                res[impl] = (us, wbytes / us / 1e3 / ceiling * 100.0, out)
            tc, pc, oc = res["cublas"]
            if "skinny" in res:
                ts, ps, os_ = res["skinny"]
                p = lin.skinny_plan(m, n, k, sms)
                a, b = _f32(os_.get()), _f32(oc.get())
                rel = float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))
                sk = f"{ts:>9.1f} {ps:>6.1f}% | {tc / ts:>6.2f}x | wn{p.warps_n} s{p.split} g{p.grid:<5} {rel:.1e}"
            else:
                sk = f"{'-':>9} {'-':>7} | {'-':>7} | {'-':>18} {'-':>7}"
            lines.append(f"{name:>10} {n:>6} {k:>6} {m:>3} {wbytes / 1e6:>8.1f} | {tc:>9.1f} {pc:>6.1f}% | {sk}")
            print(lines[-1], flush=True)
    print()
    print(f"{'shape':>10} {'N':>6} {'K':>6} {'M':>3} {'MB':>8} | cublas us  %ceil | skinny us  %ceil | speedup "
          "| plan               max|d|/max|y|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
