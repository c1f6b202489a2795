// RMSNorm of one row by a warp or a whole block (rmsnorm.cu's kernels).
#pragma once
#include "common.cuh"

namespace ddt {

// The row's input as bf16: either bf16 itself, or a tensor-parallel rank's all-reduced fp32 sum
// (plus, when given, the MoE shared expert's fp32 sum, rounded to bf16 first), rounded to bf16 with
// Backend.to_bf16's arithmetic (round to nearest even, NaN kept quiet with its sign): the same bits
// as that elementwise launch, which this replaces.
__device__ __forceinline__ float round_bf16_f32(float v) {
  unsigned int t = __float_as_uint(v);
  t = (t & 0x7fffffffu) > 0x7f800000u ? (t | 0x400000u) : ((t + 0x7fffu + ((t >> 16) & 1u)) & 0xffff0000u);
  return __uint_as_float(t);
}
__device__ __forceinline__ bf16 round_bf16(float v) {
  return __ushort_as_bfloat16((unsigned short)(__float_as_uint(round_bf16_f32(v)) >> 16));
}
__device__ __forceinline__ bf16 sum_to_bf16(float x, const float* plus, int i) {
  return round_bf16(plus ? x + round_bf16_f32(plus[i]) : x);
}
__device__ __forceinline__ bf16 load_in(const bf16* x, const float*, int i) { return x[i]; }
__device__ __forceinline__ bf16 load_in(const float* x, const float* plus, int i) { return sum_to_bf16(x[i], plus, i); }
__device__ __forceinline__ bf16x8 load_in8(const bf16* x, const float*, int i) {
  return *reinterpret_cast<const bf16x8*>(x + i);
}
__device__ __forceinline__ bf16x8 load_in8(const float* x, const float* plus, int i) {
  const float4 a = *reinterpret_cast<const float4*>(x + i), b = *reinterpret_cast<const float4*>(x + i + 4);
  const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  bf16x8 r;
  if (plus) {
    const float4 p = *reinterpret_cast<const float4*>(plus + i), q = *reinterpret_cast<const float4*>(plus + i + 4);
    const float u[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      r.v[j] = round_bf16(v[j] + round_bf16_f32(u[j]));
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) r.v[j] = round_bf16(v[j]);
  }
  return r;
}

// GROUP threads (a warp, or the whole block) normalise one row.
template <int GROUP, bool VEC, bool RESID, typename TX>
__device__ __forceinline__ void rmsnorm_row(const TX* x, const float* plus, const bf16* res, const bf16* __restrict__ w,
                                            bf16* y, bf16* res_out, int d, float eps) {
  __shared__ float scratch[32];
  const int t = GROUP == 32 ? (threadIdx.x & 31) : threadIdx.x;
  float ss = 0.f;
  if (VEC) {
    for (int i = t * 8; i < d; i += GROUP * 8) {
      bf16x8 a = load_in8(x, plus, i);
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
      bf16 a = load_in(x, plus, i);
      if (RESID) {
        a = to_bf16(to_f32(a) + to_f32(res[i]));
        res_out[i] = a;
      }
      ss += to_f32(a) * to_f32(a);
    }
  }
  const float total = GROUP == 32 ? warp_sum(ss) : block_sum(ss, scratch);
  const float inv = rsqrtf(total / d + eps);
  // each thread re-reads only what it wrote itself (the residual sum), or its input again
  if (VEC) {
    for (int i = t * 8; i < d; i += GROUP * 8) {
      bf16x8 a = RESID ? *reinterpret_cast<const bf16x8*>(res_out + i) : load_in8(x, plus, i);
      bf16x8 g = *reinterpret_cast<const bf16x8*>(w + i);
#pragma unroll
      for (int j = 0; j < 8; ++j) a.v[j] = to_bf16(to_f32(a.v[j]) * inv * to_f32(g.v[j]));
      *reinterpret_cast<bf16x8*>(y + i) = a;
    }
  } else {
    for (int i = t; i < d; i += GROUP) y[i] = to_bf16(to_f32(RESID ? res_out[i] : load_in(x, plus, i)) * inv * to_f32(w[i]));
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

template <int GROUP, bool RESID, typename TX>
__device__ __forceinline__ void rmsnorm_row_regs(const TX* x, const float* plus, const bf16* res, const bf16x8 (&g)[kRegVecs], bf16* y,
                                                 bf16* res_out, int d, float eps) {
  __shared__ float scratch[32];
  const int t = GROUP == 32 ? (threadIdx.x & 31) : threadIdx.x;
  bf16x8 a[kRegVecs];
#pragma unroll
  for (int v = 0; v < kRegVecs; ++v) {  // all loads first
    const int i = t * 8 + v * GROUP * 8;
    if (i < d) a[v] = load_in8(x, plus, i);
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

template <int GROUP, typename TX>
__device__ __forceinline__ void rmsnorm_regs_dispatch(const TX* x, long long x_stride, const float* plus, const bf16* residual,
                                                      long long res_stride, const bf16x8 (&g)[kRegVecs], bf16* y,
                                                      long long y_stride, bf16* residual_out,
                                                      long long res_out_stride, long long row, int d, float eps) {
  if (residual)
    rmsnorm_row_regs<GROUP, true>(x + row * x_stride, plus ? plus + row * x_stride : nullptr, residual + row * res_stride,
                                  g, y + row * y_stride, residual_out + row * res_out_stride, d, eps);
  else
    rmsnorm_row_regs<GROUP, false>(x + row * x_stride, plus ? plus + row * x_stride : nullptr, nullptr, g,
                                   y + row * y_stride, nullptr, d, eps);
}

template <int GROUP, typename TX>
__device__ __forceinline__ void rmsnorm_dispatch(const TX* x, long long x_stride, const float* plus, const bf16* residual,
                                                 long long res_stride, const bf16* w, bf16* y,
                                                 long long y_stride, bf16* residual_out,
                                                 long long res_out_stride, long long row, int d, float eps,
                                                 int vec) {
  const TX* xr = x + row * x_stride;
  const float* pr = plus ? plus + row * x_stride : nullptr;
  bf16* yr = y + row * y_stride;
  if (residual) {
    const bf16* rr = residual + row * res_stride;
    bf16* ro = residual_out + row * res_out_stride;
    if (vec) rmsnorm_row<GROUP, true, true>(xr, pr, rr, w, yr, ro, d, eps);
    else rmsnorm_row<GROUP, false, true>(xr, pr, rr, w, yr, ro, d, eps);
  } else {
    if (vec) rmsnorm_row<GROUP, true, false>(xr, pr, nullptr, w, yr, nullptr, d, eps);
    else rmsnorm_row<GROUP, false, false>(xr, pr, nullptr, w, yr, nullptr, d, eps);
  }
}

}  // namespace ddt
