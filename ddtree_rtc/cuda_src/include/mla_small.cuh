// The small-M path's MLA pieces as device functions, the bodies of mla_small.cu's entries; what they
// compute and why they are laid out so: mla_small.cu.
#pragma once
#include "common.cuh"

namespace ddt {
namespace mla_small {

constexpr int kThreads = 256;  // 8 warps per CTA
constexpr int kTile = 32;      // output columns per CTA
constexpr int kMaxGroup = 8;   // tokens per CTA at most (grid z = ceil(T / group))
constexpr int kRedTokens = 4;  // tokens per round of head_gemm_nc's shared-memory sum

// Eight bf16 at p, p + s, ..., p + 7 s as raw bits (element e in word e / 2, low half first); only the
// first `valid` (<= 8) read, the rest 0. VEC: one 16-byte load (p 16-byte aligned, s = 1, `valid` 0 or
// 8: the host's promise), predicated, into the zeroed words: nothing waits on it until bf16_at.
template <bool VEC>
__device__ __forceinline__ uint4 load8(const bf16* p, long long s, int valid) {
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (VEC) {
    if (valid > 0) u = *reinterpret_cast<const uint4*>(p);
    return u;
  }
  const unsigned short* ps = reinterpret_cast<const unsigned short*>(p);
  unsigned h[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) h[e] = e < valid ? ps[e * s] : 0u;
  u.x = h[0] | h[1] << 16;
  u.y = h[2] | h[3] << 16;
  u.z = h[4] | h[5] << 16;
  u.w = h[6] | h[7] << 16;
  return u;
}

// Element e (a constant after unrolling) of load8's bits, as fp32 (exact).
__device__ __forceinline__ float bf16_at(const uint4& u, int e) {
  const unsigned w = e < 2 ? u.x : e < 4 ? u.y : e < 6 ? u.z : u.w;
  return __uint_as_float(e & 1 ? w & 0xffff0000u : w << 16);
}

// Sum of v[i] over the 32 lanes, the lane pairs taken in the fixed order of masks 16, 8, 4, 2, 1 for
// the first STEPS of them. While more than one value is left, a step halves them (lanes with the
// mask's bit set keep the upper half), so lane l ends with value i = l >> (5 - log2 V) (its top
// log2 V bits); the steps after that add the pairs' single values. Fp32 addition commutes, so the
// sum does not depend on V nor on which lane ends up holding it: it is one tree over the lanes.
template <int V, int STEPS>
__device__ __forceinline__ float lane_tree_sum(float (&v)[V], int lane) {
  int cnt = V;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int m = 16 >> s;
    if (cnt > 1) {
      const bool upper = lane & m;
      const int half = cnt / 2;
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        if (i < half) {
          const float send = upper ? v[i] : v[i + half];
          const float keep = upper ? v[i + half] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
        }
      }
      cnt = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], m);
    }
  }
  return v[0];
}

constexpr int log2_of(int v) { return v <= 1 ? 0 : 1 + log2_of(v / 2); }

// The CTA's part of a per-head GEMM: x [T, H, K] (element strides x_t, x_h; k contiguous), W[h](k, n) at
// w + h w_h + k w_k + n w_n, out [T, H, N] (strides o_t, o_h; n contiguous); head h, output columns
// 32 bx .. 32 bx + 31, tokens t0 .. t0 + G - 1 (a token past T recomputes token T - 1, never written).

// k contiguous in W (w_k = 1, the host's choice: W_UV's rows [N, K]). Warp w owns columns n0 = 32 bx +
// 4 w .. n0 + 3 whole; lane l sums the 16-byte k chunks c = l + 32 j (k = 8 c .. 8 c + 7), j = 0, 1, ...,
// in that order, each over its eight k in order (one warp load: 512 contiguous bytes of a weight row or
// of x), then the 32 lanes' partials go through lane_tree_sum (4 rows x up to 2 tokens at a time: the
// registers of 4 would spill). A pass holds 2 chunks of each of the 4 rows in registers (K <= 512: one
// pass, kept for all G tokens).
template <int G, bool VEC>
__device__ __forceinline__ void head_gemm_kc(const bf16* __restrict__ x, long long x_t, long long x_h,
                                             const bf16* __restrict__ w, long long w_h, long long w_k,
                                             long long w_n, bf16* __restrict__ out, long long o_t, long long o_h,
                                             int T, int K, int N, int bx, int h, int t0) {
  constexpr int R = 4, J = 2, GS = G < 2 ? G : 2, V = R * GS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = bx * kTile + warp * R, chunks = (K + 7) >> 3;
  const bf16* __restrict__ wh = w + h * w_h;
  uint4 wr[R][J];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = c0 + lane + 32 * j;
        const int valid = n0 + r < N ? min(max(K - 8 * c, 0), 8) : 0;
        wr[r][j] = load8<VEC>(wh + (n0 + r) * w_n + 8 * c, 1, valid);
      }
  };
  // Weights do not depend on the previous kernel: each of the warp's rows to L2 (whole, aligned under
  // VEC) and the first pass into registers, then the wait for x.
  if (VEC && blockIdx.z == 0 && lane < R && n0 + lane < N) prefetch_l2(wh + (n0 + lane) * w_n, 2u * K);
  load_w(0);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int g0 = 0; g0 < G; g0 += GS) {  // GS tokens at a time, the weights kept in registers (K <= 512)
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.f;
    for (int c0 = 0; c0 < chunks; c0 += 32 * J) {
      if (c0 || (g0 && chunks > 32 * J)) load_w(c0);
#pragma unroll
      for (int g = 0; g < GS; ++g) {
        const bf16* __restrict__ xr = x + min(t0 + g0 + g, T - 1) * x_t + h * x_h;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int c = c0 + lane + 32 * j;
          const uint4 xv = load8<VEC>(xr + 8 * c, 1, min(max(K - 8 * c, 0), 8));
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e)
              acc[r * GS + g] = fmaf(bf16_at(xv, e), bf16_at(wr[r][j], e), acc[r * GS + g]);
        }
      }
    }
    lane_tree_sum<V, 5>(acc, lane);
    constexpr int kSpare = 5 - log2_of(V);  // lane bits below the value index
    const int i = lane >> kSpare, n = n0 + i / GS, t = t0 + g0 + i % GS;
    if ((lane & ((1 << kSpare) - 1)) == 0 && n < N && t < T) out[t * o_t + h * o_h + n] = to_bf16(acc[0]);
  }
}

// n contiguous in W (w_n = 1: W_UK's rows [K, N]). Lane (kr = lane / 4, q = lane % 4) of warp w:
// columns 32 bx + 8 q .. + 7 (one 16-byte load per weight row), the k rows s, s + 64, s + 128, ... of
// slot s = 8 w + kr, in that order. The 8 slots of a warp are summed by lane_tree_sum's first three
// steps (masks 16, 8, 4: kr's bits; lane (kr, q) is left with column 32 bx + 8 q + kr of its tokens),
// the 8 warps in warp order through `red` [4][8][32] (shared), up to 4 tokens at a time. A pass: 2 rows
// per slot, 128 rows (K <= 128: one pass, kept for all G tokens).
template <int G, bool VEC>
__device__ __forceinline__ void head_gemm_nc(const bf16* __restrict__ x, long long x_t, long long x_h,
                                             const bf16* __restrict__ w, long long w_h, long long w_k,
                                             long long w_n, bf16* __restrict__ out, long long o_t, long long o_h,
                                             int T, int K, int N, int bx, int h, int t0, float* red) {
  constexpr int U = 2, GS = G < kRedTokens ? G : kRedTokens, V = 8 * GS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kr = lane >> 2, q = lane & 3;
  const int slot = warp * 8 + kr, nc = bx * kTile + q * 8, nvalid = min(max(N - nc, 0), 8);
  const bf16* __restrict__ wc = w + h * w_h + nc * w_n;
  uint4 wr[U];
  auto load_w = [&](int k0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + slot + 64 * u;
      wr[u] = load8<VEC>(wc + k * w_k, w_n, k < K ? nvalid : 0);
    }
  };
  // Weights do not depend on the previous kernel: the CTA's 32-column piece of every row to L2 (aligned
  // and a multiple of 16 bytes under VEC) and the first pass into registers, then the wait for x.
  if (VEC && blockIdx.z == 0) {
    const unsigned bytes = 2u * min(N - bx * kTile, kTile);
    for (int k = threadIdx.x; k < K; k += kThreads) prefetch_l2(w + h * w_h + k * w_k + bx * kTile, bytes);
  }
  load_w(0);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int g0 = 0; g0 < G; g0 += GS) {
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += 64 * U) {
      if (k0 || (g0 && K > 64 * U)) load_w(k0);
#pragma unroll
      for (int g = 0; g < GS; ++g) {
        const bf16* __restrict__ xr = x + min(t0 + g0 + g, T - 1) * x_t + h * x_h;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = k0 + slot + 64 * u;
          const float xf = k < K ? to_f32(xr[k]) : 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e * GS + g] = fmaf(xf, bf16_at(wr[u], e), acc[e * GS + g]);
        }
      }
    }
    lane_tree_sum<V, 3>(acc, lane);
    if (g0) __syncthreads();  // the previous tokens' sums are read
#pragma unroll
    for (int g = 0; g < GS; ++g) red[(g * 8 + warp) * kTile + q * 8 + kr] = acc[g];
    __syncthreads();
    if (threadIdx.x < GS * kTile) {
      const int g = threadIdx.x / kTile, col = threadIdx.x % kTile, n = bx * kTile + col, t = t0 + g0 + g;
      float s = red[g * 8 * kTile + col];
#pragma unroll
      for (int wp = 1; wp < 8; ++wp) s += red[(g * 8 + wp) * kTile + col];
      if (n < N && t < T) out[t * o_t + h * o_h + n] = to_bf16(s);
    }
  }
}

// One CTA of mla_head_gemm_small: grid (ceil(N / 32), H, ceil(T / G)), 256 threads; `kc`: W has k
// contiguous (head_gemm_kc), else head_gemm_nc. VEC: every weight row and x row starts 16-byte aligned
// and the vectors are whole (kc: K % 8 = 0; else w_n = 1 and N % 8 = 0); else scalar loads, same sums.
template <int G, bool VEC>
__device__ __forceinline__ void head_gemm_small(const bf16* __restrict__ x, long long x_t, long long x_h,
                                                const bf16* __restrict__ w, long long w_h, long long w_k,
                                                long long w_n, bf16* __restrict__ out, long long o_t, long long o_h,
                                                int T, int K, int N, bool kc, float* red) {
  const int bx = blockIdx.x, h = blockIdx.y, t0 = blockIdx.z * G;
  if (kc)
    head_gemm_kc<G, VEC>(x, x_t, x_h, w, w_h, w_k, w_n, out, o_t, o_h, T, K, N, bx, h, t0);
  else
    head_gemm_nc<G, VEC>(x, x_t, x_h, w, w_h, w_k, w_n, out, o_t, o_h, T, K, N, bx, h, t0, red);
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

// The absorbed query: q [T, H, nope + 64] = [q_nope | q_pe] (element strides q_t, q_h) -> q_att
// [T, H, 576] = [q_nope · W_UK[h] (512) | RoPE(q_pe) (64)] (contiguous). W_UK[h](k, n) at w + h w_h +
// k w_k + n. Grid (512 / 32 + 1, H, ceil(T / G)), 256 threads: the CTAs of the last column rotate q_pe
// (thread = token g, pair), the others are head_gemm_nc's (x = q_nope, K = nope, N = 512).
template <int G, bool VEC>
__device__ __forceinline__ void query_small(const bf16* __restrict__ q, long long q_t, long long q_h, int nope,
                                            const bf16* __restrict__ w, long long w_h, long long w_k,
                                            bf16* __restrict__ q_att, const int* __restrict__ positions,
                                            const float* __restrict__ inv_freq, float rope_scale, int T, int H,
                                            float* red) {
  constexpr int kLat = 512, kRope = 64, kRow = kLat + kRope;
  const int h = blockIdx.y, t0 = blockIdx.z * G;
  if (blockIdx.x == kLat / kTile) {
    pdl_wait();  // q comes from the previous kernel
    pdl_trigger();
    const int g = threadIdx.x / 32, i = threadIdx.x % 32, t = t0 + g;
    if (g < G && t < T)
      rope_pair(q_att + ((long long)t * H + h) * kRow + kLat + 2 * i, q + t * q_t + h * q_h + nope + 2 * i,
                (float)positions[t], inv_freq[i], rope_scale);
    return;
  }
  head_gemm_nc<G, VEC>(q, q_t, q_h, w, w_h, w_k, 1, q_att, (long long)H * kRow, kRow, T, nope, kLat, blockIdx.x,
                       h, t0, red);
}

// The cache rows of T new tokens: kv [T, 576] = x W_kva^T (row stride kv_t) -> cache
// row slots[t] = [RMSNorm(c) * norm_w (512) | RoPE(k_pe) (64)]; slots outside [0, capacity) skipped.
// One warp per token: the norm's sum of squares as rmsnorm_kernel takes it (lane: 16-byte chunks
// lane, lane + 32, ..., then the warp's butterfly), lane = k_pe pair.
// Token t = 8 blk + warp of a 256-thread block (mla_query_small's rows column).
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
