// Two skinny linears over the same x in one launch (the small-M path: M <= 64 tokens), row-invariant.
// The scheme of cuda_src/linear.cu: tokens on the 16-row A side (4 m16 tiles cover M <= 64), 8 weight
// rows per warp on the n8 B side, k permuted inside a k32 chunk so every operand is one 16-byte load;
// K split over warps_k warps and a cluster of S CTAs, partials added in warp order then cluster-rank
// order (fixed by the plan, which the host makes from the shapes alone). Row blocks of 8: n1 / 8 of
// w1 [n1, k], then n2 / 8 of w2 [n2, k]. The weights go to L2 before the PDL wait (they do not
// depend on the previous kernel); x is read and the outputs written after it.
//   MODE 0 (the MoE layer's dense part): out1 fp32 [m, n1] = x w1^T (router logits); w2 = [gate; up]
//     (n2 = 2 Is), a block = gate rows i..i+3 and up rows i..i+3 (i = 4 b), out2 bf16 [m, Is] =
//     bf16(silu(bf16(gate)) * bf16(up)), as the general path's linear, then silu_mul, round them.
//   MODE 1 (two plain linears, q_a and kv_a): out1 bf16 [m, n1], out2 bf16 [m, n2].
#pragma once
#include "common.cuh"

namespace ddt {
namespace skinny_pair {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMT = 4;  // m16 token tiles: M <= 64
constexpr int kU = 4;   // k32 chunks in flight per thread

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ float4 ld_dsmem(const float4* p, unsigned rank) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
__device__ __forceinline__ void add4(float4& s, const float4& v) {
  s.x += v.x;
  s.y += v.y;
  s.z += v.z;
  s.w += v.w;
}
__device__ __forceinline__ float bf16_round(float v) { return to_f32(to_bf16(v)); }
__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// Grid ceil((n1 + n2) / 8 / warps_n) * S, block kThreads; n1, n2 multiples of 8, k of 8.
template <int S, int MODE>
__device__ __forceinline__ void run(const bf16* __restrict__ x, const bf16* __restrict__ w1,
                                    const bf16* __restrict__ w2, void* __restrict__ out1, bf16* __restrict__ out2,
                                    int m, int n1, int n2, int k, int warps_n) {
  __shared__ float4 red[kWarps][kMT][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % warps_n, wk = warp / warps_n, warps_k = kWarps / warps_n;
  const int rank = S == 1 ? 0 : static_cast<int>(cluster_rank());
  const int rb = static_cast<int>(blockIdx.x) / S * warps_n + wn;  // this warp's row block
  const int blocks1 = n1 / 8, blocks = blocks1 + n2 / 8;
  const bool rb_ok = rb < blocks, first = rb < blocks1;
  const int b2 = rb - blocks1;
  // the lane's B row (its mma column g)
  const int row2 = MODE == 0 ? (g < 4 ? 0 : n2 / 2) + 4 * b2 + (g & 3) : 8 * b2 + g;
  const bf16* wr = !rb_ok ? w1 : first ? w1 + (long long)(8 * rb + g) * k : w2 + (long long)row2 * k;
  const int pieces = k >> 3, chunks = (pieces + 3) >> 2;
  const int workers = S * warps_k, worker = rank * warps_k + wk;
  const int c_begin = static_cast<int>(static_cast<long long>(worker) * chunks / workers);
  const int c_end = static_cast<int>(static_cast<long long>(worker + 1) * chunks / workers);
  const uint4* wrow = reinterpret_cast<const uint4*>(wr);
  {
    const int p0 = c_begin * 4, p1 = min(c_end * 4, pieces);
    if (t == 0 && rb_ok && p1 > p0) prefetch_l2(wrow + p0, static_cast<unsigned>(p1 - p0) * 16u);
  }
  pdl_wait();
  pdl_trigger();
  bool xa_ok[kMT], xb_ok[kMT];
  const uint4* xa_row[kMT];
  const uint4* xb_row[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int ra = 16 * mt + g, rbw = ra + 8;
    xa_ok[mt] = ra < m;
    xb_ok[mt] = rbw < m;
    xa_row[mt] = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(xa_ok[mt] ? ra : 0) * pieces;
    xb_row[mt] = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(xb_ok[mt] ? rbw : 0) * pieces;
  }
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float acc[kMT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  for (int c = c_begin; c < c_end; c += kU) {
    uint4 wv[kU], xa[kU][kMT], xb[kU][kMT];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int p = (c + u) * 4 + t;
      const bool ok = c + u < c_end && p < pieces;  // pieces past the range add exactly +0
      wv[u] = ok && rb_ok ? ld_stream(wrow + p) : zero;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        xa[u][mt] = ok && xa_ok[mt] ? __ldg(xa_row[mt] + p) : zero;
        xb[u][mt] = ok && xb_ok[mt] ? __ldg(xb_row[mt] + p) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma(acc[mt], xa[u][mt].x, xb[u][mt].x, xa[u][mt].y, xb[u][mt].y, wv[u].x, wv[u].y);
        mma(acc[mt], xa[u][mt].z, xb[u][mt].z, xa[u][mt].w, xb[u][mt].w, wv[u].z, wv[u].w);
      }
  }
  // acc[mt]: D[token 16 mt + g][B rows 2t, 2t + 1], D[token 16 mt + g + 8][B rows 2t, 2t + 1]
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) red[warp][mt][lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
  __syncthreads();
  float4 s[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    s[mt] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (wk == 0) {
      s[mt] = red[wn][mt][lane];
      for (int j = 1; j < warps_k; ++j) add4(s[mt], red[j * warps_n + wn][mt][lane]);
      if (S > 1) red[wn][mt][lane] = s[mt];
    }
  }
  if (S > 1) {
    cluster_sync();
    if (rank == 0 && wk == 0) {
      for (int r = 1; r < S; ++r)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) add4(s[mt], ld_dsmem(&red[wn][mt][lane], r));
    }
    cluster_sync_relaxed();
    if (rank != 0) return;
  }
  if (wk != 0 || !rb_ok) return;  // (warp-uniform: the shuffle below needs the whole warp)
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int ta = 16 * mt + g, tb = ta + 8;
    const float v[4] = {s[mt].x, s[mt].y, s[mt].z, s[mt].w};  // (ta, col), (ta, col + 1), (tb, col), (tb, col + 1)
    if (first) {
      const int col = 8 * rb + 2 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = i < 2 ? ta : tb;
        if (tok >= m) continue;
        const long long o = (long long)tok * n1 + col + (i & 1);
        if (MODE == 0)
          static_cast<float*>(out1)[o] = v[i];
        else
          static_cast<bf16*>(out1)[o] = to_bf16(v[i]);
      }
    } else if (MODE == 1) {
      const int col = 8 * b2 + 2 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = i < 2 ? ta : tb;
        if (tok < m) out2[(long long)tok * n2 + col + (i & 1)] = to_bf16(v[i]);
      }
    } else {
      // lanes t = 0, 1 hold gate of intermediates 4 b2 + 2t, +1; lanes t ^ 2 the matching up
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

}  // namespace skinny_pair
}  // namespace ddt

// One extern "C" entry per cluster size S (1, 2, 4, 8) of skinny_pair::run<S, MODE>; each family
// lists its four NAME_s{S} uses one per line (the registry test reads them).
#define SKINNY_PAIR_ENTRY(NAME, S, CLUSTER, MODE)                                                           \
  extern "C" __global__ void CLUSTER __launch_bounds__(ddt::skinny_pair::kThreads, 1) NAME(                \
      const ddt::bf16* __restrict__ x, const ddt::bf16* __restrict__ w1, const ddt::bf16* __restrict__ w2, \
      void* __restrict__ out1, ddt::bf16* __restrict__ out2, int m, int n1, int n2, int k, int warps_n) {   \
    ddt::skinny_pair::run<S, MODE>(x, w1, w2, out1, out2, m, n1, n2, k, warps_n);                          \
  }
