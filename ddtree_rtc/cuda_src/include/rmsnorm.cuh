// RMSNorm of one row by a warp or a whole block (rmsnorm.cu's kernels; a phase of mla_block.cu).
#pragma once
#include "common.cuh"

namespace ddt {

// The bf16 round of an fp32 value as backend.to_bf16 rounds an all-reduced partial sum (its CuPy
// elementwise kernel): to nearest even, a NaN kept NaN with its sign and the quiet bit set.
__device__ __forceinline__ bf16 round_like_to_bf16(float v) {
  const unsigned b = __float_as_uint(v);
  const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
  const unsigned bits = nan ? ((b >> 16) | 0x40u) : ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  return __ushort_as_bfloat16(static_cast<unsigned short>(bits));
}

// The input of a row that is a tensor-parallel sublayer's all-reduced fp32 output: bf16(a), or with
// `plus` (the MoE's shared expert sum) bf16(a + bf16(plus)), as backend.to_bf16(a, plus_rounded=plus)
// computes it (the fp32 value of bf16(plus) is its bits with the low half cleared).
struct RoundedSum {
  const float* a;
  const float* plus;  // or null
  __device__ __forceinline__ RoundedSum operator+(long long o) const { return {a + o, plus ? plus + o : nullptr}; }
};

__device__ __forceinline__ float plus_rounded(float s) {
  unsigned t = __float_as_uint(s);
  t = (t & 0x7fffffffu) > 0x7f800000u ? (t | 0x400000u) : ((t + 0x7fffu + ((t >> 16) & 1u)) & 0xffff0000u);
  return __uint_as_float(t);
}

__device__ __forceinline__ bf16 norm_load1(const bf16* x, int i) { return x[i]; }
__device__ __forceinline__ bf16x8 norm_load8(const bf16* x, int i) { return *reinterpret_cast<const bf16x8*>(x + i); }
__device__ __forceinline__ bf16 norm_load1(const RoundedSum& x, int i) {
  return round_like_to_bf16(x.plus ? x.a[i] + plus_rounded(x.plus[i]) : x.a[i]);
}
__device__ __forceinline__ bf16x8 norm_load8(const RoundedSum& x, int i) {
  const float4 a0 = *reinterpret_cast<const float4*>(x.a + i), a1 = *reinterpret_cast<const float4*>(x.a + i + 4);
  float v[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  if (x.plus) {
    const float4 p0 = *reinterpret_cast<const float4*>(x.plus + i);
    const float4 p1 = *reinterpret_cast<const float4*>(x.plus + i + 4);
    const float p[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] += plus_rounded(p[j]);
  }
  bf16x8 r;
#pragma unroll
  for (int j = 0; j < 8; ++j) r.v[j] = round_like_to_bf16(v[j]);
  return r;
}

// GROUP threads (a warp, or the whole block) normalise one row. X: a bf16 row (const bf16*), or a
// RoundedSum (with RESID: the fused kernels' prologue, a tensor-parallel rank's to_bf16 + rmsnorm).
template <int GROUP, bool VEC, bool RESID, typename X = const bf16*>
__device__ __forceinline__ void rmsnorm_row(X x, const bf16* res, const bf16* __restrict__ w,
                                            bf16* y, bf16* res_out, int d, float eps) {
  __shared__ float scratch[32];
  const int t = GROUP == 32 ? (threadIdx.x & 31) : threadIdx.x;
  float ss = 0.f;
  if (VEC) {
    for (int i = t * 8; i < d; i += GROUP * 8) {
      bf16x8 a = norm_load8(x, i);
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
      bf16 a = norm_load1(x, i);
      if (RESID) {
        a = to_bf16(to_f32(a) + to_f32(res[i]));
        res_out[i] = a;
      }
      ss += to_f32(a) * to_f32(a);
    }
  }
  const float total = GROUP == 32 ? warp_sum(ss) : block_sum(ss, scratch);
  const float inv = rsqrtf(total / d + eps);
  // with RESID each thread re-reads only what it wrote itself
  if (VEC) {
    for (int i = t * 8; i < d; i += GROUP * 8) {
      bf16x8 a = RESID ? *reinterpret_cast<const bf16x8*>(res_out + i) : norm_load8(x, i);
      bf16x8 g = *reinterpret_cast<const bf16x8*>(w + i);
#pragma unroll
      for (int j = 0; j < 8; ++j) a.v[j] = to_bf16(to_f32(a.v[j]) * inv * to_f32(g.v[j]));
      *reinterpret_cast<bf16x8*>(y + i) = a;
    }
  } else {
    for (int i = t; i < d; i += GROUP)
      y[i] = to_bf16(to_f32(RESID ? res_out[i] : norm_load1(x, i)) * inv * to_f32(w[i]));
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
