// MoE routing on the GPU, graph-capturable (no host sync, sizes bounded on the host).
//   moe_route_e{64..1024}: DeepSeek-V3 noaux_tc top-k per token, one warp per token with the
//     token's scores in registers (entry = the smallest expert capacity >= E); top_k <= 8 by a
//     per-lane sort and a butterfly merge of sorted lists (include/moe_route.cuh).
//   moe_align_kernel: (token, slot) pairs grouped by expert into two block lists: experts with few
//     pairs in `block`-pair runs, experts with many in `large_block`-pair runs.
// Exact rules (ties, NaN, sum order) are those of ddtree_rtc/reference/moe_routing.py.
#include "common.cuh"
#include "moe_route.cuh"

using namespace ddt::route;

namespace {

constexpr int kRouteWarps = 4;
constexpr int kAlignThreads = 256;
constexpr int kAlignWarps = kAlignThreads / 32;
}  // namespace

// logits fp32 [M, E]; bias fp32 [E] or null; out_ids int32 / out_w fp32 [M, top_k]. E <= 32 * EPL,
// n_group <= 32 (checked on the host). merge: picks by the merge path when top_k <= kMergeK (else the
// scan; the same bits). Dynamic shared memory, per warp: E floats when n_group > 1 (group scores),
// then E floats when merge (the unbiased scores the weights are read from).
#define MOE_ROUTE_ENTRY(NAME, EPL)                                                                      \
  extern "C" __global__ void __launch_bounds__(kRouteWarps * 32, 1) NAME(                               \
      const float* __restrict__ logits, const float* __restrict__ bias, int M, int E, int top_k,        \
      int n_group, int topk_group, int norm, float scaling, int merge, int* __restrict__ out_ids,        \
      float* __restrict__ out_w) {                                                                      \
    extern __shared__ float route_smem[];                                                               \
    ddt::pdl_wait(); /* the logits come from the previous kernel */                                     \
    ddt::pdl_trigger();                                                                                 \
    const int warp = threadIdx.x >> 5;                                                                  \
    float* sel = route_smem + warp * E * ((n_group > 1) + (merge != 0));                                \
    route_token<EPL>(logits, bias, blockIdx.x * kRouteWarps + warp, M, E, top_k, n_group, topk_group,   \
                     norm, scaling, merge, out_ids, out_w, sel, sel + (n_group > 1 ? E : 0));           \
  }
MOE_ROUTE_ENTRY(moe_route_e64, 2)
MOE_ROUTE_ENTRY(moe_route_e128, 4)
MOE_ROUTE_ENTRY(moe_route_e256, 8)
MOE_ROUTE_ENTRY(moe_route_e384, 12)
MOE_ROUTE_ENTRY(moe_route_e512, 16)
MOE_ROUTE_ENTRY(moe_route_e1024, 32)

// ids int32 [P] (P = M * top_k pairs). An expert with at most `large_above` pairs gets a run padded
// to `block` in the small list: sorted_pairs[0, cap_small), blocks block_expert[0, cap_small / block);
// one with more a run padded to `large_block` in the large list: sorted_pairs[cap_small, ...),
// blocks block_expert[cap_small / block, ...). num_blocks = {small blocks, large blocks}.
// Every CTA rebuilds the histogram and both padded prefixes in shared memory (cheap, and no
// grid-wide sync); warp w of CTA b then places expert b * kAlignWarps + w (and every
// gridDim.x * kAlignWarps-th after it) with ballots, so each run lists its pairs in ascending order.
// CTA 0 writes counts, offsets (each expert's run start), num_blocks and the error flag.
// Dynamic shared memory: (2E + 2) ints, plus P ints when ids_in_smem.
extern "C" __global__ void __launch_bounds__(kAlignThreads, 1) moe_align_kernel(
    const int* __restrict__ ids, int P, int E, int block, int large_block, int large_above, int cap_small,
    int ids_in_smem, int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ sorted_pairs,
    int* __restrict__ block_expert, int* __restrict__ num_blocks, int* __restrict__ error) {
  extern __shared__ int align_smem[];
  ddt::pdl_wait();  // the ids come from the previous kernel (the routing)
  ddt::pdl_trigger();
  int* cnt = align_smem;    // [E]
  int* off = cnt + E;       // [E]
  int* tot = off + E;       // [2]: padded pairs of the small / large list
  int* sids = tot + 2;      // [P] when ids_in_smem
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < E; e += kAlignThreads) cnt[e] = 0;
  __syncthreads();
  int bad = 0;
  for (int p0 = 0; p0 < P; p0 += kAlignThreads) {  // uniform trip count: whole warps below
    const int p = p0 + tid;
    const int v = p < P ? ids[p] : -1;
    if (ids_in_smem && p < P) sids[p] = v;
    const bool ok = v >= 0 && v < E;
    if (p < P && !ok) bad = 1;
    // one atomic per distinct expert of the warp (routing skew would serialize per-pair atomics)
    const unsigned peers = __match_any_sync(kFull, ok ? v : -1);
    if (ok && lane == __ffs(peers) - 1) atomicAdd(&cnt[v], __popc(peers));
  }
  bad = __syncthreads_or(bad);
  if (warp == 0) {
    // each lane scans a contiguous chunk of experts; warp scans join the chunks (both lists at once)
    const int per = (E + 31) / 32, lo = min(E, lane * per), hi = min(E, lo + per);
    int loc_s = 0, loc_l = 0;
    for (int e = lo; e < hi; ++e) {
      const int c = cnt[e];
      if (c > large_above) loc_l += (c + large_block - 1) / large_block * large_block;
      else loc_s += (c + block - 1) / block * block;
    }
    int inc_s = loc_s, inc_l = loc_l;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int ts = __shfl_up_sync(kFull, inc_s, o), tl = __shfl_up_sync(kFull, inc_l, o);
      if (lane >= o) {
        inc_s += ts;
        inc_l += tl;
      }
    }
    int run_s = inc_s - loc_s, run_l = cap_small + inc_l - loc_l;
    for (int e = lo; e < hi; ++e) {
      const int c = cnt[e];
      if (c > large_above) {
        off[e] = run_l;
        run_l += (c + large_block - 1) / large_block * large_block;
      } else {
        off[e] = run_s;
        run_s += (c + block - 1) / block * block;
      }
    }
    if (lane == 31) {
      tot[0] = inc_s;
      tot[1] = inc_l;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int e = tid; e < E; e += kAlignThreads) {
      counts[e] = cnt[e];
      offsets[e] = off[e];
    }
    if (tid == 0) {
      num_blocks[0] = tot[0] / block;
      num_blocks[1] = tot[1] / large_block;
      error[0] = bad;
    }
  }
  const int* src = ids_in_smem ? sids : ids;
  const unsigned lt = (1u << lane) - 1u;
  for (int e = blockIdx.x * kAlignWarps + warp; e < E; e += gridDim.x * kAlignWarps) {
    const int c = cnt[e];
    if (c == 0) continue;
    const bool large = c > large_above;
    const int b = large ? large_block : block, base = off[e], padded = (c + b - 1) / b * b;
    int run = 0;
    for (int p0 = 0; p0 < P && run < c; p0 += 32) {
      const int p = p0 + lane;
      const bool mine = p < P && src[p] == e;
      const unsigned mask = __ballot_sync(kFull, mine);
      if (mine) sorted_pairs[base + run + __popc(mask & lt)] = p;
      run += __popc(mask);
    }
    for (int j = c + lane; j < padded; j += 32) sorted_pairs[base + j] = P;
    const int blk0 = large ? cap_small / block + (base - cap_small) / large_block : base / block;
    for (int j = lane; j < padded / b; j += 32) block_expert[blk0 + j] = e;
  }
}
