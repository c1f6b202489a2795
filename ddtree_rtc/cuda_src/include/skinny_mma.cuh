// The skinny-M mma scheme of the small-M bf16 linears (linear.cu; skinny_pair.cuh, two linears in one
// launch): y[M, N] = x[M, K] . W[N, K]^T with M <= 64, fp32 accumulate. Weight-bandwidth bound, so W
// is streamed once with 16-byte loads, several in flight per thread, and everything else is arranged
// around keeping those loads busy.
//
// mma.m16n8k16 with the tokens on the 16-row A side (rows >= M are zeros) and 8 weight rows on the
// n8 B side, so the weight tile is 8 rows and even N = 576 makes enough tiles. k is permuted inside a
// k32 chunk (the sum does not care): lane (g = lane / 4, t = lane % 4) holds the 16-byte piece
// k = 8t..8t+7 of weight row g (B fragments of both k16 steps: words x, y then z, w) and the same
// piece of token rows g and g + 8 (the matching A fragments), so every operand is one 16-byte load.
//
// CTA = kWarps warps = warps_n row tiles x warps_k k-ranges (runtime split). Warps of one k-range read
// the same x pieces (from L1 after the first); x is tiny and L2-resident. A cluster of S CTAs splits K
// further. Reductions are fixed-order, so results are bitwise deterministic: warps_k partials through
// shared memory in warp order, then rank 0 of the cluster adds the S CTA partials in rank order
// through distributed shared memory. A token row's sums depend only on (warps_n, S, K), never on M
// or on the other rows.
#pragma once
#include "cluster.cuh"
#include "common.cuh"
#include "int4_mma.cuh"

namespace ddt {
namespace skinny {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The token buckets of the skinny entries (linear.cu's linear_m*, skinny_pair.cuh's *_m*), MH = 1, 2,
// 4, 8 for M <= 8, 16, 32, 64: m16 token tiles (MH = 1 loads only rows 0..7 of its one tile); n8 weight
// tiles a warp holds (NT: the x fragments a warp loads for a chunk serve its NT weight tiles, so x's L1
// reads are 2 x token tiles / NT times the weight bytes: 8x at 64 rows with one tile, past L1's rate at
// HBM speed; two tiles there, one at 32 rows, where more CTAs win: benchmarks/README.md, the small-M
// path); k32 chunks in flight per thread (fewer with more tiles, so the operands stay in registers) and
// CTAs per SM of the launch bounds (the 64-row bucket needs more than 128 registers). Only how many rows
// and columns an entry holds: a row's sums are the same in every bucket. The host's copy of NT:
// kernels/linear.py, BUCKET_NTILES.
template <int MH>
constexpr int bucket_tiles() {
  return MH == 1 ? 1 : MH / 2;
}
template <int MH>
constexpr int bucket_ntiles() {
  return MH == 8 ? 2 : 1;
}
template <int MH>
constexpr int bucket_unroll() {
  return bucket_tiles<MH>() == 1 ? 8 : 4;
}
template <int MH>
constexpr int bucket_ctas_per_sm() {
  return MH == 8 ? 1 : 2;
}

using int4_mma::mma_bf16;  // the m16n8k16 bf16 MMA in scalar-register form

// Weights are read exactly once: keep them out of L1 (which holds x) and fetch 256 B DRAM runs.
__device__ __forceinline__ uint4 ld_weight(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// cluster.cuh's primitives under the skinny:: names the entries call them by
using ddt::cluster_rank;
using ddt::cluster_sync;
using ddt::cluster_sync_relaxed;
using ddt::ld_cluster;

__device__ __forceinline__ void add4(float4& s, const float4& v) {
  s.x += v.x;
  s.y += v.y;
  s.z += v.z;
  s.w += v.w;
}

// Worker `worker` of `workers` (rank * warps_k + wk of S * warps_k): its k32 chunks [c_begin, c_end)
// of a row's `pieces` 16-byte pieces (the last chunk may be partial), contiguous in worker order.
__device__ __forceinline__ void k_chunks(int pieces, int workers, int worker, int& c_begin, int& c_end) {
  const int chunks = (pieces + 3) >> 2;
  c_begin = static_cast<int>(static_cast<long long>(worker) * chunks / workers);
  c_end = static_cast<int>(static_cast<long long>(worker + 1) * chunks / workers);
}

// Under PDL, before the wait: the weight rows' pieces of chunks [c_begin, c_end) go to L2 (they do not
// depend on the previous kernel). `lead[j]`: one lane (t = 0) of weight tile j's row, where it exists.
template <int NT>
__device__ __forceinline__ void prefetch_chunks(const uint4* const (&wrow)[NT], int c_begin, int c_end, int pieces,
                                                const bool (&lead)[NT]) {
  const int p0 = c_begin * 4, p1 = min(c_end * 4, pieces);
#pragma unroll
  for (int j = 0; j < NT; ++j)
    if (lead[j] && p1 > p0) prefetch_l2(wrow[j] + p0, static_cast<unsigned>(p1 - p0) * 16u);
}

// Lane g's token rows of m16 tile mt of x [m, k]: 16 mt + g (a) and 16 mt + g + 8 (b, only when
// `upper`: M <= 8 leaves A rows 8..15 zero, never loaded). A row past m points at row 0, never read.
template <int MT>
__device__ __forceinline__ void x_rows(const bf16* x, int m, int pieces, int g, bool upper, bool (&a_ok)[MT],
                                       bool (&b_ok)[MT], const uint4* (&a_row)[MT], const uint4* (&b_row)[MT]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ra = 16 * mt + g, rb = ra + 8;
    a_ok[mt] = ra < m;
    b_ok[mt] = upper && rb < m;
    a_row[mt] = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(a_ok[mt] ? ra : 0) * pieces;
    b_row[mt] = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(b_ok[mt] ? rb : 0) * pieces;
  }
}

// The two k16 mmas of each of kU loaded chunks into every accumulator, chunk by chunk (u order): k_sum's
// body, and skinny_norm.cuh's, which loads x from shared memory instead.
template <int MT, int NT, int kU>
__device__ __forceinline__ void chunk_mmas(float (&acc)[NT * MT][4], const uint4 (&wv)[kU][NT],
                                           const uint4 (&xa)[kU][MT], const uint4 (&xb)[kU][MT]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float (&d)[4] = acc[j * MT + mt];
        mma_bf16(d, xa[u][mt].x, xb[u][mt].x, xa[u][mt].y, xb[u][mt].y, wv[u][j].x, wv[u][j].y);
        mma_bf16(d, xa[u][mt].z, xb[u][mt].z, xa[u][mt].w, xb[u][mt].w, wv[u][j].z, wv[u][j].w);
      }
}

// acc[j * MT + mt] = this lane's share of x . W^T over chunks [c_begin, c_end) for weight tile j (of the
// warp's NT), kU chunks (NT 16-byte weight loads each) in flight: D[token 16 mt + g][B rows 2t, 2t + 1],
// D[token 16 mt + g + 8][B rows 2t, 2t + 1] of tile j's 8 weight rows. The x fragments of a chunk are
// loaded once for the NT tiles. w_ok[j]: the lane's row of tile j exists (else its B operand is zero).
// Each accumulator takes its chunks in chunk order, two k16 mmas a chunk, whatever NT and kU are.
template <int MT, int NT, int kU>
__device__ __forceinline__ void k_sum(float (&acc)[NT * MT][4], const uint4* const (&wrow)[NT], const bool (&w_ok)[NT],
                                      const bool (&a_ok)[MT], const bool (&b_ok)[MT],
                                      const uint4* const (&a_row)[MT], const uint4* const (&b_row)[MT], int c_begin,
                                      int c_end, int pieces, int t) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int i = 0; i < NT * MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  for (int c = c_begin; c < c_end; c += kU) {
    uint4 wv[kU][NT], xa[kU][MT], xb[kU][MT];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int p = (c + u) * 4 + t;
      // Pieces past the range or past K are zero in both operands, so they add exactly +0.
      const bool ok = c + u < c_end && p < pieces;
#pragma unroll
      for (int j = 0; j < NT; ++j) wv[u][j] = ok && w_ok[j] ? ld_weight(wrow[j] + p) : zero;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        xa[u][mt] = ok && a_ok[mt] ? __ldg(a_row[mt] + p) : zero;
        xb[u][mt] = ok && b_ok[mt] ? __ldg(b_row[mt] + p) : zero;
      }
    }
    chunk_mmas<MT, NT, kU>(acc, wv, xa, xb);
  }
}

// The fixed-order sum of the partials acc over the warps_k warps of row tile wn (shared memory, warp
// order), then over the S CTAs of the cluster (rank order). True on the threads left holding the
// sum s (wk == 0 of cluster rank 0); every thread of the CTA must call it (barriers). MT: the warp's
// accumulator tiles (k_sum's NT x MT), each reduced alone, in the same order.
template <int MT, int S>
__device__ __forceinline__ bool reduce(float4 (&red)[kWarps][MT][32], const float (&acc)[MT][4], float4 (&s)[MT],
                                       int warp, int lane, int wn, int wk, int warps_n, int warps_k, int rank) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) red[warp][mt][lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    s[mt] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (wk == 0) {
      s[mt] = red[wn][mt][lane];
      for (int j = 1; j < warps_k; ++j) add4(s[mt], red[j * warps_n + wn][mt][lane]);
      if (S > 1) red[wn][mt][lane] = s[mt];  // read back only by this thread (j = 0) and by rank 0 below
    }
  }
  if (S > 1) {
    cluster_sync();
    if (rank == 0 && wk == 0) {
      for (int r = 1; r < S; ++r)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) add4(s[mt], ld_cluster(&red[wn][mt][lane], r));
    }
    cluster_sync_relaxed();  // the other CTAs' shared memory must outlive rank 0's reads
    if (rank != 0) return false;
  }
  return wk == 0;
}

// A warp's part of an entry of bucket MH after its weight rows and K range are known: the x rows of
// its token tiles (x_rows; xa_ok / xb_ok say which it holds), the sums of its NT weight tiles over
// chunks [c_begin, c_end) (k_sum), then the fixed-order reduction (reduce). True on the threads left
// holding the sums s[j MT + mt]; every thread of the CTA must call it (barriers). linear.cu and
// skinny_pair.cuh differ only in where the weight rows are and where the sums go.
template <int MH, int S, int MT = bucket_tiles<MH>(), int NT = bucket_ntiles<MH>()>
__device__ __forceinline__ bool row_sums(float4 (&red)[kWarps][NT * MT][32], const bf16* __restrict__ x, int m,
                                         int pieces, const uint4* const (&wrow)[NT], const bool (&w_ok)[NT],
                                         int c_begin, int c_end, float4 (&s)[NT * MT], bool (&xa_ok)[MT],
                                         bool (&xb_ok)[MT], int warp, int lane, int wn, int wk, int warps_n,
                                         int warps_k, int rank) {
  const int g = lane >> 2, t = lane & 3;
  const uint4* xa_row[MT];
  const uint4* xb_row[MT];
  x_rows<MT>(x, m, pieces, g, MH >= 2, xa_ok, xb_ok, xa_row, xb_row);
  float acc[NT * MT][4];
  k_sum<MT, NT, bucket_unroll<MH>()>(acc, wrow, w_ok, xa_ok, xb_ok, xa_row, xb_row, c_begin, c_end, pieces, t);
  return reduce<NT * MT, S>(red, acc, s, warp, lane, wn, wk, warps_n, warps_k, rank);
}

}  // namespace skinny
}  // namespace ddt
