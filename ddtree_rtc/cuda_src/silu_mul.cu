// SiLU(gate) * up over a fused [gate | up] input: out[r, j] = bf16(silu(x[r, j]) * x[r, I + j]),
// silu(g) = g / (1 + exp(-g)), fp32 math with the accurate expf.
// Grid (rows, chunks): each block handles up to 4 * blockDim units of one row; a unit is 8
// elements (16-byte accesses) when I % 8 == 0 and the arrays are 16-byte aligned, else 1.
#include "common.cuh"

using namespace ddt;

constexpr int UNITS_PER_THREAD = 4;

__device__ __forceinline__ float silu_mul1(float g, float u) { return g / (1.f + expf(-g)) * u; }

template <bool VEC>
__device__ __forceinline__ void silu_mul_row(const bf16* x, bf16* y, int inter) {
  const int units = VEC ? inter / 8 : inter;
  const int first = blockIdx.y * blockDim.x * UNITS_PER_THREAD + threadIdx.x;
  if (VEC) {
    bf16x8 g[UNITS_PER_THREAD], u[UNITS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; ++k) {
      const int c = first + k * blockDim.x;
      if (c < units) {
        g[k] = reinterpret_cast<const bf16x8*>(x)[c];
        u[k] = reinterpret_cast<const bf16x8*>(x + inter)[c];
      }
    }
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; ++k) {
      const int c = first + k * blockDim.x;
      if (c < units) {
        bf16x8 o;
#pragma unroll
        for (int j = 0; j < 8; ++j) o.v[j] = to_bf16(silu_mul1(to_f32(g[k].v[j]), to_f32(u[k].v[j])));
        reinterpret_cast<bf16x8*>(y)[c] = o;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < UNITS_PER_THREAD; ++k) {
      const int c = first + k * blockDim.x;
      if (c < units) y[c] = to_bf16(silu_mul1(to_f32(x[c]), to_f32(x[inter + c])));
    }
  }
}

// x: [rows, 2 * inter] bf16; y: [rows, inter] bf16; both contiguous.
extern "C" __global__ void __launch_bounds__(256, 1) silu_mul_kernel(const bf16* __restrict__ x,
                                                                     bf16* __restrict__ y, int inter,
                                                                     int vec) {
  const long long r = blockIdx.x;
  if (vec) silu_mul_row<true>(x + r * 2 * inter, y + r * inter, inter);
  else silu_mul_row<false>(x + r * 2 * inter, y + r * inter, inter);
}
