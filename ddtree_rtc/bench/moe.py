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
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from .harness import Row, random_bf16_device, report, time_gpu

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


def graphed(fn):
    """``fn`` captured once as a CUDA graph; returns a launcher (on the current stream)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph.launch


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
    args = ap.parse_args(argv)
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
