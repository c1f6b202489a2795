#!/usr/bin/env python
"""MLA attention tile variants side by side: decode (N = 1) at 8 heads (a TP8 rank) and 64 heads
(the whole K2.6 model), batch 1 / 8 / 32, context 4k / 16k, plus one 64-head tree verify (b8, N16).
Both variants of a case run the same inputs; the new one's output is checked against the old
one's (so a broken kernel shows as a mismatch, not as a fast time). Time = attention + merge
launch, L2 flushed between runs; % = cache bytes / time against the read ceiling of this run.

    PYTHONPATH=. python tools/mla_decode_compare.py
"""

from __future__ import annotations

import numpy as np

from ddtree_rtc.bench.attention import PAGE, ROW, SCALE, Case
from ddtree_rtc.bench.harness import random_bf16_device, read_ceiling_gbs, time_gpu

CASES = [(h, ctx, b, 1) for h in (8, 64) for b in (1, 8, 32) for ctx in (4096, 16384)] + [(64, 4096, 8, 16)]
def variants(heads: int, nodes: int) -> tuple[str, ...]:
    """The old default first (the reference of the check), then the new."""
    return ("m16" if heads * nodes <= 16 else "m64", "d16")


def main():
    import cupy
    from ml_dtypes import bfloat16

    from ddtree_rtc.kernels.mla_attention import DV, build_plan, mla_attention
    from ddtree_rtc.reference.mla_attention import validate_batch

    ceiling = read_ceiling_gbs()
    print(f"read ceiling {ceiling:.0f} GB/s")
    rows = []
    for heads, ctx, batch, nodes in CASES:
        case = Case(heads, ctx, batch, nodes)
        b = validate_batch(np.full(batch, ctx), np.full(batch, nodes), case.page_table, heads, PAGE,
                           case.num_pages, case.mask)
        cache = random_bf16_device((case.num_pages, PAGE, ROW), seed=1)
        t = batch * nodes
        q = random_bf16_device((t, heads, ROW), scale=0.3, seed=2)
        first = None
        for variant in variants(heads, nodes):
            plan = build_plan(b, variant=variant)
            out = cupy.empty((t, heads, DV), cupy.uint16)
            lse = cupy.empty((t, heads), cupy.float32)

            def fn(plan=plan, q=q, cache=cache, out=out, lse=lse):
                mla_attention(plan, q, cache, SCALE, out=out, lse=lse)

            timing = time_gpu(fn, warmup=3, iters=20)
            o = out.view(cupy.uint16).get()
            ok = "ref"
            if first is None:
                first = (o, lse.get())
            else:
                a = o.view(bfloat16).astype(np.float32)
                r = first[0].view(bfloat16).astype(np.float32)
                err = float(np.abs(a - r).max() / np.abs(r).max()) if np.isfinite(a).all() else float("inf")
                lerr = float(np.abs(lse.get() - first[1]).max())
                ok = "ok" if err < 1e-2 and lerr < 1e-3 else f"MISMATCH o (rel) {err:.3g} lse {lerr:.3g}"
            gbs = case.kv_bytes() / timing.median_us / 1e3
            rows.append((case.name, variant, timing.median_us, gbs / ceiling * 100, plan.num_work, plan.num_merge, ok))
            print(f"  {case.name} {variant}: {timing.median_us:.1f} µs", flush=True)
    print(f"\n{'case':<22} {'variant':<7} {'µs':>8} {'% read':>7} {'items':>6} {'merges':>6}  check")
    for name, variant, us, pct, items, merges, ok in rows:
        print(f"{name:<22} {variant:<7} {us:8.1f} {pct:6.1f}% {items:6d} {merges:6d}  {ok}")


if __name__ == "__main__":
    main()
