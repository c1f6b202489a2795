"""Skinny-M bf16 linear (cuda_src/linear.cu) against cuBLAS gemmEx on the K2.6 decode shapes: MLA
q_a / q_b / kv_a_proj / o_proj, MoE shared expert gate_up / down, router gate, dense MLP gate_up /
down, lm_head; M in {1, 2, 4, 8, 16, 32} (32 is past the skinny kernel: cuBLAS only). Bytes = the
weights, against the read ceiling; peer = cuBLAS on the same operands. Each row's extra has the
skinny plan (warps over N, split, grid) and the max |skinny - cublas| relative to the output's
largest value."""

from __future__ import annotations

import argparse

from .harness import Row, bf16_to_f32, random_bf16_device, rel_diff, report, time_gpu

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


def run_case(name: str, n: int, k: int, m: int, w, iters: int) -> Row:
    import cupy

    from ..kernels import linear as lin
    from ..kernels._launch import sm_count

    x = random_bf16_device((m, k), seed=200 + m)
    us, outs = {}, {}
    for impl in ("skinny", "cublas"):
        if impl == "skinny" and lin.route(x, w, "skinny") != "skinny":
            continue
        out = cupy.empty((m, n), dtype=cupy.uint16)
        us[impl] = time_gpu(lambda impl=impl, out=out: lin.linear(x, w, out=out, impl=impl), iters=iters).median_us
        outs[impl] = out
    extra = {"shape": name, "N": n, "K": k, "M": m}
    if "skinny" not in us:
        return Row(f"{name} N={n} K={k} M={m} [cublas]", us["cublas"], bytes=w.nbytes, extra=extra)
    p = lin.skinny_plan(m, n, k, sm_count())
    extra.update(warps_n=p.warps_n, split=p.split, grid=p.grid, speedup=us["cublas"] / us["skinny"],
                 rel_diff=rel_diff(bf16_to_f32(outs["skinny"].get()), bf16_to_f32(outs["cublas"].get())))
    return Row(f"{name} N={n} K={k} M={m} [skinny]", us["skinny"], bytes=w.nbytes, peer="cuBLAS gemmEx",
               peer_us=us["cublas"], extra=extra)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench linear", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated shape names")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    want = set(args.shapes.split(","))
    rows = []
    for seed, (name, n, k) in enumerate(SHAPES):
        if name not in want:
            continue
        w = random_bf16_device((n, k), scale=0.02, seed=100 + seed)
        for m in MS:
            rows.append(run_case(name, n, k, m, w, args.iters))
            print(f"  {rows[-1].case}: {rows[-1].us:.1f} µs", flush=True)
    notes = {"bytes": "the weights, read once", "peer": "cuBLAS gemmEx (bf16, fp32 accumulate) on the same operands"}
    return report("skinny-M linear vs cuBLAS at K2.6 decode shapes", rows, args.json, notes=notes)
