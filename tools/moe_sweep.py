"""Sweep the INT4 MoE plan knobs (token tiles: nt 1 / nt 4 forced or per expert above a pair
threshold; split-K of each GEMM) at K2.6 dims on the GPU and print
µs and % of the read ceiling of moe_experts per setting, timed as a CUDA graph (as the engine runs
it, so host launch overhead is not counted), then each GEMM of the best setting on its own: the data
behind moe_plan's heuristic."""

from __future__ import annotations

import argparse
import itertools

import cupy
import numpy as np

from ddtree_rtc.bench.harness import read_ceiling_gbs, time_gpu
from ddtree_rtc.bench.moe import graphed, int4_experts_device, uniform_logits
from ddtree_rtc.kernels._launch import sm_count
from ddtree_rtc.kernels.moe_gemm import ROWS_PER_CTA, moe_down, moe_experts, moe_gate_up, moe_plan
from ddtree_rtc.kernels.moe_routing import moe_route


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ms", default="1,8,256,1024")
    ap.add_argument("--nts", default="1,4", help="forced token tiles to try (1 and/or 4; '' for none)")
    ap.add_argument("--nt4-above", default="8,16", help="per-expert thresholds to try ('' for none)")
    ap.add_argument("--routing", choices=("bench", "uniform"), default="uniform",
                    help="ids as the layer bench's skewed routing or uniform without replacement")
    ap.add_argument("--splits-gate-up", default="1,2,4,7,14")
    ap.add_argument("--splits-down", default="1,2,4")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    sms = sm_count()
    experts = int4_experts_device(384, 7168, 2048, 0)  # K2.6 dims
    ceil = read_ceiling_gbs()
    rng = np.random.default_rng(0)
    print(f"read ceiling {ceil:.0f} GB/s, {sms} SMs; timed as CUDA graphs, L2 flushed, median of {args.iters}")
    print(f"routing {args.routing}")
    print("M | touched (max pairs per expert) | tiles | split_gate_up | split_down | µs | % ceiling")
    for m in _ints(args.ms):
        sweep_one(m, args, experts, rng, ceil, sms)
        cupy.get_default_memory_pool().free_all_blocks()


def sweep_one(m: int, args, experts, rng, ceil: float, sms: int) -> None:
    e, h, inter, k = experts.num_experts, experts.hidden, experts.intermediate, 8
    w13_b, w2_b = 2 * inter * h * 9 // 16, h * inter * 9 // 16
    if args.routing == "uniform":
        logits, bias = uniform_logits(m, e, int(rng.integers(2**31))), None
    else:
        crng = cupy.random.default_rng(int(rng.integers(2**31)))
        bias = (crng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
        logits = crng.standard_normal((m, e), dtype=cupy.float32)
    ids, w = moe_route(logits, bias, k, routed_scaling_factor=2.827)
    ids_h = ids.get()
    x = cupy.asarray(rng.integers(0x3C00, 0x3F00, (m, h)).astype(np.uint16))
    y = cupy.empty((m, h), cupy.uint16)
    touched = len(np.unique(ids_h))
    max_pairs = int(np.bincount(ids_h.reshape(-1)).max())
    nbytes = touched * (w13_b + w2_b) + 2 * x.nbytes

    def measure(fn):
        return time_gpu(graphed(fn), iters=args.iters).median_us

    def layer(plan):
        return lambda: moe_experts(x, ids, w, experts, out=y, plan=plan, check_ids=False)

    # split-K only where the unsplit grid is small against the SMs
    s13s = _ints(args.splits_gate_up) if touched * (2 * inter // ROWS_PER_CTA) < 8 * sms else [1]
    s2s = _ints(args.splits_down) if touched * (h // ROWS_PER_CTA) < 8 * sms else [1]
    best = None
    tiles = [{"nt": v} for v in _ints(args.nts)] + [{"nt4_above": v} for v in _ints(args.nt4_above)]
    for tile, s13, s2 in itertools.product(tiles, s13s, s2s):
        try:
            plan = moe_plan(m, e, k, h, inter, split_gate_up=s13, split_down=s2, **tile)
        except ValueError:
            continue
        t = measure(layer(plan))
        frac = nbytes / t / 1e3 / ceil
        if best is None or frac > best[0]:
            best = (frac, t, plan)
        print(f"{m} | {touched} ({max_pairs} max) | {plan.tiles} | {s13} | {s2} | {t:.1f} | {100 * frac:.1f}%")
    frac, t_best, plan = best
    default = moe_plan(m, e, k, h, inter)
    t = measure(layer(default))
    print(f"== M={m}: best {plan.tiles} splits=({plan.split_gate_up},{plan.split_down}) {t_best:.1f} µs "
          f"{100 * frac:.1f}%; default {default.tiles} splits=({default.split_gate_up},{default.split_down}) "
          f"{t:.1f} µs {100 * nbytes / t / 1e3 / ceil:.1f}%")
    layer(plan)()  # fills plan.align and plan.h for the single-GEMM timings
    for name, fn, b in (("gate_up", lambda: moe_gate_up(x, experts, plan), touched * w13_b),
                        ("down", lambda: moe_down(experts, plan), touched * w2_b)):
        t = measure(fn)
        print(f"   {name} alone: {t:.1f} µs, {b / t / 1e3:.0f} GB/s, {100 * b / t / 1e3 / ceil:.1f}%")

if __name__ == "__main__":
    main()
