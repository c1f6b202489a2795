"""INT4 MoE layer (routing + align + gate_up with SiLU*up + down + weighted combine) at K2.6 dims and
at the per-GPU shard shapes of TP8 (intermediate 256) and EP8 (48 experts), against the read
ceiling measured in the same run.

Bytes counted = distinct experts touched x (packed weights + scales of gate, up, down) + the
activations in and out (x, y) + the router logits read by the routing kernel. The router GEMM and
the shared expert are dense bf16 linears, benchmarked with the building blocks, and are not timed
here. Timed as one CUDA graph (the engine's way; eager launches in ``extra``). Routing ``bench``:
random fp32 logits N(0, 1) and correction bias N(0, 0.1) (skewed: some experts draw many pairs);
``uniform``: each token's experts drawn uniformly without replacement (logits 30 there, no bias), the
balanced load. Weights: random, made on the GPU. Peer: the bf16 dense grouped
GEMM a user without INT4 would run over the same experts and tokens: per touched expert, cuBLAS
gate_up, SiLU*mul, cuBLAS down (inputs gathered beforehand, outside the timing).

``--variants`` (K2.6 dims, M in --ms, bench and uniform routing): moe_route and moe_align alone, then
moe_experts with the token tile forced to nt 1, forced to nt 4, chosen per expert on the device
(the default plan), each as a CUDA graph; % of the read ceiling counts route + experts against the
touched experts' bytes; every variant's output is compared with nt 1's (``rel_diff`` in extra) and
with the reference computed on the GPU from the same 'mma' blobs (``mma_reference``: ``rel_diff_ref``).
``--small-m`` (TP8 shard and K2.6 dims, M in --ms, default 1,17,33,64, bench routing): the experts step
alone as a CUDA graph, the row-invariant small-M kernels (``moe_small_experts``) beside the general
ones (``moe_experts`` with its default plan) on the same ids, bytes = the touched experts + x + y;
``rel_diff`` in extra is the small-M output against the general one's.
``--sweep`` (K2.6 dims): every plan setting of token tiles (nt 1 / nt 4 forced, or per expert above
each --nt4-above threshold) x split-K of each GEMM, moe_experts alone as a CUDA graph, then the
default plan and each GEMM of the best setting on its own: the data behind moe_plan's heuristic.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import numpy as np

from .harness import (
    Row,
    bf16_to_f32,
    f32_to_bf16_bits,
    graphed,
    random_bf16_device,
    read_ceiling_gbs,
    rel_diff,
    report,
    time_gpu,
)

TOP_K = 8
SCALING = 2.827
# name -> (experts, hidden, intermediate)
CONFIGS = {"K2.6": (384, 7168, 2048), "TP8 shard": (384, 7168, 256), "EP8 shard": (48, 7168, 2048)}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
QUICK = {"K2.6": (1, 16, 256, 1024), "TP8 shard": (1, 256), "EP8 shard": (1, 256)}


def int4_experts_device(num_experts: int, hidden: int, inter: int, seed: int):
    """Random experts directly in the kernels' 'mma' layout: random nibbles, valid bf16 scales."""
    import cupy

    from ..model.int4_repack import BLOCK_BYTES, TILE_K, TILE_N, Int4Experts

    rng = cupy.random.default_rng(seed)

    def blob(n: int, k: int):
        b = cupy.empty((num_experts, n // TILE_N, k // TILE_K, BLOCK_BYTES), dtype=cupy.uint8)
        c = 1.0 / math.sqrt(21.5 * k)
        for e in range(num_experts):  # one expert at a time keeps the temporaries small
            words = rng.integers(0, 2**31, size=b[e].size // 4, dtype=cupy.int32)
            b[e] = (words ^ (words << 1)).view(cupy.uint8).reshape(b[e].shape)
            s = ((rng.random((n // TILE_N, k // TILE_K, 64), dtype=cupy.float32) + 0.5) * c).astype(cupy.float32)
            b[e, :, :, 1024:] = (s.view(cupy.uint32) >> 16).astype(cupy.uint16).view(cupy.uint8)
        return b

    return Int4Experts("mma", num_experts, hidden, inter, blob(2 * inter, hidden), None, blob(hidden, inter), None)


def _dequant_mma(blob, n: int, k: int, xp):
    """One 'mma' blob (uint8 [N/16, K/128, 1152], numpy or CuPy) -> fp32 [N, K] dequantized exactly:
    ``int4_repack.unrepack_matrix`` and ``reference.moe_gemm.dequant_int4`` in array ops of ``xp``."""
    from ..model.int4_repack import _NIBBLE_POS, BLOCK_BYTES, GROUP, TILE_K, TILE_N

    tn, kc = n // TILE_N, k // TILE_K
    b = xp.ascontiguousarray(blob).reshape(tn, kc, BLOCK_BYTES)
    words = xp.ascontiguousarray(b[:, :, :1024]).view(xp.uint32).reshape(tn, kc, 2, 8, 4, 2, 2)
    p = xp.ascontiguousarray(words.transpose(0, 6, 3, 1, 2, 5, 4)).reshape(n, k // 8)
    pos = xp.asarray(_NIBBLE_POS.astype(np.uint32) * 4)  # value i sits at nibble _NIBBLE_POS[i]
    q = ((p[:, :, None] >> pos[None, None, :]) & xp.uint32(0xF)).astype(xp.int32).reshape(n, k) - 8
    s = xp.ascontiguousarray(b[:, :, 1024:]).view(xp.uint16).reshape(tn, kc, 8, 2, 4)
    s = xp.ascontiguousarray(s.transpose(0, 3, 2, 1, 4)).reshape(n, k // GROUP)
    s = (s.astype(xp.uint32) << 16).view(xp.float32)
    return q.astype(xp.float32) * xp.repeat(s, GROUP, axis=1)


def mma_reference(x_bits, ids, w, experts, xp=np):
    """The reference's y (reference/moe_gemm.py: h rounded to bf16, float64 sums, y rounded to bf16
    once) from experts in the kernels' 'mma' layout, in ``xp`` (CuPy on the GPU: the bench's
    random K2.6 experts exist only as device blobs) -> bf16 bits [M, H]. Slots sum in float64, not in
    the reference's fp32 slot order (a last-bit difference at most). Ids out of range contribute nothing."""
    m, hid = x_bits.shape
    inter = experts.intermediate
    ids_h = np.asarray(ids.get() if hasattr(ids, "get") else ids)
    w_h = np.asarray(w.get() if hasattr(w, "get") else w, dtype=np.float64)
    xf = bf16_to_f32(x_bits).astype(xp.float64)
    y = xp.zeros((m, hid), xp.float64)
    for e in np.unique(ids_h[(ids_h >= 0) & (ids_h < experts.num_experts)]):
        toks = np.nonzero((ids_h == e).any(axis=1))[0]
        wt = xp.asarray(np.array([w_h[t][ids_h[t] == e].sum() for t in toks]))
        gu = _dequant_mma(experts.w13[e], 2 * inter, hid, xp).astype(xp.float64) @ xf[toks].T  # fused tile rows
        gu = gu.astype(xp.float32).reshape(inter // 8, 2, 8, len(toks))
        g, u = gu[:, 0].reshape(inter, -1), gu[:, 1].reshape(inter, -1)
        h = (g / (xp.float32(1) + xp.exp(-g)) * u).astype(xp.float32)  # fp32 SiLU * up, as the reference
        h = bf16_to_f32(f32_to_bf16_bits(h)).astype(xp.float64)
        d = _dequant_mma(experts.w2[e], hid, inter, xp).astype(xp.float64) @ h  # [H, tokens]
        y[xp.asarray(toks)] += (d * wt[None, :]).T
    return f32_to_bf16_bits(y.astype(xp.float32))


def _timed(fn, iters: int, extra: dict, key: str) -> float:
    """Median µs of ``fn`` as a CUDA graph; if capture fails, eager, with the reason in ``extra``."""
    try:
        launch = graphed(fn)
    except Exception as e:  # noqa: BLE001 - report the reason and still give a number
        extra[f"{key}_graph_error"] = f"{type(e).__name__}: {e}"
        print(f"warning: {key}: CUDA graph capture failed ({e}); timing eager launches", file=sys.stderr)
        launch = fn
    return time_gpu(launch, iters=iters).median_us


class PeerBf16:
    """bf16 dense experts (random, on the GPU) and the grouped cuBLAS GEMM over a routing."""

    def __init__(self, num_experts: int, hidden: int, inter: int, seed: int):
        import cupy

        self.w13 = cupy.empty((num_experts, 2 * inter, hidden), dtype=cupy.uint16)
        self.w2 = cupy.empty((num_experts, hidden, inter), dtype=cupy.uint16)
        for e in range(num_experts):
            self.w13[e] = random_bf16_device((2 * inter, hidden), 1 / math.sqrt(hidden), seed=seed + 2 * e)
            self.w2[e] = random_bf16_device((hidden, inter), 1 / math.sqrt(inter), seed=seed + 2 * e + 1)
        self.inter = inter

    def runner(self, x, ids: np.ndarray):
        """The grouped GEMM for host routing ``ids`` [M, k], inputs gathered and outputs allocated."""
        import cupy

        from ..kernels.linear import linear
        from ..kernels.silu_mul import silu_mul

        work = []
        for e in np.unique(ids):
            tokens = cupy.asarray(np.nonzero((ids == e).any(axis=1))[0].astype(np.int32))
            xe = cupy.ascontiguousarray(x[tokens])
            n = xe.shape[0]
            work.append((xe, self.w13[e], self.w2[e], cupy.empty((n, 2 * self.inter), cupy.uint16),
                         cupy.empty((n, self.inter), cupy.uint16), cupy.empty((n, x.shape[1]), cupy.uint16)))

        def run():
            for xe, w13, w2, gu, h, y in work:
                linear(xe, w13, out=gu)
                silu_mul(gu, out=h)
                linear(h, w2, out=y)

        return run


ROUTINGS = ("bench", "uniform")


def uniform_logits(m: int, e: int, seed: int):
    """fp32 logits [M, E] (GPU) whose top-8 (without bias) are TOP_K experts drawn uniformly without
    replacement per token: 30 there (sigmoid 1.0), N(0, 1) elsewhere."""
    import cupy

    host = np.random.default_rng(seed)
    logits = cupy.random.default_rng(seed).standard_normal((m, e), dtype=cupy.float32)
    pick = np.stack([host.choice(e, TOP_K, replace=False) for _ in range(m)])
    logits[cupy.asarray(np.repeat(np.arange(m), TOP_K)), cupy.asarray(pick.reshape(-1))] = 30.0
    return logits


def bench_config(name: str, ms, iters: int, seed: int, peer: bool, routings=("bench",)) -> list[Row]:
    import cupy

    from ..kernels.moe_gemm import moe_experts, moe_plan
    from ..kernels.moe_routing import moe_route

    e, hidden, inter = CONFIGS[name]
    experts = int4_experts_device(e, hidden, inter, seed)
    peer_w = PeerBf16(e, hidden, inter, seed + 1000) if peer else None
    rows = []
    for routing in routings:
        rng = cupy.random.default_rng(seed + 1)  # the bench routing's draws, whatever else runs
        bench_bias = (rng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
        for m in ms:
            x = random_bf16_device((m, hidden), seed=seed + m)
            if routing == "bench":
                logits, bias = rng.standard_normal((m, e), dtype=cupy.float32), bench_bias
            else:
                logits, bias = uniform_logits(m, e, seed + 1 + m), None
            ids = cupy.empty((m, TOP_K), cupy.int32)
            w = cupy.empty((m, TOP_K), cupy.float32)
            y = cupy.empty((m, hidden), cupy.uint16)
            plan = moe_plan(m, e, TOP_K, hidden, inter)

            def layer(x=x, logits=logits, bias=bias, ids=ids, w=w, y=y, plan=plan):
                moe_route(logits, bias, TOP_K, 1, 1, True, SCALING, out_ids=ids, out_weights=w)
                moe_experts(x, ids, w, experts, out=y, plan=plan, check_ids=False)

            layer()
            host_ids = ids.get()
            touched = len(np.unique(host_ids))
            nbytes = touched * experts.expert_nbytes() + 2 * x.nbytes + logits.nbytes
            counts = np.bincount(host_ids.reshape(-1), minlength=e)
            extra = {"config": name, "M": m, "routing": routing, "experts_touched": touched,
                     "max_pairs_per_expert": int(counts.max()), "tiles": plan.tiles,
                     "split_gate_up": plan.split_gate_up, "split_down": plan.split_down,
                     "experts": e, "hidden": hidden, "intermediate": inter, "top_k": TOP_K}
            us = _timed(layer, iters, extra, "moe")
            extra["eager_us"] = time_gpu(layer, iters=iters).median_us
            peer_us = None
            if peer_w is not None:
                peer_us = _timed(peer_w.runner(x, host_ids), iters, extra, "peer")
            rows.append(Row(f"{name} M={m} {routing} ({touched} experts)", us, bytes=int(nbytes), ceiling="read",
                            peer="cuBLAS bf16 grouped" if peer_w is not None else None, peer_us=peer_us,
                            extra=extra))
    return rows


def print_moe_table(rows: list[Row], read_gbs: float) -> None:
    """The issue's view: M | experts touched | µs | GB/s | % of ceiling | bf16 peer µs."""
    header = ("config", "M", "routing", "experts touched", "max pairs", "tiles", "µs", "GB/s", "% of ceiling",
              "bf16 peer µs")
    lines = [(r.extra["config"], str(r.extra["M"]), r.extra["routing"], str(r.extra["experts_touched"]),
              str(r.extra["max_pairs_per_expert"]), r.extra["tiles"], f"{r.us:.1f}",
              f"{r.gbs:.0f}", f"{100 * r.gbs / read_gbs:.1f}%", "-" if r.peer_us is None else f"{r.peer_us:.1f}")
             for r in rows]
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(wd) for h, wd in zip(header, widths)))
    print("-|-".join("-" * wd for wd in widths))
    for ln in lines:
        print(" | ".join(c.ljust(wd) for c, wd in zip(ln, widths)))


K26 = CONFIGS["K2.6"]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def variant_rows(ms, routings, iters: int) -> list[Row]:
    """route, align, and moe_experts with nt 1 / nt 4 / per-expert tiles (the default) per (routing, M),
    each checked against ``mma_reference``."""
    import cupy

    from ..kernels.moe_gemm import moe_experts, moe_plan
    from ..kernels.moe_routing import moe_align, moe_route

    e, h, inter = K26
    experts = int4_experts_device(e, h, inter, 0)
    rows = []
    for routing in routings:
        rng = cupy.random.default_rng(1)
        bench_bias = (rng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
        for m in ms:
            if routing == "bench":
                logits, bias = rng.standard_normal((m, e), dtype=cupy.float32), bench_bias
            else:
                logits, bias = uniform_logits(m, e, 1 + m), None
            ids = cupy.empty((m, TOP_K), cupy.int32)
            w = cupy.empty((m, TOP_K), cupy.float32)

            def route(logits=logits, bias=bias, ids=ids, w=w):
                moe_route(logits, bias, TOP_K, 1, 1, True, SCALING, out_ids=ids, out_weights=w)

            route()
            counts = np.bincount(ids.get().reshape(-1), minlength=e)
            touched = int((counts > 0).sum())
            x = cupy.asarray(np.random.default_rng(m).integers(0x3C00, 0x3F00, (m, h)).astype(np.uint16))
            y = cupy.empty((m, h), cupy.uint16)
            nbytes = touched * experts.expert_nbytes() + 2 * x.nbytes + logits.nbytes
            extra = {"routing": routing, "M": m, "experts_touched": touched, "max_pairs_per_expert": int(counts.max())}
            route_us = time_gpu(graphed(route), iters=iters).median_us
            rows.append(Row(f"route M={m} {routing}", route_us, bytes=logits.nbytes, extra=extra))
            ref = bf16_to_f32(mma_reference(x, ids, w, experts, cupy).get())
            first = None
            variants = [("nt1", {"nt": 1}), ("nt4", {"nt": 4}), ("default", {})]
            for name, kw in variants:
                plan = moe_plan(m, e, TOP_K, h, inter, **kw)
                if name == "default":
                    al = plan.align
                    rows.append(Row(f"align M={m} {routing}", time_gpu(graphed(lambda al=al, ids=ids: moe_align(
                        ids, e, al.block, out=al, check_ids=False, large_block=al.large_block,
                        large_above=al.large_above)), iters=iters).median_us, extra=extra))

                def experts_step(plan=plan, x=x, ids=ids, w=w, y=y):
                    moe_experts(x, ids, w, experts, out=y, plan=plan, check_ids=False)

                def layer(route=route, experts_step=experts_step):
                    route()
                    experts_step()

                us = time_gpu(graphed(experts_step), iters=iters).median_us
                layer_graph_us = time_gpu(graphed(layer), iters=iters).median_us  # one graph, as bench moe
                yf = bf16_to_f32(y.get())
                first = yf if first is None else first
                layer_us = us + route_us  # the layer (route + experts) against the touched experts' bytes
                rows.append(Row(f"experts M={m} {routing} [{name}: {plan.tiles}]", us,
                                extra={**extra, "variant": name, "tiles": plan.tiles,
                                       "rel_diff": rel_diff(yf, first), "rel_diff_ref": rel_diff(yf, ref),
                                       "layer_us": layer_us, "layer_graph_us": layer_graph_us,
                                       "layer_bytes": int(nbytes),
                                       "layer_graph_fraction_of_read":
                                           nbytes / layer_graph_us / 1e3 / read_ceiling_gbs(),
                                       "layer_fraction_of_read": nbytes / layer_us / 1e3 / read_ceiling_gbs()}))
            done = [r for r in rows if r.extra.get("M") == m and r.extra.get("routing") == routing]
            print(f"  M={m} {routing}: " + ", ".join(
                f"{r.case} {r.us:.1f} µs" + (f" (layer {r.extra['layer_graph_us']:.1f} µs, rel diff vs ref "
                                             f"{r.extra['rel_diff_ref']:.1e})" if "variant" in r.extra else "")
                for r in done), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def sweep_rows(ms, args) -> list[Row]:
    """moe_experts over every (tiles, split_gate_up, split_down) setting per M, then the default
    plan and each GEMM of the best setting alone."""
    import cupy

    from ..kernels._launch import sm_count
    from ..kernels.moe_gemm import ROWS_PER_CTA, moe_down, moe_experts, moe_gate_up, moe_plan
    from ..kernels.moe_routing import moe_route

    e, h, inter = K26
    k, sms = TOP_K, sm_count()
    experts = int4_experts_device(e, h, inter, 0)
    rng = np.random.default_rng(0)
    w13_b, w2_b = 2 * inter * h * 9 // 16, h * inter * 9 // 16
    rows = []
    for m in ms:
        seed = int(rng.integers(2**31))
        if args.routing == "uniform":
            logits, bias = uniform_logits(m, e, seed), None
        else:
            crng = cupy.random.default_rng(seed)
            bias = (crng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
            logits = crng.standard_normal((m, e), dtype=cupy.float32)
        ids, w = moe_route(logits, bias, k, routed_scaling_factor=SCALING)
        ids_h = ids.get()
        x = cupy.asarray(rng.integers(0x3C00, 0x3F00, (m, h)).astype(np.uint16))
        y = cupy.empty((m, h), cupy.uint16)
        touched = len(np.unique(ids_h))
        nbytes = touched * (w13_b + w2_b) + 2 * x.nbytes
        extra = {"M": m, "routing": args.routing, "experts_touched": touched,
                 "max_pairs_per_expert": int(np.bincount(ids_h.reshape(-1)).max())}

        def layer(plan, x=x, ids=ids, w=w, y=y):
            return graphed(lambda: moe_experts(x, ids, w, experts, out=y, plan=plan, check_ids=False))

        # split-K only where the unsplit grid is small against the SMs
        s13s = _ints(args.splits_gate_up) if touched * (2 * inter // ROWS_PER_CTA) < 8 * sms else [1]
        s2s = _ints(args.splits_down) if touched * (h // ROWS_PER_CTA) < 8 * sms else [1]
        tiles = [{"nt": v} for v in _ints(args.nts)] + [{"nt4_above": v} for v in _ints(args.nt4_above)]
        best = None
        for tile, s13, s2 in itertools.product(tiles, s13s, s2s):
            try:
                plan = moe_plan(m, e, k, h, inter, split_gate_up=s13, split_down=s2, **tile)
            except ValueError:
                continue
            us = time_gpu(layer(plan), iters=args.iters).median_us
            rows.append(Row(f"experts M={m} [{plan.tiles} splits {s13},{s2}]", us, bytes=int(nbytes),
                            extra={**extra, "tiles": plan.tiles, "split_gate_up": s13, "split_down": s2}))
            if best is None or us < best[0]:
                best = (us, plan)
        default = moe_plan(m, e, k, h, inter)
        rows.append(Row(f"experts M={m} [default: {default.tiles} splits {default.split_gate_up},"
                        f"{default.split_down}]", time_gpu(layer(default), iters=args.iters).median_us,
                        bytes=int(nbytes), extra={**extra, "tiles": default.tiles, "default": True}))
        plan = best[1]
        layer(plan)()  # fills plan.align and plan.h for the single-GEMM timings
        for name, fn, b in (("gate_up", lambda x=x, plan=plan: moe_gate_up(x, experts, plan), touched * w13_b),
                            ("down", lambda plan=plan: moe_down(experts, plan), touched * w2_b)):
            rows.append(Row(f"{name} alone M={m} [best: {plan.tiles} splits {plan.split_gate_up},{plan.split_down}]",
                            time_gpu(graphed(fn), iters=args.iters).median_us, bytes=int(b), extra=extra))
        print(f"  M={m}: best {best[0]:.1f} µs ({plan.tiles}), default {rows[-3].us:.1f} µs", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


SMALL_M_CONFIGS = ("TP8 shard", "K2.6")


def small_m_rows(ms, iters: int, seed: int, configs=SMALL_M_CONFIGS) -> list[Row]:
    """Per config and M: the small-M experts step and the general one on the same routing, each alone
    as a CUDA graph (the ids routed once beforehand)."""
    import cupy

    from ..kernels.moe_gemm import moe_experts, moe_plan
    from ..kernels.moe_routing import moe_route
    from ..kernels.moe_small import moe_small_experts, moe_small_plan

    rows = []
    for name in configs:
        e, hidden, inter = CONFIGS[name]
        experts = int4_experts_device(e, hidden, inter, seed)
        rng = cupy.random.default_rng(seed + 1)
        bias = (rng.standard_normal(e, dtype=cupy.float32) * 0.1).astype(cupy.float32)
        for m in ms:
            x = random_bf16_device((m, hidden), seed=seed + m)
            ids = cupy.empty((m, TOP_K), cupy.int32)
            w = cupy.empty((m, TOP_K), cupy.float32)
            moe_route(rng.standard_normal((m, e), dtype=cupy.float32), bias, TOP_K, 1, 1, True, SCALING,
                      out_ids=ids, out_weights=w)
            host_ids = ids.get()
            touched = len(np.unique(host_ids))
            nbytes = touched * experts.expert_nbytes() + 2 * x.nbytes
            counts = np.bincount(host_ids.reshape(-1), minlength=e)
            outs = {}
            for path in ("general", "small-M"):
                y = cupy.empty((m, hidden), cupy.uint16)
                run, make_plan = (moe_experts, moe_plan) if path == "general" else (moe_small_experts, moe_small_plan)
                plan = make_plan(m, e, TOP_K, hidden, inter)

                def step(x=x, ids=ids, w=w, y=y, plan=plan, ex=experts, run=run):
                    run(x, ids, w, ex, out=y, plan=plan, check_ids=False)
                step()
                outs[path] = y.get()
                extra = {"config": name, "M": m, "path": path, "experts_touched": touched,
                         "max_pairs_per_expert": int(counts.max()), "experts": e, "hidden": hidden,
                         "intermediate": inter, "top_k": TOP_K}
                if path == "small-M":
                    extra["rel_diff"] = rel_diff(bf16_to_f32(outs[path]), bf16_to_f32(outs["general"]))
                us = _timed(step, iters, extra, "experts")
                rows.append(Row(f"{name} M={m} {path} experts ({touched} touched)", us, bytes=int(nbytes),
                                ceiling="read", extra=extra))
        experts = None  # this shape's weights are garbage now
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None) -> dict:
    import cupy

    ap = argparse.ArgumentParser(prog="ddtree-rtc bench moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer M values and iterations (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    ap.add_argument("--config", choices=sorted(CONFIGS), action="append",
                    help="only these shapes (repeatable; default: all)")
    ap.add_argument("--no-peer", action="store_true", help="skip the bf16 cuBLAS peer (saves ~34 GB)")
    ap.add_argument("--routing", choices=ROUTINGS, action="append",
                    help="token -> expert routing (repeatable; default: bench): 'bench' random logits + "
                         "bias (skewed), 'uniform' experts drawn uniformly per token (balanced)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", action="store_true",
                    help="route, align and the experts with nt 1 / nt 4 / per-expert tiles side by side (K2.6)")
    ap.add_argument("--sweep", action="store_true", help="every token-tile x split-K plan setting (K2.6)")
    ap.add_argument("--small-m", action="store_true",
                    help="the experts step, small-M kernels beside the general ones (TP8 shard, K2.6; M in "
                         "--ms, default 1,17,33,64)")
    ap.add_argument("--ms", help="--variants / --sweep: token counts (default 1,16,256,1024 / 1,8,256,1024)")
    ap.add_argument("--iters", type=int, default=20, help="--variants / --sweep: timed runs per case")
    ap.add_argument("--nts", default="1,4", help="--sweep: forced token tiles to try ('' for none)")
    ap.add_argument("--nt4-above", default="8,16", help="--sweep: per-expert thresholds to try ('' for none)")
    ap.add_argument("--splits-gate-up", default="1,2,4,7,14", help="--sweep: gate_up split-K factors")
    ap.add_argument("--splits-down", default="1,2,4", help="--sweep: down split-K factors")
    args = ap.parse_args(argv)
    if args.variants:
        rows = variant_rows(_ints(args.ms or "1,16,256,1024"), args.routing or list(ROUTINGS), args.iters)
        return report("INT4 MoE variants at K2.6 dims (CUDA graphs)", rows, args.json,
                      notes={"rel_diff": "max |y - y(nt1)| / max |y(nt1)|",
                             "rel_diff_ref": "max |y - y(ref)| / max |y(ref)|, ref = mma_reference on the GPU",
                             "layer": "layer_bytes / layer_us (route + experts) is the layer's rate",
                             "layer_graph_us": "route + experts captured as one CUDA graph (PDL edges included), "
                                               "the way bench moe times the layer"})
    if args.small_m:
        rows = small_m_rows(_ints(args.ms or "1,17,33,64"), args.iters, args.seed,
                            [c for c in (args.config or SMALL_M_CONFIGS) if c in SMALL_M_CONFIGS])
        return report("INT4 MoE experts step: small-M (row-invariant) vs general kernels (CUDA graphs)", rows,
                      args.json, notes={"bytes": "experts touched x (packed + scales) + x + y",
                                        "rel_diff": "small-M output vs the general one's, max |d| / max |y|"})
    if args.sweep:
        args.routing = (args.routing or ["uniform"])[0]
        rows = sweep_rows(_ints(args.ms or "1,8,256,1024"), args)
        return report("INT4 MoE plan sweep at K2.6 dims (moe_experts as a CUDA graph)", rows, args.json,
                      notes={"bytes": "experts touched x (packed + scales) + x + y"})
    rows = []
    for name in args.config or list(CONFIGS):
        ms = QUICK[name] if args.quick else MS
        rows += bench_config(name, ms, 10 if args.quick else 50, args.seed, not args.no_peer,
                             args.routing or ["bench"])
        cupy.get_default_memory_pool().free_all_blocks()  # this shape's weights are garbage now
    doc = report("INT4 MoE layer (routing + experts), H200 target >= 80% read ceiling at M=1, >= 85% at M>=256",
                 rows, args.json, notes={"bytes": "experts touched x (packed + scales) + x + y + logits",
                                         "timing": "CUDA graph of moe_route + moe_experts; eager in extra"})
    print()
    print_moe_table(rows, doc["ceilings"]["read_gbs"])
    return doc


if __name__ == "__main__":
    main()
