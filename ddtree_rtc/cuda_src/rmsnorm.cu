// RMSNorm over the last dim, optionally fused with the residual add (bf16 in/out, fp32 math).
//   h = x (+ residual, rounded to bf16 and written to residual_out)
//   y = bf16(h * rsqrt(mean(h^2) + eps) * w)
// Short rows (d <= 1024): one warp per row, 8 rows per block. Long rows (hidden 7168): one block of
// 256 threads per row, so a single decode token is not one warp walking 14 KB serially.
// 16-byte accesses when the row length is a multiple of 8; such rows of up to 8192 (a block) or 1024
// (a warp) elements stay in registers, the norm weight loaded before the PDL wait (rmsnorm.cuh).
// Launched under PDL (kernels/_launch.py): each waits on the previous kernel before it reads, then lets
// the next one launch at once, so the next kernel's launch and its weight prefetch (the small-M
// linears put theirs before their wait) overlap this one instead of following it.
#include "common.cuh"
#include "rmsnorm.cuh"

using namespace ddt;

// x, residual, y, residual_out: [rows, d] with row strides (elements); w: [d].
extern "C" __global__ void __launch_bounds__(256, 1) rmsnorm_kernel(
    const bf16* x, long long x_stride, const bf16* residual, long long res_stride,
    const bf16* __restrict__ w, bf16* y, long long y_stride, bf16* residual_out, long long res_out_stride,
    int rows, int d, float eps, int vec) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (rmsnorm_in_regs<32>(d, vec)) {
    bf16x8 g[kRegVecs];
    rmsnorm_weights<32>(w, d, g);  // w does not depend on the previous kernel
    pdl_wait();  // x / residual come from the previous kernel; a warp without a row still waits (PDL rule)
    pdl_trigger();
    if (row >= rows) return;
    rmsnorm_regs_dispatch<32>(x, x_stride, residual, res_stride, g, y, y_stride, residual_out, res_out_stride,
                              row, d, eps);
    return;
  }
  pdl_wait();
  pdl_trigger();
  if (row >= rows) return;
  rmsnorm_dispatch<32>(x, x_stride, residual, res_stride, w, y, y_stride, residual_out, res_out_stride, row,
                       d, eps, vec);
}

// Same contract; one block of 256 threads per row (grid = rows).
extern "C" __global__ void __launch_bounds__(256, 1) rmsnorm_block_kernel(
    const bf16* x, long long x_stride, const bf16* residual, long long res_stride,
    const bf16* __restrict__ w, bf16* y, long long y_stride, bf16* residual_out, long long res_out_stride,
    int rows, int d, float eps, int vec) {
  if (rmsnorm_in_regs<256>(d, vec)) {
    bf16x8 g[kRegVecs];
    rmsnorm_weights<256>(w, d, g);  // w does not depend on the previous kernel
    pdl_wait();
    pdl_trigger();
    rmsnorm_regs_dispatch<256>(x, x_stride, residual, res_stride, g, y, y_stride, residual_out, res_out_stride,
                               blockIdx.x, d, eps);
    return;
  }
  pdl_wait();
  pdl_trigger();
  rmsnorm_dispatch<256>(x, x_stride, residual, res_stride, w, y, y_stride, residual_out, res_out_stride,
                        blockIdx.x, d, eps, vec);
}
