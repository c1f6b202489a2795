"""Per-step compare of the INT4 MoE layer at K2.6 dims on the GPU (< 60 s): moe_route and moe_align
alone, then moe_experts with the token tile forced to nt 1, forced to the large list, and chosen per
expert on the device (the default plan), for the layer bench's skewed routing and for uniform routing. Each timed as a
CUDA graph, median of --iters; % of the read ceiling counts the touched experts' bytes; the outputs
of all variants are compared with the first one's (max abs difference, relative to its max)."""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from ddtree_rtc.bench.harness import read_ceiling_gbs, time_gpu
from ddtree_rtc.bench.moe import SCALING, TOP_K, graphed, int4_experts_device, uniform_logits
from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan
from ddtree_rtc.kernels.moe_routing import moe_align, moe_route
from ddtree_rtc.testing import as_f64


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ms", default="1,16,256,1024")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--routings", default="bench,uniform")
    args = ap.parse_args()
    variants = [("nt1", {"nt": 1}), ("nt4", {"nt": 4}), ("auto", {})]
    e, h, inter = 384, 7168, 2048
    experts = int4_experts_device(e, h, inter, 0)
    ceil = read_ceiling_gbs()
    measure = lambda fn: time_gpu(graphed(fn), iters=args.iters).median_us  # noqa: E731
    rows = []
    for routing in args.routings.split(","):
        rng = cupy.random.default_rng(1)
        bias = (rng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
        for m in (int(v) for v in args.ms.split(",")):
            if routing == "bench":
                logits, b = rng.standard_normal((m, e), dtype=cupy.float32), bias
            else:
                logits, b = uniform_logits(m, e, 1 + m), None
            ids = cupy.empty((m, TOP_K), cupy.int32)
            w = cupy.empty((m, TOP_K), cupy.float32)
            route = lambda logits=logits, b=b, ids=ids, w=w: moe_route(  # noqa: E731
                logits, b, TOP_K, 1, 1, True, SCALING, out_ids=ids, out_weights=w)
            route()
            ids_h = ids.get()
            counts = np.bincount(ids_h.reshape(-1), minlength=e)
            touched = int((counts > 0).sum())
            x = cupy.asarray(np.random.default_rng(m).integers(0x3C00, 0x3F00, (m, h)).astype(np.uint16))
            y = cupy.empty((m, h), cupy.uint16)
            nbytes = touched * experts.expert_nbytes() + 2 * x.nbytes + logits.nbytes
            row = {"routing": routing, "M": m, "touched": touched, "max": int(counts.max()), "route": measure(route)}
            first = None
            for name, kw in variants:
                plan = moe_plan(m, e, TOP_K, h, inter, **kw)
                al = plan.align
                if name == "auto":
                    row["tiles-" + name] = plan.tiles
                if name == "auto":
                    row["align"] = measure(lambda al=al, ids=ids: moe_align(
                        ids, e, al.block, out=al, check_ids=False, large_block=al.large_block,
                        large_above=al.large_above))
                t = measure(lambda plan=plan, x=x, ids=ids, w=w, y=y: moe_experts(
                    x, ids, w, experts, out=y, plan=plan, check_ids=False))
                yf = as_f64(y, bf16_bits=True)
                if first is None:
                    first = yf
                row["diff-" + name] = float(np.abs(yf - first).max() / max(float(np.abs(first).max()), 1e-30))
                row[name] = t
                row[name + "%"] = 100 * nbytes / (t + row["route"]) / 1e3 / ceil
            rows.append(row)
            print(row, flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"\nread ceiling {ceil:.0f} GB/s; µs per step (CUDA graph); % = layer (route + experts) of the ceiling")
    names = [n for n, _ in variants]
    print("routing | M | touched | max pairs | route µs | align µs | " + " | ".join(f"{n} µs (%)" for n in names)
          + " | max rel diff to nt1")
    for r in rows:
        print(f"{r['routing']} | {r['M']} | {r['touched']} | {r['max']} | {r['route']:.1f} | {r['align']:.1f} | "
              + " | ".join(f"{r[k]:.1f} ({r[k + '%']:.0f}%)" for k in names)
              + " | " + " ".join(f"{r['diff-' + k]:.1e}" for k in names[1:]))


if __name__ == "__main__":
    main()
