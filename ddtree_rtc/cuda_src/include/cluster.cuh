// Thread-block-cluster primitives (sm_90+): the CTA's rank, the cluster barrier, and distributed
// shared memory (a pointer into this CTA's shared memory, read or written at the same offset in
// cluster CTA `rank`). Used by the skinny linears' split-K reduction (skinny_mma.cuh), the q_a norm's
// shared rows (skinny_norm.cuh) and the one-shot all-reduce (allreduce.cu).
#pragma once
#include "common.cuh"

namespace ddt {

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster; arrive releases and wait acquires (the PTX defaults), so
// shared-memory writes before it are visible to every CTA's reads after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// Same rendezvous without the memory ordering (no fence): only keeps the CTAs alive.
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// The shared::cluster address of `p` (this CTA's shared memory) in cluster CTA `rank`.
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
  return v;
}

__device__ __forceinline__ float4 ld_cluster(const float4* p, unsigned rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr(p, rank))
               : "memory");
  return v;
}

__device__ __forceinline__ uint4 ld_cluster(const uint4* p, unsigned rank) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(cluster_addr(p, rank))
               : "memory");
  return v;
}

__device__ __forceinline__ void st_cluster(const float* p, unsigned rank, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_addr(p, rank)), "f"(v) : "memory");
}

}  // namespace ddt
