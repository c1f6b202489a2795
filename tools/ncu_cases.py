"""The four kernel-gap cases of the round, each run a few times on the GPU, for ncu to profile:

    ncu --clock-control none --section SpeedOfLight ... python tools/ncu_cases.py CASE [REPS]

CASE: ``moe`` (the K2.6 MoE layer at M = 1: route + experts), ``topk8`` / ``topk32`` (vocabulary
top-k of batch 8 / 32 x depth 7, V = 163840, k = 64, bf16 Zipf logits), ``mla`` (MLA decode, 64
heads, batch 8, ctx 4k), ``tree`` (tree build + accept, batch 32, budget 64). A trailing ``v`` runs
the candidate variant instead of the default: moe_plan(small="fused"), topk variant "radix",
merge="fused", tree_build variant "warp". Used by tools/variants_check.sh.
"""

import sys

import cupy
import numpy as np

from ddtree_rtc.bench.harness import random_bf16_device


def moe_case(variant: bool):
    from ddtree_rtc.bench.moe import CONFIGS, SCALING, TOP_K, int4_experts_device
    from ddtree_rtc.kernels.moe_gemm import moe_experts, moe_plan
    from ddtree_rtc.kernels.moe_routing import moe_route

    e, hidden, inter = CONFIGS["K2.6"]
    experts = int4_experts_device(e, hidden, inter, 0)
    rng = cupy.random.default_rng(1)
    bias = (rng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
    logits = rng.standard_normal((1, e), dtype=cupy.float32)
    x = random_bf16_device((1, hidden), seed=1)
    ids, w = cupy.empty((1, TOP_K), cupy.int32), cupy.empty((1, TOP_K), cupy.float32)
    y = cupy.empty((1, hidden), cupy.uint16)
    plan = moe_plan(1, e, TOP_K, hidden, inter, **({"small": "fused"} if variant else {}))

    def fn():
        moe_route(logits, bias, TOP_K, 1, 1, True, SCALING, out_ids=ids, out_weights=w)
        moe_experts(x, ids, w, experts, out=y, plan=plan, check_ids=False)
    return fn


def topk_case(batch: int, variant: bool):
    from ddtree_rtc.bench.tree import zipf_logits
    from ddtree_rtc.kernels import topk

    logits = zipf_logits(batch, 7, 163840, seed=batch)
    ws = topk.topk_workspace(logits.shape, 64, **({"variant": "radix"} if variant else {}))
    logq, ids = cupy.empty((batch, 7, 64), cupy.float32), cupy.empty((batch, 7, 64), cupy.int32)
    print("topk variant", ws.variant)

    def fn():
        topk.topk_logprobs(logits, 64, out_logq=logq, out_ids=ids, workspace=ws)
    return fn


def mla_case(variant: bool):
    from ddtree_rtc.bench.attention import DV, PAGE, ROW, SCALE, Case
    from ddtree_rtc.kernels.mla_attention import mla_attention, mla_attention_plan

    c = Case(64, 4096, 8, 1)
    plan = mla_attention_plan(np.full(8, 4096), np.ones(8, int), c.page_table, 64, PAGE, c.num_pages, None,
                              **({"merge": "fused"} if variant else {}))
    cache = random_bf16_device((c.num_pages, PAGE, ROW), seed=1)
    q = random_bf16_device((8, 64, ROW), scale=0.3, seed=2)
    out, lse = cupy.empty((8, 64, DV), cupy.uint16), cupy.empty((8, 64), cupy.float32)
    print("mla plan", plan.variant, plan.num_work, plan.num_merge)

    def fn():
        mla_attention(plan, q, cache, SCALE, out=out, lse=lse)
    return fn


def tree_case(variant: bool):
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.bench.tree import DEPTH, VOCAB, target_choices, zipf_logits
    from ddtree_rtc.engine.decode.tree import TreeBuffers, TreeShape
    from ddtree_rtc.kernels.tree_build import tree_build_variant

    rng = np.random.default_rng(0)
    be = Backend("cuda")
    bufs = TreeBuffers(be, TreeShape(batch=32, budget=64, depth=DEPTH, vocab=VOCAB))
    logits = zipf_logits(32, DEPTH, VOCAB, seed=5)
    roots = cupy.asarray(rng.integers(0, VOCAB, 32).astype(np.int32))
    prefix = cupy.asarray(rng.integers(100, 4000, 32).astype(np.int32))
    bufs.build(logits, roots, prefix)
    choices = cupy.asarray(target_choices(bufs.tree, rng))
    name = "warp" if variant else None

    def fn():
        if name:
            tree_build_variant(name, bufs.logq, bufs.ids, roots, bufs.budgets, bufs.depths, prefix, 64,
                               out=bufs.tree)
        else:
            be.tree_build(bufs.logq, bufs.ids, roots, bufs.budgets, bufs.depths, prefix, 64, out=bufs.tree)
        bufs.accept(choices)
    return fn


def main(argv) -> None:
    case, reps = argv[0], int(argv[1]) if len(argv) > 1 else 3
    variant, base = case.endswith("v"), case.rstrip("v")
    if base == "moe":
        fn = moe_case(variant)
    elif base in ("topk8", "topk32"):
        fn = topk_case(int(base[4:]), variant)
    elif base == "mla":
        fn = mla_case(variant)
    elif base == "tree":
        fn = tree_case(variant)
    else:
        raise SystemExit(f"unknown case {case!r}: moe, topk8, topk32, mla, tree (+ 'v' for the variant)")
    for _ in range(reps):
        fn()
    cupy.cuda.Device().synchronize()
    print(case, "ok")


if __name__ == "__main__":
    main(sys.argv[1:])
