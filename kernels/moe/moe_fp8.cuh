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

// Two e4m3 bytes (the low one first) as f16x2, exactly: e4m3 converts to f16 without rounding.
__device__ __forceinline__ og_u32 og_e4m3x2_f16x2(og_u32 v16) {
  og_u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)v16));
  return r;
}

// d += A B for one m16n8k16 f16 tile (A's fragment a0..a3, B's b0, b1), fp32 accumulators.
__device__ __forceinline__ void og_mma_f16(float (&d)[4], og_u32 a0, og_u32 a1, og_u32 a2, og_u32 a3, og_u32 b0,
                                           og_u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-k step of 16 e4m3 weight rows times 8 f16 columns, fp32 result from zero (ACC false)
// or added to d: r and r8 are rows g and g+8 as the 8 bytes a lane c loads at physical k =
// 8c..8c+7, b column g's 8 values at the same k (a 16-byte load). Two m16n8k16 f16 MMAs: the
// first takes physical 8c..8c+3 as its logical k 2c, 2c+1 (a0/a1/b0) and 8+2c, 9+2c (a2/a3/b1),
// the second 8c+4..8c+7 the same way; a dot product does not depend on the order of k. sm_90 has
// no e4m3 mma.sync of its own (ptxas turns one into these conversions and two f16 MMAs), so
// converting the weights here costs nothing. d as og_mma_e4m3's.
template <bool ACC = false>
__device__ __forceinline__ void og_mma_e4m3_f16(float (&d)[4], const og_vec2 &r, const og_vec2 &r8, const og_vec4 &b) {
  if (!ACC) d[0] = d[1] = d[2] = d[3] = 0.f;
  og_mma_f16(d, og_e4m3x2_f16x2(r.x), og_e4m3x2_f16x2(r8.x), og_e4m3x2_f16x2(r.x >> 16), og_e4m3x2_f16x2(r8.x >> 16),
             b.x, b.y);
  og_mma_f16(d, og_e4m3x2_f16x2(r.y), og_e4m3x2_f16x2(r8.y), og_e4m3x2_f16x2(r.y >> 16), og_e4m3x2_f16x2(r8.y >> 16),
             b.z, b.w);
}

// 8 e4m3 bytes (x then y, low byte first) as 8 f16.
__device__ __forceinline__ og_vec4 og_e4m3x8_f16(og_u32 x, og_u32 y) {
  og_vec4 v;
  v.x = og_e4m3x2_f16x2(x), v.y = og_e4m3x2_f16x2(x >> 16), v.z = og_e4m3x2_f16x2(y), v.w = og_e4m3x2_f16x2(y >> 16);
  return v;
}

// A k-step of 64 (OG_GU_KS / OG_DOWN_KS 64): a lane loads 16 bytes of each weight row, physical k
// 16c..16c+15, and the B values of the same k; the step is two of og_mma_e4m3_f16's 8-byte halves
// (16c..16c+7, then 16c+8..16c+15), together every k of the 64 once. Half the load instructions
// of 32-k steps for the same bytes: on the H200 the FP8 stages took as long as the bf16 ones
// for half the bytes, the same count of (half as wide) loads in flight (bench/NOTES.md, v23).
struct og_vec8 {
  og_vec4 lo, hi;  // 16 f16: physical k 16c..16c+7, 16c+8..16c+15
};
__device__ __forceinline__ void og_mma_k64_f16(float (&d)[4], const og_vec4 &r, const og_vec4 &r8, const og_vec8 &b) {
  og_vec2 r0, r80, r1, r81;
  r0.x = r.x, r0.y = r.y, r80.x = r8.x, r80.y = r8.y;
  r1.x = r.z, r1.y = r.w, r81.x = r8.z, r81.y = r8.w;
  og_mma_e4m3_f16<false>(d, r0, r80, b.lo);
  og_mma_e4m3_f16<true>(d, r1, r81, b.hi);
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

// v (|v| <= 448 here) as f16 bits, rounded to nearest even: 11 significant bits, bf16's 8 and
// more, where vLLM's TritonExperts feeds its second GEMM one e4m3 term (4).
__device__ __forceinline__ unsigned short og_f16_bits(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
