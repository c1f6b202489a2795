// Skinny-M dense bf16 linear for decode: y[M, N] = x[M, K] . W[N, K]^T with M <= 64, fp32 accumulate,
// rounded once to bf16 (or written fp32: the *_f32 entries). Weight-bandwidth bound, so W is streamed once with 16-byte loads, 8 in flight
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

// bf16: rounded once; fp32: a tensor-parallel partial, unrounded
template <typename OutT>
__device__ __forceinline__ OutT out_value(float v);
template <>
__device__ __forceinline__ bf16 out_value<bf16>(float v) {
  return to_bf16(v);
}
template <>
__device__ __forceinline__ float out_value<float>(float v) {
  return v;
}

__device__ __forceinline__ void add4(float4& s, const float4& v) {
  s.x += v.x;
  s.y += v.y;
  s.z += v.z;
  s.w += v.w;
}

// MH = 1: M <= 8 (A rows 8..15 are zeros, never loaded); MH = 2: M <= 16; MH = 4 / 8: M <= 32 / 64
// (2 / 4 m16 tiles of tokens, fewer k32 chunks in flight so the operands stay in registers). S: CTAs
// per cluster. A token row's sums depend only on (warps_n, S, K), never on MH or on the other rows:
// the small-M path plans them from the shape alone (kernels/linear.py, impl="invariant").
// Grid: ceil(N / (8 warps_n)) row blocks x S, cluster rank = split index along K.
// early (a launch under PDL, kernels/_launch.py): each weight row's K range goes to L2 before the
// wait on the previous kernel, whose output x is read only after it (weights do not depend on it).
template <int MH, int S, typename OutT>
__device__ __forceinline__ void linear_skinny(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              OutT* __restrict__ y, int m, int n, int k, int warps_n, int early) {
  constexpr int MT = MH == 1 ? 1 : MH / 2;  // m16 token tiles
  constexpr int kU = MT == 1 ? kUnroll : kUnroll / 2;  // M <= 64: one CTA per SM (launch bounds) to hold them
  __shared__ float4 red[kWarps][MT][32];
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
  const bool row_ok = row < n;
  const uint4* wrow = reinterpret_cast<const uint4*>(w) + static_cast<size_t>(row_ok ? row : 0) * pieces;
  if (early) {
    const int p0 = c_begin * 4, p1 = min(c_end * 4, pieces);
    if (t == 0 && row_ok && p1 > p0) prefetch_l2(wrow + p0, static_cast<unsigned>(p1 - p0) * 16u);
    pdl_wait();
    pdl_trigger();
  }
  bool xa_ok[MT], xb_ok[MT];
  const uint4* xa_row[MT];
  const uint4* xb_row[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ra = 16 * mt + g, rb = ra + 8;
    xa_ok[mt] = ra < m;
    xb_ok[mt] = MH >= 2 && rb < m;
    xa_row[mt] = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(xa_ok[mt] ? ra : 0) * pieces;
    xb_row[mt] = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(xb_ok[mt] ? rb : 0) * pieces;
  }
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  for (int c = c_begin; c < c_end; c += kU) {
    uint4 wv[kU], xa[kU][MT], xb[kU][MT];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int p = (c + u) * 4 + t;
      // Pieces past the range or past K are zero in both operands, so they add exactly +0.
      const bool ok = c + u < c_end && p < pieces;
      wv[u] = ok && row_ok ? ld_weight(wrow + p) : zero;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        xa[u][mt] = ok && xa_ok[mt] ? __ldg(xa_row[mt] + p) : zero;
        xb[u][mt] = ok && xb_ok[mt] ? __ldg(xb_row[mt] + p) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_bf16(acc[mt], xa[u][mt].x, xb[u][mt].x, xa[u][mt].y, xb[u][mt].y, wv[u].x, wv[u].y);
        mma_bf16(acc[mt], xa[u][mt].z, xb[u][mt].z, xa[u][mt].w, xb[u][mt].w, wv[u].z, wv[u].w);
      }
  }

  // acc[mt]: C[token 16mt + g][col 2t, 2t+1], C[token 16mt + g + 8][col 2t, 2t+1] of this warp's 8 weight rows.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) red[warp][mt][lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
  __syncthreads();
  float4 s[MT];
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
    if (rank != 0) return;
  }
  if (wk != 0) return;
  const int col = n0 + 2 * t;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    OutT* y0 = y + static_cast<size_t>(16 * mt + g) * n;
    if (xa_ok[mt]) {
      if (col < n) y0[col] = out_value<OutT>(s[mt].x);
      if (col + 1 < n) y0[col + 1] = out_value<OutT>(s[mt].y);
    }
    if (xb_ok[mt]) {
      OutT* y8 = y0 + static_cast<size_t>(8) * n;
      if (col < n) y8[col] = out_value<OutT>(s[mt].z);
      if (col + 1 < n) y8[col + 1] = out_value<OutT>(s[mt].w);
    }
  }
}

}  // namespace

// x [m, k], w [n, k], y [m, n] (bf16, or fp32 for the *_f32 entries), all contiguous; grid
// ceil(n / (8 warps_n)) * S, block 256; early: launched under PDL (see linear_skinny).
#define LINEAR_ENTRY(NAME, MH, S, CLUSTER, OUT)                                                             \
  extern "C" __global__ void CLUSTER __launch_bounds__(kThreads, MH == 8 ? 1 : 2)                                    \
      NAME(const bf16* __restrict__ x, const bf16* __restrict__ w, OUT* __restrict__ y, int m, int n, int k,  \
           int warps_n, int early) {                                                                      \
    linear_skinny<MH, S, OUT>(x, w, y, m, n, k, warps_n, early);                                          \
  }

LINEAR_ENTRY(linear_m8_s1, 1, 1, , bf16)
LINEAR_ENTRY(linear_m8_s2, 1, 2, __cluster_dims__(2, 1, 1), bf16)
LINEAR_ENTRY(linear_m8_s4, 1, 4, __cluster_dims__(4, 1, 1), bf16)
LINEAR_ENTRY(linear_m8_s8, 1, 8, __cluster_dims__(8, 1, 1), bf16)
LINEAR_ENTRY(linear_m16_s1, 2, 1, , bf16)
LINEAR_ENTRY(linear_m16_s2, 2, 2, __cluster_dims__(2, 1, 1), bf16)
LINEAR_ENTRY(linear_m16_s4, 2, 4, __cluster_dims__(4, 1, 1), bf16)
LINEAR_ENTRY(linear_m16_s8, 2, 8, __cluster_dims__(8, 1, 1), bf16)
LINEAR_ENTRY(linear_m32_s1, 4, 1, , bf16)
LINEAR_ENTRY(linear_m32_s2, 4, 2, __cluster_dims__(2, 1, 1), bf16)
LINEAR_ENTRY(linear_m32_s4, 4, 4, __cluster_dims__(4, 1, 1), bf16)
LINEAR_ENTRY(linear_m32_s8, 4, 8, __cluster_dims__(8, 1, 1), bf16)
LINEAR_ENTRY(linear_m64_s1, 8, 1, , bf16)
LINEAR_ENTRY(linear_m64_s2, 8, 2, __cluster_dims__(2, 1, 1), bf16)
LINEAR_ENTRY(linear_m64_s4, 8, 4, __cluster_dims__(4, 1, 1), bf16)
LINEAR_ENTRY(linear_m64_s8, 8, 8, __cluster_dims__(8, 1, 1), bf16)
LINEAR_ENTRY(linear_m8_f32_s1, 1, 1, , float)
LINEAR_ENTRY(linear_m8_f32_s2, 1, 2, __cluster_dims__(2, 1, 1), float)
LINEAR_ENTRY(linear_m8_f32_s4, 1, 4, __cluster_dims__(4, 1, 1), float)
LINEAR_ENTRY(linear_m8_f32_s8, 1, 8, __cluster_dims__(8, 1, 1), float)
LINEAR_ENTRY(linear_m16_f32_s1, 2, 1, , float)
LINEAR_ENTRY(linear_m16_f32_s2, 2, 2, __cluster_dims__(2, 1, 1), float)
LINEAR_ENTRY(linear_m16_f32_s4, 2, 4, __cluster_dims__(4, 1, 1), float)
LINEAR_ENTRY(linear_m16_f32_s8, 2, 8, __cluster_dims__(8, 1, 1), float)
LINEAR_ENTRY(linear_m32_f32_s1, 4, 1, , float)
LINEAR_ENTRY(linear_m32_f32_s2, 4, 2, __cluster_dims__(2, 1, 1), float)
LINEAR_ENTRY(linear_m32_f32_s4, 4, 4, __cluster_dims__(4, 1, 1), float)
LINEAR_ENTRY(linear_m32_f32_s8, 4, 8, __cluster_dims__(8, 1, 1), float)
LINEAR_ENTRY(linear_m64_f32_s1, 8, 1, , float)
LINEAR_ENTRY(linear_m64_f32_s2, 8, 2, __cluster_dims__(2, 1, 1), float)
LINEAR_ENTRY(linear_m64_f32_s4, 8, 4, __cluster_dims__(4, 1, 1), float)
LINEAR_ENTRY(linear_m64_f32_s8, 8, 8, __cluster_dims__(8, 1, 1), float)
