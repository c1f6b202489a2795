"""The ceilings every benchmark is measured against, on this GPU: streaming read and device copy
bandwidth (bench_ceiling.cu's 16-byte-access kernels), the latency floor of a small kernel (one
dependent load per block, one and two launches back to back), the mma.sync m16n8k16 bf16 (fp32
accumulate) peak at 1 / 2 / 4 / 8 blocks of 4 warps per SM (8 independent accumulator chains per warp
on register operands: the compute ceiling of the INT4 MoE GEMMs, which issue mma.sync on every arch)
and the cuBLAS bf16 matmul rate (8192^3, wgmma on sm_90a)."""

from __future__ import annotations

import argparse

from .harness import (
    Row,
    copy_ceiling_gbs,
    latency_floor_us,
    matmul_ceiling_tflops,
    mma_peak_tflops,
    read_ceiling_gbs,
    report,
)

READ_BYTES, COPY_BYTES, MATMUL_N = 2 << 30, 1 << 30, 8192
MMA_ITERS = 4096


def main(argv=None) -> dict:
    from ..kernels._launch import sm_count

    ap = argparse.ArgumentParser(prog="ddtree-rtc bench ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    read, copy = read_ceiling_gbs(READ_BYTES), copy_ceiling_gbs(COPY_BYTES)
    rows = [Row(f"read stream {READ_BYTES >> 20} MiB", READ_BYTES / read / 1e3, bytes=READ_BYTES),
            Row(f"copy stream {COPY_BYTES >> 20} MiB (read + write)", 2 * COPY_BYTES / copy / 1e3,
                bytes=2 * COPY_BYTES, ceiling="copy")]
    for blocks in (1, 32, sm_count()):
        for kernels in (1, 2):
            rows.append(Row(f"latency floor: {kernels} launch(es) of {blocks} blocks, 1 dependent load",
                            latency_floor_us(blocks, kernels), extra={"blocks": blocks, "kernels": kernels}))
    matmul = matmul_ceiling_tflops(MATMUL_N)
    flops = 2 * MATMUL_N**3
    rows.append(Row(f"cuBLAS bf16 matmul {MATMUL_N}^3", flops / matmul / 1e6, flops=flops, ceiling="matmul"))
    for per_sm in (1, 2, 4, 8):
        tflops = mma_peak_tflops(per_sm, MMA_ITERS)
        mma_flops = sm_count() * per_sm * 4 * MMA_ITERS * 8 * 2 * 16 * 8 * 16  # as mma_peak_tflops counts
        rows.append(Row(f"mma.sync m16n8k16 bf16 peak, {per_sm} blocks of 4 warps per SM", mma_flops / tflops / 1e6,
                        flops=mma_flops, ceiling="matmul", extra={"blocks_per_sm": per_sm}))
    return report("ceilings: read / copy bandwidth, latency floor, mma.sync and cuBLAS matmul peaks", rows,
                  args.json, notes={"mma": "mma_peak_kernel; % of ceiling is against the cuBLAS rate"})
