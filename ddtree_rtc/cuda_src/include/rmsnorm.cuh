// RMSNorm of one row by a warp or a whole block (rmsnorm.cu's kernels).
#pragma once
#include "common.cuh"

namespace ddt {

// GROUP threads (a warp, or the whole block) normalise one row.
template <int GROUP, bool VEC, bool RESID>
__device__ __forceinline__ void rmsnorm_row(const bf16* x, const bf16* res, const bf16* __restrict__ w,
                                            bf16* y, bf16* res_out, int d, float eps) {
  __shared__ float scratch[32];
  const int t = GROUP == 32 ? (threadIdx.x & 31) : threadIdx.x;
  float ss = 0.f;
  if (VEC) {
    for (int i = t * 8; i < d; i += GROUP * 8) {
      bf16x8 a = *reinterpret_cast<const bf16x8*>(x + i);
      if (RESID) {
        bf16x8 r = *reinterpret_cast<const bf16x8*>(res + i);
#pragma unroll
        for (int j = 0; j < 8; ++j) a.v[j] = to_bf16(to_f32(a.v[j]) + to_f32(r.v[j]));
        *reinterpret_cast<bf16x8*>(res_out + i) = a;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += to_f32(a.v[j]) * to_f32(a.v[j]);
    }
  } else {
    for (int i = t; i < d; i += GROUP) {
      bf16 a = x[i];
      if (RESID) {
        a = to_bf16(to_f32(a) + to_f32(res[i]));
        res_out[i] = a;
      }
      ss += to_f32(a) * to_f32(a);
    }
  }
  const float total = GROUP == 32 ? warp_sum(ss) : block_sum(ss, scratch);
  const float inv = rsqrtf(total / d + eps);
  const bf16* h = RESID ? res_out : x;  // each thread re-reads only what it wrote itself
  if (VEC) {
    for (int i = t * 8; i < d; i += GROUP * 8) {
      bf16x8 a = *reinterpret_cast<const bf16x8*>(h + i);
      bf16x8 g = *reinterpret_cast<const bf16x8*>(w + i);
#pragma unroll
      for (int j = 0; j < 8; ++j) a.v[j] = to_bf16(to_f32(a.v[j]) * inv * to_f32(g.v[j]));
      *reinterpret_cast<bf16x8*>(y + i) = a;
    }
  } else {
    for (int i = t; i < d; i += GROUP) y[i] = to_bf16(to_f32(h[i]) * inv * to_f32(w[i]));
  }
}

template <int GROUP>
__device__ __forceinline__ void rmsnorm_dispatch(const bf16* x, long long x_stride, const bf16* residual,
                                                 long long res_stride, const bf16* w, bf16* y,
                                                 long long y_stride, bf16* residual_out,
                                                 long long res_out_stride, long long row, int d, float eps,
                                                 int vec) {
  const bf16* xr = x + row * x_stride;
  bf16* yr = y + row * y_stride;
  if (residual) {
    const bf16* rr = residual + row * res_stride;
    bf16* ro = residual_out + row * res_out_stride;
    if (vec) rmsnorm_row<GROUP, true, true>(xr, rr, w, yr, ro, d, eps);
    else rmsnorm_row<GROUP, false, true>(xr, rr, w, yr, ro, d, eps);
  } else {
    if (vec) rmsnorm_row<GROUP, true, false>(xr, nullptr, w, yr, nullptr, d, eps);
    else rmsnorm_row<GROUP, false, false>(xr, nullptr, w, yr, nullptr, d, eps);
  }
}

}  // namespace ddt
