// The MLA per-head GEMMs of the small-M path (M <= 64 tokens), row-invariant: W_UK absorption
// (q_nope [T, H, 128] x W_UK[h] [128, 512]) and W_UV expansion (o_lat [T, H, 512] x W_UV[h]^T).
// One thread per output element, its sum over k in a fixed order (four fp32 accumulators k mod 4,
// added (a0 + a1) + (a2 + a3)), so a token's values do not depend on T or on the other tokens, unlike
// the strided-batched cuBLAS GEMM of the general path, whose kernel choice follows T.
// Weights are tiny (1 MB per layer at 8 heads) and L2-resident after their first use; x is broadcast
// across a warp (its 32 lanes are 32 output columns of one token and head).
#include "common.cuh"

using namespace ddt;

// x [T, H, K] (element strides x_t, x_h; k contiguous); W[h](k, n) at w + h * w_h + k * w_k + n * w_n;
// out [T, H, N] (strides o_t, o_h; n contiguous). Grid (ceil(N / 32), H, ceil(T / 8)), block (32, 8).
extern "C" __global__ void __launch_bounds__(256) mla_head_gemm_small(
    const bf16* __restrict__ x, long long x_t, long long x_h, const bf16* __restrict__ w, long long w_h,
    long long w_k, long long w_n, bf16* __restrict__ out, long long o_t, long long o_h, int T, int K, int N) {
  const int n = blockIdx.x * 32 + threadIdx.x, h = blockIdx.y, t = blockIdx.z * 8 + threadIdx.y;
  if (n >= N || t >= T) return;
  const bf16* __restrict__ xr = x + t * x_t + h * x_h;
  const bf16* __restrict__ wc = w + h * w_h + n * w_n;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  int k = 0;
  for (; k + 4 <= K; k += 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = fmaf(to_f32(xr[k + i]), to_f32(wc[(long long)(k + i) * w_k]), a[i]);
  }
  for (int i = 0; k < K; ++k, ++i) a[i] = fmaf(to_f32(xr[k]), to_f32(wc[(long long)k * w_k]), a[i]);
  out[t * o_t + h * o_h + n] = to_bf16((a[0] + a[1]) + (a[2] + a[3]));
}
