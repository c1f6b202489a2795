// The small-M path's MLA pieces (M <= 64 tokens), each row-invariant: q_a and kv_a in one skinny
// launch (mla_qkv_a_small_m*_s*), the absorbed query with its RoPE and, in the same launch, the cache
// rows with their norm and RoPE (mla_query_small), and the per-head GEMMs (mla_head_gemm_small: W_UK
// absorption q_nope [T, H, 128] x W_UK[h] [128, 512], W_UV expansion o_lat [T, H, 512] x W_UV[h]^T).
//
// The head GEMMs (include/mla_small.cuh: head_gemm_kc for W_UV's k-contiguous rows, head_gemm_nc for
// W_UK's n-contiguous rows; mla_query_small is head_gemm_nc plus the RoPE). At T = 1 and a TP8 rank's 8
// heads each is a 1 MB weight read feeding a few thousand outputs, so its time is load latency, and
// what cuts it is many loads in flight, not arithmetic: one CTA per (head, 32 output columns, group of
// G tokens), all 256 threads splitting the K sum of those columns, each thread's weight loads 16 bytes
// wide, coalesced along the weight rows and independent of each other. Weights never depend on the
// previous kernel, so their L2 prefetch and register loads come before the PDL wait; x after it.
// Row invariance by construction: which thread adds which k, and the tree that combines the threads'
// fp32 partials (shuffles in a fixed lane order, then the warps in warp order through shared memory),
// follow from K alone; no atomics, nothing chosen from T or the SM count. G (1, 2, 4 or 8: the smallest
// power of two >= min(T, 8)) only says how many tokens a CTA takes; a token's arithmetic is the same
// for every G, and the tree's sum does not depend on which lane ends up holding it (fp32 addition
// commutes). Tokens beyond 8 go to more CTAs (grid z), not a longer loop in one: at T = 64 the fp32
// FMAs are the cost (64 per thread and token for W_UV), better spread over the SMs than serialised to
// reuse weights that L2 serves anyway. Views whose rows are not 16-byte aligned, or whose vectors are not
// whole (K or N not a multiple of 8), take scalar loads: the same sums, the same bits.
#include "common.cuh"
#include "mla_small.cuh"
#include "skinny_pair.cuh"

using namespace ddt;
using namespace ddt::mla_small;

// q_a and kv_a over the same x in one launch (include/skinny_pair.cuh, MODE 1): [m, q_lora] and
// [m, 576] bf16; an entry per token bucket (m8 .. m64, picked from M) and cluster size (s1 .. s8).
SKINNY_PAIR_ENTRIES(mla_qkv_a_small_m8, 1, 1)
SKINNY_PAIR_ENTRIES(mla_qkv_a_small_m16, 2, 1)
SKINNY_PAIR_ENTRIES(mla_qkv_a_small_m32, 4, 1)
SKINNY_PAIR_ENTRIES(mla_qkv_a_small_m64, 8, 1)

// The bodies' instantiations: F<G, VEC>::run(args...) for group = G (1, 2, 4, 8) and vec = VEC.
template <template <int, bool> class F, typename... A>
__device__ __forceinline__ void dispatch(int group, int vec, A... a) {
  if (vec) {
    switch (group) {
      case 8: F<8, true>::run(a...); break;
      case 4: F<4, true>::run(a...); break;
      case 2: F<2, true>::run(a...); break;
      default: F<1, true>::run(a...);
    }
  } else {
    switch (group) {
      case 8: F<8, false>::run(a...); break;
      case 4: F<4, false>::run(a...); break;
      case 2: F<2, false>::run(a...); break;
      default: F<1, false>::run(a...);
    }
  }
}
template <int G, bool VEC>
struct HeadGemm {
  template <typename... A>
  __device__ __forceinline__ static void run(A... a) { head_gemm_small<G, VEC>(a...); }
};
template <int G, bool VEC>
struct Query {
  template <typename... A>
  __device__ __forceinline__ static void run(A... a) { query_small<G, VEC>(a...); }
};

// Grid (ceil(N / 32), H, ceil(T / group)), 256 threads; kc, vec, group: kernels/mla_small.head_gemm_plan
// (vec: the host's promise of aligned, whole 16-byte vectors). The bodies load their first weights, then
// wait on the previous kernel (x is its output), then let the next one launch. Two CTAs per SM (at most
// 128 registers): W_UV's grid at T = 64 (256 CTAs) fits the SMs of an H100 at once.
extern "C" __global__ void __launch_bounds__(kThreads, 2) mla_head_gemm_small(
    const bf16* __restrict__ x, long long x_t, long long x_h, const bf16* __restrict__ w, long long w_h,
    long long w_k, long long w_n, bf16* __restrict__ out, long long o_t, long long o_h, int T, int K, int N,
    int group, int kc, int vec) {
  __shared__ float red[kRedTokens * 8 * kTile];
  dispatch<HeadGemm>(group, vec, x, x_t, x_h, w, w_h, w_k, w_n, out, o_t, o_h, T, K, N, kc != 0, red);
}

// Grid (512 / 32 + 1 + rows, H, ceil(T / group)), 256 threads; the same waits as mla_head_gemm_small.
// rows: the last column of CTAs writes the new tokens' cache rows instead (kv [T, 576] = x W_kva^T,
// row stride kv_t -> cache row slots[t] = [RMSNorm(c) * norm_w | RoPE(k_pe)], include/mla_small.cuh's
// kv_rows_small: 8 tokens a CTA, the column's H x ceil(T / group) CTAs taking the blocks of 8 in
// turn), so the query and the rows are one launch; they are independent (kv is an output of two
// launches back, q of the previous one: the PDL wait covers both).
extern "C" __global__ void __launch_bounds__(kThreads, 2) mla_query_small(
    const bf16* __restrict__ q, long long q_t, long long q_h, int nope, const bf16* __restrict__ w, long long w_h,
    long long w_k, bf16* __restrict__ q_att, const int* __restrict__ positions, const float* __restrict__ inv_freq,
    float rope_scale, int T, int H, int group, int vec, const bf16* __restrict__ kv, long long kv_t,
    const bf16* __restrict__ norm_w, float eps, bf16* __restrict__ cache, long long capacity,
    const int* __restrict__ slots, int rows) {
  __shared__ float red[kRedTokens * 8 * kTile];
  if (rows && blockIdx.x == gridDim.x - 1) {
    pdl_wait();  // kv comes from an earlier kernel; the cache rows written here are read after
    pdl_trigger();
    const int per = gridDim.y * gridDim.z, blocks = (T + 7) / 8;
    for (int blk = blockIdx.z * gridDim.y + blockIdx.y; blk < blocks; blk += per)
      kv_rows_small(kv, kv_t, norm_w, eps, positions, inv_freq, rope_scale, cache, capacity, slots, T, blk);
    return;
  }
  dispatch<Query>(group, vec, q, q_t, q_h, nope, w, w_h, w_k, q_att, positions, inv_freq, rope_scale, T, H, red);
}
