// Skinny-M dense bf16 linear for decode: y[M, N] = x[M, K] . W[N, K]^T with M <= 16, fp32 accumulate,
// rounded once to bf16. Weight-bandwidth bound, so W is streamed once with 16-byte loads, 8 in flight
// per thread, and everything else is arranged around keeping those loads busy.
//
// mma.m16n8k16 with the tokens on the 16-row A side (rows >= M are zeros) and 8 weight rows on the
// n8 B side, so the weight tile is 8 rows and even N = 576 makes enough tiles. k is permuted inside a
// k32 chunk (the sum does not care): lane (g = lane / 4, t = lane % 4) holds the 16-byte piece
// k = 8t..8t+7 of weight row g (B fragments of both k16 steps: words x, y then z, w) and the same
// piece of token rows g and g + 8 (the matching A fragments), so every operand is one 16-byte load.
//
// CTA = 8 warps = warps_n row tiles x warps_k k-ranges (runtime split). Warps of one k-range read the
// same x pieces (from L1 after the first); x is tiny and L2-resident. A cluster of S CTAs splits K
// further (S = 1, 2, 4, 8: the LINEAR_ENTRY list below). Reductions are fixed-order, so results are
// bitwise deterministic: warps_k partials through shared memory in warp order, then rank 0 of the
// cluster adds the S CTA partials in rank order through distributed shared memory.
// Preconditions (checked by the wrapper): K % 8 == 0, x and W 16-byte aligned, x and y contiguous.
#include "common.cuh"

using namespace ddt;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // k32 chunks (16-byte weight loads) in flight per thread

// Weights are read exactly once: keep them out of L1 (which holds x) and fetch 256 B DRAM runs.
__device__ __forceinline__ uint4 ld_weight(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster; release/acquire orders the shared-memory partials.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// Same rendezvous without the memory ordering (no fence): only keeps the CTAs alive.
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// `p` in this CTA's shared memory, read at the same offset in cluster CTA `rank`.
__device__ __forceinline__ float4 ld_cluster(const float4* p, unsigned rank) {
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

// MH = 1: M <= 8 (A rows 8..15 are zeros, never loaded); MH = 2: M <= 16. S: CTAs per cluster.
// Grid: ceil(N / (8 warps_n)) row blocks x S, cluster rank = split index along K.
template <int MH, int S>
__device__ __forceinline__ void linear_skinny(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              bf16* __restrict__ y, int m, int n, int k, int warps_n) {
  __shared__ float4 red[kWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % warps_n, wk = warp / warps_n, warps_k = kWarps / warps_n;
  const int rank = S == 1 ? 0 : static_cast<int>(cluster_rank());
  const int n0 = (static_cast<int>(blockIdx.x) / S * warps_n + wn) * 8;

  const int pieces = k >> 3;             // 16-byte pieces per row
  const int chunks = (pieces + 3) >> 2;  // k32 chunks (the last may be partial)
  const int workers = S * warps_k, worker = rank * warps_k + wk;
  const int c_begin = static_cast<int>(static_cast<long long>(worker) * chunks / workers);
  const int c_end = static_cast<int>(static_cast<long long>(worker + 1) * chunks / workers);

  const int row = n0 + g;
  const bool row_ok = row < n, xa_ok = g < m, xb_ok = MH == 2 && g + 8 < m;
  const uint4* wrow = reinterpret_cast<const uint4*>(w) + static_cast<size_t>(row_ok ? row : 0) * pieces;
  const uint4* xa_row = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(xa_ok ? g : 0) * pieces;
  const uint4* xb_row = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(xb_ok ? g + 8 : 0) * pieces;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c = c_begin; c < c_end; c += kUnroll) {
    uint4 wv[kUnroll], xa[kUnroll], xb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = (c + u) * 4 + t;
      // Pieces past the range or past K are zero in both operands, so they add exactly +0.
      const bool ok = c + u < c_end && p < pieces;
      wv[u] = ok && row_ok ? ld_weight(wrow + p) : zero;
      xa[u] = ok && xa_ok ? __ldg(xa_row + p) : zero;
      xb[u] = ok && xb_ok ? __ldg(xb_row + p) : zero;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      mma_bf16(acc, xa[u].x, xb[u].x, xa[u].y, xb[u].y, wv[u].x, wv[u].y);
      mma_bf16(acc, xa[u].z, xb[u].z, xa[u].w, xb[u].w, wv[u].z, wv[u].w);
    }
  }

  // acc: C[token g][col 2t, 2t+1], C[token g+8][col 2t, 2t+1] of this warp's 8 weight rows.
  red[warp][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  if (wk == 0) {
    s = red[wn][lane];
    for (int j = 1; j < warps_k; ++j) add4(s, red[j * warps_n + wn][lane]);
    if (S > 1) red[wn][lane] = s;  // read back only by this thread (j = 0) and by rank 0 below
  }
  if (S > 1) {
    cluster_sync();
    if (rank == 0 && wk == 0) {
      for (int r = 1; r < S; ++r) add4(s, ld_cluster(&red[wn][lane], r));
    }
    cluster_sync_relaxed();  // the other CTAs' shared memory must outlive rank 0's reads
    if (rank != 0) return;
  }
  if (wk != 0) return;
  const int col = n0 + 2 * t;
  bf16* y0 = y + static_cast<size_t>(g) * n;
  if (xa_ok) {
    if (col < n) y0[col] = to_bf16(s.x);
    if (col + 1 < n) y0[col + 1] = to_bf16(s.y);
  }
  if (xb_ok) {
    bf16* y8 = y0 + static_cast<size_t>(8) * n;
    if (col < n) y8[col] = to_bf16(s.z);
    if (col + 1 < n) y8[col + 1] = to_bf16(s.w);
  }
}

}  // namespace

// x [m, k], w [n, k], y [m, n], all contiguous; grid ceil(n / (8 warps_n)) * S, block 256.
#define LINEAR_ENTRY(NAME, MH, S, CLUSTER)                                                                  \
  extern "C" __global__ void CLUSTER __launch_bounds__(kThreads, 2)                                       \
      NAME(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y, int m, int n, int k, \
           int warps_n) {                                                                                 \
    linear_skinny<MH, S>(x, w, y, m, n, k, warps_n);                                                      \
  }

LINEAR_ENTRY(linear_m8_s1, 1, 1, )
LINEAR_ENTRY(linear_m8_s2, 1, 2, __cluster_dims__(2, 1, 1))
LINEAR_ENTRY(linear_m8_s4, 1, 4, __cluster_dims__(4, 1, 1))
LINEAR_ENTRY(linear_m8_s8, 1, 8, __cluster_dims__(8, 1, 1))
LINEAR_ENTRY(linear_m16_s1, 2, 1, )
LINEAR_ENTRY(linear_m16_s2, 2, 2, __cluster_dims__(2, 1, 1))
LINEAR_ENTRY(linear_m16_s4, 2, 4, __cluster_dims__(4, 1, 1))
LINEAR_ENTRY(linear_m16_s8, 2, 8, __cluster_dims__(8, 1, 1))
