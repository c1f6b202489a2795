// The small-M path's MLA pieces (M <= 64 tokens), each row-invariant: q_a and kv_a in one skinny
// launch (mla_qkv_a_small_s*), the absorbed query with its RoPE (mla_query_small), the cache rows with
// their norm and RoPE (mla_kv_rows_small), and the per-head GEMMs (mla_head_gemm_small: W_UK
// absorption q_nope [T, H, 128] x W_UK[h] [128, 512], W_UV expansion o_lat [T, H, 512] x W_UV[h]^T).
// The GEMMs: one thread per output element, its sum over k in a fixed order (four fp32 accumulators k mod 4,
// added (a0 + a1) + (a2 + a3)), so a token's values do not depend on T or on the other tokens, unlike
// the strided-batched cuBLAS GEMM of the general path, whose kernel choice follows T.
// Weights are tiny (1 MB per layer at 8 heads) and L2-resident after their first use; x is broadcast
// across a warp (its 32 lanes are 32 output columns of one token and head).
#include "common.cuh"
#include "mla_small.cuh"
#include "skinny_pair.cuh"

using namespace ddt;
using namespace ddt::mla_small;

// q_a and kv_a over the same x in one launch (include/skinny_pair.cuh, MODE 1): [m, q_lora] and
// [m, 576] bf16.
SKINNY_PAIR_ENTRY(mla_qkv_a_small_s1, 1, , 1)
SKINNY_PAIR_ENTRY(mla_qkv_a_small_s2, 2, __cluster_dims__(2, 1, 1), 1)
SKINNY_PAIR_ENTRY(mla_qkv_a_small_s4, 4, __cluster_dims__(4, 1, 1), 1)
SKINNY_PAIR_ENTRY(mla_qkv_a_small_s8, 8, __cluster_dims__(8, 1, 1), 1)

extern "C" __global__ void __launch_bounds__(256) mla_head_gemm_small(
    const bf16* __restrict__ x, long long x_t, long long x_h, const bf16* __restrict__ w, long long w_h,
    long long w_k, long long w_n, bf16* __restrict__ out, long long o_t, long long o_h, int T, int K, int N) {
  pdl_wait();  // x comes from the previous kernel (launched under PDL where the GPU has it)
  pdl_trigger();
  head_gemm_small(x, x_t, x_h, w, w_h, w_k, w_n, out, o_t, o_h, T, K, N, blockIdx.x, blockIdx.y, blockIdx.z,
                  threadIdx.x, threadIdx.y);
}

extern "C" __global__ void __launch_bounds__(256) mla_query_small(
    const bf16* __restrict__ q, long long q_t, long long q_h, int nope, const bf16* __restrict__ w, long long w_h,
    long long w_k, bf16* __restrict__ q_att, const int* __restrict__ positions, const float* __restrict__ inv_freq,
    float rope_scale, int T, int H) {
  pdl_wait();  // q comes from the previous kernel
  pdl_trigger();
  query_small(q, q_t, q_h, nope, w, w_h, w_k, q_att, positions, inv_freq, rope_scale, T, H, blockIdx.x, blockIdx.y,
              blockIdx.z, threadIdx.x, threadIdx.y);
}

extern "C" __global__ void __launch_bounds__(256) mla_kv_rows_small(
    const bf16* __restrict__ kv, long long kv_t, const bf16* __restrict__ norm_w, float eps,
    const int* __restrict__ positions, const float* __restrict__ inv_freq, float rope_scale,
    bf16* __restrict__ cache, long long capacity, const int* __restrict__ slots, int T) {
  pdl_wait();  // kv comes from the previous kernel; the cache rows written here are read after
  pdl_trigger();
  kv_rows_small(kv, kv_t, norm_w, eps, positions, inv_freq, rope_scale, cache, capacity, slots, T, blockIdx.x);
}
