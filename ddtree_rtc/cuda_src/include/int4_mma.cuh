// The INT4 W4A16 mma pieces the expert kernels share (moe_gemm, moe_small): the m16n8k16 bf16 MMA
// with fp32 accumulation in scalar-register form (the skinny bf16 linears' too: skinny_mma.cuh), and
// the one-LOP3 unpack of the "mma" INT4 layout (ddtree_rtc/model/int4_repack.py) to bf16x2 128 + u,
// whose offset the -136 constant undoes.
#pragma once

namespace ddt {
namespace int4_mma {

constexpr unsigned kMinus136 = 0xC308C308u;  // bf16x2 (-136, -136)

__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (v & 0x000F000F) | 0x43004300: the bf16x2 pair 128 + u (u = q + 8), exact, in one LOP3.
__device__ __forceinline__ unsigned raw2(unsigned v) {
  unsigned raw;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(raw) : "r"(v), "r"(0x000F000Fu), "r"(0x43004300u));
  return raw;
}

}  // namespace int4_mma
}  // namespace ddt
