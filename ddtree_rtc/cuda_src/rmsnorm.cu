// RMSNorm over the last dim, optionally fused with the residual add (bf16 in/out, fp32 math).
//   h = x (+ residual, rounded to bf16 and written to residual_out)
//   y = bf16(h * rsqrt(mean(h^2) + eps) * w)
// Short rows (d <= 1024): one warp per row, 8 rows per block. Long rows (hidden 7168): one block of
// 256 threads per row, so a single decode token is not one warp walking 14 KB serially.
// 16-byte accesses when the row length is a multiple of 8; such rows of up to 8192 (a block) or 1024
// (a warp) elements stay in registers, the norm weight loaded before the PDL wait (rmsnorm.cuh).
// The _f32 entries take a tensor-parallel rank's all-reduced fp32 sublayer sum (and the MoE shared
// expert's fp32 sum) instead of bf16 x and round it as Backend.to_bf16 does, so the elementwise rounding
// launch between each all-reduce and its residual norm is gone (rmsnorm.cuh's load_in).
// Launched under PDL (kernels/_launch.py): each waits on the previous kernel before it reads, then lets
// the next one launch at once, so the next kernel's launch and its weight prefetch (the small-M
// linears put theirs before their wait) overlap this one instead of following it.
#include "common.cuh"
#include "rmsnorm.cuh"

using namespace ddt;

// x, residual, y, residual_out: [rows, d] with row strides (elements); w: [d]; plus (fp32 x only): [rows, d]
// with x's strides, or null.
template <typename TX>
__device__ __forceinline__ void rmsnorm_warps(const TX* x, long long x_stride, const float* plus, const bf16* residual,
                                              long long res_stride, const bf16* __restrict__ w, bf16* y,
                                              long long y_stride, bf16* residual_out, long long res_out_stride,
                                              int rows, int d, float eps, int vec) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (rmsnorm_in_regs<32>(d, vec)) {
    bf16x8 g[kRegVecs];
    rmsnorm_weights<32>(w, d, g);  // w does not depend on the previous kernel
    pdl_wait();  // x / residual come from the previous kernel; a warp without a row still waits (PDL rule)
    pdl_trigger();
    if (row >= rows) return;
    rmsnorm_regs_dispatch<32>(x, x_stride, plus, residual, res_stride, g, y, y_stride, residual_out,
                              res_out_stride, row, d, eps);
    return;
  }
  pdl_wait();
  pdl_trigger();
  if (row >= rows) return;
  rmsnorm_dispatch<32>(x, x_stride, plus, residual, res_stride, w, y, y_stride, residual_out, res_out_stride, row,
                       d, eps, vec);
}

// Same contract; one block of 256 threads per row (grid = rows).
template <typename TX>
__device__ __forceinline__ void rmsnorm_block(const TX* x, long long x_stride, const float* plus, const bf16* residual,
                                              long long res_stride, const bf16* __restrict__ w, bf16* y,
                                              long long y_stride, bf16* residual_out, long long res_out_stride,
                                              int d, float eps, int vec) {
  if (rmsnorm_in_regs<256>(d, vec)) {
    bf16x8 g[kRegVecs];
    rmsnorm_weights<256>(w, d, g);  // w does not depend on the previous kernel
    pdl_wait();
    pdl_trigger();
    rmsnorm_regs_dispatch<256>(x, x_stride, plus, residual, res_stride, g, y, y_stride, residual_out,
                               res_out_stride, blockIdx.x, d, eps);
    return;
  }
  pdl_wait();
  pdl_trigger();
  rmsnorm_dispatch<256>(x, x_stride, plus, residual, res_stride, w, y, y_stride, residual_out, res_out_stride,
                        blockIdx.x, d, eps, vec);
}

#define RMSNORM_ENTRIES(SUFFIX, TX, PLUS_PARAM, PLUS)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 1) rmsnorm##SUFFIX##kernel(                                 \
      const TX* x, long long x_stride, PLUS_PARAM const bf16* residual, long long res_stride,                    \
      const bf16* __restrict__ w, bf16* y, long long y_stride, bf16* residual_out, long long res_out_stride,   \
      int rows, int d, float eps, int vec) {                                                                    \
    rmsnorm_warps(x, x_stride, PLUS, residual, res_stride, w, y, y_stride, residual_out, res_out_stride, rows,  \
                  d, eps, vec);                                                                                 \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(256, 1) rmsnorm_block##SUFFIX##kernel(                           \
      const TX* x, long long x_stride, PLUS_PARAM const bf16* residual, long long res_stride,                    \
      const bf16* __restrict__ w, bf16* y, long long y_stride, bf16* residual_out, long long res_out_stride,   \
      int rows, int d, float eps, int vec) {                                                                    \
    rmsnorm_block(x, x_stride, PLUS, residual, res_stride, w, y, y_stride, residual_out, res_out_stride, d,     \
                  eps, vec);                                                                                    \
  }

#define RMSNORM_NO_PLUS
#define RMSNORM_PLUS_PARAM const float* plus,
RMSNORM_ENTRIES(_, bf16, RMSNORM_NO_PLUS, (const float*)nullptr)
RMSNORM_ENTRIES(_f32_, float, RMSNORM_PLUS_PARAM, plus)
