// One-shot all-reduce of tensor-parallel fp32 partials over peer memory, fused with the residual
// RMSNorm that follows every sublayer (model/target.py): one launch per rank and sublayer instead of an
// NCCL all-reduce, the bf16 rounding and the norm.
//
// Every rank owns one buffer registered for peer access (CUDA IPC; one process's simulated ranks:
// plain buffers of one device), laid out as
//   flags  u32 [kMaxCtas][kMaxRanks]   written by the peers: flags[b][q] = rank q's CTA b's last epoch
//   epochs u32 [kMaxCtas]              this rank's own: how often its CTA b has run
//   slots  2 x [parts][rows][d] fp32   the partials, double-buffered (the host alternates slots)
// The sublayer writes its partial straight into the slot (Communicator.partial_buffer). CTA b of rank r
// then counts its epoch e, writes e into flags[b][r] of every rank (release), waits until every rank's
// flags[b][q] >= e in its own buffer (acquire), and reads its share of all N partials. A rank can be at
// most one call ahead (its next call waits for this rank's flags of that call, raised only once this
// call has finished), so it writes the other slot: the double buffer is the only exit barrier needed.
//
// Sums: ranks 0..N-1 in that order in fp32 on every rank, so every rank gets the same bits (NCCL's
// ring order differs, so they equal NCCL's only where its order happens to match). Then exactly
// Backend.to_bf16 (with parts = 2, the MoE: routed + bf16(shared), rounded once), the residual add and
// rmsnorm_block_kernel's register path (rmsnorm.cuh): the sum of squares in its thread and warp order,
// so y and the new residual are bit-identical to to_bf16 + rmsnorm given the same sum.
//
// A row is split over a cluster of kCta CTAs (one SM pulling N x 28 KB over NVLink is latency-bound):
// CTA c sums columns [c d / kCta, (c + 1) d / kCta) with one 16-byte load per rank per thread in flight,
// keeps h in shared memory, and the norm's canonical warps (rmsnorm's thread t owns vectors t + 256 v;
// its warp w runs as warp 0 of CTA w) read their vectors through distributed shared memory.
//
// Waits are bounded: past timeout_ns on %globaltimer the CTA prints who it waited for and traps (the
// context is lost, but a dead rank never hangs the others forever). Epochs live in device memory, so a
// CUDA graph replays with fresh epochs.
#include "cluster.cuh"
#include "common.cuh"
#include "rmsnorm.cuh"  // round_bf16 / round_bf16_f32: Backend.to_bf16's rounding, bit for bit

using namespace ddt;

namespace oneshot {

constexpr int kMaxRanks = 8;
constexpr int kCta = 8;  // CTAs per row (the cluster)
constexpr int kMaxRows = 16;
constexpr int kMaxCtas = kMaxRows * kCta;
constexpr int kThreads = 256;        // rmsnorm_block_kernel's row group: the canonical norm threads
constexpr int kHeaderBytes = 8192;   // flags + epochs, rounded up (kernels/allreduce.py: HEADER_BYTES)
constexpr int kMaxD = kThreads * 8 * 4;  // rmsnorm.cuh kRegVecs = 4: the register path's rows

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every rank's partial at element `elem` (a multiple of 4) of its slot, all loads first, then summed in
// rank order 0 .. nranks - 1: the same bits on every rank.
__device__ __forceinline__ float4 rank_sum(const unsigned long long* __restrict__ bases, long long slot_offset,
                                           long long elem, int nranks) {
  float4 p[kMaxRanks];
#pragma unroll
  for (int q = 0; q < kMaxRanks; ++q)
    if (q < nranks)
      p[q] = __ldcg(reinterpret_cast<const float4*>(reinterpret_cast<const unsigned char*>(bases[q]) + slot_offset) +
                    elem / 4);
  float4 s = p[0];
#pragma unroll
  for (int q = 1; q < kMaxRanks; ++q)
    if (q < nranks) { s.x += p[q].x; s.y += p[q].y; s.z += p[q].z; s.w += p[q].w; }
  return s;
}

}  // namespace oneshot

// bases[q]: rank q's buffer as this process sees it (N = nranks). The launch runs ranks rank0 ..
// rank0 + gridDim.y - 1 (one rank, or every rank of one process's simulated group); residual, out and
// residual_out of launch rank y start y * rank_stride elements in. rows <= 16, 1024 < d <= 8192,
// d % 64 == 0, parts 1 or 2. Grid (kCta, ranks, rows), cluster (kCta, 1, 1), kThreads threads.
extern "C" __global__ void __cluster_dims__(oneshot::kCta, 1, 1) __launch_bounds__(oneshot::kThreads)
    allreduce_rmsnorm_kernel(const unsigned long long* __restrict__ bases, long long slot_offset, int nranks,
                             int rank0, const bf16* residual, bf16* out, bf16* residual_out, long long rank_stride,
                             const bf16* __restrict__ w, int rows, int d, int parts, float eps,
                             long long timeout_ns) {
  using namespace oneshot;
  __shared__ __align__(16) bf16 h_s[kMaxD / kCta];
  __shared__ float warp_ss[kThreads / 32];
  __shared__ unsigned epoch_s;
  const int t = threadIdx.x, c = static_cast<int>(cluster_rank()), row = blockIdx.z;
  const int rank = rank0 + blockIdx.y, cta = row * kCta + c;
  const int chunk = d / kCta, col = c * chunk + 4 * t;  // this thread's 4 columns (one 16-byte load)
  const bool mine = 4 * t < chunk;
  const long long base = blockIdx.y * rank_stride + (long long)row * d;
  unsigned char* own = reinterpret_cast<unsigned char*>(bases[rank]);

  uint2 g = make_uint2(0u, 0u);  // the norm weight does not depend on the previous kernel
  if (mine) g = *reinterpret_cast<const uint2*>(w + col);
  pdl_wait();  // the partial comes from the previous kernel
  pdl_trigger();

  if (t == 0) {
    unsigned* epochs = reinterpret_cast<unsigned*>(own + kMaxCtas * kMaxRanks * 4);
    epoch_s = epochs[cta] + 1;
    epochs[cta] = epoch_s;
  }
  __syncthreads();
  const unsigned epoch = epoch_s;
  if (t < nranks) {
    unsigned* theirs = reinterpret_cast<unsigned*>(bases[t]);
    st_release_sys(theirs + cta * kMaxRanks + rank, epoch);
    const unsigned* flag = reinterpret_cast<const unsigned*>(own) + cta * kMaxRanks + t;
    const unsigned long long t0 = globaltimer();
    for (unsigned spin = 0; static_cast<int>(ld_acquire_sys(flag) - epoch) < 0; ++spin) {
      if ((spin & 63u) == 63u && static_cast<long long>(globaltimer() - t0) > timeout_ns) {
        printf("allreduce_rmsnorm: rank %d CTA %d waited %lld ns for rank %d (epoch %u, its flag %u): a peer "
               "died, is stuck, or the ranks called different collectives\n",
               rank, cta, timeout_ns, t, epoch, ld_acquire_sys(flag));
        __trap();
      }
    }
  }
  __syncthreads();

  // columns: every rank's partial in rank order, rounded as to_bf16, plus the residual
  uint2 hv = make_uint2(0u, 0u);
  if (mine) {
    const long long elem = (long long)row * d + col, part_elems = (long long)rows * d;
    float4 s = rank_sum(bases, slot_offset, elem, nranks);
    if (parts == 2) {  // the MoE: routed sum + bf16(shared sum)
      const float4 u = rank_sum(bases, slot_offset, elem + part_elems, nranks);
      s.x += round_bf16_f32(u.x);
      s.y += round_bf16_f32(u.y);
      s.z += round_bf16_f32(u.z);
      s.w += round_bf16_f32(u.w);
    }
    const uint2 r = *reinterpret_cast<const uint2*>(residual + base + col);
    const bf16* rb = reinterpret_cast<const bf16*>(&r);
    bf16* hb = reinterpret_cast<bf16*>(&hv);
    const float a[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) hb[j] = to_bf16(to_f32(round_bf16(a[j])) + to_f32(rb[j]));
    *reinterpret_cast<uint2*>(h_s + 4 * t) = hv;
    *reinterpret_cast<uint2*>(residual_out + base + col) = hv;
  }
  cluster_sync();

  // the norm's canonical thread tc = 32 c + lane: its vectors tc + 256 v, summed as rmsnorm_row_regs does
  if (t < 32) {
    const int tc = 32 * c + t, nvec = d / 8, vchunk = chunk / 8;
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int gv = tc + v * kThreads;
      if (gv >= nvec) continue;
      const uint4 raw = ld_cluster(reinterpret_cast<const uint4*>(h_s + 8 * (gv % vchunk)), gv / vchunk);
      const bf16* hb = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += to_f32(hb[j]) * to_f32(hb[j]);
    }
    ss = warp_sum(ss);
    if (t < kCta) st_cluster(&warp_ss[c], t, ss);  // warp c's sum into every CTA of the row
  }
  cluster_sync();  // the last remote access: no CTA's shared memory is read after this
  const int lane = t & 31;
  const float total = warp_sum(lane < kThreads / 32 ? warp_ss[lane] : 0.f);  // block_sum's second stage
  const float inv = rsqrtf(total / d + eps);
  if (mine) {
    const bf16* hb = reinterpret_cast<const bf16*>(&hv);
    const bf16* gb = reinterpret_cast<const bf16*>(&g);
    uint2 y;
    bf16* yb = reinterpret_cast<bf16*>(&y);
#pragma unroll
    for (int j = 0; j < 4; ++j) yb[j] = to_bf16(to_f32(hb[j]) * inv * to_f32(gb[j]));
    *reinterpret_cast<uint2*>(out + base + col) = y;
  }
}
