// The decode variant of the absorbed MLA attention (split_body: <= 16 query rows per item, K of S
// split across the warps) and the split-K merge, as device functions over a CTA index, the bodies of
// mla_attention.cu's decode and merge entries. The layout and the math: mla_attention.cu's header comment.
#pragma once
#include "common.cuh"
#include "warp_mma.cuh"

namespace ddt {
namespace mla {

constexpr int ROW = 576;         // query / cache row: [c 512 | k_pe 64]
constexpr int DV = 512;          // latent value width
constexpr int ROW_CHUNKS = 72;   // 16-byte chunks per row
constexpr int KSTEPS = ROW / 16; // k16 steps of Q·K^T
constexpr int WORK_INTS = 8;     // work item: req, m0, m_count, kv_begin, kv_end, partial, merge item, path code
constexpr int REQ_INTS = 4;      // request: ctx, n_new, q_start, -
constexpr int MERGE_INTS = 4;    // merge item: first partial, splits, first flattened row, rows
constexpr float LN2 = 0.69314718055994531f;

// Lanes 0-15 give the addresses; the others' are ignored (but kept valid).
__device__ __forceinline__ void ldsm_x2(unsigned addr, unsigned (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}


// Two floats as a bf16 pair, the first in the low half (the lower column / k index).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// Index (in 16-byte chunks) of chunk `c` of row `r` in a tile with CHUNKS chunks per row.
template <int CHUNKS>
__device__ __forceinline__ int swz(int r, int c) {
  static_assert(CHUNKS % 8 == 0 || (CHUNKS & (CHUNKS - 1)) == 0, "swizzle needs 8k or 2^k chunks per row");
  constexpr int M = CHUNKS >= 8 ? 7 : CHUNKS - 1;
  return r * CHUNKS + (c ^ (r & M));
}

// One work item of the plan, with its request's fields.
struct Item {
  int req, m0, m_count, kv_begin, kv_end, part, group, ctx, q_start;  // group: merge item of a partial
  int prow;          // a partial's rows start at row part * BM + prow of o_part (path_item; else 0)
  const int* pt;     // the request's page-table row
  long long row_g0;  // first flattened query row
  // A tree row read along its path (work word 7, below): its token's mask row, else null.
  const unsigned long long* path;
};

// Work word 7 of a tree verify row under the row-invariant schedule (split="shape",
// kernels/mla_attention.py path_code): 1 | BN << 1 | fewest BN-units per piece << 9 | most pieces
// << 17 | partial row << 25; 0 otherwise. Such an item holds one token (depth d: d ancestors, root
// included, before it) and reduces exactly what its autoregressive twin (the same token decoded at
// cache position ctx + d) reduces: key i < ctx is cache position i, key ctx + i the token's ancestor
// at depth i (its i-th visible tree node, parents preceding children), key ctx + d the token itself;
// the keys' length ctx + d + 1 sets the pieces as for the twin, and word 3 is the piece index (the
// host plans the most pieces any depth the row may have needs; the ones past this row's length are
// empty). So the tiles, their keys' order, the softmax's rescale points and the merge are the
// twin's, whatever nodes the tree puts beside the path. Where a few tokens of a tree share their
// pieces below ctx (ordinary items over all their rows: kernels/mla_attention.py _tree_groups), a
// token's rows of the group's partial slots start at the partial row (prow), not 0.
__device__ __forceinline__ void path_item(Item& it, int code, const unsigned long long* __restrict__ mask,
                                          int mask_words, int num_heads) {
  const unsigned long long* row = mask + (long long)(it.q_start + it.m0 / num_heads) * mask_words;
  int seen = 0;
  for (int w = 0; w < mask_words; ++w) seen += __popcll(__ldg(row + w));
  const int len = it.ctx + seen;  // ctx + depth + 1
  const int bn = (code >> 1) & 0xFF, per_min = (code >> 9) & 0xFF, pieces = (code >> 17) & 0xFF;
  const int units = (len + bn - 1) / bn;
  const int per = max(per_min, (units + pieces - 1) / pieces) * bn;
  const int k = it.kv_begin;
  it.kv_begin = min(k * per, len);
  it.kv_end = min((k + 1) * per, len);
  it.path = row;
  it.prow = (code >> 25) & 0x3F;
}

__device__ __forceinline__ Item load_item(const int* __restrict__ work, int w, const int* __restrict__ req_info,
                                          const int* __restrict__ page_table, int pt_stride, int num_heads,
                                          const unsigned long long* __restrict__ mask = nullptr,
                                          int mask_words = 0) {
  const int* item = work + (long long)w * WORK_INTS;
  Item it;
  it.req = item[0], it.m0 = item[1], it.m_count = item[2], it.kv_begin = item[3], it.kv_end = item[4];
  it.part = item[5], it.group = item[6];
  it.ctx = req_info[it.req * REQ_INTS + 0], it.q_start = req_info[it.req * REQ_INTS + 2];
  it.pt = page_table + (long long)it.req * pt_stride;
  it.row_g0 = (long long)it.q_start * num_heads + it.m0;
  it.path = nullptr;
  it.prow = 0;
  if (item[7] != 0 && mask) path_item(it, item[7], mask, mask_words, num_heads);
  return it;
}

// The cache position of key `pos` of an item: itself, or on a tree path (path_item) past ctx the
// token's (pos - ctx)-th visible tree node.
__device__ __forceinline__ int key_position(const Item& it, int pos) {
  if (!it.path || pos < it.ctx) return pos;
  int i = pos - it.ctx;
  for (int w = 0;; ++w) {
    unsigned long long bits = __ldg(it.path + w);
    const int n = __popcll(bits);
    if (i < n) {
      for (; i > 0; --i) bits &= bits - 1;
      return it.ctx + 64 * w + __ffsll((long long)bits) - 1;
    }
    i -= n;
  }
}

// The two query rows r and r + 8 of an item that a thread's mma fragments cover: inside the item,
// and the query token each belongs to (rows are token-major, num_heads per token).
__device__ __forceinline__ void item_rows(const Item& it, int r, int num_heads, bool (&row_ok)[2], int (&tok)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_ok[i] = r + 8 * i < it.m_count;
    tok[i] = (it.m0 + r + 8 * i) / num_heads;
  }
}

// May a query row (token tok of its request; row_ok: a real row of the item) see cache position
// pos? Committed rows before kv_end always; new row j = pos - ctx when bit j of the token's mask row
// is set (tree verify) or j <= tok (causal); on a tree path (path_item) every key before kv_end.
__device__ __forceinline__ bool visible(int pos, const Item& it, bool row_ok, int tok,
                                        const unsigned long long* __restrict__ mask, int mask_words) {
  if (pos >= it.kv_end) return false;
  if (pos < it.ctx) return true;
  if (!row_ok) return false;
  if (it.path) return true;
  const int j = pos - it.ctx;
  if (!mask) return j <= tok;
  const unsigned long long word = __ldg(mask + (long long)(it.q_start + tok) * mask_words + (j >> 6));
  return (word >> (j & 63)) & 1ull;
}


// The epilogue of one finished query row (split_body and mla_attention.cu's attention_body): half h
// of a thread's mma accumulator tile acc[ONT][4] (C fragment row g + 8h: the item's row r, columns
// o_col0 + 8 nt + 2 tq and +1) times inv (1 / row sum, 0 for an empty row). A final item (part < 0)
// writes bf16 out row row_g0 + r and lse = lse2 ln 2 (lse2: the row's log2-sum-exp); a split-K
// partial writes fp32 o_part row part * BM + prow + r and lse_part = lse2. The lse comes from lane tq == 0
// of the warp holding column 0 (lse_col); the tq test stays in here, as the callers had it, since
// hoisting the whole condition into the caller changes the sm_100 schedule.
template <int BM, int ONT>
__device__ __forceinline__ void write_row(const float (&acc)[ONT][4], int h, float inv, float lse2, bool lse_col,
                                          const Item& it, int r, int o_col0, int tq, bf16* __restrict__ out,
                                          float* __restrict__ lse, float* __restrict__ o_part,
                                          float* __restrict__ lse_part) {
  if (it.part < 0) {
    bf16* dst = out + (it.row_g0 + r) * DV + o_col0 + tq * 2;
#pragma unroll
    for (int nt = 0; nt < ONT; ++nt)
      *reinterpret_cast<unsigned*>(dst + nt * 8) = pack_bf16(acc[nt][2 * h] * inv, acc[nt][2 * h + 1] * inv);
    if (lse_col && tq == 0) lse[it.row_g0 + r] = lse2 * LN2;
  } else {
    float* dst = o_part + ((long long)it.part * BM + it.prow + r) * DV + o_col0 + tq * 2;
#pragma unroll
    for (int nt = 0; nt < ONT; ++nt)
      *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(acc[nt][2 * h] * inv, acc[nt][2 * h + 1] * inv);
    if (lse_col && tq == 0) lse_part[(long long)it.part * BM + it.prow + r] = lse2;
  }
}


// ---- Decode variant: at most 16 query rows per item, K of S split across the warps.
// Per stage of BN cache rows: warp w computes the partial S [16 x BN] over its KPW k16 steps of the
// 576 (independent chains: BN/8 n-tiles x 2 accumulator sets; its Q fragments read from smem once
// per item and held in registers), the partials meet in smem, and every warp sums them in the same
// order, so all warps hold bit-identical S, run the same online softmax and keep P in registers as
// the A operand of P·V (no P/alpha/max exchange). Warp w then owns O columns w*OCOLS..+OCOLS. Two
// block barriers per stage; the cp.async ring is STAGES deep (STAGES - 1 copies in flight while a
// stage is computed; at 2, plain double buffering), and the page-table lookups of a stage (one lane
// per row) are issued one stage before its copy.
template <int BN_, int NW_, int STAGES_>
struct SplitCfg {
  static constexpr int BM = 16, BN = BN_, NW = NW_, THREADS = 32 * NW_, STAGES = STAGES_;
  static constexpr int NT = BN / 8;                         // n8 tiles of S
  static constexpr int KPW = KSTEPS / NW;                   // k16 steps of Q·K^T per warp
  static constexpr int OCOLS = DV / NW, ONT = OCOLS / 8;    // O columns per warp
  static constexpr int ROWS_PER_WARP = BN / NW;             // cache rows each warp copies per stage
  static_assert(KSTEPS % NW == 0 && NT % 2 == 0 && ONT % 2 == 0 && BN % NW == 0, "bad split layout");
  static_assert(ROWS_PER_WARP <= 32 && STAGES >= 2, "one lane per copied row");
  // Shared memory (bytes), mirrored by _smem_bytes() in ddtree_rtc/kernels/mla_attention.py:
  // Q [16][576] bf16, KV [STAGES][BN][576] bf16, partial S [NW][NT][32 lanes] float4.
  static constexpr int SMEM = (BM * ROW + STAGES * BN * ROW) * 2 + NW * NT * 32 * 16;
  // The CTA's barrier over THREADS threads (named barrier 1): the whole CTA of mla_attention_d16_kernel.
  static __device__ __forceinline__ void sync() { asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); }
};

// Decode with <= 16 heads (TP8 rank: 8). Two stages (one copy in flight while a stage is computed)
// keep the CTA at 98 KB, so two CTAs share an SM on sm_90/sm_100 (228 KB per SM, 1 KB reserved per
// CTA): two stages in flight per SM (a 4-deep ring in one CTA: three), and one CTA's item ramp (work
// and page-table lookups, Q, first stage), partial write and barriers overlap the other's reads.
// D16_CTAS_PER_SM is mirrored by Variant.ctas_per_sm in kernels/mla_attention.py, whose plan sizes
// the grid by the driver's occupancy (one CTA per SM where two do not fit: sm_120).
using CfgD16 = SplitCfg<32, 4, 2>;
constexpr int D16_CTAS_PER_SM = 2;
static_assert(D16_CTAS_PER_SM * (CfgD16::SMEM + 1024) <= 228 * 1024, "two d16 CTAs per sm_90/sm_100 SM");
static_assert(CfgD16::SMEM <= 99 * 1024, "over the sm_120 opt-in limit");

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Cache slot of row warp + NW*lane of the stage at `base`; -1 past kv_end and on spare lanes.
template <class C>
__device__ __forceinline__ int stage_slot(const Item& it, int page_size, int base) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int key = base + warp + C::NW * lane;
  if (lane >= C::ROWS_PER_WARP || key >= it.kv_end) return -1;
  const int pos = key_position(it, key);
  return __ldg(it.pt + pos / page_size) * page_size + pos % page_size;
}

// cp.async of one stage; row warp + NW*i comes from the slot lane i looked up (-1: zero-filled).
// A stage past the item's last tile (`live` false, uniform over the CTA) issues nothing.
template <class C>
__device__ __forceinline__ void copy_stage(unsigned dst, const bf16* __restrict__ cache, int slot, bool live) {
  if (!live) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < C::ROWS_PER_WARP; ++i) {
    const int sl = __shfl_sync(0xffffffffu, slot, i);
    const int r = warp + C::NW * i;
    const bf16* src = cache + (long long)max(sl, 0) * ROW;
#pragma unroll
    for (int j = 0; j < (ROW_CHUNKS + 31) / 32; ++j) {
      const int c = lane + 32 * j;
      if (c < ROW_CHUNKS) cp_async16(dst + swz<ROW_CHUNKS>(r, c) * 16, src + c * 8, sl >= 0);
    }
  }
}

template <class C>
__device__ __forceinline__ void split_body(
    const bf16* __restrict__ q, const bf16* __restrict__ cache, const int* __restrict__ page_table,
    int pt_stride, int page_size, int num_heads, const int* __restrict__ work, const int* __restrict__ cta_work,
    const int* __restrict__ req_info, const unsigned long long* __restrict__ mask, int mask_words,
    bf16* __restrict__ out, float* __restrict__ lse, float* __restrict__ o_part, float* __restrict__ lse_part,
    float scale_log2, int cta) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* kv_s = q_s + C::BM * ROW;
  float4* red_s = reinterpret_cast<float4*>(kv_s + C::STAGES * C::BN * ROW);  // [NW][NT][32]
  constexpr unsigned KV_STAGE = C::BN * ROW * 2;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int k0 = warp * C::KPW, o_col0 = warp * C::OCOLS;
  const unsigned q_base = smem_u32(q_s), kv_base = smem_u32(kv_s);

  const int w_end = cta_work[cta + 1];
  for (int w = cta_work[cta]; w < w_end; ++w) {
    const Item it = load_item(work, w, req_info, page_table, pt_stride, num_heads, mask, mask_words);

    // This thread's two query rows: g and g + 8.
    bool row_ok[2];
    int tok[2];
    item_rows(it, g, num_heads, row_ok, tok);
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    float acc[C::ONT][4];
#pragma unroll
    for (int nt = 0; nt < C::ONT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;

    cp_async_wait<0>();  // (nothing is pending: stages past an item's end issue no copies)
    C::sync();     // the previous item is done with q_s, kv_s and red_s
    for (int r = warp; r < C::BM; r += C::NW) {
      const bool ok = r < it.m_count;
      const bf16* src = ok ? q + (it.row_g0 + r) * ROW : q;
      for (int c = lane; c < ROW_CHUNKS; c += 32) cp_async16(q_base + swz<ROW_CHUNKS>(r, c) * 16, src + c * 8, ok);
    }
    const int n_tiles = (it.kv_end - it.kv_begin + C::BN - 1) / C::BN;
    // Prologue: stages 0 .. STAGES-2, one commit group each (Q rides with stage 0), whether or not
    // the item has that many, so that the group count per stage stays fixed.
    int slots[C::STAGES - 1];  // all lookups first: their latencies overlap
#pragma unroll
    for (int st = 0; st < C::STAGES - 1; ++st)
      slots[st] = stage_slot<C>(it, page_size, it.kv_begin + st * C::BN);
#pragma unroll
    for (int st = 0; st < C::STAGES - 1; ++st) {
      copy_stage<C>(kv_base + st * KV_STAGE, cache, slots[st], st < n_tiles);
      cp_async_commit();
    }
    int next_slot = stage_slot<C>(it, page_size, it.kv_begin + (C::STAGES - 1) * C::BN);
    unsigned qa[C::KPW][4];  // this warp's Q fragments (its KPW k16 steps), read once per item

    for (int t = 0; t < n_tiles; ++t) {
      cp_async_wait<C::STAGES - 2>();  // groups 0..t are complete: stage t (and Q) landed
      C::sync();                 // ... for everyone; everyone is done with stage t-1 and red_s
      if (t == 0) {
#pragma unroll
        for (int j = 0; j < C::KPW; ++j)
          ldsm_x4(q_base + swz<ROW_CHUNKS>(lane & 15, (k0 + j) * 2 + (lane >> 4)) * 16, qa[j]);
      }
      copy_stage<C>(kv_base + ((t + C::STAGES - 1) % C::STAGES) * KV_STAGE, cache, next_slot,
                    t + C::STAGES - 1 < n_tiles);
      cp_async_commit();
      next_slot = stage_slot<C>(it, page_size, it.kv_begin + (t + C::STAGES) * C::BN);
      const unsigned kv_t = kv_base + (t % C::STAGES) * KV_STAGE;
      const int base = it.kv_begin + t * C::BN;

      // ---- partial S over this warp's k16 steps
      float s[2][C::NT][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[h][nt][e] = 0.f;
#pragma unroll
      for (int j = 0; j < C::KPW; ++j) {
        const int kk = k0 + j;
#pragma unroll
        for (int nt = 0; nt < C::NT; nt += 2) {
          // matrices: (n 0-7, k 0-7) (n 0-7, k 8-15) (n 8-15, k 0-7) (n 8-15, k 8-15)
          const int mi = lane >> 3;
          unsigned b[4];
          ldsm_x4(kv_t + swz<ROW_CHUNKS>((nt + (mi >> 1)) * 8 + (lane & 7), kk * 2 + (mi & 1)) * 16, b);
          mma_bf16(s[j & 1][nt], qa[j], b[0], b[1]);
          mma_bf16(s[j & 1][nt + 1], qa[j], b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
        red_s[(warp * C::NT + nt) * 32 + lane] = make_float4(s[0][nt][0] + s[1][nt][0], s[0][nt][1] + s[1][nt][1],
                                                             s[0][nt][2] + s[1][nt][2], s[0][nt][3] + s[1][nt][3]);
      C::sync();

      // ---- full S (partials summed in warp order: identical in every warp), scale, mask, row max
      const bool edge = base + C::BN > it.ctx || base + C::BN > it.kv_end;
      float x[C::NT][4];
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        float4 v = red_s[nt * 32 + lane];
#pragma unroll
        for (int ww = 1; ww < C::NW; ++ww) {
          const float4 u = red_s[(ww * C::NT + nt) * 32 + lane];
          v.x += u.x;
          v.y += u.y;
          v.z += u.z;
          v.w += u.w;
        }
        x[nt][0] = v.x;
        x[nt][1] = v.y;
        x[nt][2] = v.z;
        x[nt][3] = v.w;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          float xv = x[nt][e] * scale_log2;
          if (edge) {
            const int pos = base + nt * 8 + tq * 2 + (e & 1);
            if (!visible(pos, it, row_ok[i], tok[i], mask, mask_words)) xv = neg_inf();
          }
          x[nt][e] = xv;
          mx[i] = fmaxf(mx[i], xv);
        }
      }

      // ---- online softmax in registers; P (bf16) becomes the A fragments of P·V
      float m_use[2], alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float m_new = fmaxf(m_run[i], mx[i]);
        m_use[i] = m_new == neg_inf() ? 0.f : m_new;  // a row that saw nothing yet: avoid inf - inf
        alpha[i] = exp2f(m_run[i] - m_use[i]);
        m_run[i] = m_new;
        l_run[i] *= alpha[i];
      }
      unsigned pa[C::NT / 2][4];  // k16 step kc of P·V: a0 (g, 2tq) a1 (g+8, 2tq) a2 (g, 8+2tq) a3 (g+8, 8+2tq)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const float p0 = exp2f(x[nt][0] - m_use[0]), p1 = exp2f(x[nt][1] - m_use[0]);
        const float p2 = exp2f(x[nt][2] - m_use[1]), p3 = exp2f(x[nt][3] - m_use[1]);
        l_run[0] += p0 + p1;
        l_run[1] += p2 + p3;
        pa[nt >> 1][(nt & 1) * 2] = pack_bf16(p0, p1);
        pa[nt >> 1][(nt & 1) * 2 + 1] = pack_bf16(p2, p3);
      }

      // ---- O = alpha * O + P V over this warp's columns
#pragma unroll
      for (int nt = 0; nt < C::ONT; ++nt) {
        acc[nt][0] *= alpha[0];
        acc[nt][1] *= alpha[0];
        acc[nt][2] *= alpha[1];
        acc[nt][3] *= alpha[1];
      }
#pragma unroll
      for (int kc = 0; kc < C::NT / 2; ++kc) {
#pragma unroll
        for (int nt = 0; nt < C::ONT; nt += 2) {
          // matrices: (k 0-7, n 0-7) (k 8-15, n 0-7) (k 0-7, n 8-15) (k 8-15, n 8-15), transposed
          const int mi = lane >> 3;
          unsigned b[4];
          ldsm_x4_trans(
              kv_t + swz<ROW_CHUNKS>(kc * 16 + (mi & 1) * 8 + (lane & 7), (o_col0 >> 3) + nt + (mi >> 1)) * 16, b);
          mma_bf16(acc[nt], pa[kc], b[0], b[1]);
          mma_bf16(acc[nt + 1], pa[kc], b[2], b[3]);
        }
      }
    }

    // ---- epilogue: every warp holds the same row max and sums; each writes its own columns
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int r = g + 8 * h;
      if (r >= it.m_count) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse2 = l > 0.f ? m_run[h] + log2f(l) : neg_inf();
      write_row<C::BM>(acc, h, inv, lse2, warp == 0, it, r, o_col0, tq, out, lse, o_part, lse_part);
    }
  }
}

// Split-K merge over the (merge item, row) pairs first, first + stride, ...: 128 threads (4 columns
// each) per pair. With partial log2-sum-exps L_s and normalised partials o_s:
//   o = Σ 2^(L_s - L) o_s,  L = log2 Σ 2^L_s.
__device__ __forceinline__ void merge_rows(const int* __restrict__ merge, const int* __restrict__ merge_count,
                                           const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                           int part_rows, bf16* __restrict__ out, float* __restrict__ lse,
                                           int first, int stride) {
  const int col = threadIdx.x * 4;
  const int pairs = merge_count[0] * part_rows;  // from device memory: graph replays take later plans
  for (int i = first; i < pairs; i += stride) {
    const int it = i / part_rows, row = i - it * part_rows;
    const int* m = merge + it * MERGE_INTS;
    const int p0 = m[0], splits = m[1], m_count = m[3];
    if (row >= m_count) continue;
    const long long g_row = (long long)m[2] + row;
    float top = neg_inf();
    for (int s = 0; s < splits; ++s) top = fmaxf(top, lse_part[(long long)(p0 + s) * part_rows + row]);
    float sum = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const long long pr = (long long)(p0 + s) * part_rows + row;
      const float ls = lse_part[pr];
      const float wgt = ls == neg_inf() ? 0.f : exp2f(ls - top);
      const float4 v = *reinterpret_cast<const float4*>(o_part + pr * DV + col);
      sum += wgt;
      o[0] += wgt * v.x;
      o[1] += wgt * v.y;
      o[2] += wgt * v.z;
      o[3] += wgt * v.w;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    uint2 packed;
    packed.x = pack_bf16(o[0] * inv, o[1] * inv);
    packed.y = pack_bf16(o[2] * inv, o[3] * inv);
    *reinterpret_cast<uint2*>(out + g_row * DV + col) = packed;
    if (threadIdx.x == 0) lse[g_row] = sum > 0.f ? (top + log2f(sum)) * LN2 : neg_inf();
  }
}

}  // namespace mla
}  // namespace ddt
