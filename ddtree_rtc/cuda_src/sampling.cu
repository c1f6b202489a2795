// Argmax and seeded temperature / top-p sampling over the vocabulary. One block per row.
//
// Rules shared bit for bit with ddtree_rtc/reference/sampling.py:
//   argmax: ties -> smallest index; NaN is never chosen; a row of only NaN gives -1.
//   sample: T <= 0 (or NaN) -> argmax. z = l * fl(1/T); m = max z over non-NaN; a non-finite m
//     (all NaN / all -inf / some z = +inf) -> argmax of the raw row. x = m - z >= 0 and its float
//     bits `key` order tokens by probability. E = floor(exp(-x) * 2^32) with our own exp (fixed
//     point, so block sums are exact and order-free). With top_p < 1 the nucleus is
//     {key <= key*}, key* the smallest key whose mass(key_j <= key*) >= max(1, ceil(top_p * S));
//     ties at the threshold are therefore included. The token is argmax over the nucleus of
//     z + g, g = -log(-log(u)) (our own log), u from a SplitMix64-style hash of
//     (seed, offset, row, token); score ties -> smallest index.
// All float steps that the reference repeats use __f*_rn intrinsics: no FMA contraction, so the
// GPU and numpy round identically. key* is found by radix select over the key bits with fixed-point
// mass histograms (no sort): level 0 spans x in [2^-11, 32) at 128 bins per octave, each next level
// splits the chosen bin into <= 2048 bins until one key is left.
#include "common.cuh"

namespace {

constexpr int THREADS = 512;  // the wrappers launch exactly this many
constexpr int LIGHT = 4;  // loads in flight per thread in passes that only compare
constexpr int HEAVY = 1;  // passes with exp/log per token are compute bound: keep the code small
constexpr int NB = 2048;      // histogram bins per radix level
constexpr int BINS_PER_THREAD = NB / THREADS;
constexpr unsigned LEVEL0_BASE = 0x3A010000u;  // key of x = 2^-11 * (1 + 1/128)
constexpr int LEVEL0_SHIFT = 16;               // 128 bins per octave; bin NB-1 starts at x = 32
constexpr unsigned KEY_INF = 0x7F800000u;
constexpr unsigned FULL = 0xffffffffu;

// Gumbel noise lies in [G_MIN, G_MAX] (true range [-2.8115, 16.636]); used only to skip tokens.
constexpr float G_MAX = 17.0f;
constexpr float G_MIN = -3.0f;

// exp / log constants (hex floats, mirrored by the reference; a test keeps them in sync)
constexpr float C_LOG2E = 0x1.715476p+0f;
constexpr float C_LN2_HI = 0x1.62e4p-1f;  // 17 significant bits: n * LN2_HI is exact
constexpr float C_LN2_LO = 0x1.7f7d1cp-20f;
constexpr float C_INV2 = 0x1p-1f;
constexpr float C_INV6 = 0x1.555556p-3f;
constexpr float C_INV24 = 0x1.555556p-5f;
constexpr float C_INV120 = 0x1.111112p-7f;
constexpr float C_INV720 = 0x1.6c16c2p-10f;
constexpr float C_INV5040 = 0x1.a01a02p-13f;
constexpr float C_LN2 = 0x1.62e43p-1f;
constexpr float C_THIRD = 0x1.555556p-2f;
constexpr float C_FIFTH = 0x1.99999ap-3f;
constexpr float C_SEVENTH = 0x1.24924ap-3f;
constexpr float C_NINTH = 0x1.c71c72p-4f;
constexpr unsigned SQRT2_BITS = 0x3FB504F3u;
constexpr unsigned long long GAMMA = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// exp(-x) * 2^32 truncated, for x >= 0; 0 from x = 32 on (the true value is < 1 from x = 22.2).
// Cody-Waite reduction, degree-7 Taylor polynomial, every step rounded as in numpy.
__device__ __forceinline__ unsigned long long fixed_exp_neg(float x) {
  if (!(x < 32.f)) return 0ull;
  const float nf = rintf(__fmul_rn(x, C_LOG2E));
  const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(nf, C_LN2_HI)), __fmul_rn(nf, C_LN2_LO));
  const float t = -r;
  float p = C_INV5040;
  p = __fadd_rn(__fmul_rn(p, t), C_INV720);
  p = __fadd_rn(__fmul_rn(p, t), C_INV120);
  p = __fadd_rn(__fmul_rn(p, t), C_INV24);
  p = __fadd_rn(__fmul_rn(p, t), C_INV6);
  p = __fadd_rn(__fmul_rn(p, t), C_INV2);
  p = __fadd_rn(__fmul_rn(p, t), 1.f);
  p = __fadd_rn(__fmul_rn(p, t), 1.f);
  const int n = (int)nf;  // 0..46
  const float y = __fmul_rn(p, __uint_as_float((unsigned)(127 - n) << 23));
  return __float2ull_rz(__fmul_rn(y, 4294967296.f));
}

// Natural log of a positive normal float: 2 * atanh((f-1)/(f+1)) series, f in [sqrt(1/2), sqrt(2)).
__device__ __forceinline__ float log_pos(float v) {
  const unsigned bits = __float_as_uint(v);
  int e = (int)(bits >> 23) - 127;
  unsigned fb = (bits & 0x7FFFFFu) | 0x3F800000u;
  float f = __uint_as_float(fb);
  if (fb > SQRT2_BITS) {
    f = __fmul_rn(f, 0.5f);
    e += 1;
  }
  const float s = __fdiv_rn(__fsub_rn(f, 1.f), __fadd_rn(f, 1.f));
  const float s2 = __fmul_rn(s, s);
  float q = __fadd_rn(__fmul_rn(s2, C_NINTH), C_SEVENTH);
  q = __fadd_rn(__fmul_rn(q, s2), C_FIFTH);
  q = __fadd_rn(__fmul_rn(q, s2), C_THIRD);
  q = __fmul_rn(q, s2);
  const float t = __fadd_rn(s, s);
  return __fadd_rn(__fmul_rn((float)e, C_LN2), __fadd_rn(t, __fmul_rn(t, q)));
}

__device__ __forceinline__ float gumbel(unsigned long long row_key, int token) {
  const unsigned long long h = mix64(row_key + (unsigned long long)(token + 1) * GAMMA);
  const unsigned k = (unsigned)(h >> 41);                          // 23 random bits
  const float u = __fmul_rn((float)(2u * k + 1u), 0x1p-24f);      // exact, in (0, 1)
  return -log_pos(-log_pos(u));
}

__device__ __forceinline__ float elem_f32(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
__device__ __forceinline__ float elem_f32(float v) { return v; }

template <typename T>
__device__ __forceinline__ void unpack(const uint4& q, float* v);
template <>
__device__ __forceinline__ void unpack<unsigned short>(const uint4& q, float* v) {
  const unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = __uint_as_float(w[j] << 16);
    v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
}
template <>
__device__ __forceinline__ void unpack<float>(const uint4& q, float* v) {
  v[0] = __uint_as_float(q.x);
  v[1] = __uint_as_float(q.y);
  v[2] = __uint_as_float(q.z);
  v[3] = __uint_as_float(q.w);
}

// Calls f(index, value, valid) for every logit of the row, in increasing index order per thread.
// The trip count is uniform over the block and every lane calls f (valid=false past the end), so
// f may use full-warp collectives.
template <typename T, bool VEC, int UNROLL, typename F>
__device__ __forceinline__ void scan_row(const T* row, int V, F&& f) {
  constexpr int W = VEC ? int(16 / sizeof(T)) : 1;
  const int n = V / W;
  for (int base = 0; base < n; base += THREADS * UNROLL) {
    if constexpr (VEC) {
      uint4 q[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const int u = base + k * THREADS + (int)threadIdx.x;
        q[k] = u < n ? reinterpret_cast<const uint4*>(row)[u] : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const int u = base + k * THREADS + (int)threadIdx.x;
        float v[W];
        unpack<T>(q[k], v);
#pragma unroll
        for (int w = 0; w < W; ++w) f(u * W + w, v[w], u < n);
      }
    } else {
      T q[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const int u = base + k * THREADS + (int)threadIdx.x;
        q[k] = u < n ? row[u] : T(0);
      }
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const int u = base + k * THREADS + (int)threadIdx.x;
        f(u, elem_f32(q[k]), u < n);
      }
    }
  }
}

// (value, index) order: a valid index beats none; then larger value; then smaller index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

struct Scratch {
  float val[32];
  int idx[32];
  unsigned long long u64[32];
  unsigned long long hist[NB];
  unsigned long long before;
  int bin;
};

// Block-wide best (value, index); every thread gets it.
__device__ __forceinline__ int block_best(float v, int i, Scratch& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL, v, o);
    const int oi = __shfl_xor_sync(FULL, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  __syncthreads();
  if (lane == 0) s.val[warp] = v, s.idx[warp] = i;
  __syncthreads();
  v = lane < THREADS / 32 ? s.val[lane] : 0.f;
  i = lane < THREADS / 32 ? s.idx[lane] : -1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL, v, o);
    const int oi = __shfl_xor_sync(FULL, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  return i;
}

template <typename T, bool VEC>
__device__ int argmax_row(const T* row, int V, Scratch& s) {
  float bv = 0.f;
  int bi = -1;
  scan_row<T, VEC, LIGHT>(row, V, [&](int i, float v, bool ok) {
    if (ok && !isnan(v) && (bi < 0 || v > bv)) bv = v, bi = i;
  });
  return block_best(bv, bi, s);
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

// Exclusive prefix over the block (thread order) and the block total.
__device__ __forceinline__ unsigned long long block_scan_u64(unsigned long long v, unsigned long long& total,
                                                             Scratch& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(FULL, inc, o);
    if (lane >= o) inc += t;
  }
  __syncthreads();
  if (lane == 31) s.u64[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = lane < THREADS / 32 ? s.u64[lane] : 0ull;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long t = __shfl_up_sync(FULL, w, o);
      if (lane >= o) w += t;
    }
    s.u64[lane] = w;
  }
  __syncthreads();
  total = s.u64[THREADS / 32 - 1];
  return (warp > 0 ? s.u64[warp - 1] : 0ull) + inc - v;
}

// Adds e to hist[bin] for lanes with take; a warp whose lanes all hit one bin adds once
// (a row of equal logits would otherwise serialise every atomic on one address).
__device__ __forceinline__ void hist_add(unsigned long long* hist, bool take, unsigned bin,
                                         unsigned long long e) {
  const unsigned key = take ? bin : 0xFFFFFFFFu;
  int same;
  __match_all_sync(FULL, key, &same);
  if (same) {
    if (take) {
      e = warp_sum_u64(e);
      if ((threadIdx.x & 31) == 0) atomicAdd(&hist[bin], e);
    }
  } else if (take) {
    atomicAdd(&hist[bin], e);
  }
}

// key* (see the header) by radix select over keys in [0, KEY_INF].
template <typename T, bool VEC>
__device__ unsigned nucleus_threshold(const T* row, int V, float inv_t, float m, float top_p, Scratch& s) {
  unsigned clo = 0u, chi = KEY_INF;
  long long base = LEVEL0_BASE;
  int shift = LEVEL0_SHIFT;
  unsigned long long above = 0ull, target = 0ull;
  for (int level = 0; level < 8; ++level) {
    for (int b = threadIdx.x; b < NB; b += THREADS) s.hist[b] = 0ull;
    __syncthreads();
    scan_row<T, VEC, HEAVY>(row, V, [&](int, float l, bool ok) {
      bool take = false;
      unsigned bin = 0u;
      unsigned long long e = 0ull;
      if (ok && !isnan(l)) {
        const float x = __fsub_rn(m, __fmul_rn(l, inv_t));
        const unsigned key = __float_as_uint(x);
        if (!isnan(x) && key >= clo && key <= chi) {
          e = fixed_exp_neg(x);
          const long long d = ((long long)key - base) >> shift;
          bin = (unsigned)(d < 0 ? 0 : (d >= NB ? NB - 1 : d));
          take = e != 0ull;
        }
      }
      hist_add(s.hist, take, bin, e);
    });
    __syncthreads();
    unsigned long long mine = 0ull;
#pragma unroll
    for (int j = 0; j < BINS_PER_THREAD; ++j) mine += s.hist[threadIdx.x * BINS_PER_THREAD + j];
    unsigned long long total;
    unsigned long long run = above + block_scan_u64(mine, total, s);
    if (level == 0) {
      const double want = ceil(__dmul_rn((double)top_p, (double)total));
      target = want < 1.0 ? 1ull : (unsigned long long)want;
    }
#pragma unroll
    for (int j = 0; j < BINS_PER_THREAD; ++j) {
      const int b = threadIdx.x * BINS_PER_THREAD + j;
      const unsigned long long h = s.hist[b];
      if (run < target && run + h >= target) s.bin = b, s.before = run;
      run += h;
    }
    __syncthreads();
    const long long b = s.bin;
    above = s.before;
    const long long lo = b == 0 ? (long long)clo : base + (b << shift);
    const long long hi = b == NB - 1 ? (long long)chi : base + ((b + 1) << shift) - 1;
    clo = (unsigned)(lo > (long long)clo ? lo : (long long)clo);
    chi = (unsigned)(hi < (long long)chi ? hi : (long long)chi);
    if (clo == chi) break;
    base = clo;
    shift = 0;
    while ((((long long)chi - (long long)clo) >> shift) >= NB) ++shift;
  }
  return clo;
}

template <typename T, bool VEC>
__device__ int sample_row(const T* row, int V, float temp, float top_p, unsigned long long row_key,
                          Scratch& s) {
  if (!(temp > 0.f)) return argmax_row<T, VEC>(row, V, s);
  const float inv_t = __fdiv_rn(1.f, temp);
  float mx = -__int_as_float(0x7f800000);
  scan_row<T, VEC, LIGHT>(row, V, [&](int, float l, bool ok) {
    if (ok && !isnan(l)) {
      const float z = __fmul_rn(l, inv_t);
      if (!isnan(z)) mx = fmaxf(mx, z);
    }
  });
  const float m = ddt::block_max(mx, s.val);
  if (!isfinite(m)) return argmax_row<T, VEC>(row, V, s);
  const bool filter = top_p < 1.f;
  const unsigned thr = filter ? nucleus_threshold<T, VEC>(row, V, inv_t, m, top_p, s) : KEY_INF;
  const float floor_score = __fadd_rn(m, G_MIN);  // the max token scores at least this
  float best = -__int_as_float(0x7f800000);
  int bi = -1;
  scan_row<T, VEC, HEAVY>(row, V, [&](int i, float l, bool ok) {
    if (!ok || isnan(l)) return;
    const float z = __fmul_rn(l, inv_t);
    if (isnan(z)) return;
    if (filter && __float_as_uint(__fsub_rn(m, z)) > thr) return;
    const float bound = __fadd_rn(z, G_MAX);
    if (bound < best || bound < floor_score) return;
    const float score = __fadd_rn(z, gumbel(row_key, i));
    if (bi < 0 || score > best) best = score, bi = i;
  });
  return block_best(best, bi, s);
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(const void* logits, long long row_stride) {
  return reinterpret_cast<const T*>(logits) + (long long)blockIdx.x * row_stride;
}

}  // namespace

// logits: [B, V] bf16 (uint16 bits) or fp32 with row stride `row_stride` (elements); out: int32 [B].
// vec: rows and base are 16-byte aligned and V is a multiple of 16 bytes. Grid (B), block 512.
extern "C" __global__ void __launch_bounds__(THREADS, 1) argmax_kernel(const void* logits, long long row_stride,
                                                                       int V, int is_bf16, int vec, int* out) {
  __shared__ Scratch s;
  int r;
  if (is_bf16) {
    const unsigned short* row = row_ptr<unsigned short>(logits, row_stride);
    r = vec ? argmax_row<unsigned short, true>(row, V, s) : argmax_row<unsigned short, false>(row, V, s);
  } else {
    const float* row = row_ptr<float>(logits, row_stride);
    r = vec ? argmax_row<float, true>(row, V, s) : argmax_row<float, false>(row, V, s);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = r;
}

// temps / top_ps: per-row fp32 arrays, or null to use the scalars temp / top_p. keys: per-row
// stream keys (the engine's (seed, request, position) keys), or null to derive them from
// (seed, offset, row).
extern "C" __global__ void __launch_bounds__(THREADS, 1) sample_kernel(
    const void* logits, long long row_stride, int V, int is_bf16, int vec, const float* temps, float temp,
    const float* top_ps, float top_p, unsigned long long seed, unsigned long long offset,
    const unsigned long long* keys, int* out) {
  __shared__ Scratch s;
  const float t = temps ? temps[blockIdx.x] : temp;
  const float p = top_ps ? top_ps[blockIdx.x] : top_p;
  const unsigned long long row_key =
      keys ? keys[blockIdx.x] : mix64(mix64(mix64(seed) ^ offset) + (blockIdx.x + 1ull) * GAMMA);
  int r;
  if (is_bf16) {
    const unsigned short* row = row_ptr<unsigned short>(logits, row_stride);
    r = vec ? sample_row<unsigned short, true>(row, V, t, p, row_key, s)
            : sample_row<unsigned short, false>(row, V, t, p, row_key, s);
  } else {
    const float* row = row_ptr<float>(logits, row_stride);
    r = vec ? sample_row<float, true>(row, V, t, p, row_key, s) : sample_row<float, false>(row, V, t, p, row_key, s);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = r;
}
