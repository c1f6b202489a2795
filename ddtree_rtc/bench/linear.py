"""Skinny-M bf16 linear (cuda_src/linear.cu) against cuBLAS gemmEx on the K2.6 decode shapes: MLA
q_a / q_b / kv_a_proj / o_proj, MoE shared expert gate_up / down, router gate, dense MLP gate_up /
down, lm_head; M in {1, 2, 4, 8, 16, 32} (32 is past the skinny kernel: cuBLAS only). Bytes = the
weights, against the read ceiling; peer = cuBLAS on the same operands. Each row's extra has the
skinny plan (warps over N, split, grid) and the max |skinny - cublas| relative to the output's
largest value.

``--invariant-plans``: the small-M path's row-invariant linear instead, every (warps_n, split) plan
against the default plan and cuBLAS at M in {1, 8, 17, 33, 64}, on one rank's shapes (``--shard
tp8``: the TP8 shares the decode bench runs); per shape the plan with the least summed time over M.
Any plan chosen from (N, K) alone keeps a row's sums independent of M, so this measures the plan rule."""

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
PLAN_MS = (1, 8, 17, 33, 64)
# the TP8 share of each shape: N split (column-parallel) or K split (row-parallel); q_a, kv_a and the
# router are replicated
TP8_SPLIT = {"q_b": "n", "o_proj": "k", "shared_w13": "n", "shared_w2": "k", "dense_w13": "n", "dense_w2": "k",
             "lm_head": "n"}


def shard_shapes(shard: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one rank's share: ``none`` (the whole model's) or ``tp8``."""
    if shard == "none":
        return list(SHAPES)
    if shard != "tp8":
        raise ValueError(f"shard {shard!r}: expected 'none' or 'tp8'")
    split = {"n": lambda n, k: (n // 8, k), "k": lambda n, k: (n, k // 8)}
    return [(name, *split[TP8_SPLIT[name]](n, k)) if name in TP8_SPLIT else (name, n, k) for name, n, k in SHAPES]


def plan_rows(name: str, n: int, k: int, w, iters: int) -> list[Row]:
    """Every invariant plan of [n, k] at PLAN_MS, as rows (extra: plan, M, default?, cuBLAS µs)."""
    import cupy

    from ..kernels import linear as lin
    from ..kernels._launch import sm_count

    sms, rows = sm_count(), []
    default = lin.invariant_plan(8, n, k, sms)
    for m in PLAN_MS:
        x = random_bf16_device((m, k), seed=300 + m)
        y = cupy.empty((m, n), dtype=cupy.uint16)
        t_cublas = time_gpu(lambda x=x, y=y: lin.linear(x, w, out=y, impl="cublas"), iters=iters).median_us
        for plan in lin.invariant_plans(m, n, k, sms):
            us = time_gpu(lambda plan=plan, x=x, y=y: lin.launch_plan(x, w, y, plan), iters=iters).median_us
            rows.append(Row(f"{name} N={n} K={k} M={m} wn{plan.warps_n} s{plan.split}", us, bytes=w.nbytes,
                            peer="cuBLAS gemmEx", peer_us=t_cublas,
                            extra={"shape": name, "N": n, "K": k, "M": m, "warps_n": plan.warps_n,
                                   "split": plan.split, "grid": plan.grid, "est_us": plan.est_us,
                                   "default": (plan.warps_n, plan.split) == (default.warps_n, default.split)}))
    return rows


def best_plans(rows: list[Row]) -> dict:
    """Per shape: the default plan's and the best plan's summed µs over M (the best: least sum), and
    cuBLAS's."""
    out: dict = {}
    for r in rows:
        e = r.extra
        d = out.setdefault(e["shape"], {"plans": {}, "cublas_us": {}})
        d["plans"].setdefault((e["warps_n"], e["split"]), {})[e["M"]] = r.us
        d["cublas_us"][e["M"]] = r.peer_us
        if e["default"]:
            d["default"] = (e["warps_n"], e["split"])
    summary = {}
    for shape, d in out.items():
        total = {p: sum(t.values()) for p, t in d["plans"].items()}
        best = min(total, key=total.get)
        summary[shape] = {"default": list(d["default"]), "default_us": d["plans"][d["default"]],
                          "best": list(best), "best_us": d["plans"][best], "cublas_us": d["cublas_us"]}
    return summary


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
    ap.add_argument("--invariant-plans", action="store_true",
                    help="time every (warps_n, split) plan of the row-invariant linear at M 1/8/17/33/64 "
                         "against the default plan and cuBLAS")
    ap.add_argument("--shard", choices=("none", "tp8"), default="none",
                    help="the shapes of one rank's share (with --invariant-plans)")
    args = ap.parse_args(argv)
    want = set(args.shapes.split(","))
    unknown = want - {s[0] for s in SHAPES}
    if unknown:
        ap.error(f"--shapes: unknown {sorted(unknown)}; shapes: {', '.join(s[0] for s in SHAPES)}")
    rows = []
    if args.invariant_plans:
        for seed, (name, n, k) in enumerate(shard_shapes(args.shard)):
            if name in want:
                rows += plan_rows(name, n, k, random_bf16_device((n, k), scale=0.02, seed=100 + seed), args.iters)
        summary = best_plans(rows)
        for shape, d in summary.items():
            print(f"  {shape}: default wn{d['default'][0]} s{d['default'][1]} "
                  + " ".join(f"M{m} {t:.1f}" for m, t in sorted(d["default_us"].items()))
                  + f" | best wn{d['best'][0]} s{d['best'][1]} "
                  + " ".join(f"M{m} {t:.1f}" for m, t in sorted(d["best_us"].items()))
                  + " | cuBLAS " + " ".join(f"M{m} {t:.1f}" for m, t in sorted(d["cublas_us"].items())), flush=True)

        def keyed(d):  # JSON keys are strings
            return {k: {str(m): t for m, t in v.items()} if k.endswith("_us") else v for k, v in d.items()}

        notes = {"bytes": "the weights, read once", "peer": "cuBLAS gemmEx on the same operands",
                 "shard": args.shard, "best_plans": {shape: keyed(d) for shape, d in summary.items()}}
        return report("row-invariant linear: every plan vs the default and cuBLAS", rows, args.json, notes=notes)
    for seed, (name, n, k) in enumerate(SHAPES):
        if name not in want:
            continue
        w = random_bf16_device((n, k), scale=0.02, seed=100 + seed)
        for m in MS:
            rows.append(run_case(name, n, k, m, w, args.iters))
            print(f"  {rows[-1].case}: {rows[-1].us:.1f} µs", flush=True)
    notes = {"bytes": "the weights, read once", "peer": "cuBLAS gemmEx (bf16, fp32 accumulate) on the same operands"}
    return report("skinny-M linear vs cuBLAS at K2.6 decode shapes", rows, args.json, notes=notes)
