#!/usr/bin/env python
"""mma.sync m16n8k16 bf16 (fp32 accumulate) peak on this GPU, the compute ceiling of the INT4 MoE
GEMMs (they issue mma.sync on every arch): bench_ceiling.cu's mma_peak_kernel, 4-warp blocks with 8
independent accumulator chains per warp on register operands, at 1 / 2 / 4 / 8 blocks per SM.
Prints TFLOP/s per occupancy and the cuBLAS bf16 matmul rate (wgmma on sm_90a) beside it.
H200, 2026-12-04 (the same kernel as a standalone script): 553 / 624 / 640 / 646 TFLOP/s against
cuBLAS 792. Usage (on a GPU): python tools/mma_peak.py"""

from ddtree_rtc.bench.harness import matmul_ceiling_tflops, mma_peak_tflops
from ddtree_rtc.rtc.arch import detect_arch


def main():
    print(f"{detect_arch()}: mma.sync m16n8k16 bf16 -> fp32 peak")
    for per_sm in (1, 2, 4, 8):
        print(f"  {per_sm} blocks of 4 warps per SM: {mma_peak_tflops(per_sm):7.1f} TFLOP/s")
    print(f"  cuBLAS bf16 matmul 8192^3: {matmul_ceiling_tflops():.1f} TFLOP/s")


if __name__ == "__main__":
    main()
