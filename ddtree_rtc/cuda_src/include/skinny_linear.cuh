// The body of one skinny-M dense bf16 linear (linear.cu's linear_m* entries, and the shared expert's
// down projection in moe_small.cu's moe_small_route_shared_m*): y[M, N] = x[M, K] . W[N, K]^T with
// M <= 64, fp32 accumulate, rounded once to bf16 or written fp32. The scheme: include/skinny_mma.cuh.
// Preconditions (checked by the wrappers): K % 8 == 0, x and W 16-byte aligned, x and y contiguous.
#pragma once
#include "common.cuh"
#include "skinny_mma.cuh"

namespace ddt {
namespace skinny_linear {

using skinny::kWarps;

// bf16: rounded once; fp32: a tensor-parallel partial, unrounded
template <typename OutT>
__device__ __forceinline__ OutT out_value(float v);
template <>
__device__ __forceinline__ bf16 out_value<bf16>(float v) {
  return to_bf16(v);
}
template <>
__device__ __forceinline__ float out_value<float>(float v) {
  return v;
}

// MH = 1: M <= 8 (A rows 8..15 are zeros, never loaded); MH = 2: M <= 16; MH = 4 / 8: M <= 32 / 64
// (2 / 4 m16 tiles of tokens, NT = 1 / 2 n8 weight tiles a warp, fewer k32 chunks in flight so the
// operands stay in registers). S: CTAs per cluster. A token row's sums depend only on (warps_n, S, K),
// never on MH or on the other rows (include/skinny_mma.cuh): the small-M path plans them from the shape
// alone (kernels/linear.py, impl="invariant").
// Grid: ceil(N / (8 warps_n NT)) row blocks x S, cluster rank = split index along K; `block` is the
// CTA's index in that grid (blockIdx.x in linear.cu; a fused launch whose first CTAs do other work
// passes blockIdx.x less those, a whole number of clusters); warp wn's weight tile j of row block b is
// tile (b NT + j) warps_n + wn.
// early (a launch under PDL, kernels/_launch.py): each weight row's K range goes to L2 before the
// wait on the previous kernel, whose output x is read only after it (weights do not depend on it).
template <int MH, int S, typename OutT>
__device__ __forceinline__ void run(const bf16* __restrict__ x, const bf16* __restrict__ w, OutT* __restrict__ y,
                                    int m, int n, int k, int warps_n, int early, int block) {
  constexpr int MT = skinny::bucket_tiles<MH>(), NT = skinny::bucket_ntiles<MH>();  // include/skinny_mma.cuh
  __shared__ float4 red[kWarps][NT * MT][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % warps_n, wk = warp / warps_n, warps_k = kWarps / warps_n;
  const int rank = S == 1 ? 0 : static_cast<int>(skinny::cluster_rank());

  const int pieces = k >> 3;  // 16-byte pieces per row
  int c_begin, c_end;
  skinny::k_chunks(pieces, S * warps_k, rank * warps_k + wk, c_begin, c_end);

  int n0[NT];
  bool row_ok[NT], lead[NT];
  const uint4* wrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    n0[j] = ((block / S * NT + j) * warps_n + wn) * 8;
    const int row = n0[j] + g;
    row_ok[j] = row < n;
    lead[j] = t == 0 && row_ok[j];
    wrow[j] = reinterpret_cast<const uint4*>(w) + static_cast<size_t>(row_ok[j] ? row : 0) * pieces;
  }
  if (early) {
    skinny::prefetch_chunks<NT>(wrow, c_begin, c_end, pieces, lead);
    pdl_wait();
    pdl_trigger();
  }
  bool xa_ok[MT], xb_ok[MT];
  float4 s[NT * MT];
  if (!skinny::row_sums<MH, S>(red, x, m, pieces, wrow, row_ok, c_begin, c_end, s, xa_ok, xb_ok, warp, lane, wn, wk,
                               warps_n, warps_k, rank))
    return;
  // s[j MT + mt]: y[token 16mt + g][col 2t, 2t+1], y[token 16mt + g + 8][col 2t, 2t+1] of the warp's
  // weight tile j.
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int col = n0[j] + 2 * t;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float4 v = s[j * MT + mt];
      OutT* y0 = y + static_cast<size_t>(16 * mt + g) * n;
      if (xa_ok[mt]) {
        if (col < n) y0[col] = out_value<OutT>(v.x);
        if (col + 1 < n) y0[col + 1] = out_value<OutT>(v.y);
      }
      if (xb_ok[mt]) {
        OutT* y8 = y0 + static_cast<size_t>(8) * n;
        if (col < n) y8[col] = out_value<OutT>(v.z);
        if (col + 1 < n) y8[col + 1] = out_value<OutT>(v.w);
      }
    }
  }
}

}  // namespace skinny_linear
}  // namespace ddt
