// RoPE in place on the slice [rot_offset, rot_offset + rot_dim) of every head.
//   interleaved (GPT-J, MLA's q_pe/k_pe): pair (x[2i], x[2i+1]) rotated by frequency i
//   half (rotate-half, the drafter):     pair (x[i], x[i + rot_dim/2]) rotated by frequency i
// angle = fl32(pos) * inv_freq[i] (one fp32 rounding), accurate sincosf, cos/sin times `scale`;
// y0 = x0*c - x1*s, y1 = x0*s + x1*c in fp32, rounded to bf16.
// One block per token: cos/sin for the token go to shared memory once, then the block sweeps
// the heads' pairs (consecutive threads take consecutive pairs, so accesses coalesce).
#include "common.cuh"

using namespace ddt;

// x: [tokens, heads, head_dim] bf16, contiguous. Dynamic shared memory: rot_dim floats.
// pair_vec: interleaved pairs are 4-byte aligned, so each pair is one bf16x2 access.
extern "C" __global__ void __launch_bounds__(256, 1) rope_kernel(
    bf16* x, const int* __restrict__ positions, const float* __restrict__ inv_freq, int heads,
    int head_dim, int rot_offset, int rot_dim, int interleaved, int pair_vec, float scale) {
  extern __shared__ float cs[];  // [half] cos, then [half] sin
  const int half = rot_dim >> 1;
  const long long t = blockIdx.x;
  const float pos = (float)positions[t];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(__fmul_rn(pos, inv_freq[i]), &s, &c);
    cs[i] = c * scale;
    cs[half + i] = s * scale;
  }
  __syncthreads();
  bf16* base = x + t * heads * head_dim + rot_offset;
  const int pairs = heads * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int h = p / half, i = p - h * half;
    bf16* hp = base + (long long)h * head_dim;
    const float c = cs[i], s = cs[half + i];
    if (interleaved) {
      float a, b;
      if (pair_vec) {
        const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(hp + 2 * i);
        a = to_f32(v.x);
        b = to_f32(v.y);
        __nv_bfloat162 r;
        r.x = to_bf16(a * c - b * s);
        r.y = to_bf16(a * s + b * c);
        *reinterpret_cast<__nv_bfloat162*>(hp + 2 * i) = r;
      } else {
        a = to_f32(hp[2 * i]);
        b = to_f32(hp[2 * i + 1]);
        hp[2 * i] = to_bf16(a * c - b * s);
        hp[2 * i + 1] = to_bf16(a * s + b * c);
      }
    } else {
      const float a = to_f32(hp[i]), b = to_f32(hp[i + half]);
      hp[i] = to_bf16(a * c - b * s);
      hp[i + half] = to_bf16(a * s + b * c);
    }
  }
}
