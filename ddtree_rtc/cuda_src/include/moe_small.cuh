// The small-M expert step's device code (moe_small.cu's kernels): the CTA's routing from the ids, one
// gate_up item, one down tile, its combine. What they compute and why it is row-invariant: moe_small.cu.
#pragma once
#include "common.cuh"
#include "int4_mma.cuh"

#ifndef MOE_SMALL_STAGES
#define MOE_SMALL_STAGES 4
#endif

namespace ddt {
namespace moe_small {

using int4_mma::kMinus136;
using int4_mma::mma_bf16;
using int4_mma::raw2;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kStepK = 128;
constexpr int kBlockBytes = 1152;
constexpr int kMaxTokens = 64;
constexpr int kMaxNt = kMaxTokens / 8;
constexpr int kMaxExperts = 1024;
constexpr int kMaxPairs = 1024;
constexpr int kStages = MOE_SMALL_STAGES;
static_assert(kStages >= 2, "the ring needs two stages");
constexpr int kWarpRingBytes = kStages * kBlockBytes;

// The routing of the batch as this CTA sees it (shared memory).
struct Routing {
  unsigned long long tokens[kMaxExperts];  // bit m: token m routes (at least once) to this expert
  int touched[kMaxExperts];                // the touched experts, ascending
  int ids[kMaxPairs];                      // topk_ids, flattened
  unsigned words[kMaxExperts / 32];        // bit: expert touched
  int num_touched;
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// A weight copy with an L2 policy (evict_first: the weights are read once, so they do not push the re-read
// x / h rows out of L2) and the 256-byte L2 prefetch hint, as moe_gemm.cu's weight copies; the kernels
// from 17 tokens use it (moe_small_gate_up_t2, moe_small_down_x), the ones up to 16 the plain copy.
__device__ __forceinline__ void cp_async16_hint(unsigned dst, const void* src, unsigned long long pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(pol)
               : "memory");
}
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_ring() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
}

// Every thread of the CTA: ids (P pairs) - id_offset -> r. Ids outside [0, E) then route nowhere
// (an expert shard's ids come from the whole router: id_offset is its first expert).
__device__ void build_routing(const int* __restrict__ ids, int P, int top_k, int E, int id_offset, Routing& r) {
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kThreads) r.tokens[e] = 0ull;
  for (int p = tid; p < P; p += kThreads) r.ids[p] = ids[p] - id_offset;
  __syncthreads();
  for (int p = tid; p < P; p += kThreads) {
    const int e = r.ids[p];
    if (e >= 0 && e < E) atomicOr(&r.tokens[e], 1ull << (p / top_k));  // a set, not a sum
  }
  __syncthreads();
  const int words = (E + 31) / 32;
  for (int w = tid >> 5; w < words; w += kWarps) {
    const int e = w * 32 + (tid & 31);
    const unsigned b = __ballot_sync(0xffffffffu, e < E && r.tokens[e] != 0ull);
    if ((tid & 31) == 0) r.words[w] = b;
  }
  __syncthreads();
  if (tid < words) {
    int base = 0;
    for (int w = 0; w < tid; ++w) base += __popc(r.words[w]);
    unsigned b = r.words[tid];
    while (b) {
      r.touched[base++] = tid * 32 + __ffs(b) - 1;
      b &= b - 1;
    }
    if (tid == words - 1) r.num_touched = base;
  }
  __syncthreads();
}

// Token of each mma column of an expert (its tokens ascending), by `n` threads starting at lane 0 of
// the caller's group: cols[c] for c < popcount(mask).
__device__ __forceinline__ void fill_cols(unsigned long long mask, int i, int* cols) {
  if ((mask >> i) & 1ull) cols[__popcll(mask & ((1ull << i) - 1ull))] = i;
}

__device__ __forceinline__ uint4 lds128(const unsigned char* p) { return *reinterpret_cast<const uint4*>(p); }
// The same at a shared-window address (the cp.async destinations' form, so one register addresses both).
// volatile: kept after the ring wait and before the slot's refill, which are asm volatile as well.
__device__ __forceinline__ uint4 lds128(unsigned a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}

// The correction of one k32 chunk of the lane's column: corr = -136 sum_k x, two mma from zero (the
// zero point of the (128 + u) weight encoding). mma_block makes it per tile, mma_pair once for two.
__device__ __forceinline__ void chunk_corr(float (&corr)[4], const uint4& xc) {
  corr[0] = corr[1] = corr[2] = corr[3] = 0.f;
  mma_bf16(corr, kMinus136, kMinus136, kMinus136, kMinus136, xc.x, xc.y);
  mma_bf16(corr, kMinus136, kMinus136, kMinus136, kMinus136, xc.z, xc.w);
}

// k32 chunk c of one block after its correction corr (chunk_corr): t = corr + sum_k (128 + u) x over
// the chunk's two k16 steps, then acc += s * t.
__device__ __forceinline__ void chunk_post(float (&acc)[4], const uint4 (&buf)[3], int c, const float (&corr)[4],
                                           const uint4 xc) {
  float t[4] = {corr[0], corr[1], corr[2], corr[3]};
  const uint4 wv = buf[c >> 1];
  const unsigned wg = (c & 1) ? wv.z : wv.x, wg8 = (c & 1) ? wv.w : wv.y;
  mma_bf16(t, raw2(wg), raw2(wg8), raw2(wg >> 4), raw2(wg8 >> 4), xc.x, xc.y);
  mma_bf16(t, raw2(wg >> 8), raw2(wg8 >> 8), raw2(wg >> 12), raw2(wg8 >> 12), xc.z, xc.w);
  const unsigned sw = c < 2 ? buf[2].x : buf[2].y, sw8 = c < 2 ? buf[2].z : buf[2].w;
  const float s = __uint_as_float((c & 1) ? (sw & 0xFFFF0000u) : (sw << 16));
  const float s8 = __uint_as_float((c & 1) ? (sw8 & 0xFFFF0000u) : (sw8 << 16));
  acc[0] = fmaf(s, t[0], acc[0]);
  acc[1] = fmaf(s, t[1], acc[1]);
  acc[2] = fmaf(s8, t[2], acc[2]);
  acc[3] = fmaf(s8, t[3], acc[3]);
}

// One k128 block of one m16 tile against one n8 column tile: 4 chunks of k32 (one scale group
// each). Per chunk: t = sum_k (128 + u) x - 136 sum_k x = sum_k q x in the mma (the correction
// corr = -136 sum_k x first, then chunk_post), then acc += s * t in fp32. buf: the lane's two 16-byte
// weight pieces and its 16 bytes of scales (row g, g + 8); xb[c]: the lane's 8 k values of chunk c of
// its column.
__device__ __forceinline__ void mma_block(float (&acc)[4], const uint4 (&buf)[3], const uint4 (&xb)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float corr[4];
    chunk_corr(corr, xb[c]);
    chunk_post(acc, buf, c, corr, xb[c]);
  }
}

// A warp's copy of one weight block into its ring stage: lane L moves bytes [16L, 16L + 16) and
// [512 + 16L, ...), lanes 0..7 the 128 scale bytes.
__device__ __forceinline__ void issue_block(unsigned dst, const unsigned char* src, int lane) {
  cp_async16(dst + 16 * lane, src + 16 * lane);
  cp_async16(dst + 512 + 16 * lane, src + 512 + 16 * lane);
  if (lane < 8) cp_async16(dst + 1024 + 16 * lane, src + 1024 + 16 * lane);
}
__device__ __forceinline__ void issue_block(unsigned dst, const unsigned char* src, int lane, unsigned long long pol) {
  cp_async16_hint(dst + 16 * lane, src + 16 * lane, pol);
  cp_async16_hint(dst + 512 + 16 * lane, src + 512 + 16 * lane, pol);
  if (lane < 8) cp_async16_hint(dst + 1024 + 16 * lane, src + 1024 + 16 * lane, pol);
}

__device__ __forceinline__ void load_block(uint4 (&buf)[3], const unsigned char* ws, int lane, int g) {
  buf[0] = lds128(ws + 16 * lane);
  buf[1] = lds128(ws + 512 + 16 * lane);
  buf[2] = lds128(ws + 1024 + 16 * g);
}

// The lane's B fragments of one k128 block of column tile nt: 8 k values per k32 chunk of the
// column's row of `act` (zeros for a column without a token).
__device__ __forceinline__ void load_act(uint4 (&xb)[4], const bf16* __restrict__ row, bool valid, int k0, int t) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
    xb[c] = valid ? __ldg(reinterpret_cast<const uint4*>(row + k0 + 32 * c + 8 * t)) : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// gate_up items: kGuTiles fused 16-row tiles of one expert, whose weight blocks share each x load;
// an expert's columns go in passes of kGuPassNt column tiles (its weights read again from L2 past the
// first), so the accumulators stay at kGuTiles x kGuPassNt x 4 registers.
// One tile per item up to 16 tokens (a 1-token step has few items per CTA, and two tiles per item
// left some SMs idle: H100, MoE 53.1 vs 49.7 µs at M = 1), two above.
// The two-tile form (from 17 tokens) also brings column tile 0's x of the warp's next k block into L1
// while it works on this one (x held in registers one step ahead spilled at the 128-register cap), so
// a step's x loads hit L1 instead of waiting on an L2 round trip, and copies its weights with the L2
// hints of cp_async16_hint. Neither changes a number.
// Column tiles per pass: 4 with one tile per item; 2 with two (whose full ring's issue in the step
// spilled at the 128-register cap with 4: an expert with more than 16 tokens streams its item once per
// pass).
template <int kGuTiles>
constexpr int gu_pass_nt() {
  return kGuTiles > 1 ? 2 : 4;
}

// One k128 block of two m16 tiles against kNt n8 column tiles (x fragments xb[nt]): per k32 chunk
// each column tile's correction once (chunk_corr), then each (tile, column tile)'s chunk_post, so a
// chunk's unpacked weights feed every column tile. Every value's operations and their order are
// mma_block's.
template <int kNt>
__device__ __forceinline__ void mma_pair_nt(float (&acc)[2][2][4], const uint4 (&b0)[3], const uint4 (&b1)[3],
                                            const uint4 (&xb)[kNt][4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float corr[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) chunk_corr(corr[nt], xb[nt][c]);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) chunk_post(acc[0][nt], b0, c, corr[nt], xb[nt][c]);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) chunk_post(acc[1][nt], b1, c, corr[nt], xb[nt][c]);
  }
}

// The copies and loads of a two-tile gate_up pass, as running addresses set up once per pass (one
// step's advance: the warps' 8 k blocks): the lane's copy source (first tile's block of step + kStages),
// its ring bytes (copy destination and load source, slot 0), its x row (column tile nt0; nt0 + 1 at
// dx1 elements from it).
struct GuT2Cursor {
  const unsigned char* src;
  const bf16* xl;
  unsigned dst, scl;  // the lane's weight bytes and its scales (rows g, g + 8) in slot 0
  int tile_bytes, dx1;
  unsigned long long pol;
};

// The warp's steps of one two-tile pass against kNt column tiles, into acc; the first kStages stages
// are in flight on entry. `pre`: this lane brings its column's x lines of the next k block into L1.
template <int kNt>
__device__ __forceinline__ void gate_up_steps_t2(float (&acc)[2][2][4], GuT2Cursor q, int steps, bool pre) {
  constexpr int kStage = 2 * kBlockBytes, kWarpBytes = kWarps * kBlockBytes, kWarpK = kWarps * kStepK;
  const bool scales = (threadIdx.x & 31) < 8;
  for (int step = 0; step < steps; ++step) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");  // stage `step` has landed
    __syncwarp();
    const unsigned slot = (step % kStages) * kStage;
    uint4 b0[3], b1[3];
    b0[0] = lds128(q.dst + slot);
    b0[1] = lds128(q.dst + slot + 512);
    b0[2] = lds128(q.scl + slot);
    b1[0] = lds128(q.dst + slot + kBlockBytes);
    b1[1] = lds128(q.dst + slot + kBlockBytes + 512);
    b1[2] = lds128(q.scl + slot + kBlockBytes);
    __syncwarp();  // every lane's reads of this stage are performed: its slot takes stage step + kStages
    if (step + kStages < steps) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const unsigned char* su = u ? q.src + q.tile_bytes : q.src;
        const unsigned d = q.dst + slot + u * kBlockBytes;
        cp_async16_hint(d, su, q.pol);
        cp_async16_hint(d + 512, su + 512, q.pol);
        if (scales) cp_async16_hint(d + 1024, su + 1024, q.pol);
      }
    }
    cp_async_commit();
    q.src += kWarpBytes;
    if (pre && step + 1 < steps) {
      prefetch_l1(q.xl + kWarpK);
      prefetch_l1(q.xl + kWarpK + 64);
    }
    uint4 xb[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) xb[nt][c] = __ldg(reinterpret_cast<const uint4*>(q.xl + nt * q.dx1 + 32 * c));
    mma_pair_nt<kNt>(acc, b0, b1, xb);
    q.xl += kWarpK;
  }
}

// One column pass of a two-tile gate_up item (moe_small_gate_up_t2): the warp's k blocks warp, warp + 8,
// ... of the item's two fused tiles (first tile's blocks at wsrc, the second's tile_bytes on) against
// column tiles [nt0, nt0 + ntp) (ntp <= 2), into acc (zero on entry). Each value's operations and their
// order are the one-tile step's (mma_block). What the step leaves out, none of which changes a number:
// addresses rebuilt from the step index (running ones instead: GuT2Cursor); zeros behind a predicate
// for a lane past the expert's tokens (it reads a real token's x row, column cols[0]: its mma column,
// independent of the others, is never stored); a chunk's unpacking once per column tile (once per
// step here, for both); an L2 policy per copy (one per pass). Lane t = 0 of a column brings both of its
// x lines of the next k block into L1.
__device__ __forceinline__ void gate_up_pass_t2(float (&acc)[2][2][4], const unsigned char* __restrict__ wsrc,
                                                int tile_bytes, const bf16* __restrict__ x, int H, int steps,
                                                int cnt, int nt0, int ntp, const int* cols, unsigned char* ring) {
  constexpr int kStage = 2 * kBlockBytes, kRing = kStages * kStage, kWarpBytes = kWarps * kBlockBytes;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int c0 = nt0 * 8 + g, c1 = c0 + 8;
  const int row0 = cols[c0 < cnt ? c0 : 0];
  GuT2Cursor q;
  q.src = wsrc + warp * kBlockBytes + 16 * lane;
  q.xl = x + (long long)row0 * H + warp * kStepK + 8 * t;
  q.dst = smem_addr(ring) + warp * kRing + 16 * lane;
  q.scl = smem_addr(ring) + warp * kRing + 1024 + 16 * g;
  q.tile_bytes = tile_bytes;
  q.dx1 = ntp > 1 ? (cols[c1 < cnt ? c1 : 0] - row0) * H : 0;
  q.pol = evict_first_policy();
  const bool scales = lane < 8;
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < steps) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const unsigned char* su = q.src + s * kWarpBytes + u * tile_bytes;
        const unsigned d = q.dst + s * kStage + u * kBlockBytes;
        cp_async16_hint(d, su, q.pol);
        cp_async16_hint(d + 512, su + 512, q.pol);
        if (scales) cp_async16_hint(d + 1024, su + 1024, q.pol);
      }
    }
    cp_async_commit();
  }
  q.src += kStages * kWarpBytes;
  const bool pre = c0 < cnt && t == 0;
  if (pre && steps > 0) {
    prefetch_l1(q.xl);
    prefetch_l1(q.xl + 64);
  }
  if (ntp > 1)
    gate_up_steps_t2<2>(acc, q, steps, pre);
  else
    gate_up_steps_t2<1>(acc, q, steps, pre);
}

// The gate_up of tiles [tile, tile + kGuTiles) of touched expert e into h; every thread of the CTA.
// The rings are free on entry and on return.
template <int kGuTiles>
__device__ __forceinline__ void gate_up_item(const unsigned char* __restrict__ w13, long long w13_expert_bytes,
                                             const bf16* __restrict__ x, int top_k, int H, int I, int e, int tile,
                                             const Routing& r, int* cols, unsigned char* ring,
                                             bf16* __restrict__ h) {
  constexpr int kGuStageBytes = kGuTiles * kBlockBytes, kGuWarpRingBytes = kStages * kGuStageBytes;
  constexpr int kGuPassNt = gu_pass_nt<kGuTiles>();
  const unsigned long long mask = r.tokens[e];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (tid < kMaxTokens) fill_cols(mask, tid, cols);
  __syncthreads();
  const int cnt = __popcll(mask), ntl = (cnt + 7) >> 3;
  const int kb_total = H / kStepK;
  const long long tile_bytes = (long long)kb_total * kBlockBytes;
  const unsigned char* wsrc = w13 + (long long)e * w13_expert_bytes + tile * tile_bytes;
  const int steps = warp < kb_total ? (kb_total - 1 - warp) / kWarps + 1 : 0;  // blocks warp, warp + 8, ...
  const unsigned wring = smem_addr(ring) + warp * kGuWarpRingBytes;
  auto issue = [&](int s) {
    const unsigned char* src = wsrc + (long long)(warp + s * kWarps) * kBlockBytes;
#pragma unroll
    for (int u = 0; u < kGuTiles; ++u)
      issue_block(wring + (s % kStages) * kGuStageBytes + u * kBlockBytes, src + u * tile_bytes, lane);
  };
  for (int nt0 = 0; nt0 < ntl; nt0 += kGuPassNt) {
    const int ntp = min(kGuPassNt, ntl - nt0);
    float acc[kGuTiles][kGuPassNt][4];
#pragma unroll
    for (int u = 0; u < kGuTiles; ++u)
#pragma unroll
      for (int nt = 0; nt < kGuPassNt; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
    if constexpr (kGuTiles == 2) {
      gate_up_pass_t2(acc, wsrc, (int)tile_bytes, x, H, steps, cnt, nt0, ntp, cols, ring);
    } else {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < steps) issue(s);
        cp_async_commit();
      }
      for (int step = 0; step < steps; ++step) {
        cp_async_wait_ring();
        __syncwarp();
        if (step + kStages - 1 < steps) issue(step + kStages - 1);
        cp_async_commit();
        uint4 buf[kGuTiles][3];
#pragma unroll
        for (int u = 0; u < kGuTiles; ++u)
          load_block(buf[u], ring + warp * kGuWarpRingBytes + (step % kStages) * kGuStageBytes + u * kBlockBytes,
                     lane, g);
        const int k0 = (warp + step * kWarps) * kStepK;
#pragma unroll
        for (int nt = 0; nt < kGuPassNt; ++nt) {
          if (nt < ntp) {
            const int c = (nt0 + nt) * 8 + g;
            uint4 xb[4];
            load_act(xb, x + (long long)(c < cnt ? cols[c] : 0) * H, c < cnt, k0, t);
#pragma unroll
            for (int u = 0; u < kGuTiles; ++u) mma_block(acc[u][nt], buf[u], xb);
          }
        }
      }
    }
    // warps' partial sums, added in warp order (fixed by K), through the rings' shared memory
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    auto red = reinterpret_cast<float(*)[kGuTiles][kGuPassNt][32][4]>(ring);  // [warp][tile][nt][lane][4]
#pragma unroll
    for (int u = 0; u < kGuTiles; ++u)
#pragma unroll
      for (int nt = 0; nt < kGuPassNt; ++nt)
        if (nt < ntp)
          *reinterpret_cast<float4*>(red[warp][u][nt][lane]) =
              make_float4(acc[u][nt][0], acc[u][nt][1], acc[u][nt][2], acc[u][nt][3]);
    __syncthreads();
    if (tid < kGuTiles * ntp * 32) {
      const int u = tid / (ntp * 32), nt = (tid >> 5) % ntp;
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = red[0][u][nt][lane][i];
#pragma unroll
      for (int w = 1; w < kWarps; ++w)
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] += red[w][u][nt][lane][i];
      // C fragment: {row g col 2t, row g col 2t + 1, row g + 8 col 2t, row g + 8 col 2t + 1}; fused
      // tile rows g / g + 8 are gate / up of intermediate index 8 * tile + g
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = (nt0 + nt) * 8 + 2 * t + j;
        if (c >= cnt) continue;
        const int m = cols[c];
        const bf16 val = to_bf16(silu(v[j]) * v[2 + j]);
        for (int s = 0; s < top_k; ++s)
          if (r.ids[m * top_k + s] == e) h[(long long)(m * top_k + s) * I + (tile + u) * 8 + g] = val;
      }
    }
    __syncthreads();  // red is reused by the next pass, red and cols by the next item
  }
}

// The h row of (token m, expert e): the pair of m's first slot with id e (m routes to e).
__device__ __forceinline__ int first_pair(const Routing& r, int m, int top_k, int e) {
  int p = m * top_k;
  while (r.ids[p] != e) ++p;
  return p;
}

// The down GEMM of a 16-row tile of H for every touched expert (warp w: ranks w, w + 8, ...), each
// (token, expert) value into dsm [P][16] at every pair of that token with that id. The first
// kStages - 1 ring stages were issued by the caller when `issued` (before the PDL wait).
__device__ __forceinline__ void down_tile(const unsigned char* __restrict__ w2, long long w2_expert_bytes,
                                          const bf16* __restrict__ h, int top_k, int I, int tile, const Routing& r,
                                          int (*cols)[kMaxTokens], unsigned char* ring, float* dsm, bool issued) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kb_total = I / kStepK;
  const int mine = r.num_touched > warp ? (r.num_touched - 1 - warp) / kWarps + 1 : 0;  // ranks warp, warp + 8, ...
  const int steps = mine * kb_total;
  const unsigned wring = smem_addr(ring) + warp * kWarpRingBytes;
  auto src_of = [&](int step) {
    const int ex = r.touched[warp + (step / kb_total) * kWarps];
    return w2 + (long long)ex * w2_expert_bytes + ((long long)tile * kb_total + step % kb_total) * kBlockBytes;
  };
  if (!issued) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < steps) issue_block(wring + s * kBlockBytes, src_of(s), lane);
      cp_async_commit();
    }
  }
  float acc[kMaxNt][4];
  int cnt = 0, ntl = 0, e = -1;
  const bf16* h0 = h;  // column tile 0's h row of the current expert (its lane's column g)
  for (int step = 0; step < steps; ++step) {
    const int kb = step % kb_total;
    if (kb == 0) {
      e = r.touched[warp + (step / kb_total) * kWarps];
      const unsigned long long mask = r.tokens[e];
      cnt = __popcll(mask);
      ntl = (cnt + 7) >> 3;
      __syncwarp();
      fill_cols(mask, lane, cols[warp]);
      fill_cols(mask, lane + 32, cols[warp]);
      __syncwarp();
#pragma unroll
      for (int nt = 0; nt < kMaxNt; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
      h0 = h + (long long)(g < cnt ? first_pair(r, cols[warp][g], top_k, e) : 0) * I;
    }
    // column tile 0's h values go out before the ring wait (they do not depend on the ring)
    uint4 xb0[4];
    load_act(xb0, h0, g < cnt, kb * kStepK, t);
    cp_async_wait_ring();
    __syncwarp();
    const int next = step + kStages - 1;
    if (next < steps) issue_block(wring + (next % kStages) * kBlockBytes, src_of(next), lane);
    cp_async_commit();
    uint4 buf[3];
    load_block(buf, ring + warp * kWarpRingBytes + (step % kStages) * kBlockBytes, lane, g);
    mma_block(acc[0], buf, xb0);
#pragma unroll
    for (int nt = 1; nt < kMaxNt; ++nt) {
      if (nt < ntl) {
        const int c = nt * 8 + g;
        const int p = c < cnt ? first_pair(r, cols[warp][c], top_k, e) : 0;
        uint4 xb[4];
        load_act(xb, h + (long long)p * I, c < cnt, kb * kStepK, t);
        mma_block(acc[nt], buf, xb);
      }
    }
    if (kb == kb_total - 1) {
#pragma unroll
      for (int nt = 0; nt < kMaxNt; ++nt) {
        if (nt >= ntl) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = nt * 8 + 2 * t + j;
          if (c >= cnt) continue;
          const int m = cols[warp][c];
          for (int s = 0; s < top_k; ++s) {
            if (r.ids[m * top_k + s] != e) continue;
            float* d = dsm + (m * top_k + s) * 16;
            d[g] = acc[nt][j];
            d[g + 8] = acc[nt][2 + j];
          }
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// The weighted combine of one 16-row tile of H: y[m, n] = sum_slot w[m, slot] * dsm[pair][row] (+ shared),
// slots in order; every thread of the CTA.
__device__ __forceinline__ void combine_tile(const Routing& r, const float* dsm, const float* __restrict__ topk_w,
                                             int M, int top_k, int E, int H, int tile,
                                             const bf16* __restrict__ shared, void* __restrict__ y, int out_f32) {
  for (int i = threadIdx.x; i < M * 16; i += kThreads) {
    const int m = i >> 4, row = i & 15, n = tile * 16 + row;
    float a = 0.f;
    for (int s = 0; s < top_k; ++s) {
      const int p = m * top_k + s, ex = r.ids[p];
      if (ex >= 0 && ex < E) a = __fadd_rn(a, __fmul_rn(topk_w[p], dsm[p * 16 + row]));
    }
    if (shared) a = __fadd_rn(a, to_f32(shared[(long long)m * H + n]));
    if (out_f32)
      static_cast<float*>(y)[(long long)m * H + n] = a;
    else
      static_cast<bf16*>(y)[(long long)m * H + n] = to_bf16(a);
  }
}

// moe_small_down_x's work: the (touched-expert rank, kGroupRows-row group of H) units, rank-major, cut
// into one contiguous range per CTA of the grid, as even as whole units allow (ranges_lo); a range is
// one or a few segments (an expert, a run of its groups). Per segment the expert's h rows (its tokens'
// first pairs) are staged in shared memory once, so a step waits only on its weight blocks; the down
// values go to d [P, H] fp32, which moe_small_combine sums. (moe_small_down, the tile-major form, runs
// up to 16 tokens.)
constexpr int kGroupRows = 128;
constexpr int kStageBytes = 36864;  // h rows of one segment: 64 columns at I = 256, 8 at I = 2048
// A warp takes its 16-row tiles of a segment two at a time (tiles j and j + 8 of the group run), and a
// step is one k block of both: the two blocks share the step's x fragments and the -136 x correction
// mma of each k32 chunk (which does not depend on the weights), so a weight byte costs about half the
// x loads and three quarters of the mma of the one-tile step. The columns go in passes of kDownPassNt
// column tile (an expert with more than 8 tokens streams the pair's blocks once per column tile: at
// M <= 64 over hundreds of experts that is rare), so the accumulators stay at 2 x kDownPassNt x 4
// registers (wider passes spilled at the 128-register cap on some archs).
constexpr int kDownPassNt = 1;
static_assert(kStages % 2 == 0, "moe_small_down_x's warp ring holds whole steps of two blocks");

// The item's columns: pcol[c] = the first pair of column c's token with this expert, slots[c] = bit s
// for every slot s of that token with it (a token may name an expert twice). Threads 0..63.
__device__ __forceinline__ void item_columns(const Routing& r, int e, int top_k, int* pcol, unsigned* slots) {
  const int tid = threadIdx.x;
  const unsigned long long mask = r.tokens[e];
  if (tid < kMaxTokens && ((mask >> tid) & 1ull)) {
    const int c = __popcll(mask & ((1ull << tid) - 1ull));
    unsigned bits = 0u;
    for (int s = top_k - 1; s >= 0; --s)
      if (r.ids[tid * top_k + s] == e) bits |= 1u << s;
    pcol[c] = tid * top_k + __ffs(bits) - 1;
    slots[c] = bits;
  }
}

// The first unit of CTA `cta`'s range of `units` over `ctas` CTAs (its end: the next CTA's first).
__device__ __forceinline__ long long range_lo(int cta, int ctas, long long units) {
  return (long long)cta * units / ctas;
}

// One segment: expert ex's 16-row tiles [t0, t1) of H, with its cnt tokens. Per warp: its tiles
// t0 + warp + 8j, in pairs (j = 2q, 2q + 1), `steps` steps (pair, column pass, k block).
struct DownSeg {
  int ex, t0, t1, cnt, passes, steps;
};

__device__ __forceinline__ DownSeg down_seg(const Routing& r, int rank, int g0, int g1, int kb_total) {
  const int warp = threadIdx.x >> 5;
  DownSeg sg;
  sg.ex = r.touched[rank];
  sg.t0 = g0 * (kGroupRows / 16);
  sg.t1 = g1 * (kGroupRows / 16);
  sg.cnt = __popcll(r.tokens[sg.ex]);
  sg.passes = ((sg.cnt + 7) / 8 + kDownPassNt - 1) / kDownPassNt;
  const int mine = sg.t1 - sg.t0 > warp ? (sg.t1 - sg.t0 - 1 - warp) / kWarps + 1 : 0;
  sg.steps = (mine + 1) / 2 * sg.passes * kb_total;
  return sg;
}

// A position in a warp's step sequence: the k block, the column pass, the pair's first tile.
struct DownCursor {
  int kb, pass, tile;
  __device__ __forceinline__ void next(int kb_total, int passes) {
    if (++kb == kb_total) {
      kb = 0;
      if (++pass == passes) {
        pass = 0;
        tile += 2 * kWarps;
      }
    }
  }
};

// A warp's copy cursor over a segment's steps: the next step n to copy, at (kb, pass, pair's first
// tile), its first tile's block at src (kept as a running address: recomputing it from the cursor cost
// about a hundred instructions a step at the register cap).
struct DownCopies {
  const unsigned char* src;
  int kb, pass, tile, n;
};

// Step q.n's two weight blocks into ring slots 2n, 2n + 1 (mod kStages), one commit group each (empty
// past the segment's steps), then q to the next step. A pair without a second tile (an odd count at a
// segment's end) copies its first tile's block twice (an L2 hit), so every step is the same code; the
// second copy's values are never stored.
__device__ __forceinline__ void down_copy(const DownSeg& sg, int kb_total, DownCopies& q, unsigned wring, int lane) {
  const bool live = q.n < sg.steps;
  const unsigned long long pol = evict_first_policy();  // made here, not held across the step (registers)
  const unsigned dst = wring + ((2 * q.n) % kStages) * kBlockBytes;
  if (live) issue_block(dst, q.src, lane, pol);
  cp_async_commit();
  if (live)
    issue_block(dst + kBlockBytes, q.tile + kWarps < sg.t1 ? q.src + (long long)kWarps * kb_total * kBlockBytes : q.src,
                lane, pol);
  cp_async_commit();
  ++q.n;
  if (live) {  // the next k block; at a pass's end back to the pair's first block, or on to the next pair
    q.src += kBlockBytes;
    if (++q.kb == kb_total) {
      q.kb = 0;
      q.src -= (long long)kb_total * kBlockBytes;
      if (++q.pass == sg.passes) {
        q.pass = 0;
        q.tile += 2 * kWarps;
        q.src += (long long)2 * kWarps * kb_total * kBlockBytes;
      }
    }
  }
}

// A warp's first kStages / 2 steps of a segment (expert weights wx), q set from its start.
__device__ __forceinline__ void down_prologue(const unsigned char* __restrict__ wx, const DownSeg& sg, int kb_total,
                                              DownCopies& q, unsigned wring, int lane) {
  const int tile = sg.t0 + (int)(threadIdx.x >> 5);
  q = DownCopies{wx + (long long)tile * kb_total * kBlockBytes, 0, 0, tile, 0};
#pragma unroll
  for (int s = 0; s < kStages / 2; ++s) down_copy(sg, kb_total, q, wring, lane);
}

// One k128 block of two m16 tiles against one n8 column tile: per k32 chunk the correction once
// (chunk_corr), then each tile's chunk_post.
// Every value's operations and their order are mma_block's.
__device__ __forceinline__ void mma_pair(float (&acc_a)[4], float (&acc_b)[4], const uint4 (&ba)[3],
                                         const uint4 (&bb)[3], const uint4 (&xb)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float corr[4];
    chunk_corr(corr, xb[c]);
    chunk_post(acc_a, ba, c, corr, xb[c]);
    chunk_post(acc_b, bb, c, corr, xb[c]);
  }
}

// A tile's down values of the pass's column tiles, at every pair of each column's token with the
// expert: d[pair][16 tile + row]; the accumulators are zeroed for the next tile.
__device__ __forceinline__ void down_store(float (&acc)[kDownPassNt][4], int pass, int ntl, int cnt, int tile,
                                           const int* pcol, const unsigned* slots, int H, float* __restrict__ d) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kDownPassNt; ++nt) {
    if (pass * kDownPassNt + nt >= ntl) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = (pass * kDownPassNt + nt) * 8 + 2 * t + j;
      if (c >= cnt) continue;
      unsigned bits = slots[c];
      const int base = pcol[c] - (__ffs(bits) - 1);  // the token's first pair: pcol is its first slot with ex
      while (bits) {
        const int s = __ffs(bits) - 1;
        bits &= bits - 1;
        float* dp = d + (long long)(base + s) * H + tile * 16;
        dp[g] = acc[nt][j];
        dp[g + 8] = acc[nt][2 + j];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
  }
}

// The down GEMM of segment sg (warp w: tile pairs from t0 + w, whole K = I per tile), each (token,
// expert) value into d at every pair of that token with that id. The segment's columns (pcol, slots)
// and its staged h rows (stage, `staged` columns of row stride `stride` bytes) are in shared memory;
// the first kStages / 2 steps are in flight on entry (down_prologue, copy cursor q). A step's
// slots are refilled (step + kStages / 2) as soon as its blocks are in registers, so kStages blocks
// are in flight while it computes.
__device__ __forceinline__ void down_item(const bf16* __restrict__ h, int I, int H, const DownSeg& sg,
                                          const int* pcol, const unsigned* slots, const unsigned char* stage,
                                          int staged, int stride, unsigned char* ring, float* __restrict__ d,
                                          DownCopies& q) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kb_total = I / kStepK, ntl = (sg.cnt + 7) >> 3;
  const unsigned wring = smem_addr(ring) + warp * kWarpRingBytes;
  const unsigned char* wring_p = ring + warp * kWarpRingBytes;
  DownCursor cc{0, 0, sg.t0 + warp};
  float acc[2][kDownPassNt][4];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < kDownPassNt; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
  for (int step = 0; step < sg.steps; ++step) {
    cp_async_wait_ring();  // this step's two groups have landed (the next kStages / 2 - 1 steps' may not)
    __syncwarp();
    const unsigned char* slot = wring_p + ((2 * step) % kStages) * kBlockBytes;
    uint4 ba[3], bb[3];
    load_block(ba, slot, lane, g);
    load_block(bb, slot + kBlockBytes, lane, g);
    __syncwarp();  // every lane's reads of this step's slots are performed: they take step + kStages / 2
    down_copy(sg, kb_total, q, wring, lane);  // step + kStages / 2
#pragma unroll
    for (int nt = 0; nt < kDownPassNt; ++nt) {
      const int ntg = cc.pass * kDownPassNt + nt;
      if (ntg < ntl) {
        const int c = ntg * 8 + g;
        uint4 xb[4];
        if (c < staged) {
          const unsigned char* row = stage + c * stride + (cc.kb * kStepK + 8 * t) * 2;
#pragma unroll
          for (int q = 0; q < 4; ++q) xb[q] = lds128(row + 64 * q);
        } else {
          load_act(xb, h + (long long)(c < sg.cnt ? pcol[c] : 0) * I, c < sg.cnt, cc.kb * kStepK, t);
        }
        mma_pair(acc[0][nt], acc[1][nt], ba, bb, xb);
      }
    }
    if (cc.kb == kb_total - 1) {
      down_store(acc[0], cc.pass, ntl, sg.cnt, cc.tile, pcol, slots, H, d);
      if (cc.tile + kWarps < sg.t1)
        down_store(acc[1], cc.pass, ntl, sg.cnt, cc.tile + kWarps, pcol, slots, H, d);
      else
#pragma unroll
        for (int nt = 0; nt < kDownPassNt; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[1][nt][i] = 0.f;
    }
    cc.next(kb_total, sg.passes);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

}  // namespace moe_small
}  // namespace ddt
