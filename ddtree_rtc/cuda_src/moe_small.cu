// Row-invariant INT4 MoE experts for small batches (M <= 64 tokens): the routed gate_up and the
// down GEMM with the weighted combine, two launches chained under PDL, no align step, no split-K
// reduce kernel, no atomics in any sum.
//
// Row invariance (docs/architecture.md, "The small-M path"): every number a token's output depends
// on is computed by a procedure fixed by the shapes (H, I, top_k), never by M, by the other tokens or
// by the grid:
//   - a (token, expert) gate_up value is one mma column (columns of an mma are independent), its K
//     split over the CTA's 8 warps by k-block index (block b to warp b % 8), the warps' partial sums
//     added in warp order;
//   - a (token, expert) down value is one mma column over the whole K = I in one warp;
//   - the combine adds a token's slots in slot order, then the shared expert, as the reference does.
// The weights use the "mma" INT4 layout of ddtree_rtc/model/int4_repack.py (1152-byte blocks of 16
// rows x 128 k) and the scale-after-mma dequant of moe_gemm.cu's one-token blocks.
//
// Each CTA rebuilds the routing it needs from the ids in shared memory (a token bitmask per expert,
// the touched experts in ascending order): M * top_k <= 1024 pairs, cheap, and no align launch.
// Work: moe_small_gate_up, items (touched-expert rank, 1 or 2 fused w13 16-row tiles: the host picks
// the entry from M, kernels/moe_small.py); moe_small_down, 16-row tiles of H, a CTA's warps taking the
// touched experts round-robin by rank. Both grids are one wave of CTAs looping over their items, so
// each CTA builds the routing once; which CTA computes an item never changes its numbers.
// moe_small_down reads the ids before its PDL wait (they come from two launches back) and puts its
// first weight stages in flight while moe_small_gate_up drains.
#include "common.cuh"
#include "moe_small.cuh"
#include "skinny_pair.cuh"

using namespace ddt;
using namespace ddt::moe_small;


// h [P, I] bf16: h[p] = bf16(silu(x[m] W_gate[e]^T) * (x[m] W_up[e]^T)) for every pair p = (m, slot)
// whose id e is in [0, E); other rows of h are not written. Items (touched-expert rank, kGuTiles fused
// 16-row tiles of 2I / 16, one x load feeding them all), item i to CTA i % gridDim.x (any grid: the
// values do not depend on it, nor on kGuTiles). Dynamic shared memory: 8 warp rings of kGuTiles-block
// stages (at least 32 KB: the warps' partial sums go through it at the end of each column pass).
template <int kGuTiles>
__device__ __forceinline__ void gate_up_kernel(const unsigned char* __restrict__ w13, long long w13_expert_bytes,
                                               const bf16* __restrict__ x, const int* __restrict__ topk_ids,
                                               int id_offset, int M, int top_k, int E, int H, int I,
                                               bf16* __restrict__ h) {
  extern __shared__ __align__(16) unsigned char ring[];
  __shared__ Routing r;
  __shared__ int cols[kMaxTokens];
  pdl_wait();  // the ids come from a recent kernel (the routing)
  pdl_trigger();
  build_routing(topk_ids, M * top_k, top_k, E, id_offset, r);
  const int tiles = 2 * I / 16 / kGuTiles, items = r.num_touched * tiles;
  for (int item = blockIdx.x; item < items; item += gridDim.x)
    gate_up_item<kGuTiles>(w13, w13_expert_bytes, x, top_k, H, I, r.touched[item / tiles], (item % tiles) * kGuTiles,
                           r, cols, ring, h);
}

#define GATE_UP_ENTRY(NAME, TILES)                                                                              \
  extern "C" __global__ void __launch_bounds__(kThreads, 2)                                                    \
      NAME(const unsigned char* __restrict__ w13, long long w13_expert_bytes, const bf16* __restrict__ x,      \
           const int* __restrict__ topk_ids, int id_offset, int M, int top_k, int E, int H, int I,             \
           bf16* __restrict__ h) {                                                                             \
    gate_up_kernel<TILES>(w13, w13_expert_bytes, x, topk_ids, id_offset, M, top_k, E, H, I, h);                \
  }
GATE_UP_ENTRY(moe_small_gate_up, 1)
GATE_UP_ENTRY(moe_small_gate_up_t2, 2)

// y [M, H] = sum_slot w[m, slot] * (h[m, slot] W_down[e]^T) (+ shared[m]), slots in order; bf16,
// or fp32 unrounded when out_f32 (a tensor-parallel partial). 16-row tiles of H, tile i to CTA
// i % gridDim.x. Dynamic shared memory: 8 warp rings + P x 16 fp32 down values.
extern "C" __global__ void __launch_bounds__(kThreads, 2) moe_small_down(
    const unsigned char* __restrict__ w2, long long w2_expert_bytes, const bf16* __restrict__ h,
    const int* __restrict__ topk_ids, int id_offset, const float* __restrict__ topk_w, int M, int top_k, int E,
    int H, int I, const bf16* __restrict__ shared, void* __restrict__ y, int out_f32) {
  extern __shared__ __align__(16) unsigned char ring[];
  __shared__ Routing r;
  __shared__ int cols[kWarps][kMaxTokens];
  float* dsm = reinterpret_cast<float*>(ring + kWarps * kWarpRingBytes);  // [P][16]
  // the ids were written two launches back or earlier (PDL rule, kernels/_launch.py): read them, and
  // put the first tile's first weight stages in flight, before the wait
  build_routing(topk_ids, M * top_k, top_k, E, id_offset, r);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles = H / 16, kb_total = I / kStepK;
  const int mine = r.num_touched > warp ? (r.num_touched - 1 - warp) / kWarps + 1 : 0;
  if (blockIdx.x < tiles) {
    const unsigned wring = smem_addr(ring) + warp * kWarpRingBytes;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < mine * kb_total) {
        const int ex = r.touched[warp + (s / kb_total) * kWarps];
        issue_block(wring + s * kBlockBytes,
                    w2 + (long long)ex * w2_expert_bytes + ((long long)blockIdx.x * kb_total + s % kb_total) * kBlockBytes,
                    lane);
      }
      cp_async_commit();
    }
  }
  pdl_wait();  // h comes from the previous kernel
  pdl_trigger();
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    down_tile(w2, w2_expert_bytes, h, top_k, I, tile, r, cols, ring, dsm, tile == (int)blockIdx.x);
    __syncthreads();
    combine_tile(r, dsm, topk_w, M, top_k, E, H, tile, shared, y, out_f32);
    __syncthreads();  // dsm and the rings are reused by the next tile
  }
}

// The MoE layer's dense part in one launch (include/skinny_pair.cuh, MODE 0): router logits fp32
// [m, E] and the shared expert's bf16(silu(gate) * up) [m, Is] from w13 = [gate; up] [2 Is, k]; an
// entry per token bucket (m8 .. m64, picked from M) and cluster size (s1 .. s8).
SKINNY_PAIR_ENTRIES(moe_small_dense_m8, 1, 0)
SKINNY_PAIR_ENTRIES(moe_small_dense_m16, 2, 0)
SKINNY_PAIR_ENTRIES(moe_small_dense_m32, 4, 0)
SKINNY_PAIR_ENTRIES(moe_small_dense_m64, 8, 0)
