// Two skinny linears over the same x in one launch (the small-M path: M <= 64 tokens), row-invariant.
// The scheme of include/skinny_mma.cuh, with linear.cu's token buckets: MH = 1 (M <= 8: one m16 token
// tile whose rows 8..15 are zeros, never loaded; 8 k32 chunks in flight), MH = 2 (M <= 16), MH = 4 / 8
// (M <= 32 / 64: 2 / 4 m16 tiles and 1 / 2 n8 weight tiles a warp, 4 chunks in flight so the operands
// stay in registers). MH = 1, 2, 4 fit 128 registers, two CTAs per SM; MH = 8 needs one SM per CTA.
// The K split (warps_k warps, a cluster of S CTAs) is fixed by the plan, which the host makes from the
// shapes alone; the host picks MH from M. Row blocks of 8: n1 / 8 of w1 [n1, k], then n2 / 8 of w2 [n2, k]. The weights go to L2
// before the PDL wait (they do not depend on the previous kernel); x is read and the outputs written
// after it.
// Row invariance across the buckets: a token's m16 tile (token / 16) and its lane and register in that
// tile (token % 16) are the same for every MH; the rows a bucket adds are zeros, and mma rows do not
// mix; k_sum adds a tile's chunks in chunk order whatever kU and NT are (padding chunks add exactly +0 to
// sums that start at +0); the reductions depend on (warps_n, S) alone. So a token row's bits depend
// only on (warps_n, S, K), never on MH or M.
//   MODE 0 (the MoE layer's dense part): out1 fp32 [m, n1] = x w1^T (router logits); w2 = [gate; up]
//     (n2 = 2 Is), a block = gate rows i..i+3 and up rows i..i+3 (i = 4 b), out2 bf16 [m, Is] =
//     bf16(silu(bf16(gate)) * bf16(up)), as the general path's linear, then silu_mul, round them.
//   MODE 1 (two plain linears, q_a and kv_a): out1 bf16 [m, n1], out2 bf16 [m, n2].
#pragma once
#include "common.cuh"
#include "skinny_mma.cuh"

namespace ddt {
namespace skinny_pair {

using skinny::kThreads;
using skinny::kWarps;

__device__ __forceinline__ float bf16_round(float v) { return to_f32(to_bf16(v)); }
__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16* p, float v) { *p = to_bf16(v); }

// A warp's sums s of row block rb (blocks of w1 first: `first`, then b2 = rb - blocks of w1) into the
// outputs: the products (MODE 1, and MODE 0's first), or MODE 0's bf16(silu(bf16(gate)) * bf16(up)) of
// w2 = [gate; up] (lanes t ^ 2 hold the matching up, so the whole warp comes here). Rows >= m are not
// written.
template <int MODE, int MT, typename Out1>
__device__ __forceinline__ void store_tile(const float4 (&s)[MT], int m, int g, int t, bool first, int rb, int b2,
                                           Out1* __restrict__ out1, int n1, bf16* __restrict__ out2, int n2) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ta = 16 * mt + g, tb = ta + 8;
    const float v[4] = {s[mt].x, s[mt].y, s[mt].z, s[mt].w};  // (ta, col), (ta, col + 1), (tb, col), (tb, col + 1)
    if (first) {
      const int col = 8 * rb + 2 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = i < 2 ? ta : tb;
        if (tok < m) store(out1 + (long long)tok * n1 + col + (i & 1), v[i]);
      }
    } else if (MODE == 1) {
      const int col = 8 * b2 + 2 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = i < 2 ? ta : tb;
        if (tok < m) store(out2 + (long long)tok * n2 + col + (i & 1), v[i]);
      }
    } else {
      float up[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) up[i] = __shfl_xor_sync(0xffffffffu, v[i], 2);
      if (t < 2) {
        const int is = n2 / 2, col = 4 * b2 + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = i < 2 ? ta : tb;
          if (tok < m) out2[(long long)tok * is + col + (i & 1)] = to_bf16(silu(bf16_round(v[i])) * bf16_round(up[i]));
        }
      }
    }
  }
}

// Grid ceil((n1 + n2) / 8 / warps_n / NT) * S, block kThreads; n1, n2 multiples of 8, k of 8. Warp wn's
// weight tile j (of NT, include/skinny_mma.cuh's bucket_ntiles) of CTA row block b is row block
// (b NT + j) warps_n + wn.
template <int MH, int S, int MODE>
__device__ __forceinline__ void run(const bf16* __restrict__ x, const bf16* __restrict__ w1,
                                    const bf16* __restrict__ w2, void* __restrict__ out1, bf16* __restrict__ out2,
                                    int m, int n1, int n2, int k, int warps_n) {
  constexpr int kMT = skinny::bucket_tiles<MH>(), kNT = skinny::bucket_ntiles<MH>();
  __shared__ float4 red[kWarps][kNT * kMT][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % warps_n, wk = warp / warps_n, warps_k = kWarps / warps_n;
  const int rank = S == 1 ? 0 : static_cast<int>(skinny::cluster_rank());
  const int blocks1 = n1 / 8, blocks = blocks1 + n2 / 8;
  const int pieces = k >> 3;
  int rb[kNT];
  bool rb_ok[kNT], lead[kNT];
  const uint4* wrow[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    rb[j] = (static_cast<int>(blockIdx.x) / S * kNT + j) * warps_n + wn;  // this warp's row block j
    rb_ok[j] = rb[j] < blocks;
    lead[j] = t == 0 && rb_ok[j];
    const int b2 = rb[j] - blocks1;
    // the lane's B row (its mma column g)
    const int row2 = MODE == 0 ? (g < 4 ? 0 : n2 / 2) + 4 * b2 + (g & 3) : 8 * b2 + g;
    const bf16* wr = !rb_ok[j] ? w1 : rb[j] < blocks1 ? w1 + (long long)(8 * rb[j] + g) * k : w2 + (long long)row2 * k;
    wrow[j] = reinterpret_cast<const uint4*>(wr);
  }
  int c_begin, c_end;
  skinny::k_chunks(pieces, S * warps_k, rank * warps_k + wk, c_begin, c_end);
  skinny::prefetch_chunks<kNT>(wrow, c_begin, c_end, pieces, lead);
  pdl_wait();
  pdl_trigger();
  bool xa_ok[kMT], xb_ok[kMT];
  float4 s[kNT * kMT];
  if (!skinny::row_sums<MH, S>(red, x, m, pieces, wrow, rb_ok, c_begin, c_end, s, xa_ok, xb_ok, warp, lane, wn, wk,
                               warps_n, warps_k, rank))
    return;
  // s[j kMT + mt]: D[token 16 mt + g][B rows 2t, 2t + 1], D[token 16 mt + g + 8][B rows 2t, 2t + 1] of
  // row block j (rb_ok is warp-uniform: the shuffle in store_tile needs the whole warp)
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    if (!rb_ok[j]) continue;
    const float4 (&sj)[kMT] = *reinterpret_cast<const float4(*)[kMT]>(&s[j * kMT]);
    const bool first = rb[j] < blocks1;
    if constexpr (MODE == 0)
      store_tile<MODE, kMT>(sj, m, g, t, first, rb[j], rb[j] - blocks1, static_cast<float*>(out1), n1, out2, n2);
    else
      store_tile<MODE, kMT>(sj, m, g, t, first, rb[j], rb[j] - blocks1, static_cast<bf16*>(out1), n1, out2, n2);
  }
}

}  // namespace skinny_pair
}  // namespace ddt

// One extern "C" entry per (bucket MH, cluster size S) of skinny_pair::run<MH, S, MODE>: NAME_m{8, 16,
// 32, 64}_s{1, 2, 4, 8} from one SKINNY_PAIR_ENTRIES line per bucket in each family's .cu (the
// registry lists them; tests/test_kernel_sources.py checks the two agree). Launch bounds: two CTAs per
// SM (128 registers) except MH = 8.
#define SKINNY_PAIR_ENTRY(NAME, MH, S, CLUSTER, MODE)                                                       \
  extern "C" __global__ void CLUSTER __launch_bounds__(ddt::skinny::kThreads, ddt::skinny::bucket_ctas_per_sm<MH>()) NAME( \
      const ddt::bf16* __restrict__ x, const ddt::bf16* __restrict__ w1, const ddt::bf16* __restrict__ w2, \
      void* __restrict__ out1, ddt::bf16* __restrict__ out2, int m, int n1, int n2, int k, int warps_n) {   \
    ddt::skinny_pair::run<MH, S, MODE>(x, w1, w2, out1, out2, m, n1, n2, k, warps_n);                      \
  }

#define SKINNY_PAIR_ENTRIES(PREFIX, MH, MODE)                                   \
  SKINNY_PAIR_ENTRY(PREFIX##_s1, MH, 1, , MODE)                                 \
  SKINNY_PAIR_ENTRY(PREFIX##_s2, MH, 2, __cluster_dims__(2, 1, 1), MODE)        \
  SKINNY_PAIR_ENTRY(PREFIX##_s4, MH, 4, __cluster_dims__(4, 1, 1), MODE)        \
  SKINNY_PAIR_ENTRY(PREFIX##_s8, MH, 8, __cluster_dims__(8, 1, 1), MODE)
