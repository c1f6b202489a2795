// The small-M path's MLA pieces as device functions over explicit block / thread indices, the bodies of
// mla_small.cu's entries; what they compute: mla_small.cu.
#pragma once
#include "common.cuh"

namespace ddt {
namespace mla_small {
// x [T, H, K] (element strides x_t, x_h; k contiguous); W[h](k, n) at w + h * w_h + k * w_k + n * w_n;
// out [T, H, N] (strides o_t, o_h; n contiguous). Grid (ceil(N / 32), H, ceil(T / 8)), block (32, 8).
// One output of block (bx, by, bz), thread (tx, ty) of a (32, 8) block: the body of mla_head_gemm_small.
__device__ __forceinline__ void head_gemm_small(const bf16* __restrict__ x, long long x_t, long long x_h,
                                                const bf16* __restrict__ w, long long w_h, long long w_k,
                                                long long w_n, bf16* __restrict__ out, long long o_t, long long o_h,
                                                int T, int K, int N, int bx, int by, int bz, int tx, int ty) {
  const int n = bx * 32 + tx, h = by, t = bz * 8 + ty;
  if (n >= N || t >= T) return;
  const bf16* __restrict__ xr = x + t * x_t + h * x_h;
  const bf16* __restrict__ wc = w + h * w_h + n * w_n;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  int k = 0;
  for (; k + 4 <= K; k += 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = fmaf(to_f32(xr[k + i]), to_f32(wc[(long long)(k + i) * w_k]), a[i]);
  }
  for (int i = 0; k < K; ++k, ++i) a[i] = fmaf(to_f32(xr[k]), to_f32(wc[(long long)k * w_k]), a[i]);
  out[t * o_t + h * o_h + n] = to_bf16((a[0] + a[1]) + (a[2] + a[3]));
}

// The rotary factors of one pair: angle = fl32(pos) * inv_freq[i] (one rounding), accurate sincosf,
// times `scale` (cuda_src/rope.cu's rule).
__device__ __forceinline__ void rope_pair(bf16* dst, const bf16* src, float pos, float inv_freq, float scale) {
  float s, c;
  sincosf(__fmul_rn(pos, inv_freq), &s, &c);
  c *= scale;
  s *= scale;
  const float a = to_f32(src[0]), b = to_f32(src[1]);
  dst[0] = to_bf16(a * c - b * s);
  dst[1] = to_bf16(a * s + b * c);
}

// The absorbed query in one launch: q [T, H, nope + 64] = [q_nope | q_pe] (element strides q_t, q_h)
// -> q_att [T, H, 576] = [q_nope · W_UK[h] (512) | RoPE(q_pe) (64)] (contiguous). W_UK[h](k, n) at
// w + h * w_h + k * w_k + n (k < nope, a multiple of 4; n < 512). Grid (512 / 32 + 1, H, ceil(T / 8)),
// block (32, 8): the last column of blocks rotates q_pe (lane = pair), the others are
// mla_head_gemm_small's sums.
__device__ __forceinline__ void query_small(const bf16* __restrict__ q, long long q_t, long long q_h, int nope,
                                            const bf16* __restrict__ w, long long w_h, long long w_k,
                                            bf16* __restrict__ q_att, const int* __restrict__ positions,
                                            const float* __restrict__ inv_freq, float rope_scale, int T, int H,
                                            int bx, int by, int bz, int tx, int ty) {
  constexpr int kLat = 512, kRope = 64, kRow = kLat + kRope;
  const int h = by, t = bz * 8 + ty;
  if (t >= T) return;
  const bf16* __restrict__ qr = q + t * q_t + h * q_h;
  bf16* __restrict__ out = q_att + ((long long)t * H + h) * kRow;
  if (bx == kLat / 32) {  // RoPE(q_pe): lane = pair
    const int i = tx;
    rope_pair(out + kLat + 2 * i, qr + nope + 2 * i, (float)positions[t], inv_freq[i], rope_scale);
    return;
  }
  const int n = bx * 32 + tx;
  const bf16* __restrict__ wc = w + h * w_h + n;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < nope; k += 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = fmaf(to_f32(qr[k + i]), to_f32(wc[(long long)(k + i) * w_k]), a[i]);
  }
  out[n] = to_bf16((a[0] + a[1]) + (a[2] + a[3]));
}

// The cache rows of T new tokens in one launch: kv [T, 576] = x W_kva^T (row stride kv_t) -> cache
// row slots[t] = [RMSNorm(c) * norm_w (512) | RoPE(k_pe) (64)]; slots outside [0, capacity) skipped.
// One warp per token: the norm's sum of squares as rmsnorm_kernel takes it (lane: 16-byte chunks
// lane, lane + 32, ..., then the warp's butterfly), lane = k_pe pair.
// Token t = 8 blk + warp of a 256-thread block.
__device__ __forceinline__ void kv_rows_small(const bf16* __restrict__ kv, long long kv_t,
                                              const bf16* __restrict__ norm_w, float eps,
                                              const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                              float rope_scale, bf16* __restrict__ cache, long long capacity,
                                              const int* __restrict__ slots, int T, int blk) {
  constexpr int kLat = 512, kRow = 576;
  const int t = blk * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (t >= T) return;
  const long long slot = slots[t];
  if (slot < 0 || slot >= capacity) return;
  const bf16* __restrict__ src = kv + t * kv_t;
  bf16* __restrict__ dst = cache + slot * kRow;
  bf16x8 c[2];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    c[j] = *reinterpret_cast<const bf16x8*>(src + (lane + 32 * j) * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += to_f32(c[j].v[i]) * to_f32(c[j].v[i]);
  }
  const float inv = rsqrtf(warp_sum(ss) / kLat + eps);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const bf16x8 g = *reinterpret_cast<const bf16x8*>(norm_w + (lane + 32 * j) * 8);
    bf16x8 o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = to_bf16(to_f32(c[j].v[i]) * inv * to_f32(g.v[i]));
    *reinterpret_cast<bf16x8*>(dst + (lane + 32 * j) * 8) = o;
  }
  rope_pair(dst + kLat + 2 * lane, src + kLat + 2 * lane, (float)positions[t], inv_freq[lane], rope_scale);
}

}  // namespace mla_small
}  // namespace ddt
