// GQA attention of the DFlash block-diffusion drafter over a paged K/V cache.
//
// Request b drafts a block of Q query rows (Q <= 16) that attend non-causally, with no mask, over
//   keys = [context rows start .. len-1 of the paged cache ; the block's own Q rows (k_block / v_block)]
// Query head h uses kv head h / G (G = Hq / Hkv). Per query row: s_j = scale * q.k_j,
// o = sum_j softmax(s)_j v_j, fp32 softmax and accumulation, one bf16 rounding at the end.
//
// Grid (B * Hkv, m_tiles, splits), 128 threads (4 warps). A CTA owns one (request, kv head) and a
// tile of BM = 64 query rows of it: row m = qi * G + g is block row qi, query head kvh * G + g (all
// Q * G rows of a kv head share its keys; m_tiles = ceil(Q * G / 64), one for Kimi's 8 x 8). Warp w
// owns tile rows 16w .. 16w+15 (FlashAttention-2 layout: S, the online softmax and P stay in the
// warp's registers, no cross-warp exchange). Keys stream through shared memory in chunks of BN = 64
// rows (K and V, cp.async, double buffered). The context window [start, len) is cut into 64-row
// chunks and the chunks are dealt to the `splits` CTAs of the (request, kv head) in equal runs (from
// the device-side lengths: the host picks `splits` from shapes only); the LAST split also takes the
// block's own K/V rows as one extra chunk. A split with nothing to do writes an empty partial.
// splits == 1: the CTA writes bf16 out directly. Otherwise it writes its fp32 output normalised by
// its own sum and its log2-sum-exp to the workspace, and gqa_attention_merge_kernel combines them.
//
// Only context rows p in [start, min(len, capacity)) are looked up in the page table, so entries
// past the context (the engine's PAGE_SENTINEL) and before the window are never dereferenced; rows
// of a chunk past the end are zero-filled without a read and masked.
//
// Tensor cores: mma.sync m16n8k16, bf16 in, fp32 accumulate. Fragments (g = lane/4, tq = lane%4):
//   A 16x16 (row-major)  a0 = (g, 2tq..2tq+1)  a1 = (g+8, 2tq..)  a2 = (g, 8+2tq..)  a3 = (g+8, 8+2tq..)
//   B 16x8  (k x n)      b0 = (k 2tq..2tq+1, n g)   b1 = (k 8+2tq.., n g)
//   C 16x8               c0,c1 = (g, 2tq..2tq+1)    c2,c3 = (g+8, 2tq..2tq+1)
// S's C fragments of two adjacent n8 tiles are exactly P's A fragment of one k16 step, so P goes
// from the S accumulators to the P.V mma without shared memory. Shared tiles are row-major with the
// 16-byte chunks XOR-swizzled by (row & 7) (conflict-free ldmatrix). Scores are kept in log2 units.
#include "common.cuh"
#include "warp_mma.cuh"

using namespace ddt;

namespace {

constexpr int BM = 64;       // query rows per CTA
constexpr int BN = 64;       // keys per chunk
constexpr int NW = 4;        // warps
constexpr int THREADS = 32 * NW;
constexpr int SNT = BN / 8;  // n8 tiles of S per warp


// Two floats as a bf16 pair, the first in the low half (the lower column / k index).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// Byte offset of 16-byte chunk c of row r in a tile with CH chunks per row (swizzled by row & 7).
template <int CH>
__device__ __forceinline__ unsigned swz(int r, int c) {
  static_assert(CH % 8 == 0, "swizzle needs a multiple of 8 chunks per row");
  return static_cast<unsigned>((r * CH + (c ^ (r & 7))) * 16);
}

// Chunks [c0, c1) of a window of n_rows context rows for split s of `splits`: equal runs of
// ceil(chunks / splits). Mirrored by split_chunks() in ddtree_rtc/kernels/gqa_attention.py.
__device__ __forceinline__ void split_chunks(int n_rows, int splits, int s, int& c0, int& c1) {
  const int chunks = (n_rows + BN - 1) / BN;
  const int per = (chunks + splits - 1) / splits;
  c0 = min(s * per, chunks);
  c1 = min(c0 + per, chunks);
}

template <int D>
struct Tile {
  static constexpr int CH = D / 8;          // 16-byte chunks per row
  static constexpr int KSTEPS = D / 16;     // k16 steps of Q.K^T
  static constexpr int ONT = D / 8;         // n8 tiles of O per warp
  static constexpr unsigned Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  // Shared memory (bytes), mirrored by smem_bytes() in ddtree_rtc/kernels/gqa_attention.py:
  // Q [64][D], then 2 stages of (K [64][D], V [64][D]), all bf16.
  static constexpr int SMEM = Q_BYTES + 4 * KV_BYTES;
  static constexpr int COPY_ROWS = THREADS / CH;  // rows one pass of the block copies
  static_assert(THREADS % CH == 0 && BN % COPY_ROWS == 0 && BM % COPY_ROWS == 0, "bad copy layout");
};

// K and V rows of one chunk into a stage: chunk `idx` < n_ctx_chunks is context rows
// start + idx*BN .. (through the page table, only rows < len), otherwise the block's own Q rows.
template <int D>
__device__ __forceinline__ void load_chunk(unsigned k_dst, unsigned v_dst, int idx, int n_ctx_chunks,
                                           const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                           const int* __restrict__ pt, int page_size, int start, int len,
                                           const bf16* __restrict__ k_blk, const bf16* __restrict__ v_blk,
                                           int nq, int kv_stride) {
  using T = Tile<D>;
  const int c = threadIdx.x % T::CH, r0 = threadIdx.x / T::CH;
  const bool ctx = idx < n_ctx_chunks;
  const int base = start + idx * BN;
#pragma unroll 1
  for (int j = 0; j < BN / T::COPY_ROWS; ++j) {
    const int r = r0 + j * T::COPY_ROWS;
    long long off = 0;
    bool ok;
    if (ctx) {
      const int pos = base + r;
      ok = pos < len;
      if (ok) off = ((long long)__ldg(pt + pos / page_size) * page_size + pos % page_size) * kv_stride;
    } else {
      ok = r < nq;
      off = (long long)r * kv_stride;  // block row r of this (request, kv head); unused when !ok
    }
    const bf16* ks = ctx ? k_cache : k_blk;
    const bf16* vs = ctx ? v_cache : v_blk;
    cp_async16(k_dst + swz<T::CH>(r, c), ks + (ok ? off : 0) + c * 8, ok);
    cp_async16(v_dst + swz<T::CH>(r, c), vs + (ok ? off : 0) + c * 8, ok);
  }
}

template <int D>
__device__ __forceinline__ void gqa_body(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                                         const bf16* __restrict__ v_cache, const int* __restrict__ page_table,
                                         const int* __restrict__ context_lens,
                                         const int* __restrict__ context_starts, const bf16* __restrict__ k_block,
                                         const bf16* __restrict__ v_block, int nq, int hq, int hkv,
                                         int page_size, int max_pages, float scale_log2, bf16* __restrict__ out,
                                         float* __restrict__ o_part, float* __restrict__ lse_part) {
  using T = Tile<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned q_base = smem_u32(smem), kv_base = q_base + T::Q_BYTES;

  const int bh = blockIdx.x, b = bh / hkv, kvh = bh - b * hkv;
  const int group = hq / hkv, rows = nq * group, m0 = blockIdx.y * BM;
  const int splits = gridDim.z, split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;

  // The window, clamped to the page table's capacity (the host checks only shapes).
  const int cap = max_pages * page_size;
  const int len = min(max(context_lens[b], 0), cap);
  const int start = context_starts ? min(max(context_starts[b], 0), len) : 0;
  int c0, c1;
  split_chunks(len - start, splits, split, c0, c1);
  const bool last = split == splits - 1;
  const int n_chunks = c1 - c0 + (last ? 1 : 0);

  const int* pt = page_table + (long long)b * max_pages;
  const int kv_stride = hkv * D;  // elements between consecutive rows of one kv head
  const bf16* kc = k_cache + (long long)kvh * D;
  const bf16* vc = v_cache + (long long)kvh * D;
  const bf16* kb = k_block + ((long long)b * nq * hkv + kvh) * D;
  const bf16* vb = v_block + ((long long)b * nq * hkv + kvh) * D;
  const int n_ctx_chunks = c1;  // chunk indices are absolute within the window

  // Q tile: row m -> q[b, m / group, kvh * group + m % group]; rows past Q * G zero-filled.
  {
    const int c = threadIdx.x % T::CH;
#pragma unroll
    for (int j = 0; j < BM / T::COPY_ROWS; ++j) {
      const int r = threadIdx.x / T::CH + j * T::COPY_ROWS, m = m0 + r;
      const bool ok = m < rows;
      const long long off = ok ? (((long long)b * nq + m / group) * hq + kvh * group + m % group) * D : 0;
      cp_async16(q_base + swz<T::CH>(r, c), q + off + c * 8, ok);
    }
  }
  if (n_chunks > 0)
    load_chunk<D>(kv_base, kv_base + T::KV_BYTES, c0, n_ctx_chunks, kc, vc, pt, page_size, start, len, kb, vb, nq,
                  kv_stride);
  cp_async_commit();

  float acc[T::ONT][4];
#pragma unroll
  for (int nt = 0; nt < T::ONT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
  const int row0 = warp * 16;

  for (int t = 0; t < n_chunks; ++t) {
    cp_async_wait_all();
    __syncthreads();  // chunk t (and Q) landed for everyone; everyone is done with chunk t-1's stage
    if (t + 1 < n_chunks) {
      const unsigned st = kv_base + ((t + 1) & 1) * 2 * T::KV_BYTES;
      load_chunk<D>(st, st + T::KV_BYTES, c0 + t + 1, n_ctx_chunks, kc, vc, pt, page_size, start, len, kb, vb, nq,
                    kv_stride);
      cp_async_commit();
    }
    const unsigned k_t = kv_base + (t & 1) * 2 * T::KV_BYTES, v_t = k_t + T::KV_BYTES;
    const int idx = c0 + t;
    const int n_valid = idx < n_ctx_chunks ? min(BN, len - (start + idx * BN)) : nq;

    // ---- S = Q K^T for this warp's 16 rows x 64 keys
    float s[SNT][4];
#pragma unroll
    for (int nt = 0; nt < SNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < T::KSTEPS; ++kk) {
      unsigned a[4];
      ldsm_x4(q_base + swz<T::CH>(row0 + (lane & 15), kk * 2 + (lane >> 4)), a);
#pragma unroll
      for (int nt = 0; nt < SNT; nt += 2) {
        // matrices: (n 0-7, k 0-7) (n 0-7, k 8-15) (n 8-15, k 0-7) (n 8-15, k 8-15)
        const int mi = lane >> 3;
        unsigned bk[4];
        ldsm_x4(k_t + swz<T::CH>((nt + (mi >> 1)) * 8 + (lane & 7), kk * 2 + (mi & 1)), bk);
        mma_bf16(s[nt], a, bk[0], bk[1]);
        mma_bf16(s[nt + 1], a, bk[2], bk[3]);
      }
    }

    // ---- scale, mask the keys past the chunk's end, online softmax (rows g and g + 8)
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int nt = 0; nt < SNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale_log2;
        if (nt * 8 + tq * 2 + (e & 1) >= n_valid) x = neg_inf();
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      const float m_new = fmaxf(m_run[i], mx[i]);
      m_use[i] = m_new == neg_inf() ? 0.f : m_new;  // nothing seen yet: avoid inf - inf
      const float alpha = exp2f(m_run[i] - m_use[i]);
      m_run[i] = m_new;
      l_run[i] *= alpha;
#pragma unroll
      for (int nt = 0; nt < T::ONT; ++nt) {
        acc[nt][2 * i] *= alpha;
        acc[nt][2 * i + 1] *= alpha;
      }
    }

    // ---- O += P V: P's A fragments straight from S; V via ldmatrix.trans
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[4];
      {
        const float p00 = exp2f(s[2 * kk][0] - m_use[0]), p01 = exp2f(s[2 * kk][1] - m_use[0]);
        const float p02 = exp2f(s[2 * kk][2] - m_use[1]), p03 = exp2f(s[2 * kk][3] - m_use[1]);
        const float p10 = exp2f(s[2 * kk + 1][0] - m_use[0]), p11 = exp2f(s[2 * kk + 1][1] - m_use[0]);
        const float p12 = exp2f(s[2 * kk + 1][2] - m_use[1]), p13 = exp2f(s[2 * kk + 1][3] - m_use[1]);
        l_run[0] += p00 + p01 + p10 + p11;
        l_run[1] += p02 + p03 + p12 + p13;
        a[0] = pack_bf16(p00, p01);
        a[1] = pack_bf16(p02, p03);
        a[2] = pack_bf16(p10, p11);
        a[3] = pack_bf16(p12, p13);
      }
#pragma unroll
      for (int nt = 0; nt < T::ONT; nt += 2) {
        // matrices: (k 0-7, n 0-7) (k 8-15, n 0-7) (k 0-7, n 8-15) (k 8-15, n 8-15), transposed
        const int mi = lane >> 3;
        unsigned bv[4];
        ldsm_x4_trans(v_t + swz<T::CH>(kk * 16 + (mi & 1) * 8 + (lane & 7), nt + (mi >> 1)), bv);
        mma_bf16(acc[nt], a, bv[0], bv[1]);
        mma_bf16(acc[nt + 1], a, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (a CTA with no chunks still committed Q)

  // ---- epilogue: row sums over the quad, then bf16 out (one split) or an fp32 partial + log2-sum-exp
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  const long long total_rows = (long long)gridDim.x / hkv * nq * hq;  // B * Q * Hq
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = m0 + row0 + g + 8 * i;
    if (m >= rows) continue;
    const long long orow = ((long long)b * nq + m / group) * hq + kvh * group + m % group;
    const float l = l_run[i];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (splits == 1) {
      bf16* dst = out + orow * D + tq * 2;
#pragma unroll
      for (int nt = 0; nt < T::ONT; ++nt)
        *reinterpret_cast<unsigned*>(dst + nt * 8) = pack_bf16(acc[nt][2 * i] * inv, acc[nt][2 * i + 1] * inv);
    } else {
      const long long prow = split * total_rows + orow;
      float* dst = o_part + prow * D + tq * 2;
#pragma unroll
      for (int nt = 0; nt < T::ONT; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(acc[nt][2 * i] * inv, acc[nt][2 * i + 1] * inv);
      if (tq == 0) lse_part[prow] = l > 0.f ? m_run[i] + log2f(l) : neg_inf();
    }
  }
}

}  // namespace

#define GQA_ARGS                                                                                                \
  const bf16 *__restrict__ q, const bf16 *__restrict__ k_cache, const bf16 *__restrict__ v_cache,               \
      const int *__restrict__ page_table, const int *__restrict__ context_lens,                                 \
      const int *__restrict__ context_starts, const bf16 *__restrict__ k_block, const bf16 *__restrict__ v_block, \
      int nq, int hq, int hkv, int page_size, int max_pages, float scale_log2, bf16 *__restrict__ out,          \
      float *__restrict__ o_part, float *__restrict__ lse_part
#define GQA_PASS                                                                                              \
  q, k_cache, v_cache, page_table, context_lens, context_starts, k_block, v_block, nq, hq, hkv, page_size, \
      max_pages, scale_log2, out, o_part, lse_part

extern "C" __global__ void __launch_bounds__(THREADS, 2) gqa_attention_d64_kernel(GQA_ARGS) {
  gqa_body<64>(GQA_PASS);
}
extern "C" __global__ void __launch_bounds__(THREADS, 2) gqa_attention_d128_kernel(GQA_ARGS) {
  gqa_body<128>(GQA_PASS);
}

// out[row] = sum_s 2^(lse_s - top) o_s / sum_s 2^(lse_s - top) over the splits' partials
// (o_part [splits][rows][D] f32, each normalised by its own sum; lse_part [splits][rows] log2 units;
// an empty partial has lse -inf and weight 0). Each thread writes 4 columns of one row.
extern "C" __global__ void __launch_bounds__(128) gqa_attention_merge_kernel(
    const float* __restrict__ o_part, const float* __restrict__ lse_part, int splits, long long rows, int d,
    bf16* __restrict__ out) {
  const int per_row = d / 4;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * per_row) return;
  const long long row = i / per_row;
  const int col = static_cast<int>(i - row * per_row) * 4;
  float top = neg_inf();
  for (int s = 0; s < splits; ++s) top = fmaxf(top, lse_part[s * rows + row]);
  float sum = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < splits; ++s) {
    const float ls = lse_part[s * rows + row];
    if (ls == neg_inf()) continue;  // empty partial: its o is zeros, skip the read
    const float w = exp2f(ls - top);
    const float4 v = *reinterpret_cast<const float4*>(o_part + (s * rows + row) * d + col);
    sum += w;
    o[0] += w * v.x;
    o[1] += w * v.y;
    o[2] += w * v.z;
    o[3] += w * v.w;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  uint2 packed;
  packed.x = pack_bf16(o[0] * inv, o[1] * inv);
  packed.y = pack_bf16(o[2] * inv, o[3] * inv);
  *reinterpret_cast<uint2*>(out + row * d + col) = packed;
}
