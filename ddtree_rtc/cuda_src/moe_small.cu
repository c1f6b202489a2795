// Row-invariant INT4 MoE experts for small batches (M <= 64 tokens): the routed gate_up, then the
// down GEMM with the weighted combine, chained under PDL (two launches up to 16 tokens, three from 17:
// see Work), no align step, no split-K reduce kernel, no atomics in any sum.
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
// Work: moe_small_gate_up, items (touched-expert rank, 1 or 2 fused w13 16-row tiles; the host picks
// the entry from M). The down, up to 16 tokens: moe_small_down, 16-row tiles of H, a CTA's warps
// taking the touched experts round-robin by rank, the combine in the same CTA. From 17 tokens:
// moe_small_down_x, the (touched-expert rank, 128-row group of H) units in one contiguous range per CTA,
// the expert's h rows staged in shared memory once per segment, a warp's tiles two at a time; then
// moe_small_combine (a thread per output).
// On an H100 (benchmarks/README.md) the second form is 11-60 µs faster from 17 tokens on, and 16 µs
// slower at one. The grids are one wave of CTAs looping over their items, so each CTA builds the
// routing once; which CTA computes an item never changes its numbers, and both downs compute a
// value in the same order.
// The downs read the ids before their PDL wait (they come from two launches back) and put their
// first weight stages in flight while moe_small_gate_up drains.
#include "common.cuh"
#include "moe_route.cuh"
#include "moe_small.cuh"
#include "skinny_linear.cuh"
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
  // two tiles: the item count read again per item (volatile), as held across the item it spilled (sm_120a)
  auto more = [&](int item) {
    return kGuTiles > 1 ? item < *static_cast<volatile int*>(&r.num_touched) * tiles : item < items;
  };
  for (int item = blockIdx.x; more(item); item += gridDim.x)
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

// The down values d [P, H] fp32 = h[p] W_down[e]^T for every pair p whose id e is in [0, E) (other
// rows of d are not written). The (touched rank, kGroupRows-row group of H) units, cut into one
// contiguous range per CTA (any grid: which CTA computes a value never changes it); per segment of a
// range (one expert's run of groups) the expert's h rows go to shared memory once, and its warps stream
// the segment's weight tiles two at a time (whole K per tile; include/moe_small.cuh, down_item). The
// weight copies carry the L2 hints of cp_async16_hint. Dynamic shared memory: 8 warp rings +
// kStageBytes of staged h.
// sm_120a has 128 KB of shared memory per SM, where one moe_small_down_x CTA (rings + staged h + routing,
// about 91 KB) fits but not two: its register budget is one CTA's there (at two, 4 bytes spilled).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define MOE_SMALL_DOWN_X_CTAS 1
#else
#define MOE_SMALL_DOWN_X_CTAS 2
#endif
extern "C" __global__ void __launch_bounds__(kThreads, MOE_SMALL_DOWN_X_CTAS) moe_small_down_x(
    const unsigned char* __restrict__ w2, long long w2_expert_bytes, const bf16* __restrict__ h,
    const int* __restrict__ topk_ids, int id_offset, int M, int top_k, int E, int H, int I, float* __restrict__ d) {
  extern __shared__ __align__(16) unsigned char ring[];
  __shared__ Routing r;
  __shared__ int pcol[kMaxTokens];
  __shared__ unsigned slots[kMaxTokens];
  unsigned char* stage = ring + kWarps * kWarpRingBytes;
  // the ids were written two launches back or earlier (PDL rule, kernels/_launch.py): read them, and
  // put the first segment's first weight stages in flight, before the wait
  build_routing(topk_ids, M * top_k, top_k, E, id_offset, r);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kb_total = I / kStepK, groups = H / kGroupRows;
  const int stride = 2 * I + 64;  // bytes per staged h row: 64 past a multiple of 128, so a quarter-warp's
                                  // 16-byte reads of two rows fall in different banks
  const int fit = kStageBytes / stride;
  const unsigned wring = smem_addr(ring) + warp * kWarpRingBytes;
  const long long units = (long long)r.num_touched * groups;
  const long long lo = range_lo(blockIdx.x, gridDim.x, units), hi = range_lo(blockIdx.x + 1, gridDim.x, units);
  // the segment starting at unit u: its rank and groups [g0, g1)
  auto segment = [&](long long u) {
    const int rank = (int)(u / groups), g0 = (int)(u % groups);
    return down_seg(r, rank, g0, (int)min((long long)groups, g0 + (hi - u)), kb_total);
  };
  DownCopies q{w2, 0, 0, 0, 0};
  if (lo < hi) {
    const DownSeg sg = segment(lo);
    down_prologue(w2 + (long long)sg.ex * w2_expert_bytes, sg, kb_total, q, wring, lane);
  }
  pdl_wait();  // h comes from the previous kernel
  pdl_trigger();
  for (long long u = lo; u < hi;) {
    const DownSeg sg = segment(u);
    const unsigned char* wx = w2 + (long long)sg.ex * w2_expert_bytes;
    const int staged = min(sg.cnt, fit);
    item_columns(r, sg.ex, top_k, pcol, slots);
    __syncthreads();
    const int pieces = I / 8;  // 16-byte pieces per h row
    for (int i = tid; i < staged * pieces; i += kThreads) {
      const int c = i / pieces, k8 = i % pieces;
      cp_async16(smem_addr(stage + c * stride + 16 * k8), h + (long long)pcol[c] * I + 8 * k8);
    }
    cp_async_commit();
    if (u > lo) down_prologue(wx, sg, kb_total, q, wring, lane);
    asm volatile("cp.async.wait_group 0;" ::: "memory");  // the h rows (and the ring's first stages)
    __syncthreads();
    down_item(h, I, H, sg, pcol, slots, stage, staged, stride, ring, d, q);
    __syncthreads();  // pcol, slots, the stage and the rings are reused by the next segment
    u += (sg.t1 - sg.t0) / (kGroupRows / 16);
  }
}

// y [M, H] = sum_slot w[m, slot] * d[pair][n] (+ shared[m]), slots in order (pairs whose id is
// outside [0, E) skipped); bf16, or fp32 unrounded when out_f32 (a tensor-parallel partial). A
// thread per output, grid-stride; a token's up to 8 slots' loads in flight at once.
extern "C" __global__ void __launch_bounds__(kThreads) moe_small_combine(
    const int* __restrict__ topk_ids, int id_offset, const float* __restrict__ topk_w, const float* __restrict__ d,
    int M, int top_k, int E, int H, const bf16* __restrict__ shared, void* __restrict__ y, int out_f32) {
  pdl_wait();  // d comes from the previous kernel
  pdl_trigger();
  for (long long i = (long long)blockIdx.x * kThreads + threadIdx.x; i < (long long)M * H;
       i += (long long)gridDim.x * kThreads) {
    const int m = (int)(i / H), n = (int)(i % H);
    float a = 0.f;
    for (int s0 = 0; s0 < top_k; s0 += 8) {
      float dv[8], wv[8];
      bool ok[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = m * top_k + s0 + j, ex = s0 + j < top_k ? topk_ids[p] - id_offset : -1;
        ok[j] = ex >= 0 && ex < E;
        dv[j] = ok[j] ? d[(long long)p * H + n] : 0.f;
        wv[j] = ok[j] ? topk_w[p] : 0.f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (ok[j]) a = __fadd_rn(a, __fmul_rn(wv[j], dv[j]));
    }
    if (shared) a = __fadd_rn(a, to_f32(shared[(long long)m * H + n]));
    if (out_f32)
      static_cast<float*>(y)[(long long)m * H + n] = a;
    else
      static_cast<bf16*>(y)[(long long)m * H + n] = to_bf16(a);
  }
}

// The MoE layer's dense part in one launch (include/skinny_pair.cuh, MODE 0): router logits fp32
// [m, E] and the shared expert's bf16(silu(gate) * up) [m, Is] from w13 = [gate; up] [2 Is, k]; an
// entry per token bucket (m8 .. m64, picked from M) and cluster size (s1 .. s8).
SKINNY_PAIR_ENTRIES(moe_small_dense_m8, 1, 0)
SKINNY_PAIR_ENTRIES(moe_small_dense_m16, 2, 0)
SKINNY_PAIR_ENTRIES(moe_small_dense_m32, 4, 0)
SKINNY_PAIR_ENTRIES(moe_small_dense_m64, 8, 0)

// The routing and the shared expert's down projection in one launch (they are independent once
// moe_small_dense has written the logits and hs). CTAs [0, route_ctas) route a token per warp: the
// body of moe_routing.cu's moe_route_e* (include/moe_route.cuh), kRouteSharedEpl experts a lane, whose
// picks and weights do not depend on how many (absent experts never win). The other CTAs are the
// invariant linear y = hs w2^T (linear.cu's linear_m*_s* body, include/skinny_linear.cuh) as CTA
// blockIdx.x - route_ctas of that launch's grid: route_ctas is a multiple of S, so each cluster does
// one or the other, and a linear cluster's CTAs hold the same split indices (cluster ranks) and row
// blocks as in linear_m*: the same bits. Both halves wait on the previous kernel before they read
// its output and trigger the next after it (the linear's weights go to L2 first when early).
// Dynamic shared memory: the routing's, per warp (E floats when n_group > 1, E more when merge).
constexpr int kRouteSharedEpl = 12;  // E <= 384: reference/moe_small.py, ROUTE_SHARED_MAX_EXPERTS

template <int MH, int S, typename OutT>
__device__ __forceinline__ void route_shared(const float* __restrict__ logits, const float* __restrict__ bias, int M,
                                             int E, int top_k, int n_group, int topk_group, int norm, float scaling,
                                             int merge, int* __restrict__ out_ids, float* __restrict__ out_w,
                                             int route_ctas, const bf16* __restrict__ hs,
                                             const bf16* __restrict__ w2, OutT* __restrict__ y, int H, int Is,
                                             int warps_n, int early) {
  if (static_cast<int>(blockIdx.x) < route_ctas) {
    extern __shared__ float route_smem[];
    pdl_wait();  // the logits come from the previous kernel
    pdl_trigger();
    const int warp = threadIdx.x >> 5;
    float* sel = route_smem + warp * E * ((n_group > 1) + (merge != 0));
    route::route_token<kRouteSharedEpl>(logits, bias, static_cast<int>(blockIdx.x) * skinny::kWarps + warp, M, E,
                                        top_k, n_group, topk_group, norm, scaling, merge, out_ids, out_w, sel,
                                        sel + (n_group > 1 ? E : 0));
    return;
  }
  skinny_linear::run<MH, S, OutT>(hs, w2, y, M, H, Is, warps_n, early, static_cast<int>(blockIdx.x) - route_ctas);
}

// logits fp32 [M, E], bias fp32 [E] or null, out_ids int32 / out_w fp32 [M, top_k] (moe_route_e*'s
// arguments); hs bf16 [M, Is], w2 bf16 [H, Is], y [M, H] bf16 or fp32 (the *_f32 entries), warps_n and
// early (linear_m*'s). Grid route_ctas + ceil(H / (8 warps_n NT)) * S, block 256.
#define ROUTE_SHARED_ENTRY(NAME, MH, S, CLUSTER, OUT)                                                               \
  extern "C" __global__ void CLUSTER __launch_bounds__(skinny::kThreads, skinny::bucket_ctas_per_sm<MH>()) NAME(    \
      const float* __restrict__ logits, const float* __restrict__ bias, int M, int E, int top_k, int n_group,      \
      int topk_group, int norm, float scaling, int merge, int* __restrict__ out_ids, float* __restrict__ out_w,     \
      int route_ctas, const bf16* __restrict__ hs, const bf16* __restrict__ w2, OUT* __restrict__ y, int H, int Is, \
      int warps_n, int early) {                                                                                    \
    route_shared<MH, S, OUT>(logits, bias, M, E, top_k, n_group, topk_group, norm, scaling, merge, out_ids, out_w,  \
                             route_ctas, hs, w2, y, H, Is, warps_n, early);                                        \
  }

#define ROUTE_SHARED_ENTRIES(PREFIX, MH, OUT)                                 \
  ROUTE_SHARED_ENTRY(PREFIX##_s1, MH, 1, , OUT)                               \
  ROUTE_SHARED_ENTRY(PREFIX##_s2, MH, 2, __cluster_dims__(2, 1, 1), OUT)      \
  ROUTE_SHARED_ENTRY(PREFIX##_s4, MH, 4, __cluster_dims__(4, 1, 1), OUT)      \
  ROUTE_SHARED_ENTRY(PREFIX##_s8, MH, 8, __cluster_dims__(8, 1, 1), OUT)

ROUTE_SHARED_ENTRIES(moe_small_route_shared_m8, 1, bf16)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m16, 2, bf16)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m32, 4, bf16)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m64, 8, bf16)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m8_f32, 1, float)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m16_f32, 2, float)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m32_f32, 4, float)
ROUTE_SHARED_ENTRIES(moe_small_route_shared_m64_f32, 8, float)
