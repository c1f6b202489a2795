// Embedding gather: out[r] = table[ids[r]] for ids in [0, V); an id outside [0, V) writes a NaN row
// (the engine validates ids on the host; a NaN row makes a slip loud instead of a silent wrong row).
// Grid (n, chunks): each block copies up to 4 * blockDim units of one row, 16-byte units when the
// row length is a multiple of 8 and both arrays are 16-byte aligned, else single elements.
#include "common.cuh"

using namespace ddt;

constexpr int UNITS_PER_THREAD = 4;

template <typename U>
__device__ __forceinline__ U nan_unit();
template <>
__device__ __forceinline__ uint4 nan_unit<uint4>() {
  return make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
}
template <>
__device__ __forceinline__ unsigned short nan_unit<unsigned short>() {
  return 0x7FC0;
}

template <typename U>
__device__ __forceinline__ void copy_row(const U* src, U* dst, int units, bool valid) {
  const int first = blockIdx.y * blockDim.x * UNITS_PER_THREAD + threadIdx.x;
  U v[UNITS_PER_THREAD];
#pragma unroll
  for (int k = 0; k < UNITS_PER_THREAD; ++k) {
    const int u = first + k * blockDim.x;
    if (u < units) v[k] = valid ? src[u] : nan_unit<U>();
  }
#pragma unroll
  for (int k = 0; k < UNITS_PER_THREAD; ++k) {
    const int u = first + k * blockDim.x;
    if (u < units) dst[u] = v[k];
  }
}

// ids: int32 [n]; table: [V, D] bf16; out: [n, D] bf16.
extern "C" __global__ void __launch_bounds__(256, 1) embedding_kernel(const int* __restrict__ ids,
                                                                      const bf16* __restrict__ table,
                                                                      bf16* __restrict__ out, int V, int D,
                                                                      int vec) {
  const long long r = blockIdx.x;
  const int id = ids[r];
  const bool valid = id >= 0 && id < V;
  const long long src_row = valid ? (long long)id * D : 0;
  if (vec) {
    copy_row(reinterpret_cast<const uint4*>(table + src_row), reinterpret_cast<uint4*>(out + r * D), D / 8,
             valid);
  } else {
    copy_row(reinterpret_cast<const unsigned short*>(table + src_row),
             reinterpret_cast<unsigned short*>(out + r * D), D, valid);
  }
}
