// An RMSNorm in front of a skinny linear (linear.cu's linear_norm_* entries, the small-M path's q_a norm
// and q_b in one launch): y = bf16(x_n . W^T) with x_n = bf16(x * rsqrt(mean(x^2) + eps) * norm_w), the
// bits of rmsnorm.cu's launch followed by linear.cu's linear_m* entry of the same plan.
//
// - The norm: each row's sum of squares in exactly the rmsnorm kernel's order (include/rmsnorm.cuh:
//   GROUP threads, thread t summing its 16-byte pieces t, t + GROUP, ... element by element with one
//   FFMA each, then warp_sum, and for GROUP = 256 block_sum's butterfly over the 8 warp totals), by one
//   warp per row (row_ssq), and the same rsqrtf(total / d + eps). Up to kAloneRows rows every CTA
//   sums its rows itself; from kAloneRows + 1 rows a clustered launch deals the rows over its S CTAs
//   and each CTA reads the others' inverse rms through distributed shared memory (one cluster barrier),
//   instead of every CTA reading every row: at 64 rows and S = 8 a CTA reads 8 rows, not 64.
// - The linear: the CTA's K range of x is normalised once, as bf16 exactly as the norm kernel writes
//   it, into shared memory (a slab of kQ chunks at a time: one slab at the K2.6 TP8 shard), and the
//   warps' mma tiles read it from there: include/skinny_mma.cuh's scheme with the same chunk split,
//   the same mmas in the same order (chunk_mmas) and the same reduction, so a row's bits depend on
//   (warps_n, S, K) alone, as the plain entries'. Scaling x once per CTA, not in the mma loop,
//   keeps the 33..64-row buckets' extra work to the CTA's M x K / S elements, where in the loop each
//   of the warps_n warps sharing a k-range would scale the same x again (8x at the TP8 q_b plan).
// The slab's raw x is loaded before the norm runs (it does not need the norm), so the two reads of x
// overlap; the weights go to L2 before the PDL wait as in linear.cu.
#pragma once
#include "common.cuh"
#include "skinny_mma.cuh"

namespace ddt {
namespace skinny_norm {

using skinny::kThreads;
using skinny::kWarps;

// Rows at most that every CTA normalises alone (a row of q_lora 1536 is 3 KB of L2 reads a warp);
// above, a cluster shares the work (the L2 reads of x per CTA stay at about kAloneRows rows).
constexpr int kAloneRows = 4;
constexpr int kMaxRows = 64;

// Token rows of bucket MH in the staged x (MH = 1 holds rows 0..7 only).
template <int MH>
constexpr int stage_rows() {
  return MH == 1 ? 8 : 16 * skinny::bucket_tiles<MH>();
}
// Chunks (32 elements, 64 B a row) a slab holds: odd, so a row's stride is an odd multiple of 64 B
// and the 8 lanes of one 16-byte access phase (rows g, g + 1, pieces t) hit distinct banks. About
// 24 KB for the two-CTA-per-SM buckets, 44 KB (shared with the reduction's 32 KB) for MH = 8.
template <int MH>
constexpr int stage_chunks() {
  return MH == 1 ? 49 : MH == 2 ? 23 : 11;
}
// 16-byte pieces of x each thread loads per round of the staging (the first round's stay in registers
// through the norm: within the 128 registers of the two-CTA-per-SM buckets; the TP8 q_b's 64-row CTA
// stages 6 a thread, all in that round).
template <int MH>
constexpr int stage_unroll() {
  return MH == 8 ? 6 : MH == 4 ? 4 : 2;
}

template <int MH>
struct Shared {
  static constexpr int kMT = skinny::bucket_tiles<MH>(), kNT = skinny::bucket_ntiles<MH>();
  static constexpr int kRowPieces = 4 * stage_chunks<MH>();
  union {
    uint4 stage[stage_rows<MH>() * kRowPieces];  // normalised x, [row][slab piece]
    float4 red[kWarps][kNT * kMT][32];  // skinny::reduce's partials, after the last slab
  };
  float inv[kMaxRows];  // inverse rms per row
};

// The sum of squares of row x [d] (d % 8 == 0) as GROUP threads of rmsnorm_row / rmsnorm_row_regs take
// it, on one warp: lane l plays thread 32 v + l of each virtual warp v (its pieces l + 32 v, then GROUP
// further), loads before sums. block_sum's second warp_sum sees the 8 warp totals on lanes 0..7 and
// zeros elsewhere: its xor 16 and 8 steps add +0 to sums of squares (never -0), so lane 0 ends with
// ((W0 + W4) + (W2 + W6)) + ((W1 + W5) + (W3 + W7)), and every lane with the same (a + b = b + a).
template <int GROUP>
__device__ __forceinline__ float row_ssq(const bf16* __restrict__ x, int d, int lane) {
  constexpr int kV = GROUP / 32;
  float ss[kV];
#pragma unroll
  for (int v = 0; v < kV; ++v) ss[v] = 0.f;
  for (int i0 = lane * 8; i0 < d; i0 += GROUP * 8) {
    uint4 a[kV];
#pragma unroll
    for (int v = 0; v < kV; ++v)
      a[v] = i0 + 256 * v < d ? __ldg(reinterpret_cast<const uint4*>(x + i0 + 256 * v)) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      if (i0 + 256 * v >= d) continue;
      const bf16x8 h = *reinterpret_cast<const bf16x8*>(&a[v]);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss[v] = __fmaf_rn(to_f32(h.v[j]), to_f32(h.v[j]), ss[v]);  // ss += a * a
    }
  }
  if constexpr (kV == 1) {
    return warp_sum(ss[0]);
  } else {
    static_assert(kV == 8, "rmsnorm's rows are summed by a warp or by a block of 8 warps");
    float w[kV];
#pragma unroll
    for (int v = 0; v < kV; ++v) w[v] = warp_sum(ss[v]);
    return ((w[0] + w[4]) + (w[2] + w[6])) + ((w[1] + w[5]) + (w[3] + w[7]));
  }
}

// inv[r] = rsqrtf(sum of squares / k + eps) for every row r < m, on every CTA; every thread of every
// CTA of the cluster calls it (barriers). group: the rmsnorm launch's threads per row (32 or 256).
template <int S>
__device__ __forceinline__ void norm_rows(float* inv, const bf16* __restrict__ x, int m, int k, float eps,
                                          int group, int warp, int lane, int rank) {
  const bool share = S > 1 && m > kAloneRows;
  const int first = share ? rank : 0, step = share ? S : 1;
  for (int r = first + step * warp; r < m; r += step * kWarps) {
    const bf16* row = x + static_cast<size_t>(r) * k;
    const float total = group == 32 ? row_ssq<32>(row, k, lane) : row_ssq<256>(row, k, lane);
    if (lane == 0) inv[r] = rsqrtf(total / k + eps);
  }
  if (share) {
    skinny::cluster_sync();  // the owners' inv visible cluster-wide
    // a CTA overwrites only rows it does not own, and the others read only the rows it owns
    const int r = threadIdx.x;
    if (r < m && r % S != rank) inv[r] = ld_cluster(&inv[r], r % S);
  }
  __syncthreads();
}

// One round of the staging: items [base, base + kThreads U) of the slab's m x w pieces (row-major; w
// pieces a row from piece sp0), this thread's every kThreads-th, raw x and its norm weight piece.
template <int U>
struct Round {
  uint4 x[U], g[U];
};

template <int U>
__device__ __forceinline__ void stage_load(Round<U>& b, const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                                           int m, int pieces, int sp0, int w, int base) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int it = base + u * kThreads + static_cast<int>(threadIdx.x);
    if (it >= m * w) continue;
    const int r = it / w, p = sp0 + it - r * w;
    b.x[u] = __ldg(reinterpret_cast<const uint4*>(x) + static_cast<size_t>(r) * pieces + p);
    b.g[u] = __ldg(reinterpret_cast<const uint4*>(norm_w) + p);
  }
}

// The round's pieces normalised as rmsnorm_row_regs writes them, into stage [row][piece - sp0].
template <int U>
__device__ __forceinline__ void stage_store(const Round<U>& b, uint4* stage, int row_pieces, const float* inv, int m,
                                            int w, int base) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int it = base + u * kThreads + static_cast<int>(threadIdx.x);
    if (it >= m * w) continue;
    const int r = it / w;
    const float s = inv[r];
    const bf16x8 a = *reinterpret_cast<const bf16x8*>(&b.x[u]);
    const bf16x8 g = *reinterpret_cast<const bf16x8*>(&b.g[u]);
    bf16x8 o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.v[j] = to_bf16(to_f32(a.v[j]) * s * to_f32(g.v[j]));
    stage[r * row_pieces + it - r * w] = *reinterpret_cast<const uint4*>(&o);
  }
}

// 16-byte pieces a row of the slab from chunk s0 holds (the CTA's chunks end at cta_end; K at pieces).
__device__ __forceinline__ int slab_pieces(int s0, int cta_end, int q, int pieces) {
  return max(min(4 * min(s0 + q, cta_end), pieces) - 4 * s0, 0);
}

// skinny::k_sum over chunks [c_begin, c_end) of the slab from chunk s0, x from the stage: accumulates
// into acc (zeroed once before the first slab), each chunk's mmas in chunk order.
template <int MT, int NT, int kU>
__device__ __forceinline__ void k_sum_staged(float (&acc)[NT * MT][4], const uint4* const (&wrow)[NT],
                                             const bool (&w_ok)[NT], const bool (&a_ok)[MT], const bool (&b_ok)[MT],
                                             const uint4* stage, const int (&a_row)[MT], const int (&b_row)[MT],
                                             int c_begin, int c_end, int s0, int pieces, int t) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int c = c_begin; c < c_end; c += kU) {
    uint4 wv[kU][NT];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int p = (c + u) * 4 + t;
      const bool ok = c + u < c_end && p < pieces;  // else zero in both operands: adds exactly +0
#pragma unroll
      for (int j = 0; j < NT; ++j) wv[u][j] = ok && w_ok[j] ? skinny::ld_weight(wrow[j] + p) : zero;
    }
    // x from shared memory a chunk at a time (no latency to cover), so only the weights are in flight
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int q = (c + u - s0) * 4 + t;
      const bool ok = c + u < c_end && (c + u) * 4 + t < pieces;
      uint4 w1[1][NT], xa[1][MT], xb[1][MT];
#pragma unroll
      for (int j = 0; j < NT; ++j) w1[0][j] = wv[u][j];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        xa[0][mt] = ok && a_ok[mt] ? stage[a_row[mt] + q] : zero;
        xb[0][mt] = ok && b_ok[mt] ? stage[b_row[mt] + q] : zero;
      }
      skinny::chunk_mmas<MT, NT, 1>(acc, w1, xa, xb);
    }
  }
}

// skinny::row_sums with the norm in front: the inverse rms of every row (norm_rows), then slab by slab
// of the CTA's chunks the normalised x into shared memory and the warps' mmas over their chunks of
// it, then skinny::reduce. True on the threads left holding the sums s[j MT + mt]; every thread of
// the CTA must call it (barriers).
template <int MH, int S, int MT = skinny::bucket_tiles<MH>(), int NT = skinny::bucket_ntiles<MH>()>
__device__ __forceinline__ bool row_sums(Shared<MH>& sh, const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                                         float eps, int group, int m, int k, const uint4* const (&wrow)[NT],
                                         const bool (&w_ok)[NT], int c_begin, int c_end, float4 (&s)[NT * MT],
                                         bool (&xa_ok)[MT], bool (&xb_ok)[MT], int warp, int lane, int wn, int wk,
                                         int warps_n, int warps_k, int rank) {
  constexpr int kQ = stage_chunks<MH>(), kRP = Shared<MH>::kRowPieces, kSU = stage_unroll<MH>();
  const int g = lane >> 2, t = lane & 3;
  const int pieces = k >> 3;
  int xa_row[MT], xb_row[MT];  // the lane's token rows in the stage
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ra = 16 * mt + g, rb = ra + 8;
    xa_ok[mt] = ra < m;
    xb_ok[mt] = MH >= 2 && rb < m;
    xa_row[mt] = (xa_ok[mt] ? ra : 0) * kRP;
    xb_row[mt] = (xb_ok[mt] ? rb : 0) * kRP;
  }
  // the CTA's chunks: its warps' ranges, contiguous in wk order
  int cta_begin, cta_end, unused;
  skinny::k_chunks(pieces, S * warps_k, rank * warps_k, cta_begin, unused);
  skinny::k_chunks(pieces, S * warps_k, rank * warps_k + warps_k - 1, unused, cta_end);

  float acc[NT * MT][4];
#pragma unroll
  for (int i = 0; i < NT * MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  // The first slab's first round is loaded before the norm (it does not need it); each later round is
  // loaded in its own scope, so no round's registers live across a slab's mmas.
  {
    Round<kSU> b;
    stage_load<kSU>(b, x, norm_w, m, pieces, 4 * cta_begin, slab_pieces(cta_begin, cta_end, kQ, pieces), 0);
    norm_rows<S>(sh.inv, x, m, k, eps, group, warp, lane, rank);
    stage_store<kSU>(b, sh.stage, kRP, sh.inv, m, slab_pieces(cta_begin, cta_end, kQ, pieces), 0);
  }
  for (int s0 = cta_begin; s0 < cta_end; s0 += kQ) {
    const int s1 = min(s0 + kQ, cta_end), sp0 = 4 * s0, w = slab_pieces(s0, cta_end, kQ, pieces);
    if (s0 != cta_begin) __syncthreads();  // the last slab's reads are done
    for (int base = s0 == cta_begin ? kThreads * kSU : 0; base < m * w; base += kThreads * kSU) {
      Round<kSU> b;
      stage_load<kSU>(b, x, norm_w, m, pieces, sp0, w, base);
      stage_store<kSU>(b, sh.stage, kRP, sh.inv, m, w, base);
    }
    __syncthreads();
    k_sum_staged<MT, NT, skinny::bucket_unroll<MH>()>(acc, wrow, w_ok, xa_ok, xb_ok, sh.stage, xa_row, xb_row,
                                                      max(c_begin, s0), min(c_end, s1), s0, pieces, t);
  }
  __syncthreads();  // the stage's last reads before red, which shares its memory, is written
  return skinny::reduce<NT * MT, S>(sh.red, acc, s, warp, lane, wn, wk, warps_n, warps_k, rank);
}

}  // namespace skinny_norm
}  // namespace ddt
