"""The sublayer all-reduce + residual RMSNorm at K2.6's hidden size (7168): the one-shot kernel
(cuda_src/allreduce.cu) against NCCL's all-reduce + the norm of the fp32 sum (the default path), per
call, for rows 1..16 and the dense (one fp32 part) and MoE (routed + shared) partials.

On one GPU (default): N simulated ranks (``--ranks``), their buffers on the one device and all N
ranks' CTAs in one launch, so a row reads the N partials from HBM / L2, not over NVLink: the figure
is the kernel's own latency and the N-fold work, not a TP8 node's. Its peer is NCCL on one rank (a
copy) + rmsnorm of the fp32 sum: the launches the fused kernel replaces, not NCCL's 8-rank latency.
``--nproc N`` spawns N real ranks (one GPU each, NCCL + CUDA IPC peer memory): the TP-N figures,
rank 0's, against the same rank's NCCL all-reduce + rmsnorm of the fp32 sum on the same partials.

Each case is a CUDA graph of ``--calls`` calls (slots alternating), timed per replay and divided by
the calls, so host launch time is out. Ceilings per row: ``nvlink_floor_us`` = the bytes a rank pulls
from its N - 1 peers over NVLink at ``--nvlink-gbs`` (a spec figure, default 450 GB/s a direction:
H100 SXM); the row's GB/s is against the measured HBM read ceiling for the bytes the launch reads.
"""

from __future__ import annotations

import argparse
import os
import sys

from .harness import Row, capture_graph, random_bf16_device, report, time_gpu

D = 7168
ROWS = (1, 2, 4, 8, 16)
EPS = 1e-6


def _graph_us(step, calls: int, iters: int) -> float:
    """µs per call of ``step(i)`` for i in 0..calls-1, captured as one graph."""
    graph = capture_graph(lambda: [step(i) for i in range(calls)])
    return time_gpu(graph.launch, warmup=3, iters=iters, flush_l2=False).median_us / calls


def _case_extra(n: int, rows: int, parts: int, nvlink_gbs: float) -> dict:
    pulled = (n - 1) * parts * rows * D * 4
    return {"ranks": n, "rows": rows, "parts": parts, "hidden": D, "nvlink_bytes_per_rank": pulled,
            "nvlink_floor_us": pulled / nvlink_gbs / 1e3}


def _simulated_case(peers, w, n: int, rows: int, parts: int, calls: int, iters: int, nvlink_gbs: float) -> Row:
    import cupy

    from ..backend import Backend
    from ..kernels.allreduce import allreduce_rmsnorm
    from ..parallel.comm import SingleRank

    be, single = Backend("cuda"), SingleRank()
    shape = (rows, D) if parts == 1 else (2, rows, D)
    for q in range(n):
        for slot in (0, 1):
            peers.partial(q, slot, shape)[...] = cupy.random.default_rng(q).standard_normal(shape, dtype=cupy.float32)
    res = random_bf16_device((n, rows, D), seed=2)
    y, h = cupy.empty_like(res), cupy.empty_like(res)
    fused = _graph_us(lambda i: allreduce_rmsnorm(peers, i % 2, shape, w, EPS, res, out=y, residual_out=h),
                      calls, iters)
    part, r0 = cupy.ascontiguousarray(peers.partial(0, 0, shape)), cupy.ascontiguousarray(res[0])

    def composed(i):
        single.all_reduce(part)
        if parts == 2:  # the default path's sublayer end: the norm of the fp32 sum (rmsnorm's _f32 entries)
            be.rmsnorm(part[0], w, EPS, residual=r0, plus=part[1])
        else:
            be.rmsnorm(part, w, EPS, residual=r0)

    peer = _graph_us(composed, calls, iters)
    read = n * (n * parts * rows * D * 4 + 2 * rows * D * 2)  # every launch rank: N partials, residual in and out
    return Row(f"oneshot {n} simulated ranks, {rows} rows, {'MoE' if parts == 2 else 'dense'}", fused, bytes=read,
               peer="1-rank NCCL + rmsnorm of the fp32 sum (one rank's launches)", peer_us=peer,
               extra={**_case_extra(n, rows, parts, nvlink_gbs), "mode": "simulated, one launch",
                      "us_per_rank_share": fused / n})


def simulated_rows(n: int, rows_list, calls: int, iters: int, nvlink_gbs: float) -> list[Row]:
    from ..kernels.allreduce import PeerBuffers

    peers, w = PeerBuffers.local(n, D, timeout_s=30), random_bf16_device((D,), seed=1)
    out = []
    for parts in (1, 2):
        for rows in rows_list:
            out.append(_simulated_case(peers, w, n, rows, parts, calls, iters, nvlink_gbs))
            print(f"  {out[-1].case}: {out[-1].us:.2f} µs (peer {out[-1].peer_us:.2f} µs)", flush=True)
    return out


def _rank_case(comm, be, w, rows: int, parts: int, calls: int, iters: int, nvlink_gbs: float, how: str) -> Row:
    import cupy

    shape = (rows, D) if parts == 1 else (2, rows, D)
    for slot in (0, 1):
        comm.oneshot.peers.partial(comm.rank, slot, shape)[...] = cupy.random.default_rng(comm.rank).standard_normal(
            shape, dtype=cupy.float32)
    res = random_bf16_device((rows, D), seed=2)
    comm.barrier()
    t_fused = _graph_us(lambda i: comm.all_reduce_norm(comm.partial_buffer(shape, be), w, EPS, res, be), calls, iters)
    plain = cupy.random.default_rng(comm.rank).standard_normal(shape, dtype=cupy.float32)

    def nccl(i):
        comm.all_reduce(plain)
        if parts == 2:
            be.rmsnorm(plain[0], w, EPS, residual=res, plus=plain[1])
        else:
            be.rmsnorm(plain, w, EPS, residual=res)

    comm.barrier()
    t_nccl = _graph_us(nccl, calls, iters)
    n = comm.world_size
    return Row(f"oneshot {n} ranks, {rows} rows, {'MoE' if parts == 2 else 'dense'}", t_fused,
               bytes=n * parts * rows * D * 4, peer="NCCL all-reduce + rmsnorm of the fp32 sum", peer_us=t_nccl,
               extra={**_case_extra(n, rows, parts, nvlink_gbs), "mode": f"{n} real ranks ({how})"})


def rank_rows(rows_list, calls: int, iters: int, nvlink_gbs: float) -> list[Row] | None:
    """This rank's rows of a real job (rank 0 returns them, the others None)."""
    from ..backend import Backend
    from ..parallel.launch import make_communicator, rank_env
    from ..parallel.oneshot import attach

    env = rank_env()
    comm = make_communicator(env, cuda=True)
    be = Backend("cuda")
    how = attach(comm, "oneshot", be, D)
    w = random_bf16_device((D,), seed=1)
    out = []
    try:
        for parts in (1, 2):
            for rows in rows_list:
                out.append(_rank_case(comm, be, w, rows, parts, calls, iters, nvlink_gbs, how))
                if comm.rank == 0:
                    print(f"  {out[-1].case}: {out[-1].us:.2f} µs (NCCL + norm {out[-1].peer_us:.2f} µs)", flush=True)
    finally:
        comm.close()
    return out if env.rank == 0 else None


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(prog="ddtree-rtc bench allreduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="simulated ranks on one GPU (2..8)")
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many real ranks (one GPU each) instead")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per call, comma-separated (<= 16)")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph (even)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--nvlink-gbs", type=float, default=450.0, help="NVLink GB/s a direction for the floor")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    rows_list = tuple(int(r) for r in args.rows.split(","))
    if args.calls < 2 or args.calls % 2:
        ap.error("--calls must be even (the slots alternate)")
    if any(not 1 <= r <= 16 for r in rows_list):
        ap.error("--rows: each must be 1..16")
    notes = {"hidden": D, "calls_per_graph": args.calls,
             "nvlink_floor": f"bytes pulled from the N - 1 peers at {args.nvlink_gbs:g} GB/s (spec, not measured)"}
    if os.environ.get("DDTREE_RTC_BENCH_RANK"):  # a spawned rank of --nproc
        got = rank_rows(rows_list, args.calls, args.iters, args.nvlink_gbs)
        if got is not None:
            return report(f"one-shot all-reduce + RMSNorm, {got[0].extra['ranks']} ranks", got,
                          args.json, notes={**notes, "mode": "real ranks, rank 0's figures"})
        return None
    if args.nproc:
        from ..parallel.launch import spawn

        argv = list(argv if argv is not None else sys.argv[1:])
        spawn([sys.executable, "-m", "ddtree_rtc.bench.allreduce", *argv], args.nproc,
              env={**os.environ, "DDTREE_RTC_BENCH_RANK": "1"})
        return None
    if not 2 <= args.ranks <= 8:
        ap.error("--ranks must be 2..8")
    rows = simulated_rows(args.ranks, rows_list, args.calls, args.iters, args.nvlink_gbs)
    return report(f"one-shot all-reduce + RMSNorm, {args.ranks} simulated ranks on one GPU", rows, args.json,
                  notes={**notes, "mode": "simulated ranks in one launch: N-fold work from HBM / L2, no NVLink"})


if __name__ == "__main__":
    main()
