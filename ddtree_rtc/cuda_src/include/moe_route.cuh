// DeepSeek-V3 noaux_tc top-k of one token by one warp (moe_routing.cu's moe_route_e* entries). Exact
// rules: ddtree_rtc/reference/moe_routing.py.
#pragma once
#include "common.cuh"

namespace ddt {
namespace route {

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

// The merge path: the picks are the top_k largest of pick(key, e) = key << 32 | ~e (a larger key
// first, then the lower expert index: the scan's order, as one 64-bit number, every expert's distinct).
constexpr int kMergeK = 8;

__device__ __forceinline__ unsigned long long pick(unsigned key, int e) {
  return ((unsigned long long)key << 32) | (unsigned)~e;
}
__device__ __forceinline__ int pick_index(unsigned long long p) { return (int)~(unsigned)p; }

// a <- max(a, b), b <- min(a, b), from one 64-bit compare (written as max and min, the compiler
// compares twice)
__device__ __forceinline__ void order2(unsigned long long& a, unsigned long long& b) {
  unsigned long long hi, lo;
  asm("{\n\t.reg .pred p;\n\tsetp.gt.u64 p, %2, %3;\n\tselp.b64 %0, %2, %3, p;\n\tselp.b64 %1, %3, %2, p;\n\t}"
      : "=l"(hi), "=l"(lo)
      : "l"(a), "l"(b));
  a = hi;
  b = lo;
}

// A bitonic sequence of N (a power of two) sorted into descending order: log2(N) levels.
template <int N>
__device__ __forceinline__ void bitonic_merge_desc(unsigned long long (&v)[N]) {
#pragma unroll
  for (int d = N / 2; d > 0; d >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i)
      if ((i & d) == 0) order2(v[i], v[i + d]);
}

// v (any order) sorted descending: bitonic sort, log2(N) (log2(N) + 1) / 2 levels.
template <int N>
__device__ __forceinline__ void bitonic_sort_desc(unsigned long long (&v)[N]) {
#pragma unroll
  for (int k = 2; k <= N; k <<= 1)
#pragma unroll
    for (int d = k / 2; d > 0; d >>= 1)
#pragma unroll
      for (int i = 0; i < N; ++i)
        if ((i & d) == 0) {
          if ((i & k) == 0 || k == N) order2(v[i], v[i + d]);  // this k-run descending
          else order2(v[i + d], v[i]);                          // this k-run ascending
        }
}

// a <- the N largest of a (N, descending) and b (S <= N, descending; as if padded with zeros):
// a[i] = max(a[i], b[N-1-i]) is the top N as a bitonic sequence, then one merge.
template <int N, int S>
__device__ __forceinline__ void top_of_two(unsigned long long (&a)[N], const unsigned long long (&b)[S]) {
#pragma unroll
  for (int i = N - S; i < N; ++i) a[i] = a[i] > b[N - 1 - i] ? a[i] : b[N - 1 - i];
  bitonic_merge_desc<N>(a);
}

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// Chunk c of a lane's picks (kMergeK of them, fewer in the last chunk), sorted descending, merged
// into top (the first chunk sets it); a short last chunk sorts only the next power of two of it.
template <int EPL, int C>
__device__ __forceinline__ void lane_chunk(const unsigned (&key)[EPL], int lane,
                                           unsigned long long (&top)[kMergeK]) {
  constexpr int kLeft = EPL - C * kMergeK;
  constexpr int S = pow2_at_least(kLeft < kMergeK ? kLeft : kMergeK);
  unsigned long long t[S];
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const int j = C * kMergeK + i;
    t[i] = j < EPL ? pick(key[j], lane + 32 * j) : 0ull;
  }
  bitonic_sort_desc<S>(t);
  if constexpr (C == 0) {
#pragma unroll
    for (int i = 0; i < kMergeK; ++i) top[i] = i < S ? t[i < S ? i : 0] : 0ull;
  } else {
    top_of_two<kMergeK, S>(top, t);
  }
  if constexpr ((C + 1) * kMergeK < EPL) lane_chunk<EPL, C + 1>(key, lane, top);
}

// The warp's kMergeK largest picks, descending, in every lane: each lane sorts its experts in
// chunks of kMergeK (absent ones pick 0, below every expert) and keeps its top kMergeK, then 5
// butterfly rounds (shuffle the partner's list, keep the top of the two) instead of top_k rounds of
// a warp-wide max and a serial rescan of the winner's registers.
template <int EPL>
__device__ __forceinline__ void warp_top(const unsigned (&key)[EPL], unsigned long long (&top)[kMergeK]) {
  lane_chunk<EPL, 0>(key, threadIdx.x & 31, top);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long p[kMergeK];
#pragma unroll
    for (int i = 0; i < kMergeK; ++i) p[i] = __shfl_xor_sync(kFull, top[i], o);
    top_of_two<kMergeK, kMergeK>(top, p);
  }
}

// The scan path. One warp per token; lane l holds experts l + 32 j (j < EPL) in registers. top_k rounds of a
// warp-wide max of the lanes' best keys (redux.sync), lowest expert index among the tied lanes;
// only the winning lane rescans its registers.
// Picks of top_k <= kMergeK with merge != 0 (the merge path, below), else top_k rounds of the scan:
// both give the same ids in the same order, so the same weights.
// Token m by the calling warp; sel: E floats of shared memory for this warp (used when n_group > 1),
// sv: E floats of shared memory for this warp (the merge path's unbiased scores).
template <int EPL>
__device__ __forceinline__ void route_token(const float* __restrict__ logits, const float* __restrict__ bias,
                                            int m, int M, int E, int top_k, int n_group, int topk_group, int norm,
                                            float scaling, int merge, int* __restrict__ out_ids,
                                            float* __restrict__ out_w, float* sel, float* sv) {
  const int lane = threadIdx.x & 31;
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
  if (merge && top_k <= kMergeK) {
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (lane + 32 * j < E) sv[lane + 32 * j] = s[j];
    unsigned long long top[kMergeK];
    warp_top<EPL>(key, top);
    __syncwarp();  // sv written
    // every lane holds the picks in pick order: the weights and their sum, left to right, locally
    float w[kMergeK], total = 0.f;
    int id_mine = 0;
#pragma unroll
    for (int r = 0; r < kMergeK; ++r) {
      const int id = pick_index(top[r]);
      w[r] = r < top_k ? sv[id] : 0.f;
      if (r < top_k) total = r == 0 ? w[r] : total + w[r];
      if (lane == r) id_mine = id;
    }
    float w_mine = 0.f;
#pragma unroll
    for (int r = 0; r < kMergeK; ++r)
      if (lane == r) w_mine = w[r];
    if (lane < top_k) {
      float wv = w_mine;
      if (norm) wv = wv / (total + 1e-20f);
      out_ids[(long long)m * top_k + lane] = id_mine;
      out_w[(long long)m * top_k + lane] = wv * scaling;
    }
    return;
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

}  // namespace route
}  // namespace ddt
