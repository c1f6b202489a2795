// Absorbed MLA attention over the paged latent KV cache: decode, tree verify and causal prefill.
//
// A query row is one (token, head) pair, q = [q_nope·W_UK (512) | roped q_pe (64)]; a cache row is
// [c (512) | k_pe (64)], one latent "head" shared by all query heads. For every query row:
//   s_j = scale · q·row_j over the rows j it may see;  o_lat = Σ softmax(s)_j · c_j;  lse = ln Σ e^s_j
// A request has ctx committed rows and n new tokens whose rows sit at positions ctx .. ctx+n-1 (written
// before attention). Token i sees every committed row, and new row j when bit j of its mask row is set
// (tree verify) or when j <= i (causal: prefill, and decode with n = 1).
//
// Work items come from the host plan: an item is BM consecutive query rows of one request (the
// request's rows are contiguous in q [T*H, 576], token-major) against the cache positions
// [kv_begin, kv_end), in tiles of BN rows. CTA c runs items cta_work[c] .. cta_work[c+1]-1 in turn:
// the plan gives every CTA an equal run of BN-row units over all query tiles, so every resident CTA
// (one per SM; two for the decode tile, D16_CTAS_PER_SM) stays busy at any batch size (long tiles
// are cut across CTAs: split-K). An item that covers only part of its tile's positions writes an
// fp32 partial normalised by its own sum plus its log2-sum-exp; mla_attention_merge_kernel combines
// them. The schedule lives in device memory, so a captured graph replays any later plan written into
// the same buffers. Under the row-invariant schedule (split="shape") a tree verify row's keys are its
// autoregressive twin's, read along its tree path (path_item in include/mla_split.cuh).
//
// Tensor cores: mma.sync m16n8k16, bf16 in, fp32 accumulate. Fragments (g = lane/4, tq = lane%4):
//   A 16x16 (row-major)  a0 = (g, 2tq..2tq+1)  a1 = (g+8, 2tq..)  a2 = (g, 8+2tq..)  a3 = (g+8, 8+2tq..)
//   B 16x8  (k x n)      b0 = (k 2tq..2tq+1, n g)   b1 = (k 8+2tq.., n g)
//   C 16x8               c0,c1 = (g, 2tq..2tq+1)    c2,c3 = (g+8, 2tq..2tq+1)
// Shared tiles are row-major with 16-byte chunks XOR-swizzled by (row & 7), so the 8 rows one ldmatrix
// phase reads fall in 8 distinct bank groups. Per KV tile:
//   S = Q·K^T  warp (wm, wn) of SMG x SN: rows wm*16..+16, cols wn*SCOLS..; A = Q via ldmatrix, B = K rows
//              via ldmatrix (K row-major [n][k] is B in "col" layout).
//   softmax    row max exchanged across the SN warps of a row through smem; every such warp applies
//              the same running max, keeps its own partial row sum; P (bf16) and the rescale factor
//              alpha go to smem.
//   O += P·V   warp (om, od) of OM x OD: rows om*OROWS.., cols od*OCOLS..; A = P via ldmatrix, B = V
//              rows via ldmatrix.trans (V row-major [k][n]).
// Scores are kept in log2 units (scale · log2 e folded in) so the exponentials are exp2.
// The decode variant (split_body, SplitCfg) splits the k of S across warps instead; see there.
#include "common.cuh"
#include "mla_split.cuh"
#include "warp_mma.cuh"

using namespace ddt;
using namespace ddt::mla;

namespace {

// Tile shape: BM query rows x BN cache rows per step, NW warps; O split into OM row groups.
template <int BM_, int BN_, int NW_, int OM_>
struct Cfg {
  static constexpr int BM = BM_, BN = BN_, NW = NW_, THREADS = 32 * NW_;
  static constexpr int SMG = BM / 16, SN = NW / SMG, SCOLS = BN / SN, SNT = SCOLS / 8;
  static constexpr int OM = OM_, OD = NW / OM, OROWS = BM / OM, OMT = OROWS / 16, OCOLS = DV / OD,
                       ONT = OCOLS / 8;
  static constexpr int PCH = BN / 8;  // chunks per P row
  static_assert(BM % 16 == 0 && NW % SMG == 0 && SCOLS % 8 == 0 && BN % 16 == 0, "bad S layout");
  static_assert(NW % OM == 0 && OROWS % 16 == 0 && ONT % 2 == 0, "bad O layout");
  // Shared memory (bytes), mirrored by _smem_bytes() in ddtree_rtc/kernels/mla_attention.py:
  // Q [BM][576] bf16, KV [2][BN][576] bf16, P [BM][BN] bf16, red [SN][BM] f32, alpha [BM], m [BM] f32.
  static constexpr int SMEM = (BM * ROW + 2 * BN * ROW + BM * BN) * 2 + (SN * BM + 2 * BM) * 4;
};

using CfgM64 = Cfg<64, 64, 8, 2>;    // >= 33 query rows per request (64 heads, or trees)
using CfgM16 = Cfg<16, 64, 8, 1>;    // <= 16 query rows per request (decode with <= 16 heads)
using CfgSmall = Cfg<32, 16, 4, 1>;  // GPUs with ~100 KB of shared memory per block (sm_120)
static_assert(CfgM64::SMEM <= 227 * 1024 && CfgM16::SMEM <= 227 * 1024, "over the sm_90/sm_100 opt-in limit");
static_assert(CfgSmall::SMEM <= 99 * 1024, "over the sm_120 opt-in limit");

// cp.async of the BN cache rows of an item's keys [base, base+BN) (key_position: on a tree path past
// ctx, the token's ancestors); keys at or past kv_end are zero-filled: their scores are masked anyway,
// and zeros keep P·V free of whatever lies there.
template <class C>
__device__ __forceinline__ void load_kv_tile(unsigned dst, const bf16* __restrict__ cache, const Item& it,
                                             int page_size, int base) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < C::BN; r += C::NW) {
    const bool ok = base + r < it.kv_end;
    const bf16* src = cache;
    if (ok) {
      const int pos = key_position(it, base + r);
      src = cache + ((long long)__ldg(it.pt + pos / page_size) * page_size + pos % page_size) * ROW;
    }
    for (int c = lane; c < ROW_CHUNKS; c += 32) cp_async16(dst + swz<ROW_CHUNKS>(r, c) * 16, src + c * 8, ok);
  }
}

template <class C>
__device__ __forceinline__ void attention_body(
    const bf16* __restrict__ q, const bf16* __restrict__ cache, const int* __restrict__ page_table,
    int pt_stride, int page_size, int num_heads, const int* __restrict__ work, const int* __restrict__ cta_work,
    const int* __restrict__ req_info, const unsigned long long* __restrict__ mask, int mask_words,
    bf16* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_part, float* __restrict__ lse_part,
    float scale_log2) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* kv_s = q_s + C::BM * ROW;
  bf16* p_s = kv_s + 2 * C::BN * ROW;
  float* red_s = reinterpret_cast<float*>(p_s + C::BM * C::BN);  // [SN][BM]: row max, at the end row sum
  float* alpha_s = red_s + C::SN * C::BM;                          // [BM] rescale factor of this tile
  float* m_s = alpha_s + C::BM;                                    // [BM] final running max
  constexpr unsigned KV_STAGE = C::BN * ROW * 2;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int s_n = warp % C::SN, s_row0 = (warp / C::SN) * 16, s_col0 = s_n * C::SCOLS;
  const int o_row0 = (warp / C::OD) * C::OROWS, o_col0 = (warp % C::OD) * C::OCOLS;
  const unsigned q_base = smem_u32(q_s), kv_base = smem_u32(kv_s), p_base = smem_u32(p_s);
  unsigned* p_words = reinterpret_cast<unsigned*>(p_s);

  const int w_end = cta_work[blockIdx.x + 1];
  for (int w = cta_work[blockIdx.x]; w < w_end; ++w) {
    const Item it = load_item(work, w, req_info, page_table, pt_stride, num_heads, mask, mask_words);

    // This thread's two S rows: s_row0 + g and s_row0 + g + 8.
    bool row_ok[2];
    int tok[2];
    item_rows(it, s_row0 + g, num_heads, row_ok, tok);
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    float acc[C::OMT][C::ONT][4];
#pragma unroll
    for (int mt = 0; mt < C::OMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < C::ONT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

    __syncthreads();  // the previous item is done with q_s, kv_s and red_s
    for (int r = warp; r < C::BM; r += C::NW) {
      const bool ok = r < it.m_count;
      const bf16* src = ok ? q + (it.row_g0 + r) * ROW : q;
      for (int c = lane; c < ROW_CHUNKS; c += 32) cp_async16(q_base + swz<ROW_CHUNKS>(r, c) * 16, src + c * 8, ok);
    }
    const int n_tiles = (it.kv_end - it.kv_begin + C::BN - 1) / C::BN;
    load_kv_tile<C>(kv_base, cache, it, page_size, it.kv_begin);
    cp_async_commit();

    for (int t = 0; t < n_tiles; ++t) {
      cp_async_wait_all();
      __syncthreads();  // tile t (and Q) landed for everyone; everyone is done with tile t-1's buffer
      if (t + 1 < n_tiles) {
        load_kv_tile<C>(kv_base + ((t + 1) & 1) * KV_STAGE, cache, it, page_size, it.kv_begin + (t + 1) * C::BN);
        cp_async_commit();
      }
      const unsigned kv_t = kv_base + (t & 1) * KV_STAGE;
      const int base = it.kv_begin + t * C::BN;

      // ---- S = Q K^T: rows s_row0..+16, cols s_col0..+SCOLS of the tile
      float s[C::SNT][4];
#pragma unroll
      for (int nt = 0; nt < C::SNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned a[4];
        ldsm_x4(q_base + swz<ROW_CHUNKS>(s_row0 + (lane & 15), kk * 2 + (lane >> 4)) * 16, a);
#pragma unroll
        for (int nt = 0; nt + 1 < C::SNT; nt += 2) {
          // matrices: (n 0-7, k 0-7) (n 0-7, k 8-15) (n 8-15, k 0-7) (n 8-15, k 8-15)
          const int mi = lane >> 3;
          unsigned b[4];
          ldsm_x4(kv_t + swz<ROW_CHUNKS>(s_col0 + (nt + (mi >> 1)) * 8 + (lane & 7), kk * 2 + (mi & 1)) * 16, b);
          mma_bf16(s[nt], a, b[0], b[1]);
          mma_bf16(s[nt + 1], a, b[2], b[3]);
        }
        if constexpr ((C::SNT & 1) != 0) {
          constexpr int nt = C::SNT - 1;
          unsigned b[2];
          ldsm_x2(kv_t + swz<ROW_CHUNKS>(s_col0 + nt * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)) * 16, b);
          mma_bf16(s[nt], a, b[0], b[1]);
        }
      }

      // ---- scale, mask, row max (only tiles touching new rows or the range end need the mask)
      const bool edge = base + C::BN > it.ctx || base + C::BN > it.kv_end;
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < C::SNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          float x = s[nt][e] * scale_log2;
          if (edge) {
            const int pos = base + s_col0 + nt * 8 + tq * 2 + (e & 1);
            if (!visible(pos, it, row_ok[i], tok[i], mask, mask_words)) x = neg_inf();
          }
          s[nt][e] = x;
          mx[i] = fmaxf(mx[i], x);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        if (tq == 0) red_s[s_n * C::BM + s_row0 + g + 8 * i] = mx[i];
      }
      __syncthreads();

      // ---- online softmax: the same running max in every warp of a row, partial sums per thread
      float m_use[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = s_row0 + g + 8 * i;
        float m_new = m_run[i];
#pragma unroll
        for (int sn = 0; sn < C::SN; ++sn) m_new = fmaxf(m_new, red_s[sn * C::BM + r]);
        m_use[i] = m_new == neg_inf() ? 0.f : m_new;  // a row that saw nothing yet: avoid inf - inf
        const float alpha = exp2f(m_run[i] - m_use[i]);
        m_run[i] = m_new;
        l_run[i] *= alpha;
        if (s_n == 0 && tq == 0) alpha_s[r] = alpha;
      }
#pragma unroll
      for (int nt = 0; nt < C::SNT; ++nt) {
        const float p0 = exp2f(s[nt][0] - m_use[0]), p1 = exp2f(s[nt][1] - m_use[0]);
        const float p2 = exp2f(s[nt][2] - m_use[1]), p3 = exp2f(s[nt][3] - m_use[1]);
        l_run[0] += p0 + p1;
        l_run[1] += p2 + p3;
        const int col = s_col0 + nt * 8 + tq * 2, r = s_row0 + g;
        p_words[(swz<C::PCH>(r, col >> 3) * 8 + (col & 7)) >> 1] = pack_bf16(p0, p1);
        p_words[(swz<C::PCH>(r + 8, col >> 3) * 8 + (col & 7)) >> 1] = pack_bf16(p2, p3);
      }
      __syncthreads();

      // ---- O = alpha * O + P V: rows o_row0..+OROWS, cols o_col0..+OCOLS
#pragma unroll
      for (int mt = 0; mt < C::OMT; ++mt) {
        const float a_lo = alpha_s[o_row0 + mt * 16 + g], a_hi = alpha_s[o_row0 + mt * 16 + g + 8];
#pragma unroll
        for (int nt = 0; nt < C::ONT; ++nt) {
          acc[mt][nt][0] *= a_lo;
          acc[mt][nt][1] *= a_lo;
          acc[mt][nt][2] *= a_hi;
          acc[mt][nt][3] *= a_hi;
        }
      }
#pragma unroll 1  // unrolled, the hoisted ldmatrix addresses cost ~30 registers and spill on sm_90
      for (int kk = 0; kk < C::BN / 16; ++kk) {
        unsigned a[C::OMT][4];
#pragma unroll
        for (int mt = 0; mt < C::OMT; ++mt)
          ldsm_x4(p_base + swz<C::PCH>(o_row0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)) * 16, a[mt]);
#pragma unroll
        for (int nt = 0; nt < C::ONT; nt += 2) {
          // matrices: (k 0-7, n 0-7) (k 8-15, n 0-7) (k 0-7, n 8-15) (k 8-15, n 8-15), transposed
          const int mi = lane >> 3;
          unsigned b[4];
          ldsm_x4_trans(
              kv_t + swz<ROW_CHUNKS>(kk * 16 + (mi & 1) * 8 + (lane & 7), (o_col0 >> 3) + nt + (mi >> 1)) * 16, b);
#pragma unroll
          for (int mt = 0; mt < C::OMT; ++mt) {
            mma_bf16(acc[mt][nt], a[mt], b[0], b[1]);
            mma_bf16(acc[mt][nt + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }

    // ---- epilogue: total row sums; red_s was last read before the final P barrier
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
      const int r = s_row0 + g + 8 * i;
      if (tq == 0) {
        red_s[s_n * C::BM + r] = l_run[i];
        if (s_n == 0) m_s[r] = m_run[i];
      }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < C::OMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = o_row0 + mt * 16 + g + 8 * h;
        if (r >= it.m_count) continue;
        float l = 0.f;
#pragma unroll
        for (int sn = 0; sn < C::SN; ++sn) l += red_s[sn * C::BM + r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const float lse2 = l > 0.f ? m_s[r] + log2f(l) : neg_inf();
        write_row<C::BM>(acc[mt], h, inv, lse2, o_col0 == 0, it, r, o_col0, tq, out, lse, o_part, lse_part);
      }
    }
  }
}



// ---- sm_90a variant (wgmma): 64 query rows x 64 cache rows per stage, two warpgroups of 128.
// Shared tiles are stored as 9 blocks of 64 columns (one per 128-byte row segment) with the
// hardware's 128-byte swizzle (16-byte chunk c of row r at r*128 + ((c ^ r%8) * 16) inside a
// 1024-byte-aligned block), the canonical layout wgmma reads through a matrix descriptor:
//   S = Q K^T   warpgroup w computes the 64 x 32 columns w*32.. of S: 36 x m64n32k16, A = Q and
//               B = cache rows w*32.. both K-major (k contiguous; the k16 step is +32 bytes inside
//               the swizzle atom, the next 64 columns the next block).
//   softmax     each warpgroup's row max meets the other's in smem; both apply the same running
//               max; P (bf16) goes to smem as a K-major 64 x 64 block.
//   O += P V    warpgroup w owns O columns w*256..+256: per k16 step 2 x m64n128k16 with B = the
//               cache rows' first 512 columns read MN-major (transposed): 8 kv rows 128 bytes apart,
//               the next 8 at SBO = 1024, the next 64 columns one block (LBO = 8192) on.
// The accumulator fragment of m64nN (thread t of a warpgroup, warp t/32 = wi, g = lane/4, tq = lane%4):
//   d[4j + e] = (row 16 wi + g + 8 (e/2), col 8 j + 2 tq + e%2), so a thread's S rows and O rows
// coincide and the rescale factor never leaves the thread.
namespace w64 {
constexpr int BM = 64, BN = 64, THREADS = 256;
static_assert(BN == 64 && BM == 64, "the descriptors below assume 64 x 64 tiles");
constexpr int KBLOCKS = ROW / 64;        // 9 column blocks of 128 bytes per row
constexpr int BLK = 64 * 128;            // one column block of a 64-row tile
constexpr int TILE = KBLOCKS * BLK;      // Q, or one KV stage (73728 bytes)
// Shared memory (bytes), mirrored by _smem_bytes() in ddtree_rtc/kernels/mla_attention.py:
// alignment slack 1024, Q, 2 KV stages, P [64 x 64] bf16, red [2][64] f32.
constexpr int SMEM = 1024 + 3 * TILE + BLK + 2 * BM * 4;
static_assert(SMEM <= 227 * 1024, "over the sm_90 opt-in limit");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the helpers exist where the kernel body does
__device__ __forceinline__ unsigned tile_off(int r, int c) {
  return (c >> 3) * BLK + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Matrix descriptor: start address, leading / stride byte offsets, 128-byte swizzle.
__device__ __forceinline__ unsigned long long desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr >> 4) & 0x3FFF) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pins accumulator registers in program order around the async MMAs: without it the compiler may
// move a read of d before the wait_group, or a write (the rescale) after the issuing wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64x32] (+)= A[64x16] B[16x32]; A, B K-major in shared memory (descriptors), f32 accumulate.
__device__ __forceinline__ void wgmma_n32(float (&d)[16], unsigned long long a, unsigned long long b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}

// D[64x128] += A[64x16] B[16x128]; A K-major, B MN-major (transposed) in shared memory.
__device__ __forceinline__ void wgmma_n128_tb(float (&d)[64], unsigned long long a, unsigned long long b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "n"(1));
}

// 64 rows of 72 chunks: 8 threads per row (128 contiguous bytes per instruction), 32 rows per pass.
// Rows at or past `valid` are zero-filled.
__device__ __forceinline__ void load_rows_q(unsigned dst, const bf16* __restrict__ q, long long row_g0, int valid) {
  const int t = threadIdx.x, sub = t & 7;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r = (t >> 3) + 32 * pass;
    const bool ok = r < valid;
    const bf16* src = ok ? q + (row_g0 + r) * ROW : q;
#pragma unroll
    for (int k = 0; k < 9; ++k) cp_async16(dst + tile_off(r, sub + 8 * k), src + (sub + 8 * k) * 8, ok);
  }
}

__device__ __forceinline__ void load_rows_kv(unsigned dst, const bf16* __restrict__ cache, const int* __restrict__ pt,
                                             int page_size, int base, int kv_end) {
  const int t = threadIdx.x, sub = t & 7;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r = (t >> 3) + 32 * pass, pos = base + r;
    const bool ok = pos < kv_end;
    const bf16* src = cache;
    if (ok) src = cache + ((long long)__ldg(pt + pos / page_size) * page_size + pos % page_size) * ROW;
#pragma unroll
    for (int k = 0; k < 9; ++k) cp_async16(dst + tile_off(r, sub + 8 * k), src + (sub + 8 * k) * 8, ok);
  }
}
#endif
}  // namespace w64

}  // namespace

// q [T*H, 576] bf16; cache [pages*page_size, 576] bf16; page_table [B, pt_stride] int32;
// work [*, 8] / cta_work [grid + 1] / req_info [B, 4] int32 from the plan; mask [T, mask_words] uint64 or null
// (causal); out [T*H, 512] bf16; lse [T*H] f32 (natural log); o_part [*, BM, 512] / lse_part [*, BM] f32.
#define MLA_ATTENTION_PARAMS                                                                                     \
  const bf16 *__restrict__ q, const bf16 *__restrict__ cache, const int *__restrict__ page_table, int pt_stride, \
      int page_size, int num_heads, const int *__restrict__ work, const int *__restrict__ cta_work,           \
      const int *__restrict__ req_info, const unsigned long long *__restrict__ mask, int mask_words,           \
      bf16 *__restrict__ out, float *__restrict__ lse, float *__restrict__ o_part,                             \
      float *__restrict__ lse_part, float scale_log2
#define MLA_ATTENTION_ARGS                                                                                 \
  q, cache, page_table, pt_stride, page_size, num_heads, work, cta_work, req_info, mask, mask_words, out, lse, \
      o_part, lse_part, scale_log2

extern "C" __global__ void __launch_bounds__(CfgM64::THREADS, 1) mla_attention_m64_kernel(MLA_ATTENTION_PARAMS) {
  pdl_wait();  // launched under PDL: q and the cache rows come from the kernels before
  pdl_trigger();
  attention_body<CfgM64>(MLA_ATTENTION_ARGS);
}

extern "C" __global__ void __launch_bounds__(CfgM16::THREADS, 1) mla_attention_m16_kernel(MLA_ATTENTION_PARAMS) {
  pdl_wait();
  pdl_trigger();
  attention_body<CfgM16>(MLA_ATTENTION_ARGS);
}

extern "C" __global__ void __launch_bounds__(CfgSmall::THREADS, 1)
    mla_attention_small_kernel(MLA_ATTENTION_PARAMS) {
  pdl_wait();
  pdl_trigger();
  attention_body<CfgSmall>(MLA_ATTENTION_ARGS);
}

extern "C" __global__ void __launch_bounds__(CfgD16::THREADS, D16_CTAS_PER_SM)
    mla_attention_d16_kernel(MLA_ATTENTION_PARAMS) {
  pdl_wait();
  pdl_trigger();
  split_body<CfgD16>(MLA_ATTENTION_ARGS, blockIdx.x);
}





// The sm_90a wgmma variant (see namespace w64).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void w64_body(MLA_ATTENTION_PARAMS) {
  using namespace w64;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned raw = smem_u32(smem), aligned = (raw + 1023u) & ~1023u;
  const unsigned q_s = aligned, kv_s = aligned + TILE, p_s = aligned + 3 * TILE;
  unsigned char* p_ptr = smem + (p_s - raw);
  float* red = reinterpret_cast<float*>(p_ptr + BLK);  // [2][64]: row max per warpgroup, at the end row sums

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, tq = lane & 3, r0 = 16 * (warp & 3) + g;  // this thread's rows: r0, r0 + 8

  const int w_end = cta_work[blockIdx.x + 1];
  for (int w = cta_work[blockIdx.x]; w < w_end; ++w) {
    const Item it = load_item(work, w, req_info, page_table, pt_stride, num_heads);

    bool row_ok[2];
    int tok[2];
    item_rows(it, r0, num_heads, row_ok, tok);
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    float o[2][64];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 64; ++e) o[h][e] = 0.f;

    __syncthreads();  // the previous item is done with every buffer
    load_rows_q(q_s, q, it.row_g0, it.m_count);
    load_rows_kv(kv_s, cache, it.pt, page_size, it.kv_begin, it.kv_end);
    cp_async_commit();
    const int n_tiles = (it.kv_end - it.kv_begin + BN - 1) / BN;

    for (int t = 0; t < n_tiles; ++t) {
      cp_async_wait_all();
      fence_proxy_async();  // the copies are visible to the tensor cores' (async proxy) reads
      __syncthreads();      // tile t (and Q) landed for everyone; everyone is done with tile t-1
      if (t + 1 < n_tiles) {
        load_rows_kv(kv_s + ((t + 1) & 1) * TILE, cache, it.pt, page_size, it.kv_begin + (t + 1) * BN, it.kv_end);
        cp_async_commit();
      }
      const unsigned kv_t = kv_s + (t & 1) * TILE;
      const int base = it.kv_begin + t * BN;

      // ---- S = Q K^T, columns wg*32 .. +32
      float s[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) s[e] = 0.f;
      fence_regs(s);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const unsigned off = (ks >> 2) * BLK + (ks & 3) * 32;
        wgmma_n32(s, desc(q_s + off, 16, 1024), desc(kv_t + off + wg * 32 * 128, 16, 1024), ks);
      }
      wgmma_commit();
      wgmma_wait0();
      fence_regs(s);

      // ---- scale, mask, row max of this warpgroup's columns
      const bool edge = base + BN > it.ctx || base + BN > it.kv_end;
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          float x = s[4 * j + e] * scale_log2;
          if (edge) {
            const int pos = base + wg * 32 + 8 * j + 2 * tq + (e & 1);
            if (!visible(pos, it, row_ok[i], tok[i], mask, mask_words)) x = neg_inf();
          }
          s[4 * j + e] = x;
          mx[i] = fmaxf(mx[i], x);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        if (tq == 0) red[wg * BM + r0 + 8 * i] = mx[i];
      }
      __syncthreads();

      // ---- online softmax: both warpgroups combine the two maxima in the same order
      float m_use[2], alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = r0 + 8 * i;
        const float m_new = fmaxf(m_run[i], fmaxf(red[r], red[BM + r]));
        m_use[i] = m_new == neg_inf() ? 0.f : m_new;  // a row that saw nothing yet: avoid inf - inf
        alpha[i] = exp2f(m_run[i] - m_use[i]);
        m_run[i] = m_new;
        l_run[i] *= alpha[i];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p0 = exp2f(s[4 * j + 0] - m_use[0]), p1 = exp2f(s[4 * j + 1] - m_use[0]);
        const float p2 = exp2f(s[4 * j + 2] - m_use[1]), p3 = exp2f(s[4 * j + 3] - m_use[1]);
        l_run[0] += p0 + p1;
        l_run[1] += p2 + p3;
        const int c = wg * 32 + 8 * j + 2 * tq;  // P column = cache row of the tile
        const int r = r0;
        *reinterpret_cast<unsigned*>(p_ptr + r * 128 + ((((c >> 3) ^ (r & 7))) << 4) + (c & 7) * 2) = pack_bf16(p0, p1);
        *reinterpret_cast<unsigned*>(p_ptr + (r + 8) * 128 + ((((c >> 3) ^ ((r + 8) & 7))) << 4) + (c & 7) * 2) =
            pack_bf16(p2, p3);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          o[h][4 * j + 0] *= alpha[0];
          o[h][4 * j + 1] *= alpha[0];
          o[h][4 * j + 2] *= alpha[1];
          o[h][4 * j + 3] *= alpha[1];
        }
      fence_proxy_async();  // P's generic stores, visible to the tensor cores
      __syncthreads();

      // ---- O += P V over columns wg*256 .. +256
      fence_regs(o[0]);
      fence_regs(o[1]);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        const unsigned long long a = desc(p_s + ks * 32, 16, 1024);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wgmma_n128_tb(o[h], a, desc(kv_t + (4 * wg + 2 * h) * BLK + ks * 16 * 128, BLK, 1024));
      }
      wgmma_commit();
      wgmma_wait0();
      fence_regs(o[0]);
      fence_regs(o[1]);
    }

    // ---- epilogue: total row sums (red was last read before the final P barrier)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
      if (tq == 0) red[wg * BM + r0 + 8 * i] = l_run[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = r0 + 8 * i;
      if (r >= it.m_count) continue;
      const float l = red[r] + red[BM + r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse2 = l > 0.f ? m_run[i] + log2f(l) : neg_inf();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col0 = wg * 256 + h * 128 + 2 * tq;
        if (it.part < 0) {
          bf16* dst = out + (it.row_g0 + r) * DV + col0;
#pragma unroll
          for (int j = 0; j < 16; ++j)
            *reinterpret_cast<unsigned*>(dst + 8 * j) = pack_bf16(o[h][4 * j + 2 * i] * inv, o[h][4 * j + 2 * i + 1] * inv);
        } else {
          float* dst = o_part + ((long long)it.part * BM + r) * DV + col0;
#pragma unroll
          for (int j = 0; j < 16; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[h][4 * j + 2 * i] * inv, o[h][4 * j + 2 * i + 1] * inv);
        }
      }
      if (wg == 0 && tq == 0) {
        if (it.part < 0) lse[it.row_g0 + r] = lse2 * LN2;
        else lse_part[(long long)it.part * BM + r] = lse2;
      }
    }
  }
}
#endif

// Built for other arches as a trap (never launched there).
extern "C" __global__ void __launch_bounds__(w64::THREADS, 1) mla_attention_w64_kernel(MLA_ATTENTION_PARAMS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_wait();
  pdl_trigger();
  w64_body(MLA_ATTENTION_ARGS);
#else
  __trap();
#endif
}


// Split-K merge: one CTA of 128 threads per (merge item, row) pair, the pairs strided over a fixed grid
// (a few CTAs per SM: one wave, whatever the plan); include/mla_split.cuh, merge_rows. The attention
// kernels and the merge are launched under PDL where the GPU has it (kernels/mla_attention.py): each
// waits before it reads anything and triggers after, so its launch overlaps the kernel before it.
extern "C" __global__ void __launch_bounds__(DV / 4, 1) mla_attention_merge_kernel(
    const int* __restrict__ merge, const int* __restrict__ merge_count, const float* __restrict__ o_part,
    const float* __restrict__ lse_part, int part_rows, bf16* __restrict__ out, float* __restrict__ lse) {
  pdl_wait();  // the partials come from the attention kernel; a CTA with no pair still waits (kernels/_launch.py)
  pdl_trigger();
  merge_rows(merge, merge_count, o_part, lse_part, part_rows, out, lse, blockIdx.x, gridDim.x);
}
