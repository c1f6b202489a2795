// The small-M path's MoE layer in one launch (M <= 64 tokens): a persistent kernel whose phases are the
// bodies of the small-M path's separate kernels, separated by grid-wide barriers (the scheme of
// mla_block.cu; helpers in include/persistent.cuh).
//   1 dense part      x -> router logits fp32 [M, E], shared bf16(silu(gate) * up) [M, Is]   (moe_small_dense)
//   2 routing         logits -> ids, weights [M, top_k] (one warp per token)                 (moe_route_e*)
//     shared down     hs -> shared [M, H] (bf16, or the fp32 partial of a tensor-parallel rank)  (linear)
//   3 routed gate_up  each CTA's routing from the ids, then (touched expert, 16-row tile) items -> h
//                                                                                             (moe_small_gate_up)
//   4 down + combine  16-row tiles of H: the touched experts' down values, the weighted sum over the
//                     slots in order (+ the shared expert where it is added here) -> y     (moe_small_down)
//   5 residual norm   one rank, when a residual is given: res_out = y + residual, y_norm = RMSNorm(res_out)
//                     (the decoder's next norm)                                          (rmsnorm)
// and first, on a tensor-parallel rank when a prologue is given:
//   0 prologue        the attention's all-reduced fp32 output rounded to bf16 as backend.to_bf16 rounds it,
//                     + residual, RMSNorm -> x (this layer's input) and pro_res_out (the new residual)
//                                                                                         (to_bf16, rmsnorm)
// Every phase walks its separate kernel's items with the same indices and the same device code
// (include/persistent.cuh, moe_route.cuh, moe_small.cuh), so every value has the separate kernels'
// bits; the skinny linears' cluster splits run serially in rank order (skinny::serial_split_sum).
// Activations written in one phase and read in a later one through the separate kernels' read-only
// loads (the skinny x, the down GEMM's h) go through L2 here (ld.global.cg; see mla_block.cu).
// Weights: the router and shared gate_up go to L2 before the PDL wait, the shared down during phase 1,
// this CTA's share of the touched experts' down weights during the gate_up (once the routing is known,
// and when they are few: at most 16 MB).
#include "common.cuh"
#include "moe_route.cuh"
#include "moe_small.cuh"
#include "persistent.cuh"

using namespace ddt;
using namespace ddt::persist;

namespace {

constexpr int kRouteWarps = kThreads / 32;  // tokens routed per virtual CTA (a warp each)
// the touched experts' down weights go to L2 ahead only while they fit beside the gate_up stream
constexpr long long kDownPrefetchBytes = 16ll << 20;

// E <= 32 * EPL. Dynamic shared memory: the larger of the routing's scratch (n_group > 1: a warp's E
// floats), the gate_up rings and the down rings + P x 16 fp32 down values (kernels/moe_block.py).
template <int EPL, typename Out>
__device__ __forceinline__ void layer_body(
    bf16* x, int m, int hidden, const bf16* __restrict__ gate_w, int E,
    const float* __restrict__ bias, const bf16* __restrict__ shared_w13, int i2, const bf16* __restrict__ shared_w2,
    const unsigned char* __restrict__ w13, long long w13_expert_bytes, const unsigned char* __restrict__ w2,
    long long w2_expert_bytes, int local_e, int inter, int id_offset, int top_k, int n_group, int topk_group,
    int norm, float scaling, float* __restrict__ logits, bf16* __restrict__ hs, int* __restrict__ ids,
    float* __restrict__ topk_w, bf16* __restrict__ shared, Out* __restrict__ shared_part, bf16* __restrict__ h,
    Out* __restrict__ y, int wn_d, int split_d, int wn_s, int split_s, const bf16* residual,
    const bf16* __restrict__ norm_w, float norm_eps, bf16* __restrict__ y_norm, bf16* res_out,
    const float* pro_sum, const float* pro_plus, const bf16* pro_res, const bf16* __restrict__ pro_w, float pro_eps,
    bf16* pro_res_out, unsigned* __restrict__ bar) {
  extern __shared__ __align__(16) unsigned char ring[];
  __shared__ float4 red[skinny::kWarps][kMT][32];
  __shared__ moe_small::Routing r;
  __shared__ int cols[moe_small::kWarps][moe_small::kMaxTokens];
  const int warp = threadIdx.x >> 5, is = i2 / 2, p_total = m * top_k;

  // 1: router logits and the shared expert's SiLU(gate) * up; their weights to L2 before the wait
  prefetch_share(gate_w, (long long)E * hidden * 2);
  prefetch_share(shared_w13, (long long)i2 * hidden * 2);
  pdl_wait();
  pdl_trigger();
  // 0 (a tensor-parallel rank): the attention's residual norm makes x
  if (pro_sum) {
    residual_norm_rows(RoundedSum{pro_sum, pro_plus}, pro_res, pro_w, x, pro_res_out, m, hidden, pro_eps);
    grid_sync(bar);
  }
  for (int tile = blockIdx.x, n = tiles_of(E + i2, wn_d); tile < n; tile += gridDim.x)
    pair_tile<0, float>(red, x, m, hidden, gate_w, E, logits, shared_w13, i2, hs, wn_d, split_d, tile);
  prefetch_share(shared_w2, (long long)hidden * is * 2);
  grid_sync(bar);

  // 2: the routing (a warp per token) and the shared expert's down projection
  {
    const int route_blocks = (m + kRouteWarps - 1) / kRouteWarps, down_tiles = tiles_of(hidden, wn_s);
    for (int blk = blockIdx.x; blk < route_blocks + down_tiles; blk += gridDim.x) {
      if (blk < route_blocks)
        route::route_token<EPL>(logits, bias, blk * kRouteWarps + warp, m, E, top_k, n_group, topk_group, norm,
                                scaling, ids, topk_w, reinterpret_cast<float*>(ring) + warp * E);
      else if (shared_part)
        pair_tile<1, Out>(red, hs, m, is, shared_w2, hidden, shared_part, nullptr, 0, nullptr, wn_s, split_s,
                          blk - route_blocks);
      else
        pair_tile<1, bf16>(red, hs, m, is, shared_w2, hidden, shared, nullptr, 0, nullptr, wn_s, split_s,
                           blk - route_blocks);
    }
  }
  grid_sync(bar);

  // 3: the routed gate_up (moe_small_gate_up's items); the touched experts' down weights to L2 meanwhile
  moe_small::build_routing(ids, p_total, top_k, local_e, id_offset, r);
  if ((long long)r.num_touched * w2_expert_bytes <= kDownPrefetchBytes)
    for (int j = 0; j < r.num_touched; ++j)
      prefetch_share(w2 + (long long)r.touched[j] * w2_expert_bytes, w2_expert_bytes);
  {
    const int tiles = 2 * inter / 16, items = r.num_touched * tiles;
    for (int item = blockIdx.x; item < items; item += gridDim.x)
      moe_small::gate_up_item<true>(w13, w13_expert_bytes, x, top_k, hidden, inter, r.touched[item / tiles],
                                    item % tiles, r, cols[0], ring, h);
  }
  grid_sync(bar);

  // 4: down + the weighted combine (moe_small_down's tiles)
  float* dsm = reinterpret_cast<float*>(ring + moe_small::kWarps * moe_small::kWarpRingBytes);  // [P][16]
  for (int tile = blockIdx.x, tiles = hidden / 16; tile < tiles; tile += gridDim.x) {
    moe_small::down_tile<true>(w2, w2_expert_bytes, h, top_k, inter, tile, r, cols, ring, dsm, false);
    __syncthreads();
    moe_small::combine_tile(r, dsm, topk_w, m, top_k, local_e, hidden, tile, shared_part ? nullptr : shared, y,
                            sizeof(Out) == 4);
    __syncthreads();  // dsm and the rings are reused by the next tile
  }

  // 5 (one rank, when asked): the residual add and the next RMSNorm of the output
  if constexpr (sizeof(Out) == 2) {
    if (residual) {
      grid_sync(bar);
      residual_norm_rows(y, residual, norm_w, y_norm, res_out, m, hidden, norm_eps);
    }
  }
}

}  // namespace

// x bf16 [M, H]; gate_w bf16 [E, H]; bias fp32 [E] or null; shared_w13 bf16 [2 Is, H]; shared_w2 bf16
// [H, Is]; w13 / w2 the routed experts in the "mma" INT4 layout (local_e of them, the first id_offset);
// scratch logits fp32 [M, E], hs bf16 [M, Is], ids int32 / topk_w fp32 [M, top_k], shared bf16 [M, H],
// h bf16 [M top_k, I]. bf16 entries: y bf16 = routed + shared (one rank); _f32: y fp32 the routed
// partial and shared_part fp32 the shared expert's partial (a tensor-parallel rank's two sums). residual
// (or null), norm_w, norm_eps, y_norm, res_out: phase 5; pro_sum (or null), pro_plus (or null), pro_res,
// pro_w, pro_eps, pro_res_out: phase 0, which writes x.
#define MOE_BLOCK_PARAMS(OUT)                                                                                        \
  bf16 *x, int m, int hidden, const bf16 *__restrict__ gate_w, int E,                                              \
      const float *__restrict__ bias, const bf16 *__restrict__ shared_w13, int i2,                                   \
      const bf16 *__restrict__ shared_w2, const unsigned char *__restrict__ w13, long long w13_expert_bytes,         \
      const unsigned char *__restrict__ w2, long long w2_expert_bytes, int local_e, int inter, int id_offset,       \
      int top_k, int n_group, int topk_group, int norm, float scaling, float *__restrict__ logits,                  \
      bf16 *__restrict__ hs, int *__restrict__ ids, float *__restrict__ topk_w, bf16 *__restrict__ shared,           \
      OUT *__restrict__ shared_part, bf16 *__restrict__ h, OUT *__restrict__ y, int wn_d, int split_d, int wn_s,    \
      int split_s, const bf16 *residual, const bf16 *__restrict__ norm_w, float norm_eps, bf16 *__restrict__ y_norm,  \
      bf16 *res_out, const float *pro_sum, const float *pro_plus, const bf16 *pro_res, const bf16 *__restrict__ pro_w, \
      float pro_eps, bf16 *pro_res_out, unsigned *__restrict__ bar
#define MOE_BLOCK_ARGS                                                                                               \
  x, m, hidden, gate_w, E, bias, shared_w13, i2, shared_w2, w13, w13_expert_bytes, w2, w2_expert_bytes, local_e,     \
      inter, id_offset, top_k, n_group, topk_group, norm, scaling, logits, hs, ids, topk_w, shared, shared_part, h, \
      y, wn_d, split_d, wn_s, split_s, residual, norm_w, norm_eps, y_norm, res_out, pro_sum, pro_plus, pro_res, pro_w, \
      pro_eps, pro_res_out, bar
#define MOE_BLOCK_ENTRY(NAME, EPL, OUT)                                                                              \
  extern "C" __global__ void __launch_bounds__(kThreads, 1) NAME(MOE_BLOCK_PARAMS(OUT)) {                           \
    layer_body<EPL, OUT>(MOE_BLOCK_ARGS);                                                                            \
  }

// routers of up to 384 experts (K2.6); larger ones run the separate kernels. The routing's values do not
// depend on EPL (experts past E hold key 0), so these give moe_route_e64 .. e384's bits.
MOE_BLOCK_ENTRY(moe_block_small, 12, bf16)
MOE_BLOCK_ENTRY(moe_block_small_f32, 12, float)
