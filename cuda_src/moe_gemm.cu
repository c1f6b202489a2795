// Fused INT4 (W4A16, group 32) MoE expert GEMMs.
//
// The weights sit on the 16-row A side of mma.m16n8k16 (bf16 in, fp32 accumulate) and the tokens on
// the 8-column B side, so one token wastes nothing on the weight stream. Layout of the weights: see
// ddtree_rtc/model/int4_repack.py. Each (16-row tile, 128-k) block is 1152 contiguous bytes: per
// lane two 16-byte weight loads (the A fragments of 4 k32 chunks x 2 mma steps, nibbles already in
// the order the magic-number dequant pairs them) and one 16-byte scale load.
//
// CTA = 4 warps x 32 rows (two m16 tiles per warp) of one expert, one k range (split-K), one block
// of `8 * NT` (token, slot) pairs from the align step. Each warp streams its own rows with kDepth
// k128 steps of loads in flight (ld.global.nc, L1 no-allocate); activations come through L1 (all
// warps of the CTA read the same ones), one k32 chunk ahead. No shared memory, no atomics: every
// output element is written by exactly one lane, in a fixed order, so results are bitwise
// reproducible.
//
// Entries: moe_gemm_nt{1,4}_{h,f32}. `h`: gate_up with SiLU(gate) * up fused, writes bf16 h [P, I].
// `f32`: writes fp32 partial sums [split][P][N] (gate_up with split-K, or down). Then
// moe_gate_up_reduce_kernel (split-K gate_up -> h) and moe_combine_kernel (down partials ->
// y = sum_slot w * down + shared).
#include "common.cuh"

using namespace ddt;

namespace {

constexpr int kWarps = 4;
constexpr int kTilesPerWarp = 2;
constexpr int kRowsPerWarp = 16 * kTilesPerWarp;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kStepK = 128;
constexpr int kBlockBytes = 1152;
constexpr int kDepth = 4;

__device__ __forceinline__ uint4 ld_stream(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two int4 values (nibbles at bits 0..3 and 16..19 of v, stored as q + 8) -> bf16x2 q * scale.
// (u | 0x4300) is the bf16 128 + u; minus 136 is exact; the scale product is rounded once.
// One LOP3 ((v & mask) | magic): written out because C code with two immediates compiles to two.
__device__ __forceinline__ unsigned dequant2(unsigned v, __nv_bfloat162 scale) {
  unsigned raw;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(raw) : "r"(v), "r"(0x000F000Fu), "r"(0x43004300u));
  const unsigned q = fma_bf16x2(raw, 0x3F803F80u, 0xC308C308u);  // * 1.0 - 136.0
  const __nv_bfloat162 w = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&q), scale);
  return *reinterpret_cast<const unsigned*>(&w);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

template <int NT>
__device__ __forceinline__ void load_acts(uint4 (&xb)[NT], const bf16* const (&brow)[NT], int k, int ntl) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    if (nt < ntl) xb[nt] = __ldg(reinterpret_cast<const uint4*>(brow[nt] + k));
}

__device__ __forceinline__ void load_weights(uint4 (&buf)[kTilesPerWarp][3],
                                             const unsigned char* const (&wp)[kTilesPerWarp], int step,
                                             int lane) {
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r) {
    const unsigned char* p = wp[r] + (long long)step * kBlockBytes;
    buf[r][0] = ld_stream(p + 16 * lane);
    buf[r][1] = ld_stream(p + 512 + 16 * lane);
    buf[r][2] = ld_stream(p + 1024 + 16 * (lane >> 2));
  }
}

// k32 chunk c (0..3) of one k128 step: two mma k16 steps per m16 tile and active n-tile.
template <int NT, int C>
__device__ __forceinline__ void mma_chunk(float (&acc)[kTilesPerWarp][NT][4], const uint4 (&buf)[kTilesPerWarp][3],
                                          const uint4 (&xb)[NT], int ntl) {
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r) {
    const uint4 wv = buf[r][C >> 1];
    const unsigned wg = (C & 1) ? wv.z : wv.x;   // row g, this chunk's 8 k values
    const unsigned wg8 = (C & 1) ? wv.w : wv.y;  // row g + 8
    const uint4 sc = buf[r][2];
    const unsigned sw = C < 2 ? sc.x : sc.y, sw8 = C < 2 ? sc.z : sc.w;
    const __nv_bfloat162 sp = *reinterpret_cast<const __nv_bfloat162*>(&sw);
    const __nv_bfloat162 sp8 = *reinterpret_cast<const __nv_bfloat162*>(&sw8);
    // broadcast this group's scale (low or high half) to both lanes of the pair
    const __nv_bfloat162 s = (C & 1) ? __high2bfloat162(sp) : __low2bfloat162(sp);
    const __nv_bfloat162 s8 = (C & 1) ? __high2bfloat162(sp8) : __low2bfloat162(sp8);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned a0 = dequant2(wg >> (8 * h), s), a1 = dequant2(wg8 >> (8 * h), s8);
      const unsigned a2 = dequant2(wg >> (8 * h + 4), s), a3 = dequant2(wg8 >> (8 * h + 4), s8);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntl) mma_bf16(acc[r][nt], a0, a1, a2, a3, h ? xb[nt].z : xb[nt].x, h ? xb[nt].w : xb[nt].y);
    }
  }
}

// MODE 0: gate_up, write h = bf16(silu(gate) * up) [P, N/2]. MODE 1: write fp32 [split][P][N].
template <int NT, int MODE>
__device__ __forceinline__ void moe_gemm(const unsigned char* __restrict__ w, long long w_expert_bytes,
                                         const bf16* __restrict__ act, int act_row_div,
                                         const int* __restrict__ sorted_pairs,
                                         const int* __restrict__ block_expert,
                                         const int* __restrict__ num_blocks, int P, int N, int K, int k_split,
                                         int n_ctas, bf16* __restrict__ h_out, float* __restrict__ part_out) {
  const int u = blockIdx.y;
  if (u >= num_blocks[0]) return;
  const int e = block_expert[u];
  const int n_cta = blockIdx.x % n_ctas, split = blockIdx.x / n_ctas;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile0 = (n_cta * kRowsPerCta + warp * kRowsPerWarp) / 16;
  if (tile0 * 16 >= N) return;  // N is a multiple of 32: a warp has both tiles or none
  const int* ids = sorted_pairs + (long long)u * (NT * 8);
  int ntl = 0;  // n-tiles holding a pair: valid pairs form a prefix of the block
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    if (ids[nt * 8] < P) ntl = nt + 1;
  const int first = ids[0];
  const bf16* brow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    int p = ids[nt * 8 + g];
    if (p >= P) p = first;  // a padding column reads a real row; its results are never stored
    brow[nt] = act + (long long)(p / act_row_div) * K + (long long)split * k_split + t * 8;
  }
  const int steps = k_split / kStepK;
  const long long kblocks = K / kStepK;
  const unsigned char* wp[kTilesPerWarp];
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r)
    wp[r] = w + (long long)e * w_expert_bytes +
            ((long long)(tile0 + r) * kblocks + (long long)split * steps) * kBlockBytes;

  float acc[kTilesPerWarp][NT][4];
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][nt][i] = 0.f;

  uint4 buf[kDepth][kTilesPerWarp][3];
  uint4 xb[2][NT];
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
    if (d < steps) load_weights(buf[d], wp, d, lane);
  load_acts<NT>(xb[0], brow, 0, ntl);
  for (int base = 0; base < steps; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int step = base + d;
      if (step < steps) {
        const int k = step * kStepK;
        load_acts<NT>(xb[1], brow, k + 32, ntl);
        mma_chunk<NT, 0>(acc, buf[d], xb[0], ntl);
        load_acts<NT>(xb[0], brow, k + 64, ntl);
        mma_chunk<NT, 1>(acc, buf[d], xb[1], ntl);
        load_acts<NT>(xb[1], brow, k + 96, ntl);
        mma_chunk<NT, 2>(acc, buf[d], xb[0], ntl);
        if (step + 1 < steps) load_acts<NT>(xb[0], brow, k + kStepK, ntl);
        mma_chunk<NT, 3>(acc, buf[d], xb[1], ntl);
        if (step + kDepth < steps) load_weights(buf[d], wp, step + kDepth, lane);
      }
    }
  }

  // C fragment: acc[r][nt] = {row g col 2t, row g col 2t+1, row g+8 col 2t, row g+8 col 2t+1}.
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt >= ntl) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int p = ids[nt * 8 + 2 * t + j];
        if (p >= P) continue;
        if (MODE == 0) {
          // fused tile rows g / g + 8 are gate / up of intermediate index 8 * tile + g
          h_out[(long long)p * (N / 2) + (tile0 + r) * 8 + g] =
              to_bf16(silu(acc[r][nt][j]) * acc[r][nt][2 + j]);
        } else {
          float* dst = part_out + ((long long)split * P + p) * N + (tile0 + r) * 16 + g;
          dst[0] = acc[r][nt][j];
          dst[8] = acc[r][nt][2 + j];
        }
      }
    }
}

}  // namespace

#define MOE_GEMM_ARGS                                                                                   \
  const unsigned char *__restrict__ w, long long w_expert_bytes, const bf16 *__restrict__ act,          \
      int act_row_div, const int *__restrict__ sorted_pairs, const int *__restrict__ block_expert,      \
      const int *__restrict__ num_blocks, int P, int N, int K, int k_split, int n_ctas,                 \
      bf16 *__restrict__ h_out, float *__restrict__ part_out
#define MOE_GEMM_PASS \
  w, w_expert_bytes, act, act_row_div, sorted_pairs, block_expert, num_blocks, P, N, K, k_split, n_ctas, h_out, part_out

extern "C" __global__ void __launch_bounds__(kWarps * 32, 1) moe_gemm_nt1_h(MOE_GEMM_ARGS) {
  moe_gemm<1, 0>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kWarps * 32, 1) moe_gemm_nt1_f32(MOE_GEMM_ARGS) {
  moe_gemm<1, 1>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kWarps * 32, 1) moe_gemm_nt4_h(MOE_GEMM_ARGS) {
  moe_gemm<4, 0>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kWarps * 32, 1) moe_gemm_nt4_f32(MOE_GEMM_ARGS) {
  moe_gemm<4, 1>(MOE_GEMM_PASS);
}

// Split-K gate_up: part fp32 [S][P][2I] in fused tile order -> h bf16 [P, I]; splits summed in order.
extern "C" __global__ void __launch_bounds__(256, 1) moe_gate_up_reduce_kernel(
    const float* __restrict__ part, int S, int P, int I, bf16* __restrict__ h) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)P * I) return;
  const long long p = idx / I;
  const int i = (int)(idx - p * I);
  const int ng = (i >> 3) * 16 + (i & 7);
  const long long stride = (long long)P * 2 * I;
  const float* src = part + p * 2 * I + ng;
  float gs = src[0], us = src[8];
  for (int s = 1; s < S; ++s) {
    gs += src[s * stride];
    us += src[s * stride + 8];
  }
  h[idx] = to_bf16(silu(gs) * us);
}

// y[m, n] = bf16(sum_j w[m, j] * (sum_s part[s][m * top_k + j][n]) + shared[m, n]); slots and
// splits summed in order; a slot whose expert id is out of range contributes nothing.
// Four columns per thread (H is a multiple of 128); grid (ceil(H / 1024), M).
extern "C" __global__ void __launch_bounds__(256, 1) moe_combine_kernel(
    const float* __restrict__ part, int S, const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
    int E, int top_k, int M, int H, const bf16* __restrict__ shared, bf16* __restrict__ y) {
  const int m = blockIdx.y;
  const int n = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (n >= H) return;
  const long long split_stride = (long long)M * top_k * H;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < top_k; ++j) {
    const int e = topk_ids[m * top_k + j];
    if (e < 0 || e >= E) continue;
    const float wj = topk_w[m * top_k + j];
    const float* src = part + ((long long)m * top_k + j) * H + n;
    float4 v = *reinterpret_cast<const float4*>(src);
    for (int s = 1; s < S; ++s) {
      const float4 o = *reinterpret_cast<const float4*>(src + s * split_stride);
      v.x += o.x;
      v.y += o.y;
      v.z += o.z;
      v.w += o.w;
    }
    a[0] += wj * v.x;
    a[1] += wj * v.y;
    a[2] += wj * v.z;
    a[3] += wj * v.w;
  }
  const long long o = (long long)m * H + n;
  if (shared) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] += to_f32(shared[o + i]);
  }
  __align__(8) bf16 r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = to_bf16(a[i]);
  *reinterpret_cast<uint2*>(y + o) = *reinterpret_cast<const uint2*>(r);
}
