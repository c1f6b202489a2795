// Skinny-M dense bf16 linear for decode: y[M, N] = x[M, K] . W[N, K]^T with M <= 64, fp32 accumulate,
// rounded once to bf16 (or written fp32: the *_f32 entries). The scheme (tokens on the mma's A side,
// 8 weight rows a warp, K split over warps and a cluster of S CTAs with fixed-order reductions):
// include/skinny_mma.cuh; the body: include/skinny_linear.cuh. S = 1, 2, 4, 8: the LINEAR_ENTRIES list below.
// Preconditions (checked by the wrapper): K % 8 == 0, x and W 16-byte aligned, x and y contiguous.
#include "common.cuh"
#include "skinny_linear.cuh"

using namespace ddt;
using skinny::kThreads;

// x [m, k], w [n, k], y [m, n] (bf16, or fp32 for the *_f32 entries), all contiguous; grid
// ceil(n / (8 warps_n NT)) * S, block 256; early: launched under PDL (see skinny_linear::run).
#define LINEAR_ENTRY(NAME, MH, S, CLUSTER, OUT)                                                             \
  extern "C" __global__ void CLUSTER __launch_bounds__(kThreads, skinny::bucket_ctas_per_sm<MH>())                   \
      NAME(const bf16* __restrict__ x, const bf16* __restrict__ w, OUT* __restrict__ y, int m, int n, int k,  \
           int warps_n, int early) {                                                                      \
    skinny_linear::run<MH, S, OUT>(x, w, y, m, n, k, warps_n, early, blockIdx.x);                          \
  }

// The four cluster sizes S = 1, 2, 4, 8 of one (M, out type): PREFIX_s1 .. PREFIX_s8.
#define LINEAR_ENTRIES(PREFIX, MH, OUT)                                 \
  LINEAR_ENTRY(PREFIX##_s1, MH, 1, , OUT)                               \
  LINEAR_ENTRY(PREFIX##_s2, MH, 2, __cluster_dims__(2, 1, 1), OUT)      \
  LINEAR_ENTRY(PREFIX##_s4, MH, 4, __cluster_dims__(4, 1, 1), OUT)      \
  LINEAR_ENTRY(PREFIX##_s8, MH, 8, __cluster_dims__(8, 1, 1), OUT)

LINEAR_ENTRIES(linear_m8, 1, bf16)
LINEAR_ENTRIES(linear_m16, 2, bf16)
LINEAR_ENTRIES(linear_m32, 4, bf16)
LINEAR_ENTRIES(linear_m64, 8, bf16)
LINEAR_ENTRIES(linear_m8_f32, 1, float)
LINEAR_ENTRIES(linear_m16_f32, 2, float)
LINEAR_ENTRIES(linear_m32_f32, 4, float)
LINEAR_ENTRIES(linear_m64_f32, 8, float)
