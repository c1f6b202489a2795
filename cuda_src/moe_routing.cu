// MoE routing on the GPU, graph-capturable (no host sync, sizes bounded on the host).
//   moe_route_kernel: DeepSeek-V3 noaux_tc top-k per token (one warp per token).
//   moe_align_kernel: (token, slot) pairs grouped by expert, each expert's run padded to `block`.
// Exact rules (ties, NaN, sum order) are those of ddtree_rtc/reference/moe_routing.py.
#include "common.cuh"

namespace {

constexpr int kRouteWarps = 4;
constexpr int kAlignThreads = 256;
constexpr int kAlignWarps = kAlignThreads / 32;
constexpr int kNoIndex = 0x7fffffff;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// (v, i) beats (bv, bi): larger value, then lower index. NaN never appears here.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

}  // namespace

// logits fp32 [M, E]; bias fp32 [E] or null; out_ids int32 / out_w fp32 [M, top_k].
// Dynamic shared memory: kRouteWarps * 2 * E floats. E <= 1024, n_group <= 32 (checked on the host).
extern "C" __global__ void __launch_bounds__(kRouteWarps * 32, 1) moe_route_kernel(
    const float* __restrict__ logits, const float* __restrict__ bias, int M, int E, int top_k,
    int n_group, int topk_group, int norm, float scaling, int* __restrict__ out_ids,
    float* __restrict__ out_w) {
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m = blockIdx.x * kRouteWarps + warp;
  if (m >= M) return;
  float* score = route_smem + warp * 2 * E;  // unbiased sigmoid
  float* sel = score + E;                     // biased, NaN -> -inf, masked groups -> -inf
  const float* row = logits + (long long)m * E;
  for (int e = lane; e < E; e += 32) {
    // correctly rounded fp32 sigmoid (double evaluation, one rounding), as the reference
    const float s = (float)(1.0 / (1.0 + exp(-(double)row[e])));
    const float b = bias ? s + bias[e] : s;
    score[e] = s;
    sel[e] = isnan(b) ? neg_inf() : b;
  }
  __syncwarp();
  if (n_group > 1) {
    const int gs = E / n_group;
    float gscore = neg_inf();
    if (lane < n_group) {
      float m1 = neg_inf(), m2 = neg_inf();
      for (int i = 0; i < gs; ++i) {
        const float v = sel[lane * gs + i];
        if (v > m1) {
          m2 = m1;
          m1 = v;
        } else if (v > m2) {
          m2 = v;
        }
      }
      gscore = m1 + m2;
    }
    bool kept = false;
    for (int r = 0; r < topk_group; ++r) {
      float v = (lane < n_group && !kept) ? gscore : neg_inf();
      int i = (lane < n_group && !kept) ? lane : kNoIndex;
      warp_argmax(v, i);
      if (lane == i) kept = true;
    }
    const unsigned keep = __ballot_sync(0xffffffffu, kept);
    __syncwarp();
    for (int e = lane; e < E; e += 32)
      if (!((keep >> (e / gs)) & 1u)) sel[e] = neg_inf();
    __syncwarp();
  }
  // top_k rounds of a warp-wide argmax; each lane remembers which of its experts are taken.
  unsigned taken = 0;  // bit j: expert lane + 32 * j
  float w_mine = 0.f;  // lane j < top_k keeps pick j's weight
  int id_mine = 0;
  for (int r = 0; r < top_k; ++r) {
    float bv = neg_inf();
    int bi = kNoIndex;
    for (int j = 0, e = lane; e < E; ++j, e += 32) {
      const float v = sel[e];
      if (!((taken >> j) & 1u) && (bi == kNoIndex || v > bv)) {
        bv = v;
        bi = e;
      }
    }
    warp_argmax(bv, bi);
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (lane == r) {
      id_mine = bi;
      w_mine = score[bi];
    }
  }
  // sum left to right in pick order (lane 0 gathers), then normalise and scale
  float total = 0.f;
  for (int r = 0; r < top_k; ++r) {
    const float v = __shfl_sync(0xffffffffu, w_mine, r);
    total = r == 0 ? v : total + v;
  }
  if (lane < top_k) {
    float w = w_mine;
    if (norm) w = w / (total + 1e-20f);
    out_ids[(long long)m * top_k + lane] = id_mine;
    out_w[(long long)m * top_k + lane] = w * scaling;
  }
}

// ids int32 [P] (P = M * top_k pairs). Every CTA rebuilds the histogram and the padded prefix in
// shared memory (cheap, and no grid-wide sync); warp w of CTA b then places expert
// b * kAlignWarps + w (and every gridDim.x * kAlignWarps-th after it) with ballots, so each run
// lists its pairs in ascending order. CTA 0 writes counts, offsets, num_blocks and the error flag.
// Dynamic shared memory: (2E + 1) ints, plus P ints when ids_in_smem.
extern "C" __global__ void __launch_bounds__(kAlignThreads, 1) moe_align_kernel(
    const int* __restrict__ ids, int P, int E, int block, int ids_in_smem, int* __restrict__ counts,
    int* __restrict__ offsets, int* __restrict__ sorted_pairs, int* __restrict__ block_expert,
    int* __restrict__ num_blocks, int* __restrict__ error) {
  extern __shared__ int align_smem[];
  int* cnt = align_smem;     // [E]
  int* off = cnt + E;        // [E + 1]
  int* sids = off + E + 1;   // [P] when ids_in_smem
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < E; e += kAlignThreads) cnt[e] = 0;
  __syncthreads();
  int bad = 0;
  for (int p = tid; p < P; p += kAlignThreads) {
    const int v = ids[p];
    if (ids_in_smem) sids[p] = v;
    if (v >= 0 && v < E) atomicAdd(&cnt[v], 1);
    else bad = 1;
  }
  bad = __syncthreads_or(bad);
  if (warp == 0) {
    // each lane scans a contiguous chunk of experts; a warp scan joins the chunks
    const int per = (E + 31) / 32, lo = min(E, lane * per), hi = min(E, lo + per);
    int local = 0;
    for (int e = lo; e < hi; ++e) local += (cnt[e] + block - 1) / block * block;
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    int run = incl - local;
    for (int e = lo; e < hi; ++e) {
      off[e] = run;
      run += (cnt[e] + block - 1) / block * block;
    }
    if (lane == 31) off[E] = incl;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int e = tid; e < E; e += kAlignThreads) counts[e] = cnt[e];
    for (int e = tid; e <= E; e += kAlignThreads) offsets[e] = off[e];
    if (tid == 0) {
      num_blocks[0] = off[E] / block;
      error[0] = bad;
    }
  }
  const int* src = ids_in_smem ? sids : ids;
  const unsigned lt = (1u << lane) - 1u;
  for (int e = blockIdx.x * kAlignWarps + warp; e < E; e += gridDim.x * kAlignWarps) {
    const int base = off[e], padded = off[e + 1] - base;
    if (padded == 0) continue;
    int run = 0;
    for (int p0 = 0; p0 < P; p0 += 32) {
      const int p = p0 + lane;
      const bool mine = p < P && src[p] == e;
      const unsigned mask = __ballot_sync(0xffffffffu, mine);
      if (mine) sorted_pairs[base + run + __popc(mask & lt)] = p;
      run += __popc(mask);
    }
    for (int j = run + lane; j < padded; j += 32) sorted_pairs[base + j] = P;
    for (int b = base / block + lane; b < (base + padded) / block; b += 32) block_expert[b] = e;
  }
}
