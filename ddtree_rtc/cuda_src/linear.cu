// Skinny-M dense bf16 linear for decode: y[M, N] = x[M, K] . W[N, K]^T with M <= 64, fp32 accumulate,
// rounded once to bf16 (or written fp32: the *_f32 entries). The scheme (tokens on the mma's A side,
// 8 weight rows a warp, K split over warps and a cluster of S CTAs with fixed-order reductions):
// include/skinny_mma.cuh; the body: include/skinny_linear.cuh. S = 1, 2, 4, 8: the LINEAR_ENTRIES list below.
// Preconditions (checked by the wrapper): K % 8 == 0, x and W 16-byte aligned, x and y contiguous.
// linear_norm_*: an RMSNorm of x in front (include/skinny_norm.cuh), bf16 out: the small-M path's q_a
// norm and q_b in one launch, the bits of the rmsnorm launch followed by the linear_m* entry.
#include "common.cuh"
#include "skinny_linear.cuh"
#include "skinny_mma.cuh"
#include "skinny_norm.cuh"

using namespace ddt;
using skinny::kThreads;
using skinny::kWarps;

namespace {

// linear_norm_skinny's weight rows and stores. skinny_linear::run (include/skinny_linear.cuh) keeps its
// own copy of both: called from it, they move ptxas's register assignment in the 8-row clustered entries
// (the same instructions), and the plain entries' SASS is kept as it was.
// Warp wn's weight tiles j < NT of this CTA's row block: first rows n0[j], the lane's row (g) and
// whether it exists, and the lane that prefetches it (t == 0).
template <int S, int NT>
__device__ __forceinline__ void weight_rows(const bf16* __restrict__ w, int n, int pieces, int warps_n, int wn, int g,
                                            int t, int (&n0)[NT], bool (&row_ok)[NT], bool (&lead)[NT],
                                            const uint4* (&wrow)[NT]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    n0[j] = ((static_cast<int>(blockIdx.x) / S * NT + j) * warps_n + wn) * 8;
    const int row = n0[j] + g;
    row_ok[j] = row < n;
    lead[j] = t == 0 && row_ok[j];
    wrow[j] = reinterpret_cast<const uint4*>(w) + static_cast<size_t>(row_ok[j] ? row : 0) * pieces;
  }
}

// s[j MT + mt]: y[token 16mt + g][col 2t, 2t+1], y[token 16mt + g + 8][col 2t, 2t+1] of the warp's
// weight tile j.
template <int MT, int NT, typename OutT>
__device__ __forceinline__ void store_sums(const float4 (&s)[NT * MT], OutT* __restrict__ y, int n, const int (&n0)[NT],
                                           const bool (&xa_ok)[MT], const bool (&xb_ok)[MT], int g, int t) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int col = n0[j] + 2 * t;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float4 v = s[j * MT + mt];
      OutT* y0 = y + static_cast<size_t>(16 * mt + g) * n;
      if (xa_ok[mt]) {
        if (col < n) y0[col] = skinny_linear::out_value<OutT>(v.x);
        if (col + 1 < n) y0[col + 1] = skinny_linear::out_value<OutT>(v.y);
      }
      if (xb_ok[mt]) {
        OutT* y8 = y0 + static_cast<size_t>(8) * n;
        if (col < n) y8[col] = skinny_linear::out_value<OutT>(v.z);
        if (col + 1 < n) y8[col + 1] = skinny_linear::out_value<OutT>(v.w);
      }
    }
  }
}

// x [m, k] -> x_n = RMSNorm(x) * norm_w, then y = bf16(x_n . W^T): skinny_linear::run with the norm in front
// (include/skinny_norm.cuh). group: the rmsnorm launch's threads per row (32 or 256, kernels/rmsnorm.py).
template <int MH, int S>
__device__ __forceinline__ void linear_norm_skinny(const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                                                   float eps, int group, const bf16* __restrict__ w,
                                                   bf16* __restrict__ y, int m, int n, int k, int warps_n,
                                                   int early) {
  constexpr int MT = skinny::bucket_tiles<MH>(), NT = skinny::bucket_ntiles<MH>();
  __shared__ skinny_norm::Shared<MH> sh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % warps_n, wk = warp / warps_n, warps_k = kWarps / warps_n;
  const int rank = S == 1 ? 0 : static_cast<int>(skinny::cluster_rank());

  const int pieces = k >> 3;
  int c_begin, c_end;
  skinny::k_chunks(pieces, S * warps_k, rank * warps_k + wk, c_begin, c_end);
  int n0[NT];
  bool row_ok[NT], lead[NT];
  const uint4* wrow[NT];
  weight_rows<S, NT>(w, n, pieces, warps_n, wn, g, t, n0, row_ok, lead, wrow);
  if (early) {
    skinny::prefetch_chunks<NT>(wrow, c_begin, c_end, pieces, lead);
    pdl_wait();
    pdl_trigger();
  }
  bool xa_ok[MT], xb_ok[MT];
  float4 s[NT * MT];
  if (!skinny_norm::row_sums<MH, S>(sh, x, norm_w, eps, group, m, k, wrow, row_ok, c_begin, c_end, s, xa_ok, xb_ok,
                                    warp, lane, wn, wk, warps_n, warps_k, rank))
    return;
  store_sums<MT, NT, bf16>(s, y, n, n0, xa_ok, xb_ok, g, t);
}

}  // namespace

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

// x [m, k], norm_w [k], w [n, k], y [m, n] bf16, all contiguous; grid and early as the entries above.
#define LINEAR_NORM_ENTRY(NAME, MH, S, CLUSTER)                                                                \
  extern "C" __global__ void CLUSTER __launch_bounds__(kThreads, skinny::bucket_ctas_per_sm<MH>())             \
      NAME(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps, int group,                   \
           const bf16* __restrict__ w, bf16* __restrict__ y, int m, int n, int k, int warps_n, int early) {     \
    linear_norm_skinny<MH, S>(x, norm_w, eps, group, w, y, m, n, k, warps_n, early);                          \
  }

#define LINEAR_NORM_ENTRIES(PREFIX, MH)                                \
  LINEAR_NORM_ENTRY(PREFIX##_s1, MH, 1, )                              \
  LINEAR_NORM_ENTRY(PREFIX##_s2, MH, 2, __cluster_dims__(2, 1, 1))     \
  LINEAR_NORM_ENTRY(PREFIX##_s4, MH, 4, __cluster_dims__(4, 1, 1))     \
  LINEAR_NORM_ENTRY(PREFIX##_s8, MH, 8, __cluster_dims__(8, 1, 1))

LINEAR_NORM_ENTRIES(linear_norm_m8, 1)
LINEAR_NORM_ENTRIES(linear_norm_m16, 2)
LINEAR_NORM_ENTRIES(linear_norm_m32, 4)
LINEAR_NORM_ENTRIES(linear_norm_m64, 8)
