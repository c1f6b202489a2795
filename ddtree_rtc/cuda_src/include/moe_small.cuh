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

// One k128 block of one m16 tile against one n8 column tile: 4 chunks of k32 (one scale group
// each). Per chunk: t = sum_k (128 + u) x - 136 sum_k x = sum_k q x in the mma, then acc += s * t
// in fp32. buf: the lane's two 16-byte weight pieces and its 16 bytes of scales (row g, g + 8);
// xb[c]: the lane's 8 k values of chunk c of its column.
__device__ __forceinline__ void mma_block(float (&acc)[4], const uint4 (&buf)[3], const uint4 (&xb)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    mma_bf16(t, kMinus136, kMinus136, kMinus136, kMinus136, xb[c].x, xb[c].y);
    mma_bf16(t, kMinus136, kMinus136, kMinus136, kMinus136, xb[c].z, xb[c].w);
    const uint4 wv = buf[c >> 1];
    const unsigned wg = (c & 1) ? wv.z : wv.x, wg8 = (c & 1) ? wv.w : wv.y;
    mma_bf16(t, raw2(wg), raw2(wg8), raw2(wg >> 4), raw2(wg8 >> 4), xb[c].x, xb[c].y);
    mma_bf16(t, raw2(wg >> 8), raw2(wg8 >> 8), raw2(wg >> 12), raw2(wg8 >> 12), xb[c].z, xb[c].w);
    const unsigned sw = c < 2 ? buf[2].x : buf[2].y, sw8 = c < 2 ? buf[2].z : buf[2].w;
    const float s = __uint_as_float((c & 1) ? (sw & 0xFFFF0000u) : (sw << 16));
    const float s8 = __uint_as_float((c & 1) ? (sw8 & 0xFFFF0000u) : (sw8 << 16));
    acc[0] = fmaf(s, t[0], acc[0]);
    acc[1] = fmaf(s, t[1], acc[1]);
    acc[2] = fmaf(s8, t[2], acc[2]);
    acc[3] = fmaf(s8, t[3], acc[3]);
  }
}

// A warp's copy of one weight block into its ring stage: lane L moves bytes [16L, 16L + 16) and
// [512 + 16L, ...), lanes 0..7 the 128 scale bytes.
__device__ __forceinline__ void issue_block(unsigned dst, const unsigned char* src, int lane) {
  cp_async16(dst + 16 * lane, src + 16 * lane);
  cp_async16(dst + 512 + 16 * lane, src + 512 + 16 * lane);
  if (lane < 8) cp_async16(dst + 1024 + 16 * lane, src + 1024 + 16 * lane);
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

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// gate_up items: kGuTiles fused 16-row tiles of one expert, whose weight blocks share each x load;
// an expert's columns go in passes of kGuPassNt column tiles (its weights read again from L2 past the
// first), so the accumulators stay at kGuTiles x kGuPassNt x 4 registers.
// One tile per item up to 16 tokens (a 1-token step has few items per CTA, and two tiles per item
// left some SMs idle: H100, MoE 53.1 vs 49.7 µs at M = 1), two above.
constexpr int kGuPassNt = 4;

// The gate_up of tiles [tile, tile + kGuTiles) of touched expert e into h; every thread of the CTA.
// The rings are free on entry and on return.
template <int kGuTiles>
__device__ __forceinline__ void gate_up_item(const unsigned char* __restrict__ w13, long long w13_expert_bytes,
                                             const bf16* __restrict__ x, int top_k, int H, int I, int e, int tile,
                                             const Routing& r, int* cols, unsigned char* ring,
                                             bf16* __restrict__ h) {
  constexpr int kGuStageBytes = kGuTiles * kBlockBytes, kGuWarpRingBytes = kStages * kGuStageBytes;
  const unsigned long long mask = r.tokens[e];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (tid < kMaxTokens) fill_cols(mask, tid, cols);
  __syncthreads();
  const int cnt = __popcll(mask), ntl = (cnt + 7) >> 3;
  const int kb_total = H / kStepK;
  const long long tile_bytes = (long long)kb_total * kBlockBytes;
  const unsigned char* wsrc = w13 + (long long)e * w13_expert_bytes + tile * tile_bytes;
  const unsigned wring = smem_addr(ring) + warp * kGuWarpRingBytes;
  const int steps = warp < kb_total ? (kb_total - 1 - warp) / kWarps + 1 : 0;  // blocks warp, warp + 8, ...
  auto issue = [&](int s) {
    const unsigned char* src = wsrc + (long long)(warp + s * kWarps) * kBlockBytes;
#pragma unroll
    for (int u = 0; u < kGuTiles; ++u)
      issue_block(wring + (s % kStages) * kGuStageBytes + u * kBlockBytes, src + u * tile_bytes, lane);
  };
  for (int nt0 = 0; nt0 < ntl; nt0 += kGuPassNt) {
    const int ntp = min(kGuPassNt, ntl - nt0);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < steps) issue(s);
      cp_async_commit();
    }
    float acc[kGuTiles][kGuPassNt][4];
#pragma unroll
    for (int u = 0; u < kGuTiles; ++u)
#pragma unroll
      for (int nt = 0; nt < kGuPassNt; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
    for (int step = 0; step < steps; ++step) {
      cp_async_wait_ring();
      __syncwarp();
      if (step + kStages - 1 < steps) issue(step + kStages - 1);
      cp_async_commit();
      uint4 buf[kGuTiles][3];
#pragma unroll
      for (int u = 0; u < kGuTiles; ++u)
        load_block(buf[u], ring + warp * kGuWarpRingBytes + (step % kStages) * kGuStageBytes + u * kBlockBytes, lane,
                   g);
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

}  // namespace moe_small
}  // namespace ddt
