// What the FP8 MoE kernels (moe_fp8.cu) share: their compile-time scaling constants, 8-byte
// loads, the e4m3 tensor-core products and the f16 rounding of the intermediate activation.
//
// OG_SCALE 1: block scales, OG_BN x OG_BK weight blocks (vLLM's weight_block_size) and 1 x OG_BK
// activation groups; OG_SCALE 2: one scale per expert matrix and one activation scale.
#pragma once
#include "og_fp8.cuh"
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
// The k of a k-step of gate_up and of down: 32 (8 bytes of a weight row a lane) or 64 (16 bytes).
#ifndef OG_GU_KS
#define OG_GU_KS 32
#endif
#ifndef OG_DOWN_KS
#define OG_DOWN_KS 32
#endif
#if (OG_GU_KS != 32 && OG_GU_KS != 64) || (OG_DOWN_KS != 32 && OG_DOWN_KS != 64)
#error "OG_GU_KS and OG_DOWN_KS are 32 or 64"
#endif
#if OG_SCALE == 1 && ((OG_GU_KS == 64 || OG_DOWN_KS == 64) && OG_BK % 64 != 0)
#error "64-k steps need weight blocks of a multiple of 64 in k"
#endif
#if (OG_GU_KS == 64 && OG_H % 64 != 0) || (OG_DOWN_KS == 64 && OG_I % 64 != 0)
#error "64-k steps need H (gate_up) or I (down) to be a multiple of 64"
#endif
// OG_XQ 1: x is 16-bit (OG_DTYPE) and gate_up quantizes it per token and 1 x OG_XG group itself:
// the weight blocks' k with block scales; with per-tensor scales the host's group (finer than
// vLLM's one dynamic scale a call, and no pass over all of x before the first product).
#ifndef OG_XQ
#define OG_XQ 0
#endif
#if OG_XQ && (!defined(OG_XG) || OG_XG < 32 || OG_XG % OG_GU_KS != 0 || OG_H % OG_XG != 0 ||            \
              (OG_SCALE == 1 && OG_XG != OG_BK))
#error "OG_XQ needs groups OG_XG of whole k-steps that divide H (the weight blocks' k with block scales)"
#endif
// gate_up's tiles: OG_GU_ROWS rows of I, in halves of 16 (one MMA tile of rows each).
#ifndef OG_GU_ROWS
#define OG_GU_ROWS 32
#endif
#if OG_GU_ROWS != 16 && OG_GU_ROWS != 32
#error "OG_GU_ROWS is 16 or 32"
#endif
#define OG_GU_HALVES (OG_GU_ROWS / 16)
// The intermediate activation's groups: one fp32 scale per routing slot and 16 rows of I.
#define OG_AS (OG_I / 16)

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
// dependent launch, while moe_down may already run): a coherent load, kept after the wait
// (volatile, as og_load_coherent).
__device__ __forceinline__ float og_load_coherent_f32(const float *p) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
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

// The k-step product of the two stages' operand forms: 32 k of e4m3 x e4m3 (og_mma_e4m3), or 64
// k of e4m3 weights times 16 e4m3 (gate_up's x) or f16 values (down's act).
__device__ __forceinline__ void og_mma_step(float (&d)[4], const og_vec2 &r, const og_vec2 &r8, const og_vec2 &b) {
  og_mma_e4m3(d, r, r8, b);
}
__device__ __forceinline__ void og_mma_step(float (&d)[4], const og_vec4 &r, const og_vec4 &r8, const og_vec4 &b) {
  og_vec8 f;
  f.lo = og_e4m3x8_f16(b.x, b.y), f.hi = og_e4m3x8_f16(b.z, b.w);
  og_mma_k64_f16(d, r, r8, f);
}
__device__ __forceinline__ void og_mma_step(float (&d)[4], const og_vec2 &r, const og_vec2 &r8, const og_vec4 &b) {
  og_mma_e4m3_f16(d, r, r8, b);
}
__device__ __forceinline__ void og_mma_step(float (&d)[4], const og_vec4 &r, const og_vec4 &r8, const og_vec8 &b) {
  og_mma_k64_f16(d, r, r8, b);
}

// A lane's weight bytes of a row a k-step (8 or 16), loaded in og_load_stream's forms, and its
// down stage's B operand (8 or 16 f16 of act).
template <int KS>
struct og_kstep;
template <>
struct og_kstep<32> {
  typedef og_vec2 w;
  typedef og_vec4 act;
  template <int FORM>
  __device__ __forceinline__ static w load(const void *p) { return og_load_stream8<FORM>(p); }
  __device__ __forceinline__ static w operand(const void *p) { return og_load_operand8(p); }
  __device__ __forceinline__ static w zero() { return og_zero2(); }
};
template <>
struct og_kstep<64> {
  typedef og_vec4 w;
  typedef og_vec8 act;
  template <int FORM>
  __device__ __forceinline__ static w load(const void *p) { return og_load_stream<FORM>(p); }
  __device__ __forceinline__ static w operand(const void *p) { return og_load_shared_operand(p); }
  __device__ __forceinline__ static w zero() { return og_zero4(); }
};

// OG_XQ: a lane's 16-bit x values of a k-step (8 a vector) as the step's B operand, rounded to
// e4m3 with the group's factor r, in f16.
__device__ __forceinline__ void og_xq_operand(og_vec4 &b, const og_vec4 (&v)[1], float r) { b = og_quant8(v[0], r); }
__device__ __forceinline__ void og_xq_operand(og_vec8 &b, const og_vec4 (&v)[2], float r) {
  b.lo = og_quant8(v[0], r), b.hi = og_quant8(v[1], r);
}

// v (|v| <= 448 here) as f16 bits, rounded to nearest even: 11 significant bits, bf16's 8 and
// more, where vLLM's TritonExperts feeds its second GEMM one e4m3 term (4).
__device__ __forceinline__ unsigned short og_f16_bits(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
