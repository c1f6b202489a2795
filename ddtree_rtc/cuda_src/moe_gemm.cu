// Fused INT4 (W4A16, group 32) MoE expert GEMMs.
//
// The weights sit on the 16-row A side of mma.m16n8k16 (bf16 in, fp32 accumulate) and the tokens on
// the 8-column B side, so one token wastes nothing on the weight stream. Layout of the weights: see
// ddtree_rtc/model/int4_repack.py. Each (16-row tile, 128-k) block is 1152 contiguous bytes: per
// lane two 16-byte weight pieces (the A fragments of 4 k32 chunks x 2 mma steps, nibbles already in
// the order the magic-number dequant pairs them) and one 16-byte scale piece.
//
// CTA = 4 warps x 32 rows (two m16 tiles per warp) of one expert, one k range (split-K), one block
// of `8 * NT` (token, slot) pairs from the align step. Both operands stream through a kStages-deep
// cp.async ring in shared memory, one k128 step per stage: the 8 weight blocks of the CTA (9 KB,
// L2 evict-first) and the step's activations of the block's pairs (2 KB per n-tile, zero-filled for
// padding pairs). So each CTA keeps ~(kStages - 1) x 11 KB in flight whatever its register count,
// and the activations (L2 hits, but at loaded-L2 latency: fetched one k32 chunk ahead they stalled
// every chunk) arrive as early as the weights. No atomics: every output element is written by
// exactly one lane, in a fixed order, so results are bitwise reproducible.
//
// Dequant: NT = 1 scales after the mma in fp32 (mma_chunk_post, fewest instructions per weight);
// NT = 4 dequantizes to bf16 q * s before the mma (mma_chunk), which amortizes over the n-tiles.
//
// Entries: moe_gemm_nt{1,4}_{h,f32} and moe_gemm_nt1_down (variants tried and dropped: the MoE
// section of benchmarks/README.md). `h`: gate_up with SiLU(gate) * up fused, writes bf16 h
// [P, I]. `f32`: writes fp32 partial sums [split][P][N] (gate_up with split-K, the nt 4 down);
// `nt1_down` the same for the 8-pair down GEMM, whose weights start streaming before its PDL wait
// (EARLY below; on nt 4 the extra live state spills at the sm_90 register cap). Then
// moe_gate_up_reduce_kernel (split-K gate_up -> h) and moe_combine_kernel (down partials ->
// y = sum_slot w * down + shared; moe_combine_f32_kernel writes y unrounded, fp32).
#include "common.cuh"
#include "int4_mma.cuh"

using namespace ddt;
using int4_mma::kMinus136;
using int4_mma::mma_bf16;
using int4_mma::raw2;

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTilesPerWarp = 2;
constexpr int kRowsPerWarp = 16 * kTilesPerWarp;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kStepK = 128;
constexpr int kBlockBytes = 1152;
#ifndef MOE_STAGES_NT1
#define MOE_STAGES_NT1 3
#endif
#ifndef MOE_STAGES_NT4
#define MOE_STAGES_NT4 3
#endif
// Minimum nt 4 CTAs per SM for __launch_bounds__: 4 caps the registers at 128 (no spills), so with
// the 3-stage ring (52 KB) four CTAs = 16 warps share an SM; the nt 4 blocks of busy experts are
// issue / latency bound, so a fourth CTA hides more of it (measured: benchmarks/README.md, MoE).
// Applied on sm_90 only, where it was measured: on sm_100a the same cap spills, so other archs keep 1.
#ifndef MOE_MIN_CTAS_NT4
#define MOE_MIN_CTAS_NT4 4
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define MOE_NT4_BOUNDS MOE_MIN_CTAS_NT4
#else
#define MOE_NT4_BOUNDS 1
#endif
// cp.async ring depth per token tile (compile-time parameters; the host sizes shared memory from
// the same values): the stages in flight are what keeps HBM busy when few CTAs share an SM.
template <int NT>
constexpr int stages() {
  return NT == 1 ? MOE_STAGES_NT1 : MOE_STAGES_NT4;
}
constexpr int kWarpStageBytes = kTilesPerWarp * kBlockBytes;
constexpr int kWeightStageBytes = kWarps * kWarpStageBytes;
constexpr int kActTileBytes = 8 * kStepK * 2;  // one n8 tile of pairs x k128, bf16

// Stage layout: [weights: warp][tile][1152 B] then [activations: k32 chunk][pair][32 k] (64 B per
// pair per chunk, so the 8 lanes of an LDS.128 phase read 128 contiguous bytes: no bank conflicts).
template <int NT>
constexpr int stage_bytes() {
  return kWeightStageBytes + NT * kActTileBytes;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Where a warp's weight copies read: its first block of the CTA's split-K range (tile0's row, then
// step 0), the stride between its two 16-row tiles, and the scale piece of lanes 0..15 (tile
// sc_tile, bytes sc_off..sc_off + 15 of the 128 after the 1024 weight bytes of a block).
struct WeightSource {
  const unsigned char* src;
  long long tile_stride;
  int sc_tile, sc_off;
};

__device__ __forceinline__ WeightSource weight_source(const unsigned char* w, long long w_expert_bytes, int e,
                                                      int tile0, long long kblocks, int split, int steps,
                                                      int lane) {
  return {w + (long long)e * w_expert_bytes + ((long long)tile0 * kblocks + (long long)split * steps) * kBlockBytes,
          kblocks * kBlockBytes, (lane >> 3) & 1, 1024 + 16 * (lane & 7)};
}

__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// L2 priority of the weights of the 32-pair (nt 4) blocks, whose expert often has several blocks
// streaming the same weights at about the same time: 0 evict_first (as nt 1), 1 evict_normal.
#ifndef MOE_NT4_WEIGHTS_NORMAL
#define MOE_NT4_WEIGHTS_NORMAL 1
#endif
template <int NT>
__device__ __forceinline__ unsigned long long weight_policy() {
  if constexpr (NT > 1 && MOE_NT4_WEIGHTS_NORMAL) {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
    return pol;
  } else {
    return evict_first_policy();
  }
}

// A weight copy with weight_policy's L2 hint (an 8-pair block reads its weights once: evict_first keeps
// them from pushing the re-read activations out of L2).
__device__ __forceinline__ void cp_async_weights(unsigned dst, const unsigned char* src,
                                                 unsigned long long pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;"
               ::"r"(dst), "l"(src), "l"(pol)
               : "memory");
}

// src_bytes 0 writes 16 zero bytes without reading src (padding pairs).
__device__ __forceinline__ void cp_async_zfill(unsigned dst, const bf16* src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 lds128(const unsigned char* p) { return *reinterpret_cast<const uint4*>(p); }

// A warp's weight blocks of one stage (kTilesPerWarp blocks from ws) into registers: each lane's
// 16 bytes of each 512-byte half of the packed nibbles, and the 16 bytes of scales of its group g.
__device__ __forceinline__ void load_weight_blocks(uint4 (&buf)[kTilesPerWarp][3], const unsigned char* ws, int lane,
                                                   int g) {
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r) {
    buf[r][0] = lds128(ws + r * kBlockBytes + 16 * lane);
    buf[r][1] = lds128(ws + r * kBlockBytes + 512 + 16 * lane);
    buf[r][2] = lds128(ws + r * kBlockBytes + 1024 + 16 * g);
  }
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

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// The bf16 A fragment (q * s) of one m16 tile for k16 step h of k32 chunk c (0..3) of a stage, from
// the tile's three 16-byte pieces: a = {row g, row g + 8, row g (+4 k), row g + 8 (+4 k)}.
__device__ __forceinline__ void a_fragment(const uint4 (&buf)[3], int c, int h, unsigned (&a)[4]) {
  const uint4 wv = buf[c >> 1];
  const unsigned wg = (c & 1) ? wv.z : wv.x;   // row g, this chunk's 8 k values
  const unsigned wg8 = (c & 1) ? wv.w : wv.y;  // row g + 8
  const uint4 sc = buf[2];
  const unsigned sw = c < 2 ? sc.x : sc.y, sw8 = c < 2 ? sc.z : sc.w;
  const __nv_bfloat162 sp = *reinterpret_cast<const __nv_bfloat162*>(&sw);
  const __nv_bfloat162 sp8 = *reinterpret_cast<const __nv_bfloat162*>(&sw8);
  // broadcast this group's scale (low or high half) to both lanes of the pair
  const __nv_bfloat162 s = (c & 1) ? __high2bfloat162(sp) : __low2bfloat162(sp);
  const __nv_bfloat162 s8 = (c & 1) ? __high2bfloat162(sp8) : __low2bfloat162(sp8);
  a[0] = dequant2(wg >> (8 * h), s);
  a[1] = dequant2(wg8 >> (8 * h), s8);
  a[2] = dequant2(wg >> (8 * h + 4), s);
  a[3] = dequant2(wg8 >> (8 * h + 4), s8);
}

// k32 chunk c (0..3) of one k128 step: two mma k16 steps per m16 tile and active n-tile.
template <int NT, int C>
__device__ __forceinline__ void mma_chunk(float (&acc)[kTilesPerWarp][NT][4], const uint4 (&buf)[kTilesPerWarp][3],
                                          const uint4 (&xb)[NT], int ntl) {
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned a[4];
      a_fragment(buf[r], C, h, a);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntl) mma_bf16(acc[r][nt], a[0], a[1], a[2], a[3], h ? xb[nt].z : xb[nt].x, h ? xb[nt].w : xb[nt].y);
    }
}

__device__ __forceinline__ void mma_bf16_c(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           unsigned b0, unsigned b1, const float (&c)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// Single-token blocks (NT = 1): the scale goes on after the mma. Group = k32 chunk, so per group
// and tile: tmp = sum_k (128 + u) x - 136 sum_k x = sum_k q x (two mma on the raw LOP3 output,
// started from corr = the -136 sum_k x of the chunk, itself one mma pair with a constant -136 A
// operand, shared by both tiles), then acc += s * tmp in fp32. Per 8 weights: 4 LOP3 + 3 SHF
// instead of 4 x (LOP3 + HFMA2 + HMUL2) + 3 SHF, and q * s is exact instead of rounded to bf16.
template <int C>
__device__ __forceinline__ void mma_chunk_post(float (&acc)[kTilesPerWarp][1][4], const uint4 (&buf)[kTilesPerWarp][3],
                                               const uint4 xb) {
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  float corr[4];
  mma_bf16_c(corr, kMinus136, kMinus136, kMinus136, kMinus136, xb.x, xb.y, zero);
  mma_bf16(corr, kMinus136, kMinus136, kMinus136, kMinus136, xb.z, xb.w);
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r) {
    const uint4 wv = buf[r][C >> 1];
    const unsigned wg = (C & 1) ? wv.z : wv.x;   // row g, this chunk's 8 k values
    const unsigned wg8 = (C & 1) ? wv.w : wv.y;  // row g + 8
    const uint4 sc = buf[r][2];
    const unsigned sw = C < 2 ? sc.x : sc.y, sw8 = C < 2 ? sc.z : sc.w;
    const float s = __uint_as_float((C & 1) ? (sw & 0xFFFF0000u) : (sw << 16));
    const float s8 = __uint_as_float((C & 1) ? (sw8 & 0xFFFF0000u) : (sw8 << 16));
    float tmp[4];
    mma_bf16_c(tmp, raw2(wg), raw2(wg8), raw2(wg >> 4), raw2(wg8 >> 4), xb.x, xb.y, corr);
    mma_bf16(tmp, raw2(wg >> 8), raw2(wg8 >> 8), raw2(wg >> 12), raw2(wg8 >> 12), xb.z, xb.w);
    acc[r][0][0] = fmaf(s, tmp[0], acc[r][0][0]);
    acc[r][0][1] = fmaf(s, tmp[1], acc[r][0][1]);
    acc[r][0][2] = fmaf(s8, tmp[2], acc[r][0][2]);
    acc[r][0][3] = fmaf(s8, tmp[3], acc[r][0][3]);
  }
}

// One k32 chunk of a stage from shared memory: the B fragments (lane (g, t) holds pair g's k values
// 8t..8t+7 of the chunk) and the mma steps.
template <int NT, int C>
__device__ __forceinline__ void stage_chunk(float (&acc)[kTilesPerWarp][NT][4], const uint4 (&buf)[kTilesPerWarp][3],
                                           const unsigned char* xs, int ntl, int g, int t) {
  uint4 xb[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    if (nt < ntl) xb[nt] = lds128(xs + ((C * NT + nt) * 8 + g) * 64 + t * 16);
  if constexpr (NT == 1)
    mma_chunk_post<C>(acc, buf, xb[0]);
  else
    mma_chunk<NT, C>(acc, buf, xb, ntl);
}

// MODE 0: gate_up, write h = bf16(silu(gate) * up) [P, N/2]. MODE 1: write fp32 [split][P][N].
// EARLY (the down GEMM under PDL, ddtree_rtc/kernels/_launch.py): the block lists were written two
// or more kernels back (by the align step, before the gate_up GEMM), so they and the weights are
// read before pdl_wait and the first stages' weight copies go out while the previous kernel (gate_up,
// whose h this one reads) finishes. Otherwise the kernel waits first.
// NTL > 0: the block's filled n-tiles as a compile-time constant (moe_gemm_ntl picks it once per CTA),
// so the per-n-tile guards of the mma loop and the copies fold away; 0: read from the block.
template <int NT, int MODE, bool EARLY, int NTL = 0>
__device__ __forceinline__ void moe_gemm(const unsigned char* __restrict__ w, long long w_expert_bytes,
                                         const bf16* __restrict__ act, int act_row_div,
                                         const int* __restrict__ sorted_pairs,
                                         const int* __restrict__ block_expert,
                                         const int* __restrict__ num_blocks, int P, int N, int K, int k_split,
                                         int n_ctas, bf16* __restrict__ h_out, float* __restrict__ part_out) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kStages = stages<NT>();
  static_assert(kStages >= 2, "the ring needs two stages");
  if constexpr (!EARLY) {
    pdl_wait();
    pdl_trigger();
  }
  const int u = blockIdx.y;
  if (u >= num_blocks[0]) {  // the whole CTA (exiting counts as triggering): no barrier yet
    // EARLY: it still waits, so that this kernel never completes before the one it depends on (with
    // an empty list every CTA ends here, and the next kernel's wait covers only this one)
    if constexpr (EARLY) pdl_wait();
    return;
  }
  const int e = block_expert[u];
  const int n_cta = blockIdx.x % n_ctas, split = blockIdx.x / n_ctas;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int tile0 = (n_cta * kRowsPerCta + warp * kRowsPerWarp) / 16;
  // N is a multiple of 32: a warp has both tiles or none. A warp without rows still takes part in
  // the copies of the activations and in every barrier.
  const bool active = tile0 * 16 < N;
  const int* ids = sorted_pairs + (long long)u * (NT * 8);
  // n-tiles holding a pair: valid pairs form a prefix of the block, and a block below num_blocks
  // holds at least one
  int ntl = NTL;
  if constexpr (NTL == 0) {
    ntl = 1;
#pragma unroll
    for (int nt = 1; nt < NT; ++nt)
      if (ids[nt * 8] < P) ntl = nt + 1;
  }
  const int steps = k_split / kStepK;
  const long long kblocks = K / kStepK;

  // Weight copies: lane L moves bytes [16L, 16L + 16) and [512 + 16L, ...) of each of its warp's two
  // blocks, and lanes 0..15 the 128 scale bytes (lanes 8r..8r+7 those of tile r).
  const WeightSource ws = weight_source(w, w_expert_bytes, e, tile0, kblocks, split, steps, lane);
  const unsigned wdst = smem_u32(smem) + warp * kWarpStageBytes;
  // Activation copies: thread tid moves 16 bytes (k 8q..8q+7 of the step, q = tid & 15) of pair
  // slot (tid >> 4) + 8m of the block for each n-tile m < ntl; padding pairs are zero-filled.
  const int q = tid & 15;
  const bf16* asrc[NT];
  unsigned abytes[NT];
  int adst[NT];
#pragma unroll
  for (int m = 0; m < NT; ++m) {
    const int j = (tid >> 4) + 8 * m;
    const int p = ids[j];
    abytes[m] = p < P ? 16u : 0u;
    asrc[m] = act + (p < P ? (long long)(p / act_row_div) * K + (long long)split * k_split + 8 * q : 0);
    adst[m] = kWeightStageBytes + (((q >> 2) * NT * 8) + j) * 64 + (q & 3) * 16;
  }
  const unsigned abase = smem_u32(smem);
  const unsigned long long pol = weight_policy<NT>();

  auto issue_weights = [&](int step, int stage) {
    const unsigned sb = stage * stage_bytes<NT>();
    if (active) {
      const unsigned char* src = ws.src + (long long)step * kBlockBytes;
#pragma unroll
      for (int r = 0; r < kTilesPerWarp; ++r) {
        const unsigned d = wdst + sb + r * kBlockBytes;
        cp_async_weights(d + 16 * lane, src + r * ws.tile_stride + 16 * lane, pol);
        cp_async_weights(d + 512 + 16 * lane, src + r * ws.tile_stride + 512 + 16 * lane, pol);
      }
      if (lane < 16) cp_async_weights(wdst + sb + ws.sc_tile * kBlockBytes + ws.sc_off,
                                      src + ws.sc_tile * ws.tile_stride + ws.sc_off, pol);
    }
  };
  auto issue_act = [&](int step, int stage) {
    const unsigned sb = stage * stage_bytes<NT>();
#pragma unroll
    for (int m = 0; m < NT; ++m)
      if (m < ntl) cp_async_zfill(abase + sb + adst[m], asrc[m] + step * kStepK, abytes[m]);
  };
  auto issue = [&](int step, int stage) {
    issue_weights(step, stage);
    issue_act(step, stage);
  };

  float acc[kTilesPerWarp][NT][4];
#pragma unroll
  for (int r = 0; r < kTilesPerWarp; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][nt][i] = 0.f;

  if constexpr (EARLY) {
    // weights of the first stages, then (after the wait) their activations: group 0 holds the
    // weights of every prologue stage and stage 0's activations, group s stage s's activations
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s)
      if (s < steps) issue_weights(s, s);
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < steps) issue_act(s, s);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < steps) issue(s, s);
      cp_async_commit();  // empty groups keep the count uniform
    }
  }
  int stage = 0;
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();  // this thread's copies of `step` have landed ...
    __syncthreads();                // ... everyone's, and everyone is done reading stage - 1
    const int next = step + kStages - 1;
    if (next < steps) issue(next, stage == 0 ? kStages - 1 : stage - 1);
    cp_async_commit();
    if (active) {
      const unsigned char* ws = smem + stage * stage_bytes<NT>() + warp * kWarpStageBytes;
      uint4 buf[kTilesPerWarp][3];
      load_weight_blocks(buf, ws, lane, g);
      const unsigned char* xs = smem + stage * stage_bytes<NT>() + kWeightStageBytes;
      stage_chunk<NT, 0>(acc, buf, xs, ntl, g, t);
      stage_chunk<NT, 1>(acc, buf, xs, ntl, g, t);
      stage_chunk<NT, 2>(acc, buf, xs, ntl, g, t);
      stage_chunk<NT, 3>(acc, buf, xs, ntl, g, t);
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  if (!active) return;

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


// The nt 4 GEMM specialized by the block's filled n-tiles (1..4), picked once per CTA: with the count a
// constant, the unrolled mma loop and the copies carry no per-n-tile guards (fewer registers on
// sm_100a / sm_120a; the timing against one body with a runtime count: benchmarks/README.md, MoE).
template <int MODE>
__device__ __forceinline__ void moe_gemm_ntl(const unsigned char* __restrict__ w, long long w_expert_bytes,
                                             const bf16* __restrict__ act, int act_row_div,
                                             const int* __restrict__ sorted_pairs,
                                             const int* __restrict__ block_expert,
                                             const int* __restrict__ num_blocks, int P, int N, int K, int k_split,
                                             int n_ctas, bf16* __restrict__ h_out, float* __restrict__ part_out) {
  pdl_wait();  // (moe_gemm waits again: returns at once)
  const int u = blockIdx.y;
  if (u >= num_blocks[0]) {
    pdl_trigger();
    return;
  }
  const int* ids = sorted_pairs + (long long)u * 32;
  const int ntl = ids[24] < P ? 4 : ids[16] < P ? 3 : ids[8] < P ? 2 : 1;  // valid pairs: a prefix
#define MOE_NTL_CASE(n)                                                                                 \
  case n:                                                                                               \
    moe_gemm<4, MODE, false, n>(w, w_expert_bytes, act, act_row_div, sorted_pairs, block_expert,        \
                                num_blocks, P, N, K, k_split, n_ctas, h_out, part_out);                 \
    break;
  switch (ntl) {
    MOE_NTL_CASE(1)
    MOE_NTL_CASE(2)
    MOE_NTL_CASE(3)
    default:
      MOE_NTL_CASE(4)
  }
#undef MOE_NTL_CASE
}

}  // namespace

#define MOE_GEMM_ARGS                                                                                   \
  const unsigned char *__restrict__ w, long long w_expert_bytes, const bf16 *__restrict__ act,          \
      int act_row_div, const int *__restrict__ sorted_pairs, const int *__restrict__ block_expert,      \
      const int *__restrict__ num_blocks, int P, int N, int K, int k_split, int n_ctas,                 \
      bf16 *__restrict__ h_out, float *__restrict__ part_out
#define MOE_GEMM_PASS \
  w, w_expert_bytes, act, act_row_div, sorted_pairs, block_expert, num_blocks, P, N, K, k_split, n_ctas, h_out, part_out

extern "C" __global__ void __launch_bounds__(kThreads, 1) moe_gemm_nt1_h(MOE_GEMM_ARGS) {
  moe_gemm<1, 0, false>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) moe_gemm_nt1_f32(MOE_GEMM_ARGS) {
  moe_gemm<1, 1, false>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kThreads, 1) moe_gemm_nt1_down(MOE_GEMM_ARGS) {
  moe_gemm<1, 1, true>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kThreads, MOE_NT4_BOUNDS) moe_gemm_nt4_h(MOE_GEMM_ARGS) {
  moe_gemm_ntl<0>(MOE_GEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(kThreads, MOE_NT4_BOUNDS) moe_gemm_nt4_f32(MOE_GEMM_ARGS) {
  moe_gemm_ntl<1>(MOE_GEMM_PASS);
}

// Split-K gate_up: part fp32 [S][P][2I] in fused tile order -> h bf16 [P, I]; splits summed in order.
extern "C" __global__ void __launch_bounds__(256, 1) moe_gate_up_reduce_kernel(
    const float* __restrict__ part, int S, int P, int I, bf16* __restrict__ h) {
  pdl_wait();
  pdl_trigger();
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
// Four columns per thread (H is a multiple of 128); grid (ceil(H / 1024), M). The slots go in groups
// of kCombineSlots whose loads are all issued before the sums (one L2 round trip per group, not
// per slot: this kernel is latency-bound at small M).
constexpr int kCombineSlots = 8;
__device__ __forceinline__ void store4(bf16* y, const float (&a)[4]) {
  __align__(8) bf16 r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = to_bf16(a[i]);
  *reinterpret_cast<uint2*>(y) = *reinterpret_cast<const uint2*>(r);
}

// fp32 output: a tensor-parallel rank's partial sum, all-reduced before its one rounding to bf16
__device__ __forceinline__ void store4(float* y, const float (&a)[4]) {
  *reinterpret_cast<float4*>(y) = make_float4(a[0], a[1], a[2], a[3]);
}

template <typename OutT>
__device__ __forceinline__ void combine(const float* __restrict__ part, int S, const int* __restrict__ topk_ids,
                                        const float* __restrict__ topk_w, int E, int top_k, int M, int H,
                                        const bf16* __restrict__ shared, OutT* __restrict__ y) {
  pdl_wait();
  pdl_trigger();
  const int m = blockIdx.y;
  const int n = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (n >= H) return;
  const long long split_stride = (long long)M * top_k * H;
  const long long o = (long long)m * H + n;
  float4 sh = make_float4(0.f, 0.f, 0.f, 0.f);
  if (shared) {
    const uint2 raw = *reinterpret_cast<const uint2*>(shared + o);
    const bf16* b = reinterpret_cast<const bf16*>(&raw);
    sh = make_float4(to_f32(b[0]), to_f32(b[1]), to_f32(b[2]), to_f32(b[3]));
  }
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j0 = 0; j0 < top_k; j0 += kCombineSlots) {
    float4 v[kCombineSlots];
    float wj[kCombineSlots];
    bool ok[kCombineSlots];
#pragma unroll
    for (int i = 0; i < kCombineSlots; ++i) {
      const int j = j0 + i;
      const int e = j < top_k ? topk_ids[m * top_k + j] : -1;
      ok[i] = e >= 0 && e < E;
      wj[i] = ok[i] ? topk_w[m * top_k + j] : 0.f;
      v[i] = ok[i] ? *reinterpret_cast<const float4*>(part + ((long long)m * top_k + j) * H + n)
                   : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int s = 1; s < S; ++s) {
#pragma unroll
      for (int i = 0; i < kCombineSlots; ++i) {
        if (!ok[i]) continue;
        const float4 q = *reinterpret_cast<const float4*>(part + s * split_stride +
                                                          ((long long)m * top_k + j0 + i) * H + n);
        v[i].x += q.x;
        v[i].y += q.y;
        v[i].z += q.z;
        v[i].w += q.w;
      }
    }
#pragma unroll
    for (int i = 0; i < kCombineSlots; ++i) {
      if (!ok[i]) continue;
      a[0] += wj[i] * v[i].x;
      a[1] += wj[i] * v[i].y;
      a[2] += wj[i] * v[i].z;
      a[3] += wj[i] * v[i].w;
    }
  }
  if (shared) {
    a[0] += sh.x;
    a[1] += sh.y;
    a[2] += sh.z;
    a[3] += sh.w;
  }
  store4(y + o, a);
}

extern "C" __global__ void __launch_bounds__(256, 1) moe_combine_kernel(
    const float* __restrict__ part, int S, const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
    int E, int top_k, int M, int H, const bf16* __restrict__ shared, bf16* __restrict__ y) {
  combine(part, S, topk_ids, topk_w, E, top_k, M, H, shared, y);
}

extern "C" __global__ void __launch_bounds__(256, 1) moe_combine_f32_kernel(
    const float* __restrict__ part, int S, const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
    int E, int top_k, int M, int H, const bf16* __restrict__ shared, float* __restrict__ y) {
  combine(part, S, topk_ids, topk_w, E, top_k, M, H, shared, y);
}
