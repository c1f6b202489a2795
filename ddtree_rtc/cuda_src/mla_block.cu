// The small-M path's MLA attention block in one launch (M <= 64 tokens): a persistent kernel whose
// phases are the bodies of the small-M path's separate kernels, separated by grid-wide barriers.
//   1 q_a, kv_a       x [M, hidden] -> qa [M, q_lora], kv [M, 576]          (mla_qkv_a_small)
//   2 q_a norm        qa -> cq (rmsnorm); kv -> cache rows (norm, RoPE, write at slots)
//                                                                            (rmsnorm, mla_kv_rows_small)
//   3 q_b             cq -> q [M, H * (nope + 64)]                           (linear, impl="invariant")
//   4 query           q -> q_att [M, H, 576] = [q_nope · W_UK | RoPE(q_pe)] (mla_query_small)
//   5 attention       q_att x cache -> o_lat [M, H, 512] or split partials   (mla_attention d16, split="shape")
//   6 merge           partials -> o_lat (only where the plan cut tiles)       (mla_attention_merge_kernel)
//   7 W_UV            o_lat -> o [M, H * v_head]                               (mla_head_gemm_small)
//   8 o_proj          o -> out [M, hidden] bf16, or fp32 (a tensor-parallel partial)  (linear)
//   9 residual norm   one rank, when a residual is given: res_out = out + residual, y_norm = RMSNorm(res_out)
//                     (the decoder's post-attention norm)                           (rmsnorm)
// and first, on a tensor-parallel rank when a prologue is given:
//   0 prologue        the previous sublayer's all-reduced fp32 output (+ its bf16-rounded shared part),
//                     rounded to bf16 as backend.to_bf16 rounds it, + residual, RMSNorm -> x (this block's
//                     input) and pro_res_out (the new residual)                          (to_bf16, rmsnorm)
// Each phase walks the separate kernel's grid ("virtual CTAs" blk = blockIdx.x, + gridDim.x, ...) and
// runs its body (include/mla_small.cuh, mla_split.cuh, rmsnorm.cuh, skinny_mma.cuh; persistent.cuh) with the same
// indices, so every value is computed by the same instructions in the same order: the bits equal the
// separate kernels' bits, and the row invariance of the small-M path carries over. The one change:
// a skinny linear whose plan splits K over a cluster of S CTAs runs the S ranks' k ranges in turn in
// one CTA and adds their partials in rank order (skinny::serial_split_sum), the cluster's order.
//
// Weights do not depend on activations: before the PDL wait each CTA sends its share of the q_a / kv_a
// weights to L2, and before each barrier its share of a later phase's (q_b and kv_b during phase 1,
// o_proj during the attention), so a phase's weights stream while the previous phase finishes.
//
// The grid barrier (grid_sync) needs every CTA resident at once: the host sizes the grid from the
// occupancy of this kernel (kernels/mla_block.py). Activations written in one phase are read only in
// later phases, after the barrier's release / acquire; the loads the separate kernels make through the
// read-only path (a skinny linear's x) go through L2 here (ld.global.cg), since that path does not
// promise to see what other CTAs wrote earlier in the same launch.
#include "common.cuh"
#include "mla_small.cuh"
#include "mla_split.cuh"
#include "rmsnorm.cuh"
#include "persistent.cuh"

using namespace ddt;
using namespace ddt::persist;

namespace {

constexpr int kLat = 512, kRope = 64, kRow = kLat + kRope;
using CfgAtt = mla::CfgD16;

// The whole block; see the header comment. Scratch: qa, cq [M, q_lora]; kv [M, 576]; q [M, H (nope +
// 64)]; q_att [M, H, 576]; o_lat [M, H, 512]; lse [M, H]; o [M, H * vhead]. Plans: (warps_n, split) of
// the three skinny linears; the attention plan's buffers (kernels/mla_attention.py) with its grid and
// whether it merges. residual (or null), norm_w, norm_eps, y_norm, res_out: phase 9. pro_sum (or null),
// pro_plus (or null), pro_res, pro_w, pro_eps, pro_res_out: phase 0, which writes x. bar: the grid
// barrier's two counters.
template <typename Out>
__device__ __forceinline__ void block_body(
    bf16* x, int m, int hidden, int q_lora, int heads, int nope, int vhead, const bf16* __restrict__ w_qa,
    const bf16* __restrict__ w_kva, const bf16* __restrict__ qa_norm,
    const bf16* __restrict__ kv_norm, float eps, const bf16* __restrict__ w_qb, const bf16* __restrict__ kv_b,
    const bf16* __restrict__ w_o, const int* __restrict__ positions, const float* __restrict__ inv_freq,
    float rope_scale, bf16* __restrict__ cache, long long capacity, const int* __restrict__ slots,
    const int* __restrict__ page_table, int pt_stride, int page_size, const int* __restrict__ work,
    const int* __restrict__ cta_work, const int* __restrict__ req_info,
    const unsigned long long* __restrict__ mask, int mask_words, float* __restrict__ o_part,
    float* __restrict__ lse_part, const int* __restrict__ merge, const int* __restrict__ merge_count,
    int att_grid, int merges, float scale_log2, bf16* __restrict__ qa, bf16* __restrict__ cq, bf16* __restrict__ kv,
    bf16* __restrict__ q, bf16* __restrict__ q_att, bf16* __restrict__ o_lat, float* __restrict__ lse,
    bf16* __restrict__ o, Out* __restrict__ out, int wn_a, int split_a, int wn_b, int split_b, int wn_o, int split_o,
    const bf16* residual, const bf16* __restrict__ norm_w, float norm_eps, bf16* __restrict__ y_norm, bf16* res_out,
    const float* pro_sum, const float* pro_plus, const bf16* pro_res, const bf16* __restrict__ pro_w, float pro_eps,
    bf16* pro_res_out, unsigned* __restrict__ bar) {
  __shared__ float4 red[skinny::kWarps][kMT][32];
  const int qk = nope + kRope, warp = threadIdx.x >> 5;
  const long long kvb_bytes = (long long)heads * (nope + vhead) * kLat * 2;

  // 1: q_a and kv_a. Their weights go to L2 before the wait on the previous kernel (x is its output).
  prefetch_share(w_qa, (long long)q_lora * hidden * 2);
  prefetch_share(w_kva, (long long)kRow * hidden * 2);
  pdl_wait();
  pdl_trigger();
  // 0 (a tensor-parallel rank): the previous sublayer's residual norm makes x
  if (pro_sum) {
    residual_norm_rows(RoundedSum{pro_sum, pro_plus}, pro_res, pro_w, x, pro_res_out, m, hidden, pro_eps);
    grid_sync(bar);
  }
  for (int tile = blockIdx.x, n = tiles_of(q_lora + kRow, wn_a); tile < n; tile += gridDim.x)
    pair_tile<1, bf16>(red, x, m, hidden, w_qa, q_lora, qa, w_kva, kRow, kv, wn_a, split_a, tile);
  prefetch_share(w_qb, (long long)heads * qk * q_lora * 2);
  prefetch_share(kv_b, kvb_bytes);
  grid_sync(bar);

  // 2: the q_a norm (rmsnorm.cu's row split) and the cache rows
  {
    const bool by_block = q_lora > kRmsBlockMinD, vec = q_lora % 8 == 0;
    const int norm_blocks = by_block ? m : (m + 7) / 8, kv_blocks = (m + 7) / 8;
    for (int blk = blockIdx.x; blk < norm_blocks + kv_blocks; blk += gridDim.x) {
      if (blk >= norm_blocks) {
        mla_small::kv_rows_small(kv, kRow, kv_norm, eps, positions, inv_freq, rope_scale, cache, capacity, slots, m,
                                 blk - norm_blocks);
      } else if (by_block) {
        const long long r = blk;
        const bf16* src = qa + r * q_lora;
        bf16* dst = cq + r * q_lora;
        if (vec) rmsnorm_row<kThreads, true, false>(src, nullptr, qa_norm, dst, nullptr, q_lora, eps);
        else rmsnorm_row<kThreads, false, false>(src, nullptr, qa_norm, dst, nullptr, q_lora, eps);
      } else {
        const long long r = (long long)blk * 8 + warp;
        if (r < m) {
          const bf16* src = qa + r * q_lora;
          bf16* dst = cq + r * q_lora;
          if (vec) rmsnorm_row<32, true, false>(src, nullptr, qa_norm, dst, nullptr, q_lora, eps);
          else rmsnorm_row<32, false, false>(src, nullptr, qa_norm, dst, nullptr, q_lora, eps);
        }
      }
    }
  }
  grid_sync(bar);

  // 3: q_b
  for (int tile = blockIdx.x, n = tiles_of(heads * qk, wn_b); tile < n; tile += gridDim.x)
    pair_tile<1, bf16>(red, cq, m, q_lora, w_qb, heads * qk, q, nullptr, 0, nullptr, wn_b, split_b, tile);
  grid_sync(bar);

  // 4: the absorbed query with its RoPE; grid (512 / 32 + 1, H, ceil(M / 8)) of (32, 8)
  {
    const int bx_n = kLat / 32 + 1, blocks = bx_n * heads * ((m + 7) / 8);
    for (int blk = blockIdx.x; blk < blocks; blk += gridDim.x)
      mla_small::query_small(q, (long long)heads * qk, qk, nope, kv_b, (long long)(nope + vhead) * kLat, kLat, q_att,
                             positions, inv_freq, rope_scale, m, heads, blk % bx_n, blk / bx_n % heads,
                             blk / (bx_n * heads), threadIdx.x & 31, warp);
  }
  prefetch_share(w_o, (long long)hidden * heads * vhead * 2);
  grid_sync(bar);

  // 5: attention over the cache (the d16 variant's CTAs on this CTA's first 4 warps)
  if (warp < CfgAtt::NW)
    for (int c = blockIdx.x; c < att_grid; c += gridDim.x)
      mla::split_body<CfgAtt>(q_att, cache, page_table, pt_stride, page_size, heads, work, cta_work, req_info, mask,
                              mask_words, o_lat, lse, o_part, lse_part, scale_log2, c);
  grid_sync(bar);

  // 6: the split merge (128 threads per (item, row) pair)
  if (merges) {
    if (threadIdx.x < mla::DV / 4)
      mla::merge_rows(merge, merge_count, o_part, lse_part, CfgAtt::BM, o_lat, lse, blockIdx.x, gridDim.x);
    grid_sync(bar);
  }

  // 7: W_UV; grid (ceil(v_head / 32), H, ceil(M / 8)) of (32, 8)
  {
    const int bx_n = (vhead + 31) / 32, blocks = bx_n * heads * ((m + 7) / 8);
    for (int blk = blockIdx.x; blk < blocks; blk += gridDim.x)
      mla_small::head_gemm_small(o_lat, (long long)heads * kLat, kLat, kv_b + (long long)nope * kLat,
                                 (long long)(nope + vhead) * kLat, 1, kLat, o, (long long)heads * vhead, vhead, m,
                                 kLat, vhead, blk % bx_n, blk / bx_n % heads, blk / (bx_n * heads), threadIdx.x & 31,
                                 warp);
  }
  grid_sync(bar);

  // 8: o_proj
  for (int tile = blockIdx.x, n = tiles_of(hidden, wn_o); tile < n; tile += gridDim.x)
    pair_tile<1, Out>(red, o, m, heads * vhead, w_o, hidden, out, nullptr, 0, nullptr, wn_o, split_o, tile);

  // 9 (one rank, when asked): the residual add and the post-attention RMSNorm of the output
  if constexpr (sizeof(Out) == 2) {
    if (residual) {
      grid_sync(bar);
      residual_norm_rows(out, residual, norm_w, y_norm, res_out, m, hidden, norm_eps);
    }
  }
}

}  // namespace

#define MLA_BLOCK_PARAMS(OUT)                                                                                        \
  bf16 *x, int m, int hidden, int q_lora, int heads, int nope, int vhead,                                           \
      const bf16 *__restrict__ w_qa, const bf16 *__restrict__ w_kva, const bf16 *__restrict__ qa_norm,               \
      const bf16 *__restrict__ kv_norm, float eps, const bf16 *__restrict__ w_qb, const bf16 *__restrict__ kv_b,      \
      const bf16 *__restrict__ w_o,                                                                                   \
      const int *__restrict__ positions, const float *__restrict__ inv_freq, float rope_scale,                        \
      bf16 *__restrict__ cache, long long capacity, const int *__restrict__ slots,                                    \
      const int *__restrict__ page_table, int pt_stride, int page_size, const int *__restrict__ work,                 \
      const int *__restrict__ cta_work, const int *__restrict__ req_info,                                             \
      const unsigned long long *__restrict__ mask, int mask_words, float *__restrict__ o_part,                        \
      float *__restrict__ lse_part, const int *__restrict__ merge, const int *__restrict__ merge_count, int att_grid, \
      int merges, float scale_log2, bf16 *__restrict__ qa, bf16 *__restrict__ cq, bf16 *__restrict__ kv,              \
      bf16 *__restrict__ q, bf16 *__restrict__ q_att, bf16 *__restrict__ o_lat, float *__restrict__ lse,              \
      bf16 *__restrict__ o, OUT *__restrict__ out, int wn_a, int split_a, int wn_b, int split_b, int wn_o,            \
      int split_o, const bf16 *residual, const bf16 *__restrict__ norm_w, float norm_eps, bf16 *__restrict__ y_norm, \
      bf16 *res_out, const float *pro_sum, const float *pro_plus, const bf16 *pro_res, const bf16 *__restrict__ pro_w, \
      float pro_eps, bf16 *pro_res_out, unsigned *__restrict__ bar
#define MLA_BLOCK_ARGS                                                                                               \
  x, m, hidden, q_lora, heads, nope, vhead, w_qa, w_kva, qa_norm, kv_norm, eps, w_qb, kv_b, w_o, positions,         \
      inv_freq, rope_scale, cache, capacity, slots, page_table, pt_stride, page_size, work, cta_work, req_info, mask, \
      mask_words, o_part, lse_part, merge, merge_count, att_grid, merges, scale_log2, qa, cq, kv, q, q_att, o_lat,    \
      lse, o, out, wn_a, split_a, wn_b, split_b, wn_o, split_o, residual, norm_w, norm_eps, y_norm, res_out, pro_sum, \
      pro_plus, pro_res, pro_w, pro_eps, pro_res_out, bar

// out bf16 [M, hidden] (one rank) or fp32 (a tensor-parallel rank's unrounded partial).
extern "C" __global__ void __launch_bounds__(kThreads, 1) mla_block_small(MLA_BLOCK_PARAMS(bf16)) {
  block_body<bf16>(MLA_BLOCK_ARGS);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) mla_block_small_f32(MLA_BLOCK_PARAMS(float)) {
  block_body<float>(MLA_BLOCK_ARGS);
}
