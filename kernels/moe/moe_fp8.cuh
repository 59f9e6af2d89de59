// What the FP8 MoE kernels (moe_fp8.cu) share: their compile-time scaling constants, 8-byte
// loads, the e4m3 tensor-core products and the f16 rounding of the intermediate activation.
//
// OG_SCALE 1: block scales, OG_BN x OG_BK weight blocks (vLLM's weight_block_size) and 1 x OG_BK
// activation groups; OG_SCALE 2: one scale per expert matrix and one activation scale.
#pragma once
#include "moe_fp8_params.h"
#include "moe_routing.cuh"

#ifndef OG_SCALE
#define OG_SCALE 1
#endif
#if OG_SCALE == 1
#if !defined(OG_BN) || !defined(OG_BK) || OG_BN < 32 || OG_BN % 32 != 0 || OG_BK < 32 || OG_BK % 32 != 0
#error "block scales need OG_BN and OG_BK, multiples of 32"
#endif
// Each half of w13 (gate, up) has ceil(I / OG_BN) row blocks of scales, the gate's first.
#define OG_IB ((OG_I + OG_BN - 1) / OG_BN)
#elif OG_SCALE != 2
#error "OG_SCALE must be 1 (block) or 2 (per-tensor)"
#endif
// The intermediate activation's groups: one fp32 scale per routing slot and 32 rows of I.
#define OG_AS (OG_I / 32)

struct __align__(8) og_vec2 {
  og_u32 x, y;
};

__device__ __forceinline__ og_vec2 og_zero2() {
  og_vec2 v;
  v.x = v.y = 0u;
  return v;
}

// og_load_stream's forms (og_common.cuh) for 8 bytes: a lane reads 8 consecutive e4m3 weights, so
// the 4 lanes of a row read 32 contiguous bytes (one sector) a k-step.
template <int FORM>
__device__ __forceinline__ og_vec2 og_load_stream8(const void *p) {
  static_assert(FORM == 1 || FORM == 4, "og_load_stream8: FORM is 1 or 4");
  og_vec2 v;
  if (FORM == 1) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint" OG_L2_FETCH_Q ".v2.u32 {%0, %1}, [%2], %3;"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "l"(policy));
  } else {
    asm("ld.global.nc" OG_L2_FETCH_Q ".v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  }
  return v;
}

// Activations that many blocks read again (the call's hidden states).
__device__ __forceinline__ og_vec2 og_load_operand8(const void *p) {
  og_vec2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// The intermediate's scales, written by gate_up earlier on the stream (under programmatic
// dependent launch, while moe_down may already run): a plain (coherent) load.
__device__ __forceinline__ float og_load_coherent_f32(const float *p) {
  float v;
  asm("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// One 32-k step of 16 weight rows times 8 columns, e4m3 x e4m3 with an fp32 result, started from
// zero (sm_89+). r and r8 are rows g and g+8, b column g, each as the 8 bytes a lane c loads at
// physical k = 8c..8c+7. A and B map physical 8c+j to the MMA's logical k 4c+j (j < 4) and
// 16+4c+(j-4) (j >= 4), the fragment layout of m16n8k32 (a0 = A[g][4c..], a1 = A[g+8][4c..],
// a2 = A[g][16+4c..], a3 = A[g+8][16+4c..]; b0 = B[4c..][g], b1 = B[16+4c..][g]); a dot product
// does not depend on the order of k. d = D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1].
__device__ __forceinline__ void og_mma_e4m3(float (&d)[4], const og_vec2 &r, const og_vec2 &r8, const og_vec2 &b) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(r.x), "r"(r8.x), "r"(r.y), "r"(r8.y), "r"(b.x), "r"(b.y), "f"(0.f));
}

// Two e4m3 bytes (the low one first) as f16x2, exactly: e4m3 converts to f16 without rounding.
__device__ __forceinline__ og_u32 og_e4m3x2_f16x2(og_u32 v16) {
  og_u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)v16));
  return r;
}

// One 32-k step of 16 e4m3 weight rows times 8 f16 columns, fp32 result from zero: r and r8 are
// rows g and g+8 as the 8 bytes a lane c loads at physical k = 8c..8c+7, b column g's 8 values
// at the same k (a 16-byte load). Two m16n8k16 f16 MMAs: the first takes physical 8c..8c+3 as its
// logical k 2c, 2c+1 (a0/a1/b0) and 8+2c, 9+2c (a2/a3/b1), the second 8c+4..8c+7 the same way; a
// dot product does not depend on the order of k. sm_90 has no e4m3 mma.sync of its own (ptxas
// turns one into these conversions and two f16 MMAs), so converting the weights here costs
// nothing, and the f16 operand needs none. d as og_mma_e4m3's.
__device__ __forceinline__ void og_mma_e4m3_f16(float (&d)[4], const og_vec2 &r, const og_vec2 &r8, const og_vec4 &b) {
  const og_u32 a0 = og_e4m3x2_f16x2(r.x), a1 = og_e4m3x2_f16x2(r8.x), a2 = og_e4m3x2_f16x2(r.x >> 16),
               a3 = og_e4m3x2_f16x2(r8.x >> 16);
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y), "f"(0.f));
  const og_u32 c0 = og_e4m3x2_f16x2(r.y), c1 = og_e4m3x2_f16x2(r8.y), c2 = og_e4m3x2_f16x2(r.y >> 16),
               c3 = og_e4m3x2_f16x2(r8.y >> 16);
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(b.z), "r"(b.w));
}

// v (|v| <= 448 here) as f16 bits, rounded to nearest even: 11 significant bits, bf16's 8 and
// more, where vLLM's TritonExperts feeds its second GEMM one e4m3 term (4).
__device__ __forceinline__ unsigned short og_f16_bits(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
