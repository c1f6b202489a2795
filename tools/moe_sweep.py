"""Sweep the INT4 MoE plan knobs (split-K of each GEMM, token tile) at K2.6 dims on the GPU and
print µs and % of the read ceiling per setting: the data behind moe_plan's heuristic."""

from __future__ import annotations

import argparse
import itertools

import cupy
import numpy as np

from ddtree_rtc.bench.harness import read_ceiling_gbs, time_gpu
from ddtree_rtc.bench.moe import int4_experts_device
from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ms", default="1,8,64,256,1024")
    ap.add_argument("--splits", default="1,2,4,7,8,14")
    args = ap.parse_args()
    e, h, inter, k = 384, 7168, 2048, 8
    experts = int4_experts_device(e, h, inter, 0)
    ceil = read_ceiling_gbs()
    rng = np.random.default_rng(0)
    print(f"read ceiling {ceil:.0f} GB/s")
    print("M | touched | nt | split_gate_up | split_down | µs | % ceiling")
    for m in map(int, args.ms.split(",")):
        ids_h = np.stack([rng.choice(e, k, replace=False) for _ in range(m)]).astype(np.int32)
        ids, w = cupy.asarray(ids_h), cupy.full((m, k), 0.125, cupy.float32)
        x = cupy.asarray(rng.integers(0x3C00, 0x3F00, (m, h)).astype(np.uint16))
        y = cupy.empty((m, h), cupy.uint16)
        nbytes = len(np.unique(ids_h)) * experts.expert_nbytes() + 2 * x.nbytes

        def measure(plan, x=x, ids=ids, w=w, y=y):
            return time_gpu(lambda: moe_experts(x, ids, w, experts, out=y, plan=plan, check_ids=False),
                            iters=20).median_us
        best = None
        splits = [int(s) for s in args.splits.split(",")]
        for nt, s13, s2 in itertools.product((1, 4), splits, splits):
            try:
                plan = moe_plan(m, e, k, h, inter, split_gate_up=s13, split_down=s2, nt=nt)
            except ValueError:
                continue
            t = measure(plan)
            frac = nbytes / t / 1e3 / ceil
            best = max(best or (0, None), (frac, (nt, s13, s2, t)))
            print(f"{m} | {len(np.unique(ids_h))} | {nt} | {s13} | {s2} | {t:.1f} | {100 * frac:.1f}%")
        default = moe_plan(m, e, k, h, inter)
        t = measure(default)
        print(f"== M={m}: best {best[1]} {100 * best[0]:.1f}%; default nt={default.nt} "
              f"splits=({default.split_gate_up},{default.split_down}) {t:.1f} µs "
              f"{100 * nbytes / t / 1e3 / ceil:.1f}%")


if __name__ == "__main__":
    main()
