// Vocabulary top-k with fp32 log-softmax: per row of logits [rows, V] (bf16 bits or fp32), the K
// largest log-probs and their token ids, sorted descending, ties by the smaller id. Rules (NaN and
// +inf count as -inf, -0 as +0, lse = 0 for a row without a finite logit, log-probs clamped to
// >= -FLT_MAX) are shared with ddtree_rtc/reference/topk.py.
//
// This file holds the two kernels the default dispatch (ddtree_rtc/kernels/topk.py) picks between,
// with identical results:
//   stream (topk_stream_*, K <= 256, wide batches): one block per row chunk reads it once from
//     HBM, keeping only the 16-byte vectors that reach a rising threshold; the row's last block
//     merges the chunks' candidates;
//   radix (topk_radix_hist_* then topk_radix_select_*, small batches and every K > 256): many
//     blocks per row stream it once into a histogram of vector keys; one block per row then
//     re-reads only the 128-byte groups that can hold the K best.
// First the pieces both use (keys, block reductions, the exact radix select and bitonic sort of
// candidate keys in shared memory, row output), then each variant, then the entries.
// Elements are ordered by a unique 64-bit key (order-preserving float bits << 32 | ~id), so ties
// need no special case. (Variants tried and dropped: benchmarks/README.md, topk.)
#ifndef TOPK_CAP
#define TOPK_CAP 8192
#endif
#ifndef TOPK_PROFILE
#define TOPK_PROFILE 0  // stream variant: per-phase SM clock stamps in topk_prof[8 * block]
#endif
#if TOPK_PROFILE
__device__ long long topk_prof[8 * 8192];
#define TOPK_STAMP(i)                                                 \
  if (threadIdx.x == 0 && blockIdx.y * gridDim.x + blockIdx.x < 8192) \
  topk_prof[8 * (blockIdx.y * gridDim.x + blockIdx.x) + (i)] = clock64()
#else
#define TOPK_STAMP(i)
#endif
#ifndef TOPK_STREAM_BLOCKS
#define TOPK_STREAM_BLOCKS 2  // stream variant: blocks per SM the registers are sized for
#endif

namespace {

constexpr int THREADS = 512;  // the largest block the shared reductions are sized for
constexpr int WARPS = THREADS / 32;
constexpr int MAX_K = 512;
constexpr int CAP = TOPK_CAP;  // candidate buffer (keys); shared memory is (CAP + MAX_K) * 8 bytes
static_assert(CAP >= 2 * MAX_K && CAP >= THREADS, "the candidate buffer must hold 2 K and the per-thread bests");
constexpr unsigned FULL = 0xffffffffu;
constexpr float FLT_MAX_F = 3.402823466e+38f;
constexpr float LOG2E = 1.44269504088896340736f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }
__device__ __forceinline__ float to_float(float v) { return v; }

// NaN and +inf -> -inf (NaN fails the compare). Keys also need -0 -> +0 (canon) so both zeros
// get one key; value comparisons do not (-0 == +0).
__device__ __forceinline__ float sanitize(float x) { return x <= FLT_MAX_F ? x : neg_inf(); }
__device__ __forceinline__ float canon(float x) { return x == 0.f ? 0.f : x; }

// Order-preserving map of float bits to unsigned (finite and -inf: the larger float, the larger key).
__device__ __forceinline__ unsigned ord32(float x) {
  const unsigned b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float unord32(unsigned o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// Larger key = larger value, then smaller id. Real keys are > 0 (ord32(-inf) = 0x007fffff).
__device__ __forceinline__ unsigned long long make_key(unsigned o, int id) {
  return ((unsigned long long)o << 32) | (unsigned)~id;
}

struct Shared {
  unsigned long long* cand;  // [CAP] candidate keys (first the per-thread bests)
  unsigned long long* top;   // [MAX_K] selected keys
  unsigned* hist;            // [256]
  unsigned long long* red;   // [2 * WARPS] block reductions
  float* red_f;              // [2 * WARPS]
  unsigned* scalars;         // [6]: count, selected digit, count above it, count in it; two more counts
};

// (m, s) += (m2, s2) for sums of exp(x - m); m = -inf means "no finite element yet".
__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == neg_inf()) return;
  s = (m == neg_inf() ? 0.f : s * exp2f((m - M) * LOG2E)) + (m2 == neg_inf() ? 0.f : s2 * exp2f((m2 - M) * LOG2E));
  m = M;
}

template <int NT>
__device__ void block_lse(float& m, float& s, const Shared& sh) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(FULL, m, o), s2 = __shfl_xor_sync(FULL, s, o);
    lse_combine(m, s, m2, s2);
  }
  __syncthreads();
  if (lane == 0) {
    sh.red_f[warp] = m;
    sh.red_f[NW + warp] = s;
  }
  __syncthreads();
  m = neg_inf();
  s = 0.f;
  for (int w = 0; w < NW; ++w) lse_combine(m, s, sh.red_f[w], sh.red_f[NW + w]);
}

// OR and AND of the keys of all threads (every thread gets both).
template <int NT>
__device__ void block_or_and(unsigned long long& o, unsigned long long& a, const Shared& sh) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    o |= __shfl_xor_sync(FULL, o, d);
    a &= __shfl_xor_sync(FULL, a, d);
  }
  __syncthreads();
  if (lane == 0) {
    sh.red[warp] = o;
    sh.red[NW + warp] = a;
  }
  __syncthreads();
  o = 0ull;
  a = ~0ull;
  for (int w = 0; w < NW; ++w) {
    o |= sh.red[w];
    a &= sh.red[NW + w];
  }
}

// Warp 0: the bin of hist[256] holding the need-th largest key (bins in increasing key order):
// scalars[1] = the bin, [2] = keys in higher bins, [3] = keys in it. Suffix sums over 8 bins per lane.
__device__ __forceinline__ void pick_bin(unsigned need, const Shared& sh) {
  const int lane = threadIdx.x & 31;
  unsigned local = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) local += sh.hist[lane * 8 + i];
  unsigned incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned t = __shfl_down_sync(FULL, incl, d);
    if (lane + d < 32) incl += t;
  }
  unsigned above = incl - local;
#pragma unroll
  for (int i = 7; i >= 0; --i) {
    const unsigned c = sh.hist[lane * 8 + i];
    if (above < need && need <= above + c) {
      sh.scalars[1] = (unsigned)(lane * 8 + i);
      sh.scalars[2] = above;
      sh.scalars[3] = c;
    }
    above += c;
  }
}

// A threshold t with exactly kk keys >= t among a[0, n) when the keys are distinct (1 <= kk <= n),
// at least kk when some are equal (only the zero keys of threads without elements can be).
// MSD radix select: each round splits the active keys on the 8 bits below their highest differing bit.
template <int NT>
__device__ unsigned long long radix_select(const unsigned long long* a, int n, int kk, const Shared& sh) {
  const int tid = threadIdx.x;
  unsigned long long prefix = 0ull, fixed = 0ull;  // fixed: the decided high bits; prefix: their value
  unsigned need = (unsigned)kk;
  while (true) {
    unsigned long long o = 0ull, an = ~0ull;
    for (int i = tid; i < n; i += NT) {
      const unsigned long long k = a[i];
      if ((k & fixed) == prefix) {
        o |= k;
        an &= k;
      }
    }
    block_or_and<NT>(o, an, sh);
    const unsigned long long diff = o ^ an;
    if (diff == 0ull) return an;  // one active key (or equal ones): it is the threshold
    const int h = 63 - __clzll(diff);
    const int shift = h >= 7 ? h - 7 : 0;
    const unsigned dmask = (2u << (h - shift)) - 1u;
    fixed = h == 63 ? 0ull : ~0ull << (h + 1);
    prefix = an & fixed;  // bits above h are common to all active keys
    for (int i = tid; i < 256; i += NT) sh.hist[i] = 0u;
    __syncthreads();
    for (int i = tid; i < n; i += NT) {
      const unsigned long long k = a[i];
      if ((k & fixed) == prefix) atomicAdd(&sh.hist[(unsigned)(k >> shift) & dmask], 1u);
    }
    __syncthreads();
    if (tid < 32) pick_bin(need, sh);
    __syncthreads();
    const unsigned digit = sh.scalars[1], above = sh.scalars[2], in_bin = sh.scalars[3];
    need -= above;
    prefix |= (unsigned long long)digit << shift;
    fixed |= (unsigned long long)dmask << shift;
    if (in_bin == need) return prefix;  // the whole bin is in: everything >= prefix (low bits 0)
  }
}

// top[0, kk) = the keys >= thr of a[0, n) (exactly kk of them), in any order.
template <int NT>
__device__ void gather(const unsigned long long* a, int n, unsigned long long thr, const Shared& sh) {
  if (threadIdx.x == 0) sh.scalars[0] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += NT) {
    const unsigned long long k = a[i];
    if (k >= thr) {
      const unsigned pos = atomicAdd(&sh.scalars[0], 1u);
      if (pos < (unsigned)MAX_K) sh.top[pos] = k;  // exactly kk <= MAX_K keys pass: keys are distinct
    }
  }
  __syncthreads();
}

// Sort top[0, kk) descending (bitonic over the next power of two, padded with zero keys).
template <int NT>
__device__ void sort_top(int kk, const Shared& sh) {
  int p = 1;
  while (p < kk) p <<= 1;
  for (int i = kk + threadIdx.x; i < p; i += NT) sh.top[i] = 0ull;
  __syncthreads();
  for (int k = 2; k <= p; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < p; i += NT) {
        const int l = i ^ j;
        if (l > i) {
          const unsigned long long x = sh.top[i], y = sh.top[l];
          if ((i & k) == 0 ? x < y : x > y) {
            sh.top[i] = y;
            sh.top[l] = x;
          }
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ float row_lse(float m, float s) { return m == neg_inf() ? 0.f : m + logf(s); }

template <int NT>
__device__ void write_row(int K, float m, float s, float* logq, int* ids, const Shared& sh) {
  const float lse = row_lse(m, s);
  for (int i = threadIdx.x; i < K; i += NT) {
    const unsigned long long k = sh.top[i];
    logq[i] = fmaxf(unord32((unsigned)(k >> 32)) - lse, -FLT_MAX_F);
    ids[i] = (int)~(unsigned)k;
  }
}

// ---------------------------------------------------------------- shared by the stream and radix variants
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 16 bytes of logits as raw bits; elements past the end are -inf.
template <typename T>
struct Vec16;
template <>
struct Vec16<unsigned short> {
  static constexpr int N = 8;
  static __device__ __forceinline__ uint4 load_scalar(const unsigned short* p, int n) {
    unsigned h[N];
#pragma unroll
    for (int e = 0; e < N; ++e) h[e] = e < n ? (unsigned)p[e] : 0xff80u;
    return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
  }
  static __device__ __forceinline__ void unpack(const uint4& r, float (&x)[N]) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};
template <>
struct Vec16<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ uint4 load_scalar(const float* p, int n) {
    unsigned w[N];
#pragma unroll
    for (int e = 0; e < N; ++e) w[e] = e < n ? __float_as_uint(p[e]) : 0xff800000u;
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ __forceinline__ void unpack(const uint4& r, float (&x)[N]) {
    x[0] = __uint_as_float(r.x);
    x[1] = __uint_as_float(r.y);
    x[2] = __uint_as_float(r.z);
    x[3] = __uint_as_float(r.w);
  }
};

// Split rows: publish this block's (m, s) (its keys are in its slot ws_keys[row, c] already);
// true in the last of the row's C blocks to arrive, which then holds every block's (m, s) in
// (m, s) (for every thread) and its keys in a[0, *n) (chunk j has min(K, min(chunk, V - j * chunk));
// C * K fit in a),
// and has reset the row's counter for the next launch (and graph replay).
template <int NT>
__device__ bool gather_split(int V, int K, int C, int chunk, int row, int c, float& m, float& s,
                             unsigned long long* ws_keys, float* ws_ms, unsigned* ws_count, unsigned long long* a,
                             int* n, const Shared& sh) {
  __shared__ int is_last;
  const int tid = threadIdx.x;
  if (tid == 0) {
    ws_ms[2 * (row * C + c)] = m;
    ws_ms[2 * (row * C + c) + 1] = s;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(&ws_count[row], 1u) == (unsigned)(C - 1);
  __syncthreads();
  if (!is_last) return false;
  __threadfence();
  // Chunks j < C - 1 are full (kk = min(K, chunk)); all their loads are issued at once.
  const int full = min(K, chunk), last = min(K, V - (C - 1) * chunk), nm = (C - 1) * full + last;
  const unsigned long long* keys = ws_keys + (long long)row * C * K;
  for (int i = tid; i < nm; i += NT) {
    const int j = i / full, e = i - j * full;
    a[i] = __ldcg(keys + (long long)j * K + e);
  }
  m = neg_inf();
  s = 0.f;
  for (int j = tid; j < C; j += NT) lse_combine(m, s, __ldcg(ws_ms + 2 * (row * C + j)), __ldcg(ws_ms + 2 * (row * C + j) + 1));
  if (tid == 0) ws_count[row] = 0u;
  block_lse<NT>(m, s, sh);  // its barriers also publish the keys
  *n = nm;
  return true;
}

// ---------------------------------------------------------------- stream variant
// Each row is cut into C chunks, one block of ST threads per chunk, reading it once from HBM in
// steps of STEP 16-byte vectors (SU per thread, coalesced) and keeping no copy of it. Per step:
//   stats: online max and sum of exponentials per thread (the max from packed bf16x2 compares);
//   filter: a vector whose largest element reaches the block's threshold T goes to a shared buffer
//     of SB vectors (its 16 bytes and its vector key: the key of its largest element);
//   when the buffer could not take another step, it is compacted: T rises to the value of the
//     kk-th largest vector key (a lower bound of the chunk's kk-th largest element: kk distinct
//     elements reach it), and only vectors whose key reaches T stay. The value-only select takes
//     one 8-bit histogram round per byte of the element type (2 for bf16); when ties at that value
//     would leave too many vectors, an exact radix select on the keys keeps exactly kk.
// Invariant: the buffer holds every vector read so far whose key reaches T (and perhaps a few
// below it), so the chunk's kk best elements all lie in it. At the end a last compaction, the
// elements of the kept vectors that reach T (at most 8 per vector) are selected exactly, and the
// chunk ends: sort, or publish its keys and let the row's last block merge (gather_split).
// NaN / +inf: the first pass works on raw values; if any thread's sum came out non-finite the
// block starts over with sanitized values (re-reading its chunk).
constexpr int ST = 256;
constexpr int SU = 4;
constexpr int STEP = ST * SU;
constexpr int SB = 2048;
constexpr int STREAM_MAX_K = 256;

constexpr int SB_ROOM = SB - STEP;  // the buffer is compacted once it holds more than this
// The final candidates go into the data area after the kept vectors: 2 keys per vector there, so
// with nb kept vectors there is room for 2 * SB - 2 * nb >= 8 * nb candidates when nb <= FINAL_MAX.
constexpr int FINAL_MAX = 2 * SB / 10;
static_assert(SB_ROOM >= STREAM_MAX_K && FINAL_MAX >= STREAM_MAX_K, "the buffer must hold kk vectors and a step");

constexpr int RANK_MAX = SB_ROOM / 2;  // candidates ranked directly (the rest go the exact way)

struct StreamShared {
  unsigned long long* keys;  // [SB] vector keys
  uint4* data;               // [SB] the vectors' bytes
  int* holes;                // [SB_ROOM] compaction scratch; at the end it holds
  unsigned long long* rank;  // [RANK_MAX] the candidates to rank, or base.top (the exact path)
  unsigned* count;           // [6]: buffered vectors, two compaction counters, three per-step append counters
  Shared base;
};

// -inf in every element of a 16-byte vector of T.
template <typename T>
__device__ __forceinline__ uint4 neg_inf_vec() {
  const unsigned w = sizeof(T) == 2 ? 0xff80ff80u : 0xff800000u;
  return make_uint4(w, w, w, w);
}

__device__ __forceinline__ unsigned bf16x2_max(unsigned a, unsigned b) {
  unsigned d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));  // a NaN half loses to a number
  return d;
}

// The largest element of a vector as a float, NaN-ignoring (a vector of NaN gives NaN). SAN: the
// elements are sanitized first (so +inf and NaN count as -inf).
template <typename T, bool SAN>
__device__ __forceinline__ float vec_max(const uint4& r) {
  using W = Vec16<T>;
  if (!SAN && sizeof(T) == 2) {
    const unsigned w = bf16x2_max(bf16x2_max(r.x, r.y), bf16x2_max(r.z, r.w));
    return fmaxf(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  float x[W::N];
  W::unpack(r, x);
  float vm = neg_inf();
#pragma unroll
  for (int e = 0; e < W::N; ++e) vm = fmaxf(vm, SAN ? sanitize(x[e]) : x[e]);
  return vm;
}

// The key of a vector: that of its largest element (sanitized, the smaller id among equal ones);
// elements at or past n (chunk-relative) do not count.
template <typename T>
__device__ __forceinline__ unsigned long long vec_key(const uint4& r, int lo, int v, int n) {
  using W = Vec16<T>;
  constexpr int VEC = W::N;
  float x[VEC];
  W::unpack(r, x);
  float vm = neg_inf();
  int vi = 0;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float y = sanitize(x[e]);
    if (v * VEC + e < n && y > vm) {
      vm = y;
      vi = e;
    }
  }
  return make_key(ord32(canon(vm)), lo + v * VEC + vi);
}

// Value of a threshold key as a float for the fast filter (vm >= it <=> the vector's key value
// reaches the threshold's); -inf while the threshold is at or below every key.
__device__ __forceinline__ float thr_value(unsigned long long t) {
  const unsigned o = (unsigned)(t >> 32);
  return o <= ord32(neg_inf()) ? neg_inf() : unord32(o);
}

// Warp-aggregated append: this lane's position among the warp's takers after one atomicAdd on
// *counter per warp (same-address shared atomics serialise). Every lane of the warp calls it.
__device__ __forceinline__ unsigned warp_append(bool take, unsigned* counter) {
  const int lane = threadIdx.x & 31;
  const unsigned bal = __ballot_sync(FULL, take);
  if (bal == 0u) return 0u;
  const int leader = __ffs(bal) - 1;
  unsigned pos = 0u;
  if (lane == leader) pos = atomicAdd(counter, (unsigned)__popc(bal));
  return __shfl_sync(FULL, pos, leader) + __popc(bal & ((1u << lane) - 1u));
}

// warp_append for N ballots of the warp at once (one atomicAdd and one shuffle in all): returns the
// warp's first position; taker j of ballot i goes to that + the takers of ballots < i + j. Every
// lane calls it with the same ballots.
template <int N>
__device__ __forceinline__ unsigned warp_claim(const unsigned (&bal)[N], unsigned* counter) {
  unsigned total = 0u;
#pragma unroll
  for (int i = 0; i < N; ++i) total += __popc(bal[i]);
  if (total == 0u) return 0u;
  unsigned pos = 0u;
  if ((threadIdx.x & 31) == 0) pos = atomicAdd(counter, total);
  return __shfl_sync(FULL, pos, 0);
}

// The largest threshold t whose value bits are those of a key and whose id bits are 0, such that
// at least kk of a[0, n) are >= t (1 <= kk <= n); *count = how many are. One 8-bit histogram round
// per byte of the value (VBITS = 16 for bf16: the low half of their float bits is 0).
template <int VBITS>
__device__ unsigned long long value_select(const unsigned long long* a, int n, int kk, unsigned* count,
                                           const Shared& sh) {
  const int tid = threadIdx.x;
  unsigned long long prefix = 0ull;
  unsigned need = (unsigned)kk, above_all = 0u, in_bin = 0u;
#pragma unroll 1
  for (int r = 0; r < VBITS / 8; ++r) {
    const int shift = 56 - 8 * r;
    const unsigned long long fixed = r == 0 ? 0ull : ~0ull << (shift + 8);
    for (int i = tid; i < 256; i += ST) sh.hist[i] = 0u;
    __syncthreads();
    for (int i = tid; i < n; i += ST) {
      const unsigned long long k = a[i];
      if ((k & fixed) == prefix) atomicAdd(&sh.hist[(unsigned)(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid < 32) pick_bin(need, sh);
    __syncthreads();
    const unsigned above = sh.scalars[2];
    in_bin = sh.scalars[3];
    prefix |= (unsigned long long)sh.scalars[1] << shift;
    need -= above;
    above_all += above;
    if (in_bin == need) break;  // the whole bin is in: lower value bits 0 take all of it
  }
  *count = above_all + in_bin;
  return prefix;
}

// Keep the buffered vectors with key >= thr (exactly n_keep of the first n) in [0, n_keep): the
// ones below it in that range become holes, filled by the ones kept from above it.
__device__ void compact(int n, unsigned long long thr, int n_keep, const StreamShared& ss) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    ss.count[1] = 0u;
    ss.count[2] = 0u;
  }
  __syncthreads();
  for (int i0 = 0; i0 < n_keep; i0 += ST) {
    const int i = i0 + tid;
    const bool hole = i < n_keep && ss.keys[i] < thr;
    const unsigned h = warp_append(hole, &ss.count[1]);
    if (hole) ss.holes[h] = i;
  }
  __syncthreads();
  for (int i0 = n_keep; i0 < n; i0 += ST) {
    const int i = i0 + tid;
    const unsigned long long k = i < n ? ss.keys[i] : 0ull;
    const bool move = i < n && k >= thr;
    const unsigned h = warp_append(move, &ss.count[2]);
    if (move) {
      ss.keys[ss.holes[h]] = k;
      ss.data[ss.holes[h]] = ss.data[i];
    }
  }
  if (tid == 0) ss.count[0] = (unsigned)n_keep;
  __syncthreads();
}

// Shrink the buffer of n > kk vectors to those reaching the value of its kk-th largest key, or to
// exactly kk of them (exact select) if that leaves more than most; returns the new threshold.
// n_kept: how many stay (every thread gets it; also in count[0]).
template <typename T>
__device__ unsigned long long shrink(int n, int kk, int most, const StreamShared& ss, int* n_kept = nullptr) {
  unsigned c;
  unsigned long long t = value_select<sizeof(T) * 8>(ss.keys, n, kk, &c, ss.base);
  if ((int)c > most) {
    t = radix_select<ST>(ss.keys, n, kk, ss.base);
    c = (unsigned)kk;
  }
  compact(n, t, (int)c, ss);
  if (n_kept != nullptr) *n_kept = (int)c;
  return t;
}

// This thread's SU vectors of the step at vector `base` (-inf past the end), held in registers
// (a cp.async ring in shared memory measured slower: benchmarks/README.md, topk).
template <typename T, bool VL>
__device__ __forceinline__ void stream_load(const T* src, int base, int n, int nvec, uint4 (&raw)[SU]) {
  using W = Vec16<T>;
#pragma unroll
  for (int u = 0; u < SU; ++u) {
    const int v = base + u * ST + threadIdx.x;
    if (v >= nvec) raw[u] = neg_inf_vec<T>();
    else if (VL) raw[u] = __ldcs(reinterpret_cast<const uint4*>(src) + v);
    else raw[u] = W::load_scalar(src + v * W::N, n - v * W::N);
  }
}

// One pass over the chunk: (m, s) of this thread's elements, the buffer of candidate vectors and
// the threshold thr (both start empty / 0; the caller zeroes count[0] and count[3]). The buffer's fill
// lives in a register (nb, the same in every thread): step i appends through its own counter
// count[3 + i % 3], starting from 0, at nb + the counter's old value, and thread 0 zeroes the next
// step's counter before the step's barrier. So a warp that runs ahead into step i + 1 never moves
// the counter a slower warp reads after step i's barrier, and a counter is zeroed only once every
// thread has read it (two barriers back). At the end the fill goes to count[0] (published by the
// caller's next barrier).
template <typename T, bool VL, bool SAN>
__device__ void stream_pass(const T* src, int lo, int n, int kk, float& m, float& s, unsigned long long& thr,
                            const StreamShared& ss) {
  using W = Vec16<T>;
  constexpr int VEC = W::N;
  const int tid = threadIdx.x;
  const int nvec = (n + VEC - 1) / VEC;
  m = neg_inf();
  s = 0.f;
  float tf = thr_value(thr);
  uint4 next[SU];  // the next step's vectors, loading while this one is worked on
  stream_load<T, VL>(src, 0, n, nvec, next);
  int nb = 0, ci = 0;  // buffer fill; this step's append counter (count[3 + ci])
#pragma unroll 1
  for (int base = 0; base < nvec; base += STEP) {
    uint4 raw[SU];
#pragma unroll
    for (int u = 0; u < SU; ++u) raw[u] = next[u];
    if (base + STEP < nvec) stream_load<T, VL>(src, base + STEP, n, nvec, next);
    float vm[SU];
    float mx = neg_inf();
#pragma unroll
    for (int u = 0; u < SU; ++u) {
      vm[u] = vec_max<T, SAN>(raw[u]);
      mx = fmaxf(mx, vm[u]);
    }
    if (mx > m) {
      s *= fast_exp2((m - mx) * LOG2E);  // m = -inf: s is 0 and stays 0
      m = mx;
    }
    const float ml = m == neg_inf() ? 0.f : m * LOG2E;  // all -inf so far: every term is 0
    float s2 = 0.f;
#pragma unroll
    for (int u = 0; u < SU; ++u) {
      float x[VEC];
      W::unpack(raw[u], x);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float y = fast_exp2(fmaf(SAN ? sanitize(x[e]) : x[e], LOG2E, -ml));
        if (e & 1) s2 += y;
        else s += y;
      }
    }
    s += s2;
    // The step's takers, all SU vectors of the warp at once: one shared atomic and one shuffle per
    // warp and step, not SU chained atomic / shuffle round trips (an append per vector).
    const int lane = tid & 31;
    unsigned bal[SU];
#pragma unroll
    for (int u = 0; u < SU; ++u) bal[u] = __ballot_sync(FULL, base + u * ST + tid < nvec && vm[u] >= tf);
    unsigned pos = (unsigned)nb + warp_claim(bal, &ss.count[3 + ci]);
    const int cn = ci == 2 ? 0 : ci + 1;
    if (tid == 0) ss.count[3 + cn] = 0u;  // the next step's counter (last read two barriers ago)
#pragma unroll
    for (int u = 0; u < SU; ++u) {
      if (bal[u] >> lane & 1u) {  // < SB: at most SB_ROOM before the step, STEP in it
        const unsigned at = pos + __popc(bal[u] & ((1u << lane) - 1u));
        ss.keys[at] = vec_key<T>(raw[u], lo, base + u * ST + tid, n);
        ss.data[at] = raw[u];
      }
      pos += __popc(bal[u]);
    }
    __syncthreads();
    nb += (int)ss.count[3 + ci];
    ci = cn;
    if (nb > SB_ROOM || (base == 0 && base + STEP < nvec && nb > 2 * kk)) {  // full, or after the first step
#if TOPK_PROFILE
      const long long t0 = clock64();
#endif
      thr = shrink<T>(nb, kk, SB_ROOM, ss, &nb);
      tf = thr_value(thr);
#if TOPK_PROFILE
      if (tid == 0 && blockIdx.y * gridDim.x + blockIdx.x < 8192) topk_prof[8 * (blockIdx.y * gridDim.x + blockIdx.x) + 7] += clock64() - t0;
#endif
    }
  }
  if (tid == 0) ss.count[0] = (unsigned)nb;  // (compact wrote the same when the last step shrank)
}

// The kk best of cand[0, n) (distinct keys, kk <= n) in descending order: a key's place is the
// number of larger ones. Written as keys to dst, or (dst null) as log-probs and ids.
template <int NT>
__device__ void rank_write(const unsigned long long* cand, int n, int kk, unsigned long long* dst, float lse,
                           float* logq, int* ids) {
  for (int i = threadIdx.x; i < n; i += NT) {
    const unsigned long long k = cand[i];
    int r = 0;
#pragma unroll 4
    for (int j = 0; j < n; ++j) r += cand[j] > k;
    if (r < kk) {
      if (dst != nullptr) {
        dst[r] = k;
      } else {
        logq[r] = fmaxf(unord32((unsigned)(k >> 32)) - lse, -FLT_MAX_F);
        ids[r] = (int)~(unsigned)k;
      }
    }
  }
}

template <typename T, bool VL>
__device__ void stream_block(const T* logits, int V, int K, int C, int chunk, float* logq_out, int* ids_out,
                             unsigned long long* ws_keys, float* ws_ms, unsigned* ws_count, const StreamShared& ss) {
  using W = Vec16<T>;
  constexpr int VEC = W::N;
  const int tid = threadIdx.x;
  const int c = blockIdx.x, row = blockIdx.y;
  const int lo = c * chunk;  // < V: the host launches ceil(V / chunk) chunks per row
  const int n = min(chunk, V - lo);
  const int kk = min(K, n);
  const T* src = logits + (long long)row * V + lo;
  const Shared& sh = ss.base;
  TOPK_STAMP(0);
#if TOPK_PROFILE
  if (tid == 0 && blockIdx.y * gridDim.x + blockIdx.x < 8192) topk_prof[8 * (blockIdx.y * gridDim.x + blockIdx.x) + 7] = 0;
#endif
  if (tid == 0) ss.count[0] = ss.count[3] = 0u;
  __syncthreads();
  float m, s;
  unsigned long long thr = 0ull;
  stream_pass<T, VL, false>(src, lo, n, kk, m, s, thr, ss);
  TOPK_STAMP(1);
  if (__syncthreads_or(!(s <= FLT_MAX_F))) {  // a NaN or +inf somewhere in the chunk
    thr = 0ull;
    if (tid == 0) ss.count[0] = ss.count[3] = 0u;
    __syncthreads();
    stream_pass<T, VL, true>(src, lo, n, kk, m, s, thr, ss);
  }
  block_lse<ST>(m, s, sh);  // its barriers also publish the buffer count
  TOPK_STAMP(2);
  const int nb = (int)ss.count[0];
  const long long out_row = (long long)row * K;
  unsigned long long* slot = C == 1 ? nullptr : ws_keys + ((long long)row * C + c) * K;
  // Fast path: the value of the kk-th largest vector key bounds the chunk's kk-th element from
  // below; the elements reaching it (about kk of them unless values tie) are ranked directly.
  unsigned cv;
  const unsigned long long t = nb > kk ? value_select<sizeof(T) * 8>(ss.keys, nb, kk, &cv, sh) : thr;
  TOPK_STAMP(3);
  if (tid == 0) sh.scalars[4] = 0u;
  __syncthreads();
  for (int i0 = 0; i0 < nb; i0 += ST) {
    const int i = i0 + tid;
    const bool in = i < nb && ss.keys[i] >= t;
    if (!__any_sync(FULL, in)) continue;
    const int v = in ? (int)(~(unsigned)ss.keys[i] - (unsigned)lo) / VEC : 0;  // the vector of its largest element
    float x[VEC];
    W::unpack(in ? ss.data[i] : neg_inf_vec<T>(), x);
    // all VEC elements' takers of the warp at once: one atomic and one shuffle per warp and trip
    const int lane = tid & 31;
    unsigned long long kx[VEC];
    unsigned bal[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      kx[e] = make_key(ord32(canon(sanitize(x[e]))), lo + v * VEC + e);
      bal[e] = __ballot_sync(FULL, in && v * VEC + e < n && kx[e] >= t);
    }
    unsigned pos = warp_claim(bal, &sh.scalars[4]);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const unsigned at = pos + __popc(bal[e] & ((1u << lane) - 1u));
      if ((bal[e] >> lane & 1u) && at < (unsigned)RANK_MAX) ss.rank[at] = kx[e];
      pos += __popc(bal[e]);
    }
  }
  __syncthreads();
  const int nc = (int)sh.scalars[4];  // >= kk: kk vectors reach t, each with its largest element
  TOPK_STAMP(4);
  if (nc <= RANK_MAX) {
    rank_write<ST>(ss.rank, nc, kk, slot, row_lse(m, s), logq_out + out_row, ids_out + out_row);
    TOPK_STAMP(5);
  } else {  // many ties at the threshold: exact selects
    int nk = nb;
    unsigned long long thr2 = thr;
    if (nb > kk) {
      thr2 = shrink<T>(nb, kk, FINAL_MAX, ss);
      nk = (int)ss.count[0];
    }
    // The candidates: elements of the kept vectors with key >= thr2, written after them.
    unsigned long long* cand = reinterpret_cast<unsigned long long*>(ss.data + nk);
    if (tid == 0) {
      sh.scalars[4] = 0u;
      sh.scalars[5] = 0u;
    }
    __syncthreads();
    for (int i = tid; i < nk; i += ST) {
      const int v = (int)(~(unsigned)ss.keys[i] - (unsigned)lo) / VEC;
      float x[VEC];
      W::unpack(ss.data[i], x);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const unsigned long long k = make_key(ord32(canon(sanitize(x[e]))), lo + v * VEC + e);
        if (v * VEC + e < n && k >= thr2) cand[atomicAdd(&sh.scalars[4], 1u)] = k;
      }
    }
    __syncthreads();
    const int nx = (int)sh.scalars[4];  // kk <= nx <= VEC * nk
    const unsigned long long thr3 = nx > kk ? radix_select<ST>(cand, nx, kk, sh) : 0ull;
    unsigned long long* dst = C == 1 ? sh.top : slot;
    for (int i = tid; i < nx; i += ST) {
      const unsigned long long k = cand[i];
      if (k >= thr3) dst[atomicAdd(&sh.scalars[5], 1u)] = k;  // exactly kk pass: keys are distinct
    }
    if (C == 1) {
      __syncthreads();
      sort_top<ST>(K, sh);
      write_row<ST>(K, m, s, logq_out + out_row, ids_out + out_row, sh);
    }
  }
  if (C == 1) return;
  int nm;
  if (!gather_split<ST>(V, K, C, chunk, row, c, m, s, ws_keys, ws_ms, ws_count, sh.cand, &nm, sh)) return;
  TOPK_STAMP(6);
  // The row's merge, the same way: value threshold, rank the keys reaching it, else exact.
  const unsigned long long tm = value_select<sizeof(T) * 8>(sh.cand, nm, K, &cv, sh);
  if (cv <= (unsigned)RANK_MAX) {
    if (tid == 0) sh.scalars[4] = 0u;
    __syncthreads();
    for (int i0 = 0; i0 < nm; i0 += ST) {
      const int i = i0 + tid;
      const unsigned long long k = i < nm ? sh.cand[i] : 0ull;
      const bool take = i < nm && k >= tm;
      const unsigned pos = warp_append(take, &sh.scalars[4]);
      if (take) ss.rank[pos] = k;
    }
    __syncthreads();
    rank_write<ST>(ss.rank, (int)cv, K, nullptr, row_lse(m, s), logq_out + out_row, ids_out + out_row);
    return;
  }
  gather<ST>(sh.cand, nm, radix_select<ST>(sh.cand, nm, K, sh), sh);
  sort_top<ST>(K, sh);
  write_row<ST>(K, m, s, logq_out + out_row, ids_out + out_row, sh);
}

__device__ __forceinline__ StreamShared stream_carve() {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ unsigned hist[256];
  __shared__ unsigned long long red[2 * (ST / 32)];
  __shared__ float red_f[2 * (ST / 32)];
  __shared__ unsigned scalars[6];
  __shared__ unsigned count[6];
  __shared__ __align__(16) unsigned long long scratch[SB_ROOM / 2];  // holes, later the top keys
  static_assert(SB_ROOM / 2 >= STREAM_MAX_K, "the top keys share the holes' space");
  StreamShared ss;
  ss.keys = reinterpret_cast<unsigned long long*>(smem_raw);
  ss.data = reinterpret_cast<uint4*>(smem_raw + SB * 8);
  ss.holes = reinterpret_cast<int*>(scratch);
  ss.rank = scratch;
  ss.count = count;
  ss.base.cand = ss.keys;  // the row merge reuses the whole dynamic area
  ss.base.top = scratch;
  ss.base.hist = hist;
  ss.base.red = red;
  ss.base.red_f = red_f;
  ss.base.scalars = scalars;
  return ss;
}

// Dynamic shared memory: the candidate keys, then (top == nullptr) MAX_K keys for the selected ones.
__device__ __forceinline__ Shared carve(int cand_keys, unsigned long long* top) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ unsigned hist[256];
  __shared__ unsigned long long red[2 * WARPS];
  __shared__ float red_f[2 * WARPS];
  __shared__ unsigned scalars[6];
  Shared sh;
  sh.cand = reinterpret_cast<unsigned long long*>(smem_raw);
  sh.top = top != nullptr ? top : sh.cand + cand_keys;
  sh.hist = hist;
  sh.red = red;
  sh.red_f = red_f;
  sh.scalars = scalars;
  return sh;
}

// ---------------------------------------------------------------- radix variant
// Two launches per call (docs/architecture.md section 1, the round's top-k), no block waiting on
// another and no per-block select:
//   hist (grid (C, rows), RT threads, chunks of a multiple of 256 16-byte vectors): one streaming
//     read of each chunk with every thread's loads of a step in flight. Per element: the online
//     max / sum of exponentials (fp32, the same math as the other variants). Per vector: its
//     largest element (sanitized, -0 -> +0) as an order key; the top RB bits of that key are
//     counted in a shared histogram, flushed once per block into the row's global histogram (one
//     atomic per non-zero bin), and per group of 8 consecutive vectors (128 bytes) the largest
//     bin is written to gmax[row, group]. (max, sum) go to ms[row, chunk]. After steps 1, 2, 4,
//     ... the bin of the chunk's own K-th vector key so far becomes a floor below which vectors
//     are not counted: the row's K-th is at or above it, and most shared atomics (which collide:
//     ~12 lanes of a warp on one bin on Zipf rows) are saved.
//   select (grid rows, RT threads): the row's histogram gives the bin T holding the K-th largest
//     vector key: K distinct vectors, hence K elements, have a key >= T's lower edge t, and every
//     element >= t lies in a group whose gmax >= T. Only those groups are re-read (from L2 where
//     the logits fit it; on the bench's Zipf rows ~90 of 2560 bf16 groups at k = 64, ~520 at
//     k = 512, counted with tests/test_topk.py's numpy model of this argument); their elements
//     >= t go to a shared buffer.
//     On overflow (heavy ties at t) the K-th best buffered key raises the threshold and the flagged
//     groups are read again. Then: rank directly (<= RADIX_RANK
//     candidates), or a value-only select and rank, or the exact radix select + bitonic sort.
//     The block also zeroes the row's histogram for the next launch (and graph replay).
// NaN / +inf: a vector whose NaN-propagating max is not finite is sanitized in registers first.
constexpr int RT = 256;
constexpr int RU = 4;           // vectors per thread and step, all loads in flight
constexpr int RB = 12;          // histogram bits: sign, 8 exponent bits, 3 mantissa bits
constexpr int RBINS = 1 << RB;  // 4096
constexpr int RADIX_RANK = MAX_K;  // candidates ranked directly (in sh.top on the value-select path)
constexpr int RWIN = 4096;  // groups listed at once by the select block (16 KB of dynamic shared memory)
static_assert(RT == ST, "value_select strides by ST");
static_assert(RBINS == 16 * RT, "pick_kth_bin: 16 bins per thread");

__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ unsigned bf16x2_max_nan(unsigned a, unsigned b) {
  unsigned d;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The largest element of a vector as a float, NaN if any element is NaN.
template <typename T>
__device__ __forceinline__ float vec_max_nan(const uint4& r) {
  if (sizeof(T) == 2) {
    const unsigned w = bf16x2_max_nan(bf16x2_max_nan(r.x, r.y), bf16x2_max_nan(r.z, r.w));
    return max_nan(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  return max_nan(max_nan(__uint_as_float(r.x), __uint_as_float(r.y)),
                 max_nan(__uint_as_float(r.z), __uint_as_float(r.w)));
}

// The vector with NaN / +inf elements replaced by -inf (bit patterns of T).
template <typename T>
__device__ __forceinline__ uint4 vec_sanitize(const uint4& r) {
  using W = Vec16<T>;
  float x[W::N];
  W::unpack(r, x);
  unsigned w[4];
  if (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = (__float_as_uint(sanitize(x[2 * i])) >> 16) | (__float_as_uint(sanitize(x[2 * i + 1])) & 0xffff0000u);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(sanitize(x[i]));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Vector v of a row (16-byte aligned rows with whole vectors when VL; else element loads, -inf past V).
template <typename T, bool VL>
__device__ __forceinline__ uint4 row_vec(const T* row, int V, int v) {
  using W = Vec16<T>;
  if (VL) return *reinterpret_cast<const uint4*>(row + (long long)v * W::N);
  return W::load_scalar(row + (long long)v * W::N, V - v * W::N);
}

// Thread t of RT holds the counts of bins [16 t, 16 t + 16) of a 4096-bin histogram in h: *out =
// the largest bin b with at least K counts in bins >= b (0 when the total is below K), visible to
// all after the call. warp_sum: RT / 32 words of shared scratch. Two barriers.
__device__ void pick_kth_bin(const unsigned (&h)[16], unsigned K, unsigned* warp_sum, unsigned* out) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned local = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) local += h[i];
  unsigned incl = local;  // suffix sum over the warp's lanes
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned t = __shfl_down_sync(FULL, incl, d);
    if (lane + d < 32) incl += t;
  }
  if (lane == 0) warp_sum[warp] = incl;
  if (tid == 0) *out = 0u;
  __syncthreads();
  unsigned above = incl - local;  // the counts in the bins of higher threads
  for (int w = warp + 1; w < RT / 32; ++w) above += warp_sum[w];
#pragma unroll
  for (int i = 15; i >= 0; --i) {
    if (above < K && K <= above + h[i]) *out = (unsigned)(16 * tid + i);  // one thread
    above += h[i];
  }
  __syncthreads();
}

// hist [RBINS], red_f [2 * RT / 32], scan [RT / 32 + 1]: the kernel's shared memory (one copy for
// both template paths).
template <typename T, bool VL>
__device__ void radix_hist_block(const T* logits, int V, int K, int cvec, float* ms, int ms_stride,
                                 unsigned* ghist, unsigned short* gmax, int g_stride, unsigned* hist,
                                 float* red_f, unsigned* scan) {
  using W = Vec16<T>;
  constexpr int VEC = W::N;
  const int tid = threadIdx.x, lane = tid & 31;
  const int c = blockIdx.x, row = blockIdx.y;
  const int nvec = (V + VEC - 1) / VEC;
  const int v0 = c * cvec;  // < nvec: the host launches ceil(nvec / cvec) chunks per row
  const int n = min(cvec, nvec - v0);
  const T* src = logits + (long long)row * V;
  for (int i = tid; i < RBINS; i += RT) hist[i] = 0u;
  __syncthreads();
  float m = neg_inf(), s = 0.f, s2 = 0.f;
  // Vectors in bins below floor need no count: this chunk alone has K vectors at or above it, so
  // the row's K-th vector key is too (the select block only looks at the counts from its bin up).
  // Raised after steps 1, 2, 4, ... of a chunk of several.
  unsigned floor = 0u;
#pragma unroll 1
  for (int base = 0, step = 1; base < n; base += RT * RU, ++step) {
    uint4 raw[RU];
#pragma unroll
    for (int u = 0; u < RU; ++u) {
      const int v = base + u * RT + tid;
      raw[u] = v < n ? row_vec<T, VL>(src, V, v0 + v) : neg_inf_vec<T>();
    }
#pragma unroll
    for (int u = 0; u < RU; ++u) {
      const int v = base + u * RT + tid;  // v0 + v - lane % 8 is a multiple of 8 (cvec % 256 == 0)
      if (base + u * RT >= n) break;      // uniform: no thread has more
      float vm = vec_max_nan<T>(raw[u]);
      if (!(vm <= FLT_MAX_F)) {  // NaN or +inf in the vector (rare)
        raw[u] = vec_sanitize<T>(raw[u]);
        vm = vec_max_nan<T>(raw[u]);
      }
      const unsigned bin = ord32(canon(vm)) >> (32 - RB);
      if (v < n && bin >= floor) atomicAdd(&hist[bin], 1u);
      unsigned gbin = v < n ? bin : 0u;  // the largest bin of lanes 8j..8j+7: one group of 8 vectors
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) gbin = max(gbin, __shfl_xor_sync(FULL, gbin, o));
      if ((lane & 7) == 0 && v < n) gmax[(long long)row * g_stride + (v0 + v) / 8] = (unsigned short)gbin;
      if (vm > m) {
        s = (s + s2) * fast_exp2((m - vm) * LOG2E);  // m = -inf: s is 0 and stays 0
        s2 = 0.f;
        m = vm;
      }
      const float ml = m == neg_inf() ? 0.f : m * LOG2E;  // all -inf so far: every term is 0
      float x[VEC];
      W::unpack(raw[u], x);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float y = fast_exp2(fmaf(x[e], LOG2E, -ml));
        if (e & 1) s2 += y;
        else s += y;
      }
    }
    if ((step & (step - 1)) == 0 && base + RT * RU < n) {  // uniform
      __syncthreads();  // this step's counts are in
      unsigned h[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // 16-byte reads: 4-byte ones 64 bytes apart would hit 2 banks
        const uint4 q = reinterpret_cast<const uint4*>(hist)[4 * tid + i];
        h[4 * i] = q.x;
        h[4 * i + 1] = q.y;
        h[4 * i + 2] = q.z;
        h[4 * i + 3] = q.w;
      }
      pick_kth_bin(h, (unsigned)K, scan, scan + RT / 32);
      floor = max(floor, scan[RT / 32]);
    }
  }
  s += s2;
  __syncthreads();
  unsigned* rh = ghist + (long long)row * RBINS;
  for (int i = tid; i < RBINS; i += RT) {
    const unsigned h = hist[i];
    if (h) atomicAdd(rh + i, h);
  }
  // block (max, sum): the same reduction as block_lse, on this kernel's own scratch
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float mo = __shfl_xor_sync(FULL, m, o), so = __shfl_xor_sync(FULL, s, o);
    lse_combine(m, s, mo, so);
  }
  if (lane == 0) {
    red_f[tid >> 5] = m;
    red_f[RT / 32 + (tid >> 5)] = s;
  }
  __syncthreads();
  if (tid == 0) {
    m = neg_inf();
    s = 0.f;
    for (int w = 0; w < RT / 32; ++w) lse_combine(m, s, red_f[w], red_f[RT / 32 + w]);
    ms[2 * ((long long)row * ms_stride + c)] = m;
    ms[2 * ((long long)row * ms_stride + c) + 1] = s;
  }
}

// Append every element with key >= thr of the groups (8 vectors, 128 bytes) whose gmax >= tb to
// sh.cand (the count in sh.scalars[0] goes on past CAP). Window by window of RWIN groups: the
// flagged ones are listed in shared memory, then every thread loads RU of their vectors at once.
template <typename T, bool VL>
__device__ void radix_collect(const T* row, int V, const unsigned short* gm, unsigned tb,
                              unsigned long long thr, int* list, const Shared& sh) {
  using W = Vec16<T>;
  constexpr int VEC = W::N;
  const int tid = threadIdx.x, lane = tid & 31;
  const int nvec = (V + VEC - 1) / VEC, ngroups = (nvec + 7) / 8;
  const unsigned lt = (1u << lane) - 1u;
  for (int w0 = 0; w0 < ngroups; w0 += RWIN) {
    const int end = min(ngroups, w0 + RWIN);
    if (tid == 0) sh.scalars[5] = 0u;
    __syncthreads();
    for (int i0 = w0; i0 < end; i0 += RT * 8) {  // 8 groups' bins (16 bytes) per thread
      const int g = i0 + 8 * tid;  // a multiple of 8, and g + 8 <= the row stride of gmax
      const uint4 q = g < end ? *reinterpret_cast<const uint4*>(gm + g) : make_uint4(0u, 0u, 0u, 0u);
      const unsigned w[4] = {q.x, q.y, q.z, q.w};
      unsigned bal[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) bal[j] = __ballot_sync(FULL, g + j < end && (w[j / 2] >> (16 * (j & 1)) & 0xffffu) >= tb);
      unsigned pos = warp_claim(bal, &sh.scalars[5]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (bal[j] >> lane & 1u) list[pos + __popc(bal[j] & lt)] = g + j;
        pos += __popc(bal[j]);
      }
    }
    __syncthreads();
    const int items = 8 * (int)sh.scalars[5];  // vectors of the flagged groups (<= 8 RWIN)
    for (int i0 = 0; i0 < items; i0 += RT * RU) {
      int vv[RU];
      uint4 raw[RU];
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        const int i = i0 + u * RT + tid;
        vv[u] = i < items ? list[i >> 3] * 8 + (i & 7) : nvec;
        raw[u] = vv[u] < nvec ? row_vec<T, VL>(row, V, vv[u]) : neg_inf_vec<T>();
      }
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        if (i0 + u * RT >= items) break;  // uniform
        const int v = vv[u];
        float x[VEC];
        W::unpack(raw[u], x);
        unsigned long long kx[VEC];
        unsigned bal[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          kx[e] = make_key(ord32(canon(sanitize(x[e]))), v * VEC + e);
          bal[e] = __ballot_sync(FULL, v < nvec && v * VEC + e < V && kx[e] >= thr);
        }
        unsigned pos = warp_claim(bal, &sh.scalars[0]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const unsigned at = pos + __popc(bal[e] & lt);
          if ((bal[e] >> lane & 1u) && at < (unsigned)CAP) sh.cand[at] = kx[e];
          pos += __popc(bal[e]);
        }
      }
    }
    __syncthreads();  // the list is rewritten by the next window
  }
}

template <typename T, bool VL>
__device__ void radix_select_block(const T* logits, int V, int K, int C, const float* ms, int ms_stride,
                                   unsigned* ghist, const unsigned short* gmax, int g_stride, float* logq_out,
                                   int* ids_out, const Shared& sh, int* list) {
  constexpr int PER = RBINS / RT;  // bins per thread
  const int tid = threadIdx.x;
  const int row = blockIdx.x;
  const T* src = logits + (long long)row * V;
  // The row's histogram: thread t holds bins [PER t, PER t + PER) in registers and zeroes them in
  // global memory (16-byte pieces: rows of the histogram are 16 KB apart).
  uint4* rh = reinterpret_cast<uint4*>(ghist + (long long)row * RBINS + PER * tid);
  unsigned h[PER];
#pragma unroll
  for (int i = 0; i < PER / 4; ++i) {
    const uint4 q = __ldcg(rh + i);
    h[4 * i] = q.x;
    h[4 * i + 1] = q.y;
    h[4 * i + 2] = q.z;
    h[4 * i + 3] = q.w;
  }
#pragma unroll
  for (int i = 0; i < PER / 4; ++i) rh[i] = make_uint4(0u, 0u, 0u, 0u);
  // The row's (max, sum) from its chunks, loaded while the histogram is (block_lse further down).
  float m = neg_inf(), s = 0.f;
  for (int j = tid; j < C; j += RT)
    lse_combine(m, s, ms[2 * ((long long)row * ms_stride + j)], ms[2 * ((long long)row * ms_stride + j) + 1]);
  // The bin of the K-th vector key (0 when the row has fewer vectors: every element is a
  // candidate). Only the counts from that bin up are complete (see radix_hist_block's floor).
  __shared__ unsigned scan[RT / 32 + 1];
  pick_kth_bin(h, (unsigned)K, scan, scan + RT / 32);
  block_lse<RT>(m, s, sh);
  const unsigned tb = scan[RT / 32];
  const unsigned short* gm = gmax + (long long)row * g_stride;
  unsigned long long thr = (unsigned long long)(tb << (32 - RB)) << 32;
  int n;
  while (true) {
    __syncthreads();  // everyone is done with the buffer and the counter
    if (tid == 0) sh.scalars[0] = 0u;
    __syncthreads();
    radix_collect<T, VL>(src, V, gm, tb, thr, list, sh);
    __syncthreads();
    n = (int)sh.scalars[0];  // >= K: K vectors reach thr with their largest element
    if (n <= CAP) break;
    thr = radix_select<RT>(sh.cand, CAP, K, sh);  // K-th best of those kept: strictly higher
  }
  const long long out_row = (long long)row * K;
  const float lse = row_lse(m, s);
  if (n <= RADIX_RANK) {
    rank_write<RT>(sh.cand, n, K, nullptr, lse, logq_out + out_row, ids_out + out_row);
    return;
  }
  unsigned cv;
  const unsigned long long tv = value_select<sizeof(T) * 8>(sh.cand, n, K, &cv, sh);
  if (cv <= (unsigned)RADIX_RANK) {  // the keys reaching the K-th value: rank those
    if (tid == 0) sh.scalars[4] = 0u;
    __syncthreads();
    for (int i0 = 0; i0 < n; i0 += RT) {
      const int i = i0 + tid;
      const unsigned long long k = i < n ? sh.cand[i] : 0ull;
      const bool take = i < n && k >= tv;
      const unsigned pos = warp_append(take, &sh.scalars[4]);
      if (take) sh.top[pos] = k;
    }
    __syncthreads();
    rank_write<RT>(sh.top, (int)cv, K, nullptr, lse, logq_out + out_row, ids_out + out_row);
    return;
  }
  gather<RT>(sh.cand, n, radix_select<RT>(sh.cand, n, K, sh), sh);  // many ties at the K-th value
  sort_top<RT>(K, sh);
  write_row<RT>(K, m, s, logq_out + out_row, ids_out + out_row, sh);
}

}  // namespace

// Stream variant. grid (C, rows), block 256, dynamic shared memory 2048 * 24 bytes (C * K <= 6144);
// K <= 256, chunk a multiple of 8, C = ceil(V / chunk). vec = 1: rows are 16-byte aligned and
// V % (16 / element size) == 0. C > 1: ws_keys [rows, >= C, K], ws_ms [rows, >= C, 2], ws_count [rows]
// zeroed once (reset by the kernel).
extern "C" __global__ void __launch_bounds__(ST, TOPK_STREAM_BLOCKS) topk_stream_bf16_kernel(
    const unsigned short* __restrict__ logits, int V, int K, int C, int chunk, int vec, float* __restrict__ logq,
    int* __restrict__ ids, unsigned long long* ws_keys, float* ws_ms, unsigned* ws_count) {
  const StreamShared ss = stream_carve();
  if (vec) stream_block<unsigned short, true>(logits, V, K, C, chunk, logq, ids, ws_keys, ws_ms, ws_count, ss);
  else stream_block<unsigned short, false>(logits, V, K, C, chunk, logq, ids, ws_keys, ws_ms, ws_count, ss);
}

extern "C" __global__ void __launch_bounds__(ST, TOPK_STREAM_BLOCKS) topk_stream_f32_kernel(
    const float* __restrict__ logits, int V, int K, int C, int chunk, int vec, float* __restrict__ logq,
    int* __restrict__ ids, unsigned long long* ws_keys, float* ws_ms, unsigned* ws_count) {
  const StreamShared ss = stream_carve();
  if (vec) stream_block<float, true>(logits, V, K, C, chunk, logq, ids, ws_keys, ws_ms, ws_count, ss);
  else stream_block<float, false>(logits, V, K, C, chunk, logq, ids, ws_keys, ws_ms, ws_count, ss);
}

// Radix variant, launch 1 of 2. grid (C, rows), block 256, no dynamic shared memory; cvec
// (16-byte vectors per chunk) a multiple of 256, C = ceil(ceil(V / VEC) / cvec), VEC = 16 / element
// size. vec = 1: rows are 16-byte aligned and V % VEC == 0. ms [rows, >= C, 2] (row stride
// ms_stride chunks), ghist [rows, 4096] uint32 zero before (the select launch zeroes it again),
// gmax [rows, g_stride] uint16, g_stride >= ceil(ceil(V / VEC) / 8) and a multiple of 8. K: the
// select launch's (bins below a chunk's own K-th vector key are not counted in full).
extern "C" __global__ void __launch_bounds__(RT, 4) topk_radix_hist_bf16_kernel(
    const unsigned short* __restrict__ logits, int V, int K, int cvec, int vec, float* __restrict__ ms, int ms_stride,
    unsigned* __restrict__ ghist, unsigned short* __restrict__ gmax, int g_stride) {
  __shared__ __align__(16) unsigned hist[RBINS];
  __shared__ float red_f[2 * (RT / 32)];
  __shared__ unsigned scan[RT / 32 + 1];
  if (vec) radix_hist_block<unsigned short, true>(logits, V, K, cvec, ms, ms_stride, ghist, gmax, g_stride, hist, red_f, scan);
  else radix_hist_block<unsigned short, false>(logits, V, K, cvec, ms, ms_stride, ghist, gmax, g_stride, hist, red_f, scan);
}

extern "C" __global__ void __launch_bounds__(RT, 4) topk_radix_hist_f32_kernel(
    const float* __restrict__ logits, int V, int K, int cvec, int vec, float* __restrict__ ms, int ms_stride,
    unsigned* __restrict__ ghist, unsigned short* __restrict__ gmax, int g_stride) {
  __shared__ __align__(16) unsigned hist[RBINS];
  __shared__ float red_f[2 * (RT / 32)];
  __shared__ unsigned scan[RT / 32 + 1];
  if (vec) radix_hist_block<float, true>(logits, V, K, cvec, ms, ms_stride, ghist, gmax, g_stride, hist, red_f, scan);
  else radix_hist_block<float, false>(logits, V, K, cvec, ms, ms_stride, ghist, gmax, g_stride, hist, red_f, scan);
}

// Radix variant, launch 2 of 2 (after the hist launch on the same stream). grid rows, block 256,
// dynamic shared memory (TOPK_CAP + 512) * 8 + RWIN * 4 bytes; the arguments as for the hist
// launch, K <= 512.
extern "C" __global__ void __launch_bounds__(RT, 2) topk_radix_select_bf16_kernel(
    const unsigned short* __restrict__ logits, int V, int K, int C, int vec, const float* __restrict__ ms,
    int ms_stride, unsigned* __restrict__ ghist, const unsigned short* __restrict__ gmax, int g_stride,
    float* __restrict__ logq, int* __restrict__ ids) {
  const Shared sh = carve(CAP, nullptr);
  int* list = reinterpret_cast<int*>(sh.top + MAX_K);
  if (vec) radix_select_block<unsigned short, true>(logits, V, K, C, ms, ms_stride, ghist, gmax, g_stride, logq, ids, sh, list);
  else radix_select_block<unsigned short, false>(logits, V, K, C, ms, ms_stride, ghist, gmax, g_stride, logq, ids, sh, list);
}

extern "C" __global__ void __launch_bounds__(RT, 2) topk_radix_select_f32_kernel(
    const float* __restrict__ logits, int V, int K, int C, int vec, const float* __restrict__ ms, int ms_stride,
    unsigned* __restrict__ ghist, const unsigned short* __restrict__ gmax, int g_stride, float* __restrict__ logq,
    int* __restrict__ ids) {
  const Shared sh = carve(CAP, nullptr);
  int* list = reinterpret_cast<int*>(sh.top + MAX_K);
  if (vec) radix_select_block<float, true>(logits, V, K, C, ms, ms_stride, ghist, gmax, g_stride, logq, ids, sh, list);
  else radix_select_block<float, false>(logits, V, K, C, ms, ms_stride, ghist, gmax, g_stride, logq, ids, sh, list);
}
