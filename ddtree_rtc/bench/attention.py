"""MLA attention at K2.6 dims over the paged latent cache (576-wide rows, page size 64, pages
scattered): decode (N = 1) and DDTree verify (N nodes of a realistic tree per request), 64 heads and
8 heads (one TP8 rank). Bytes = cache rows read once per request (1152 B each); FLOPs = useful
work, 2·H·(576+512) per (query, visible row). Decode is measured against the read ceiling, verify
against the bf16 matmul ceiling, both from the same run. Peer: the same attention as plain CuPy
batched matmuls (cuBLAS, fp16 data of the same size, contiguous KV) + a masked fp32 softmax.

``--variants``: every tile variant this GPU can run, side by side on the same inputs: decode (N = 1)
at 8 heads (a TP8 rank) and 64 heads, batch 1 / 8 / 32, context 4k / 16k, plus one 64-head tree verify
(b8, N16). The first row of a case is the variant the plan picks; every other row's output and LSE
are checked against it (``check`` in extra), so a broken kernel shows as a mismatch, not as a fast
time. Time = attention + merge launch; % = cache bytes against the read ceiling.

``--small-m``: one TP8 rank's 8-head decode at context 4k, batch 1 / 17 / 33 / 64, under the small-M
path's row-invariant schedule (``split="shape"``) and the general one (``split="ctas"``) side by side,
with the plan's tile, grid and item counts (the row-invariant split at 33 x 4k: ~1000 items).

``--head-gemms``: the small-M path's MLA head GEMMs and absorbed query (cuda_src/mla_small.cu) at one
TP8 rank's 8 heads, T = 1, 8, 33, 64, against the general path's cuBLAS launches (``head_gemm_rows``)."""

from __future__ import annotations

import argparse
import heapq

import numpy as np

from .harness import Row, bf16_to_f32, random_bf16_device, rel_diff, report, time_gpu

ROW, DV, PAGE = 576, 512, 64
SCALE = 0.14467963
DEPTH = 7  # DFlash block 8: tree depth limit
PEER_MAX_SCORES = 1 << 30  # fp32 score elements the peer may materialise


def ddtree_parents(rng: np.random.Generator, n_nodes: int, depth: int = DEPTH, k: int = 8) -> np.ndarray:
    """A tree as the DDTree builder makes it (docs/architecture.md §4, best-first over per-depth top-k
    log-probs of peaked random logits); returns parents, node 0 the root."""
    logits = rng.standard_normal((depth, 64)) * 3.0
    logq = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    logq = -np.sort(-logq, axis=1)[:, :k]
    parents = [0]
    heap = [(-float(logq[0, 0]), (0,), 0, 1, 0)]
    while heap and len(parents) < n_nodes:
        key, ranks, p, d, r = heapq.heappop(heap)
        score = -key
        parents.append(p)
        node = len(parents) - 1
        if r + 1 < k:
            heapq.heappush(heap, (-(score - logq[d - 1, r] + logq[d - 1, r + 1]), ranks[:-1] + (r + 1,), p, d, r + 1))
        if d < depth:
            heapq.heappush(heap, (-(score + logq[d, 0]), ranks + (0,), node, d + 1, 0))
    return np.array(parents)


class Case:
    def __init__(self, heads: int, ctx: int, batch: int, nodes: int, seed: int = 0):
        from ..reference.mla_attention import tree_mask_from_parents

        self.heads, self.ctx, self.batch, self.nodes = heads, ctx, batch, nodes
        rng = np.random.default_rng(seed)
        per_req = -(-(ctx + nodes) // PAGE)
        self.num_pages = batch * per_req
        self.page_table = rng.permutation(self.num_pages).astype(np.int32).reshape(batch, per_req)
        self.parents = [ddtree_parents(rng, nodes) for _ in range(batch)] if nodes > 1 else None
        self.mask = None
        if self.parents is not None:
            self.mask = np.concatenate([tree_mask_from_parents(p, -(-nodes // 64)) for p in self.parents])

    @property
    def name(self) -> str:
        return f"h{self.heads} ctx{self.ctx // 1024}k b{self.batch} N{self.nodes}"

    def kv_bytes(self) -> int:
        return self.batch * (self.ctx + self.nodes) * ROW * 2

    def flops(self) -> int:
        if self.parents is None:
            visible = self.batch * (self.ctx + 1)
        else:
            depth = np.concatenate([_depths(p) for p in self.parents])
            visible = int((self.ctx + depth + 1).sum())
        return 2 * self.heads * (ROW + DV) * visible


def _depths(parents):
    d = np.zeros(len(parents), np.int64)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def _peer(case: Case):
    """Plain batched attention through cuBLAS: S = Q·K^T, masked fp32 softmax, O = P·V."""
    import cupy

    b, n, h, L = case.batch, case.nodes, case.heads, case.ctx + case.nodes
    if b * n * h * L > PEER_MAX_SCORES:
        return None
    rng = cupy.random.default_rng(7)
    kv = rng.standard_normal((b, L, ROW), dtype=cupy.float32).astype(cupy.float16)
    v = cupy.ascontiguousarray(kv[:, :, :DV])
    q = rng.standard_normal((b, n * h, ROW), dtype=cupy.float32).astype(cupy.float16)
    bias = cupy.zeros((b, n * h, n), dtype=cupy.float32)
    if case.mask is not None:
        vis = np.unpackbits(case.mask.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
        bias = cupy.asarray(np.repeat(np.where(vis, 0.0, -np.inf).astype(np.float32).reshape(b, n, 1, n), h,
                                      axis=2).reshape(b, n * h, n))

    def run():
        s = cupy.matmul(q, kv.transpose(0, 2, 1)).astype(cupy.float32)
        s *= np.float32(SCALE)
        s[:, :, case.ctx:] += bias
        s -= s.max(axis=-1, keepdims=True)
        cupy.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return cupy.matmul(s.astype(cupy.float16), v)

    return run


def _iters(fn) -> int:
    """Enough timed runs for a stable median, within about half a second per case."""
    import cupy

    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, end)
    return int(np.clip(500.0 / max(ms, 1e-3), 5, 50))


def run_case(case: Case, peer: bool = True, split: str | None = None) -> Row:
    import cupy

    from ..kernels.mla_attention import mla_attention, mla_attention_plan

    ctx = np.full(case.batch, case.ctx)
    plan = mla_attention_plan(ctx, np.full(case.batch, case.nodes), case.page_table, case.heads, PAGE,
                              case.num_pages, case.mask, split=split)
    cache = random_bf16_device((case.num_pages, PAGE, ROW), seed=1)
    t = case.batch * case.nodes
    q = random_bf16_device((t, case.heads, ROW), scale=0.3, seed=2)
    out = cupy.empty((t, case.heads, DV), cupy.uint16)
    lse = cupy.empty((t, case.heads), cupy.float32)

    def fn():
        mla_attention(plan, q, cache, SCALE, out=out, lse=lse)

    timing = time_gpu(fn, warmup=3, iters=_iters(fn))
    peer_fn = _peer(case) if peer else None
    peer_us = time_gpu(peer_fn, warmup=2, iters=_iters(peer_fn)).median_us if peer_fn is not None else None
    return Row(case.name, timing.median_us, bytes=case.kv_bytes(), flops=case.flops(),
               ceiling="read" if case.nodes == 1 else "matmul",
               peer="cupy matmul+softmax" if peer_fn is not None else None, peer_us=peer_us,
               extra={"min_us": timing.min_us, "p90_us": timing.p90_us, "variant": plan.variant,
                      "work_items": plan.num_work, "merged_tiles": plan.num_merge, "split": plan.split,
                      "grid": plan.grid})


SMALL_M_BATCHES = (1, 17, 33, 64)


def small_m_rows() -> list[Row]:
    """8-head decode at 4k under split="shape" and split="ctas" (no peer): the small-M path's attention
    against the general path's on the same shapes."""
    rows = []
    for b in SMALL_M_BATCHES:
        case = Case(8, 4096, b, 1)
        for split in ("shape", "ctas"):
            row = run_case(case, peer=False, split=split)
            row.case = f"{case.name} split={split}"
            rows.append(row)
            print(f"  {row.case}: {row.us:.1f} µs ({row.extra['variant']}, grid {row.extra['grid']}, "
                  f"{row.extra['work_items']} items)", flush=True)
    return rows


VARIANT_CASES = [(h, ctx, b, 1) for h in (8, 64) for b in (1, 8, 32) for ctx in (4096, 16384)] + [(64, 4096, 8, 16)]


def variant_rows(case: Case) -> list[Row]:
    """Every tile variant that fits this GPU on one case, the plan's pick first and the reference of
    the check."""
    import cupy

    from ..kernels.mla_attention import _VARIANTS, DV, build_plan
    from ..kernels.mla_attention import mla_attention as attend
    from ..reference.mla_attention import validate_batch
    from ..rtc.arch import wgmma_build

    b = validate_batch(np.full(case.batch, case.ctx), np.full(case.batch, case.nodes), case.page_table,
                       case.heads, PAGE, case.num_pages, case.mask)
    cache = random_bf16_device((case.num_pages, PAGE, ROW), seed=1)
    t = case.batch * case.nodes
    q = random_bf16_device((t, case.heads, ROW), scale=0.3, seed=2)
    pick = build_plan(b).variant
    rows, first = [], None
    tiles = [pick] + sorted(v for v in _VARIANTS if v != pick and (wgmma_build() or not _VARIANTS[v].wgmma))
    for variant in tiles:
        try:
            plan = build_plan(b, variant=variant)
        except RuntimeError as e:  # more shared memory than this GPU has
            print(f"  {case.name} {variant}: skipped ({e})", flush=True)
            continue
        out = cupy.empty((t, case.heads, DV), cupy.uint16)
        lse = cupy.empty((t, case.heads), cupy.float32)

        def fn(plan=plan, out=out, lse=lse):
            attend(plan, q, cache, SCALE, out=out, lse=lse)

        timing = time_gpu(fn, warmup=3, iters=20)
        o, lg = bf16_to_f32(out.get()), lse.get()
        if first is None:
            first, check = (o, lg), "reference"
        else:
            err, lerr = rel_diff(o, first[0]), float(np.abs(lg - first[1]).max())
            check = "ok" if err < 1e-2 and lerr < 1e-3 else f"MISMATCH o (rel) {err:.3g} lse {lerr:.3g}"
        rows.append(Row(f"{case.name} [{variant}]", timing.median_us, bytes=case.kv_bytes(), flops=case.flops(),
                        extra={"variant": variant, "picked": variant == pick,
                               "work_items": plan.num_work, "merged_tiles": plan.num_merge,
                               "busy_ctas": int((np.diff(plan.cta_work.get()) > 0).sum()), "check": check}))
        print(f"  {rows[-1].case}: {timing.median_us:.1f} µs {check}", flush=True)
    return rows


HEAD_GEMM_TOKENS = (1, 8, 33, 64)
GRAPH_REPS = 16  # launches per graph for the chained time


def _chained_us(fn, reps: int = GRAPH_REPS) -> float:
    """µs per call of ``fn`` captured ``reps`` times back to back in one CUDA graph (PDL edges where
    the kernels launch with PDL), weights warm in L2: the cost of a launch inside a step's graph."""
    from .harness import graphed

    return time_gpu(graphed(lambda: [fn() for _ in range(reps)]), warmup=3, iters=20, flush_l2=False).median_us / reps


def _head_gemm_case(name: str, run, bytes_: int) -> Row:
    """``run(impl)`` -> output (device): impl="invariant" timed (single launch, L2 flushed: the
    weights come from HBM as in a step) against impl="auto" (the general path), outputs compared."""
    us = {impl: time_gpu(lambda impl=impl: run(impl), warmup=3, iters=30).median_us for impl in ("invariant", "auto")}
    chained = {impl: _chained_us(lambda impl=impl: run(impl)) for impl in ("invariant", "auto")}
    err = rel_diff(bf16_to_f32(run("invariant").get()), bf16_to_f32(run("auto").get()))
    return Row(name, us["invariant"], bytes=bytes_, peer="general path (cuBLAS)", peer_us=us["auto"],
               extra={"graph_us": chained["invariant"], "peer_graph_us": chained["auto"],
                      "check": "ok" if err < 1e-2 else f"MISMATCH (rel) {err:.3g}"})


def head_gemm_rows(heads: int = 8) -> list[Row]:
    """The small-M path's MLA head GEMMs at one TP8 rank's heads (K2.6: kv_b [H, 256, 512], views as
    model/mla.py takes them) for T = 1, 8, 33, 64: the W_UV expansion (o_lat [T, H, 512] x W_UV[h]^T)
    and the W_UK absorption (q_nope [T, H, 128] x W_UK[h]) with impl="invariant" (cuda_src/mla_small.cu)
    against impl="auto" (strided-batched cuBLAS); mla_query_small (W_UK + RoPE(q_pe) in one launch)
    against the general path's three launches (cuBLAS GEMM, q_pe copy, RoPE). Bytes: weights + x + out."""
    import cupy

    from ..backend import Backend
    from ..kernels.mla_attention import mla_head_gemm
    from ..kernels.mla_small import mla_query_small
    from ..model.mla import MLADims, absorb_query
    from ..reference.rope import rope_inv_freq

    be, dims = Backend("cuda", quiet=True), MLADims(heads)

    kv_b = random_bf16_device((heads, 256, DV), scale=DV ** -0.5, seed=11)
    w_uk, w_uv = kv_b[:, :128], kv_b[:, 128:]
    w_bytes = heads * 128 * DV * 2
    inv_freq = cupy.asarray(np.asarray(rope_inv_freq(64, 50000.0, None), np.float32))
    rows = []
    for t in HEAD_GEMM_TOKENS:
        o_lat = random_bf16_device((t, heads, DV), seed=12)
        q = random_bf16_device((t, heads, 192), seed=13)
        pos = cupy.arange(4000, 4000 + t, dtype=cupy.int32)
        o = cupy.empty((t, heads, 128), cupy.uint16)
        q_att = cupy.empty((t, heads, ROW), cupy.uint16)

        def expand(impl, o=o, o_lat=o_lat):
            return mla_head_gemm(o_lat, w_uv, True, out=o, impl=impl)

        def absorb(impl, q=q, q_att=q_att):
            mla_head_gemm(q[:, :, :128], w_uk, False, out=q_att[:, :, :DV], impl=impl)
            return q_att[:, :, :DV]

        def query(impl, q=q, q_att=q_att, pos=pos):
            if impl == "invariant":
                return mla_query_small(q, w_uk, pos, inv_freq, 1.0, out=q_att)
            return absorb_query(be, q, w_uk, dims, pos, inv_freq, out=q_att)

        x_out = 2 * t * heads * (DV + 128)
        rows.append(_head_gemm_case(f"W_UV expand h{heads} T{t}", expand, w_bytes + x_out))
        rows.append(_head_gemm_case(f"W_UK absorb h{heads} T{t}", absorb, w_bytes + x_out))
        rows.append(_head_gemm_case(f"query (W_UK + RoPE) h{heads} T{t}", query,
                                    w_bytes + 2 * t * heads * (192 + ROW)))
        for r in rows[-3:]:
            print(f"  {r.case}: {r.us:.2f} µs (general {r.peer_us:.2f}); in a graph {r.extra['graph_us']:.2f} "
                  f"(general {r.extra['peer_graph_us']:.2f}) {r.extra['check']}", flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes (a smoke run)")
    ap.add_argument("--variants", action="store_true",
                    help="every tile variant side by side on decode / verify cases, checked against the pick")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    ap.add_argument("--no-peer", action="store_true", help="skip the CuPy peer")
    ap.add_argument("--head-gemms", action="store_true",
                    help="the small-M path's MLA head GEMMs and absorbed query (8 heads, T = 1, 8, 33, 64) "
                         "against the general path's cuBLAS launches")
    ap.add_argument("--small-m", action="store_true",
                    help="8-head decode at 4k, batch 1 / 17 / 33 / 64, split='shape' (small-M path) and 'ctas'")
    args = ap.parse_args(argv)
    if args.small_m:
        return report("MLA attention, small-M path (split=shape) vs general (split=ctas)", small_m_rows(),
                      args.json, notes={"page_size": PAGE, "bytes": "cache rows read once per request",
                                        "us": "attention + merge launch, L2 flushed"})
    if args.head_gemms:
        return report("MLA head GEMMs, small-M path (impl=invariant) vs general (cuBLAS)", head_gemm_rows(),
                      args.json, notes={"us": "one launch, L2 flushed (weights from HBM)",
                                        "graph_us": f"per launch, {GRAPH_REPS} back to back in one CUDA graph, "
                                                    "weights warm in L2",
                                        "bytes": "weights + x + out", "check": "rel diff to the general path < 1e-2"})
    if args.variants:
        rows = [r for h, ctx, b, n in VARIANT_CASES for r in variant_rows(Case(h, ctx, b, n))]
        return report("MLA attention tile variants", rows, args.json,
                      notes={"page_size": PAGE, "bytes": "cache rows read once per request",
                             "check": "output (rel) < 1e-2 and LSE < 1e-3 of the plan's pick"})
    if args.quick:
        grid = [(h, 4096, b, n) for h in (64, 8) for b in (1, 8) for n in (1, 16)]
    else:
        grid = [(h, c, b, n) for h in (64, 8) for c in (1024, 4096, 16384, 65536) for b in (1, 8, 32)
                for n in (1, 8, 16, 32, 64)]
    rows = []
    for heads, ctx, batch, nodes in grid:
        rows.append(run_case(Case(heads, ctx, batch, nodes), peer=not args.no_peer))
        print(f"  {rows[-1].case}: {rows[-1].us:.1f} µs", flush=True)
    notes = {"page_size": PAGE, "softmax_scale": SCALE, "tree": "DDTree best-first, depth <= 7, top-8",
             "bytes": "cache rows read once per request (re-reads across query tiles hit L2)",
             "flops": "2*H*(576+512) per (query token, visible cache row)",
             "peer": f"fp16 cupy.matmul + fp32 masked softmax, contiguous KV; skipped above "
                     f"{PEER_MAX_SCORES} score elements"}
    return report("MLA attention (absorbed, paged latent cache)", rows, args.json, notes=notes)


if __name__ == "__main__":
    main()
