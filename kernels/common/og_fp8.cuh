// e4m3 helpers shared by the FP8 kernels of every op (sm_89+ for the conversions): 8-byte
// operands, e4m3 <-> f16 conversions, the f16 tensor-core products that stand in for e4m3 ones on
// sm_90, and the rounding of fp32 values to e4m3.
#pragma once
#include "og_common.cuh"

struct __align__(8) og_vec2 {
  og_u32 x, y;
};

__device__ __forceinline__ og_vec2 og_zero2() {
  og_vec2 v;
  v.x = v.y = 0u;
  return v;
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
// converting the weights here costs nothing. d = D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1].
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

// A k-step of 64: a lane loads 16 bytes of each weight row, physical k 16c..16c+15, and the B
// values of the same k; the step is two of og_mma_e4m3_f16's 8-byte halves (16c..16c+7, then
// 16c+8..16c+15), together every k of the 64 once. Half the load instructions of 32-k steps for
// the same bytes: on the H200 32-k FP8 steps took as long as 16-bit ones for half the bytes, the
// same count of (half as wide) loads in flight (bench/NOTES.md, v23).
struct og_vec8 {
  og_vec4 lo, hi;  // 16 f16: physical k 16c..16c+7, 16c+8..16c+15
};
// From zero, or (ACC) added to d.
template <bool ACC = false>
__device__ __forceinline__ void og_mma_k64_f16(float (&d)[4], const og_vec4 &r, const og_vec4 &r8, const og_vec8 &b) {
  og_vec2 r0, r80, r1, r81;
  r0.x = r.x, r0.y = r.y, r80.x = r8.x, r80.y = r8.y;
  r1.x = r.z, r1.y = r.w, r81.x = r8.z, r81.y = r8.w;
  og_mma_e4m3_f16<ACC>(d, r0, r80, b.lo);
  og_mma_e4m3_f16<true>(d, r1, r81, b.hi);
}

// (lo, hi) rounded to e4m3, nearest even, finite values past +-448 saturated to +-448: two bytes,
// lo the low one (cvt puts its first source in the high byte).
__device__ __forceinline__ og_u32 og_f32x2_e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// The activation quantization of the FP8 kernels (vLLM's per 1 x block_k group): the largest
// |value| of 8 16-bit values (x, y, z, w: 2 each) and m, and 8 values times r rounded to e4m3, as
// f16 (exact).
__device__ __forceinline__ float og_amax8(const og_vec4 &v, float m) {
  m = fmaxf(m, fmaxf(fabsf(og_lo(v.x)), fabsf(og_hi(v.x))));
  m = fmaxf(m, fmaxf(fabsf(og_lo(v.y)), fabsf(og_hi(v.y))));
  m = fmaxf(m, fmaxf(fabsf(og_lo(v.z)), fabsf(og_hi(v.z))));
  return fmaxf(m, fmaxf(fabsf(og_lo(v.w)), fabsf(og_hi(v.w))));
}

__device__ __forceinline__ og_u32 og_quant2(og_u32 v, float r) {
  return og_e4m3x2_f16x2(og_f32x2_e4m3x2(og_lo(v) * r, og_hi(v) * r));
}
__device__ __forceinline__ og_vec4 og_quant8(const og_vec4 &v, float r) {
  og_vec4 q;
  q.x = og_quant2(v.x, r), q.y = og_quant2(v.y, r), q.z = og_quant2(v.z, r), q.w = og_quant2(v.w, r);
  return q;
}

// A group's absmax from the four lanes of a row (lanes 4g..4g+3 hold its values), floored at
// vLLM's 1e-10; returns its scale amax / 448 and sets r = 448 / amax (IEEE divisions, as the C
// oracle computes them).
__device__ __forceinline__ float og_group_scale(float amax, float &r) {
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2)), 1e-10f);
  r = __fdiv_rn(448.f, amax);
  return __fdiv_rn(amax, 448.f);
}
