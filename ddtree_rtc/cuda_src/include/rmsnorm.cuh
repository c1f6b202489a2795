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

// Rows of up to GROUP x 8 x kRegVecs elements with 16-byte vectors (hidden 7168 by a block, 1024 by a
// warp) keep the row in registers: the norm weight is loaded before the kernel's PDL wait (it does
// not depend on the previous kernel), and h is not read back after the sum. The same sums in the same
// order as rmsnorm_row, so the same bits.
constexpr int kRegVecs = 4;

template <int GROUP>
__device__ __forceinline__ bool rmsnorm_in_regs(int d, int vec) {
  return vec && d <= GROUP * 8 * kRegVecs;
}

// Thread t's vectors of w (i = 8 t + 8 GROUP v < d), before the wait.
template <int GROUP>
__device__ __forceinline__ void rmsnorm_weights(const bf16* __restrict__ w, int d, bf16x8 (&g)[kRegVecs]) {
  const int t = GROUP == 32 ? (threadIdx.x & 31) : threadIdx.x;
#pragma unroll
  for (int v = 0; v < kRegVecs; ++v) {
    const int i = t * 8 + v * GROUP * 8;
    if (i < d) g[v] = *reinterpret_cast<const bf16x8*>(w + i);
  }
}

template <int GROUP, bool RESID>
__device__ __forceinline__ void rmsnorm_row_regs(const bf16* x, const bf16* res, const bf16x8 (&g)[kRegVecs], bf16* y,
                                                 bf16* res_out, int d, float eps) {
  __shared__ float scratch[32];
  const int t = GROUP == 32 ? (threadIdx.x & 31) : threadIdx.x;
  bf16x8 a[kRegVecs];
#pragma unroll
  for (int v = 0; v < kRegVecs; ++v) {  // all loads first
    const int i = t * 8 + v * GROUP * 8;
    if (i < d) a[v] = *reinterpret_cast<const bf16x8*>(x + i);
  }
  float ss = 0.f;
#pragma unroll
  for (int v = 0; v < kRegVecs; ++v) {
    const int i = t * 8 + v * GROUP * 8;
    if (i >= d) continue;
    if (RESID) {
      const bf16x8 r = *reinterpret_cast<const bf16x8*>(res + i);
#pragma unroll
      for (int j = 0; j < 8; ++j) a[v].v[j] = to_bf16(to_f32(a[v].v[j]) + to_f32(r.v[j]));
      *reinterpret_cast<bf16x8*>(res_out + i) = a[v];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += to_f32(a[v].v[j]) * to_f32(a[v].v[j]);
  }
  const float total = GROUP == 32 ? warp_sum(ss) : block_sum(ss, scratch);
  const float inv = rsqrtf(total / d + eps);
#pragma unroll
  for (int v = 0; v < kRegVecs; ++v) {
    const int i = t * 8 + v * GROUP * 8;
    if (i >= d) continue;
    bf16x8 o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.v[j] = to_bf16(to_f32(a[v].v[j]) * inv * to_f32(g[v].v[j]));
    *reinterpret_cast<bf16x8*>(y + i) = o;
  }
}

template <int GROUP>
__device__ __forceinline__ void rmsnorm_regs_dispatch(const bf16* x, long long x_stride, const bf16* residual,
                                                      long long res_stride, const bf16x8 (&g)[kRegVecs], bf16* y,
                                                      long long y_stride, bf16* residual_out,
                                                      long long res_out_stride, long long row, int d, float eps) {
  if (residual)
    rmsnorm_row_regs<GROUP, true>(x + row * x_stride, residual + row * res_stride, g, y + row * y_stride,
                                  residual_out + row * res_out_stride, d, eps);
  else
    rmsnorm_row_regs<GROUP, false>(x + row * x_stride, nullptr, g, y + row * y_stride, nullptr, d, eps);
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
