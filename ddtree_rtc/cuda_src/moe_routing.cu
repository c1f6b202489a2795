// MoE routing on the GPU, graph-capturable (no host sync, sizes bounded on the host).
//   moe_route_e{64..1024}: DeepSeek-V3 noaux_tc top-k per token, one warp per token with the
//     token's scores in registers (entry = the smallest expert capacity >= E).
//   moe_align_kernel: (token, slot) pairs grouped by expert into two block lists: experts with few
//     pairs in `block`-pair runs, experts with many in `large_block`-pair runs.
// Exact rules (ties, NaN, sum order) are those of ddtree_rtc/reference/moe_routing.py.
#include "common.cuh"

namespace {

constexpr int kRouteWarps = 4;
constexpr int kAlignThreads = 256;
constexpr int kAlignWarps = kAlignThreads / 32;
constexpr int kNoIndex = 0x7fffffff;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// (v, i) beats (bv, bi): larger value, then lower index. NaN never appears here.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, i, o);
    if (beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Selection score -> unsigned key with the same order (one redux.sync compares it). Equal scores
// get equal keys (-0 -> +0), NaN counts as -inf (key 0x007fffff); key 0 marks taken / absent
// experts, below every score.
__device__ __forceinline__ unsigned order_key(float b) {
  if (isnan(b)) b = neg_inf();
  if (b == 0.f) b = 0.f;
  const unsigned u = __float_as_uint(b);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The lane's best key (lowest j on ties: its lowest expert index) and that expert's unbiased score.
template <int EPL>
__device__ __forceinline__ void lane_best(const unsigned (&key)[EPL], const float (&s)[EPL], unsigned& bk,
                                          int& bj, float& bs) {
  bk = key[0];
  bj = 0;
  bs = s[0];
#pragma unroll
  for (int j = 1; j < EPL; ++j)
    if (key[j] > bk) {
      bk = key[j];
      bj = j;
      bs = s[j];
    }
}

// One warp per token; lane l holds experts l + 32 j (j < EPL) in registers. top_k rounds of a
// warp-wide max of the lanes' best keys (redux.sync), lowest expert index among the tied lanes;
// only the winning lane rescans its registers.
template <int EPL>
__device__ __forceinline__ void route_token(const float* __restrict__ logits, const float* __restrict__ bias,
                                            int M, int E, int top_k, int n_group, int topk_group, int norm,
                                            float scaling, int* __restrict__ out_ids, float* __restrict__ out_w) {
  extern __shared__ float route_smem[];
  ddt::pdl_wait();  // the logits come from the previous kernel
  ddt::pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m = blockIdx.x * kRouteWarps + warp;
  if (m >= M) return;
  const float* row = logits + (long long)m * E;
  float x[EPL], bb[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {  // all loads first
    const int e = lane + 32 * j;
    x[j] = e < E ? row[e] : 0.f;
    bb[j] = e < E && bias ? bias[e] : 0.f;
  }
  float s[EPL];
  unsigned key[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    // correctly rounded fp32 sigmoid (double evaluation, one rounding), as the reference
    s[j] = (float)(1.0 / (1.0 + exp(-(double)x[j])));
    const float b = bias ? s[j] + bb[j] : s[j];
    key[j] = lane + 32 * j < E ? order_key(b) : 0u;
  }
  if (n_group > 1) {
    // group scores need the group's values together: go through this warp's E floats of smem
    float* sel = route_smem + warp * E;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      if (e < E) {
        const float b = bias ? s[j] + bb[j] : s[j];
        sel[e] = isnan(b) ? neg_inf() : b;
      }
    }
    __syncwarp();
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
    const unsigned keep = __ballot_sync(kFull, kept);
    const unsigned masked = order_key(neg_inf());  // experts of dropped groups score -inf
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !((keep >> (e / gs)) & 1u)) key[j] = masked;
    }
  }
  unsigned bk;
  int bj;
  float bs;
  lane_best<EPL>(key, s, bk, bj, bs);
  float w_mine = 0.f, total = 0.f;  // lane r < top_k keeps pick r
  int id_mine = 0;
  for (int r = 0; r < top_k; ++r) {
    const unsigned mx = __reduce_max_sync(kFull, bk);
    const unsigned win = __reduce_min_sync(kFull, bk == mx ? (unsigned)(lane + 32 * bj) : 0xffffffffu);
    const float wv = __shfl_sync(kFull, bs, win & 31);
    total = r == 0 ? wv : total + wv;  // left to right in pick order
    if (lane == r) {
      id_mine = (int)win;
      w_mine = wv;
    }
    if ((int)(win & 31) == lane) {
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        if (j == bj) key[j] = 0u;
      lane_best<EPL>(key, s, bk, bj, bs);
    }
  }
  if (lane < top_k) {
    float w = w_mine;
    if (norm) w = w / (total + 1e-20f);
    out_ids[(long long)m * top_k + lane] = id_mine;
    out_w[(long long)m * top_k + lane] = w * scaling;
  }
}

}  // namespace

// logits fp32 [M, E]; bias fp32 [E] or null; out_ids int32 / out_w fp32 [M, top_k]. E <= 32 * EPL,
// n_group <= 32 (checked on the host). Dynamic shared memory: kRouteWarps * E floats when
// n_group > 1, else none.
#define MOE_ROUTE_ENTRY(NAME, EPL)                                                                      \
  extern "C" __global__ void __launch_bounds__(kRouteWarps * 32, 1) NAME(                               \
      const float* __restrict__ logits, const float* __restrict__ bias, int M, int E, int top_k,        \
      int n_group, int topk_group, int norm, float scaling, int* __restrict__ out_ids,                  \
      float* __restrict__ out_w) {                                                                      \
    route_token<EPL>(logits, bias, M, E, top_k, n_group, topk_group, norm, scaling, out_ids, out_w);    \
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
