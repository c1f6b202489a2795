// Helpers of the persistent kernels that run a decoder block's small-M kernels as phases of one launch
// (mla_block.cu, moe_block.cu): the grid barrier, a CTA's share of a weight prefetch, and one row tile of
// the skinny linears (include/skinny_pair.cuh's two modes, linear.cu's linear) with the cluster split
// run serially in rank order, so the bits are the separate kernels'.
#pragma once
#include "common.cuh"
#include "rmsnorm.cuh"
#include "skinny_mma.cuh"
#include "skinny_pair.cuh"

namespace ddt {
namespace persist {

constexpr int kThreads = skinny::kThreads;  // 256: the skinny linears' CTA
constexpr int kMT = 4;                      // m16 token tiles: M <= 64 (a row's sums do not depend on it)
// k32 chunks in flight per thread: 2 keeps a whole block in registers without spills; the phases'
// weights stream to L2 ahead through prefetch_share (bulk prefetches hold no registers)
constexpr int kU = 2;
constexpr unsigned kPrefetchPiece = 4096;  // bytes per prefetch instruction

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Every CTA of the grid; bar = {arrivals, generation}, zero before the first launch. The last CTA to
// arrive resets the count and bumps the generation the others wait on, so any grid size may follow.
__device__ __forceinline__ void grid_sync(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = ld_acquire(bar + 1);
    __threadfence();  // this CTA's writes before its arrival
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      st_release(bar + 1, gen + 1);
    } else {
      while (ld_acquire(bar + 1) == gen) __nanosleep(40);
    }
    __threadfence();
  }
  __syncthreads();
}

// This CTA's share of [p, p + bytes) to L2 (4 KB pieces over all threads of the grid); p 16-byte
// aligned, bytes a multiple of 16.
__device__ __forceinline__ void prefetch_share(const void* p, long long bytes) {
  const long long pieces = (bytes + kPrefetchPiece - 1) / kPrefetchPiece;
  const long long stride = (long long)gridDim.x * kThreads;
  for (long long i = (long long)blockIdx.x * kThreads + threadIdx.x; i < pieces; i += stride) {
    const long long off = i * kPrefetchPiece;
    const long long n = bytes - off < kPrefetchPiece ? bytes - off : kPrefetchPiece;
    prefetch_l2(static_cast<const char*>(p) + off, static_cast<unsigned>(n));
  }
}

// Row tile `tile` of the skinny linear pair x [w1 | w2]^T as include/skinny_pair.cuh computes it (MODE 1:
// out1, out2 = the two products, or linear.cu's linear with n2 = 0; MODE 0: out1 = the first product,
// out2 = bf16(silu(bf16(gate)) * bf16(up)) of w2 = [gate; up]): warps_n row blocks of 8 weight rows,
// blocks n1 / 8 of w1 then n2 / 8 of w2; K split `split` ways, run serially (skinny::serial_split_sum).
// n1, n2, k multiples of 8. Every thread of the CTA.
template <int MODE, typename Out1>
__device__ __forceinline__ void pair_tile(float4 (&red)[skinny::kWarps][kMT][32], const bf16* __restrict__ x, int m,
                                          int k, const bf16* __restrict__ w1, int n1, Out1* __restrict__ out1,
                                          const bf16* __restrict__ w2, int n2, bf16* __restrict__ out2, int warps_n,
                                          int split, int tile) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rb = tile * warps_n + warp % warps_n;
  const int blocks1 = n1 / 8, blocks = blocks1 + n2 / 8;
  const bool rb_ok = rb < blocks, first = rb < blocks1;
  const int b2 = rb - blocks1;
  const int row2 = MODE == 0 ? (g < 4 ? 0 : n2 / 2) + 4 * b2 + (g & 3) : 8 * b2 + g;  // the lane's B row
  const bf16* wr = !rb_ok ? w1 : first ? w1 + (long long)(8 * rb + g) * k : w2 + (long long)row2 * k;
  const int pieces = k >> 3;
  bool xa_ok[kMT], xb_ok[kMT];
  const uint4* xa_row[kMT];
  const uint4* xb_row[kMT];
  skinny::x_rows<kMT>(x, m, pieces, g, true, xa_ok, xb_ok, xa_row, xb_row);
  float4 s[kMT];
  if (!skinny::serial_split_sum<kMT, kU>(red, s, reinterpret_cast<const uint4*>(wr), rb_ok, xa_ok, xb_ok, xa_row,
                                         xb_row, pieces, split, warps_n) || !rb_ok)
    return;  // (warp-uniform: MODE 0's shuffle needs the whole warp)
  skinny_pair::store_tile<MODE>(s, m, g, t, first, rb, b2, out1, n1, out2, n2);
}

__device__ __forceinline__ int tiles_of(int n, int warps_n) { return (n / 8 + warps_n - 1) / warps_n; }

constexpr int kRmsBlockMinD = 1024;  // rmsnorm.cu's split: a warp per row up to this length, else a block

// The decoder's residual add and RMSNorm of rows [0, m) of a [m, d] as rmsnorm.cu's kernels compute it
// (the same row split and rmsnorm_row): res_out = bf16(a + res), y = bf16(norm(res_out) * w). res_out
// may alias res. A: a bf16 row pointer (the epilogue of one rank), or a RoundedSum (the prologue of a
// tensor-parallel rank: a = the previous sublayer's all-reduced fp32 output, rounded as to_bf16 rounds
// it). Every thread of the CTA.
template <typename A>
__device__ __forceinline__ void residual_norm_rows(A a, const bf16* res, const bf16* __restrict__ w, bf16* y,
                                                   bf16* res_out, int m, int d, float eps) {
  const bool by_block = d > kRmsBlockMinD, vec = d % 8 == 0;
  const int blocks = by_block ? m : (m + 7) / 8;
  for (int blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const long long r = by_block ? blk : (long long)blk * 8 + (threadIdx.x >> 5);
    if (!by_block && r >= m) continue;  // (warp-uniform; the warp path has no block barrier)
    const long long o = r * d;
    if (by_block) {
      if (vec) rmsnorm_row<kThreads, true, true>(a + o, res + o, w, y + o, res_out + o, d, eps);
      else rmsnorm_row<kThreads, false, true>(a + o, res + o, w, y + o, res_out + o, d, eps);
    } else {
      if (vec) rmsnorm_row<32, true, true>(a + o, res + o, w, y + o, res_out + o, d, eps);
      else rmsnorm_row<32, false, true>(a + o, res + o, w, y + o, res_out + o, d, eps);
    }
  }
}

}  // namespace persist
}  // namespace ddt
