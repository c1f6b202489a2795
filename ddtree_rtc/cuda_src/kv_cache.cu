// Paged KV cache row moves, 16 bytes per access. A cache is [pages * page_size, row] (one layer) or
// [layers][pages * page_size, row]; position p of a request lives at slot
// page_table[p / page_size] * page_size + p % page_size.
#include "common.cuh"

// cache[slots[i]] = rows[i] for i < n; slots outside [0, capacity) are skipped (padding tokens).
// rows: n rows of row16 16-byte chunks, rows_stride16 apart.
extern "C" __global__ void __launch_bounds__(256, 1) kv_cache_write_kernel(
    uint4* __restrict__ cache, long long capacity, const uint4* __restrict__ rows, long long rows_stride16,
    const int* __restrict__ slots, int n, int row16) {
  const long long total = (long long)n * row16;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int r = (int)(i / row16), c = (int)(i % row16);
    const int slot = slots[r];
    if (slot >= 0 && slot < capacity) cache[(long long)slot * row16 + c] = rows[r * rows_stride16 + c];
  }
}

constexpr int COMMIT_THREADS = 256;
constexpr int COMMIT_ITEMS = 8;  // 16-byte chunks held in registers per thread per step

__device__ __forceinline__ long long slot_of(const int* __restrict__ pt, int page_size, int pos) {
  return (long long)pt[pos / page_size] * page_size + pos % page_size;
}

// DDTree commit, in place, one CTA per (request, layer): the row of accepted node acc[j] (written at
// position prefix + acc[j] during verify) moves to position prefix + j, for j < num_accepted.
// acc is strictly increasing, so acc[j] >= j: a target never lies past its own source, and every
// source of a later j is past every earlier target. Each step gathers a block of rows into registers,
// waits for the whole CTA, then scatters them, so overlapping moves inside a step are safe too.
extern "C" __global__ void __launch_bounds__(COMMIT_THREADS, 1) kv_cache_commit_kernel(
    uint4* __restrict__ cache, long long layer_stride16, int row16, const int* __restrict__ page_table,
    int pt_stride, int page_size, const int* __restrict__ prefix_lens, const int* __restrict__ accepted,
    int acc_stride, const int* __restrict__ num_accepted) {
  const int b = blockIdx.x;
  uint4* layer = cache + blockIdx.y * layer_stride16;
  const int prefix = prefix_lens[b], na = num_accepted[b];
  const int* acc = accepted + (long long)b * acc_stride;
  const int* pt = page_table + (long long)b * pt_stride;
  const int rows_per_step = COMMIT_ITEMS * COMMIT_THREADS / row16;
  for (int j0 = 0; j0 < na; j0 += rows_per_step) {
    uint4 v[COMMIT_ITEMS];
#pragma unroll
    for (int k = 0; k < COMMIT_ITEMS; ++k) {
      const int idx = threadIdx.x + k * COMMIT_THREADS, jr = idx / row16, j = j0 + jr;
      if (jr < rows_per_step && j < na && acc[j] != j)
        v[k] = layer[slot_of(pt, page_size, prefix + acc[j]) * row16 + idx % row16];
    }
    __syncthreads();  // every source of this step is read before any target is written
#pragma unroll
    for (int k = 0; k < COMMIT_ITEMS; ++k) {
      const int idx = threadIdx.x + k * COMMIT_THREADS, jr = idx / row16, j = j0 + jr;
      if (jr < rows_per_step && j < na && acc[j] != j)
        layer[slot_of(pt, page_size, prefix + j) * row16 + idx % row16] = v[k];
    }
    // No barrier needed here: the next step's sources lie past every target written in this one.
  }
}
