// The FP8 down stage: out[t, h] = sum over used experts e of W2[e][h, :] . act(t, e) for one tile
// of 16 rows of H, e4m3 weights times the f16 intermediate, each k-step's products scaled into
// fp32 accumulators that sum over experts.
#pragma once
#include "moe_down.cuh"
#include "moe_fp8.cuh"

// down for one tile: 16 rows of H, summed over every used expert and token. The B operand of
// token tile nt is act (f16) of the lane's token nt*8 + g for the item's expert (workspace row
// src0), or zero; the accumulators of column 2c (2c+1) take the scale of that column's token,
// found by shuffle from lane 8c (8c+4), which holds its row. A token that lists the expert twice
// has one act row (og_fp8_write_act), its first slot's: src0. EARLY as in og_down_tile.
//
// A k-step of OG_DOWN_KS k. At 32 it lies in one of act's 32-row groups, whose scale goes with
// the weight block's into the accumulation. At 64 a lane's 16 k lie in one group (16c.. of the
// step) but the step spans two, so a lane scales its B values by its group's scale over the
// slot's largest (og_fp8_slot_max; <= 1, so f16 stays in range) and the accumulation takes the
// weight block's scale times that largest scale.

// KS 32: act's workspace row `row` (or zeros for -1), 8 values from element off; KS 64: 16.
__device__ __forceinline__ og_vec4 og_load_act8(const unsigned short *act, int row, long long off) {
  return row >= 0 ? og_load_coherent(act + (long long)row * OG_I + off) : og_zero4();
}
__device__ __forceinline__ void og_load_act(const unsigned short *act, int row, long long off, og_vec4 &b) {
  b = og_load_act8(act, row, off);
}
__device__ __forceinline__ void og_load_act(const unsigned short *act, int row, long long off, og_vec8 &b) {
  b.lo = og_load_act8(act, row, off);
  b.hi = og_load_act8(act, row, off + 8);
}

#ifndef OG_DOWN_HOIST
#define OG_DOWN_HOIST (OG_NT * OG_U2 <= 16 && OG_W2 <= 8)  // at 16 warps (128 registers) they would spill
#endif
#define OG_DOWN_NF (OG_DOWN_KS == 32 ? 1 + 2 * OG_NT : 1 + OG_NT)
// The scales of k-step s: the weight block's (f[0]), then at KS 32 the act scales of the lane's
// two accumulator columns of each token tile (f[1 + 2 nt], f[2 + 2 nt]; 0 without a token), at
// KS 64 the lane's B group scale over the slot's largest (f[1 + nt]). Loaded with the step's
// operands where registers allow (OG_DOWN_HOIST) and multiplied only where used: loaded next to
// their use, each k-step waited a round trip for its scales after its MMAs were ready.
__device__ __forceinline__ void og_fp8_step_scales(const og_moe_fp8_params &q, const float *ws, const int *src0,
                                                   const int *col0, const int *col1, const float *inv_max, int s,
                                                   int c, float *f) {
#if OG_SCALE == 1
  f[0] = ws[((unsigned)s * OG_DOWN_KS / OG_BK) * q.w2s_stride[2]];  // unsigned: the steps of one block share a load
#else
  f[0] = ws[0];
#endif
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt) {
#if OG_DOWN_KS == 32
    f[1 + 2 * nt] = col0[nt] >= 0 ? og_load_coherent_f32(q.act_scale + (long long)col0[nt] * OG_AS + s) : 0.f;
    f[2 + 2 * nt] = col1[nt] >= 0 ? og_load_coherent_f32(q.act_scale + (long long)col1[nt] * OG_AS + s) : 0.f;
#else
    f[1 + nt] = src0[nt] >= 0 ? og_load_coherent_f32(q.act_scale + (long long)src0[nt] * OG_AS + 2 * s + (c >> 1)) *
                                    inv_max[nt]
                              : 0.f;
#endif
  }
}

// KS 64: for each token tile, 1 / (the largest act scale of the lane's B column's slot) and that
// largest scale of the lane's two accumulator columns (m0, m1; 0 without a token). Warp-uniform.
__device__ __forceinline__ void og_fp8_slot_max(const og_moe_fp8_params &q, const int *src0, int c, float *inv_max,
                                                float *m0, float *m1) {
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt) {
    float m = 0.f;
    if (src0[nt] >= 0) {  // every load issued at once (a row is 16-byte aligned where OG_AS % 4 == 0)
      const float *row = q.act_scale + (long long)src0[nt] * OG_AS;
      if (OG_AS % 4 == 0) {
#pragma unroll
        for (int j = 0; j < OG_AS; j += 4) {
          const og_vec4 v = og_load_coherent(row + j);
          m = fmaxf(m, fmaxf(fmaxf(__uint_as_float(v.x), __uint_as_float(v.y)),
                             fmaxf(__uint_as_float(v.z), __uint_as_float(v.w))));
        }
      } else {
#pragma unroll
        for (int j = 0; j < OG_AS; ++j) m = fmaxf(m, og_load_coherent_f32(row + j));
      }
    }
    inv_max[nt] = m > 0.f ? 1.f / m : 0.f;
    m0[nt] = __shfl_sync(OG_FULL, m, 8 * c);
    m1[nt] = __shfl_sync(OG_FULL, m, 8 * c + 4);
  }
}

// b's 16 f16 times v (f16x2 products, rounded to nearest).
__device__ __forceinline__ og_u32 og_hmul2(og_u32 a, og_u32 b) {
  og_u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ void og_scale_f16(og_vec8 &b, float v) {
  og_u32 h;
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(h) : "f"(v));
  b.lo.x = og_hmul2(b.lo.x, h), b.lo.y = og_hmul2(b.lo.y, h), b.lo.z = og_hmul2(b.lo.z, h), b.lo.w = og_hmul2(b.lo.w, h);
  b.hi.x = og_hmul2(b.hi.x, h), b.hi.y = og_hmul2(b.hi.y, h), b.hi.z = og_hmul2(b.hi.z, h), b.hi.w = og_hmul2(b.hi.w, h);
}

template <int W, bool EARLY = false>
__device__ __forceinline__ void og_fp8_down_tile(const og_moe_fp8_params &q, const og_routing &r, int htile,
                                                 float (*s_red)[OG_NT][4][32]) {
  const og_moe_params &p = q.b;
  typedef og_kstep<OG_DOWN_KS> K;
#if OG_DOWN_KS == 32
  typedef og_vec4 act_t;
#else
  typedef og_vec8 act_t;
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int T = p.T;
  const int h0 = htile * 16;
  const int steps = OG_I / OG_DOWN_KS;
  const int nchunks = (steps + OG_U2 - 1) / OG_U2;
  const int items = r.nused * nchunks;
  const long long row8 = 8 * p.w2_rstride;
  const unsigned short *act = (const unsigned short *)p.act;

  float acc[OG_NT][4];
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[nt][k] = 0.f;

  int cur_u = -1;
  bool fresh = false;  // the item is the first of its expert (KS 64: its slot maxima still to load)
  const char *wrow = 0;
  const float *ws = 0;  // this tile's row of w2 scales for the current expert
  int src0[OG_NT], src1[OG_NT], col0[OG_NT], col1[OG_NT];
  float inv_max[OG_NT], m0[OG_NT], m1[OG_NT];  // KS 64 (og_fp8_slot_max)
  for (int it = warp; it < items; it += W) {
    const int uu = it / nchunks, ch = it - uu * nchunks;
    if (uu != cur_u) {  // warp-uniform: every lane takes the shuffles
      cur_u = uu, fresh = true;
      const int e = r.experts[uu];
      wrow = (const char *)p.w2 + e * p.w2_estride + (long long)(h0 + g) * p.w2_rstride;
#if OG_SCALE == 1
      ws = q.w2_scale + e * q.w2s_stride[0] + (long long)(h0 / OG_BN) * q.w2s_stride[1];
#else
      ws = q.w2_scale + e * q.w2s_stride[0];
#endif
      og_act_sources(r, T, e, g, src0, src1);
#pragma unroll
      for (int nt = 0; nt < OG_NT; ++nt) {
        col0[nt] = __shfl_sync(OG_FULL, src0[nt], 8 * c);
        col1[nt] = __shfl_sync(OG_FULL, src0[nt], 8 * c + 4);
      }
    }
    typename K::w a[OG_U2], a8[OG_U2];
    act_t b[OG_U2][OG_NT];
    float f[OG_U2][OG_DOWN_NF];  // the k-steps' scales (og_fp8_step_scales)
    // act, its scales (written by gate_up) and the slot maxima they give: after the wait with EARLY
    auto load_act = [&]() {
      if (OG_DOWN_KS == 64 && fresh) og_fp8_slot_max(q, src0, c, inv_max, m0, m1);
      fresh = false;
#pragma unroll
      for (int u = 0; u < OG_U2; ++u) {
        const int s = ch * OG_U2 + u;
        if (steps % OG_U2 == 0 || s < steps) {
          const long long off = (long long)(s * OG_DOWN_KS + c * (OG_DOWN_KS / 4));
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt) og_load_act(act, src0[nt], off, b[u][nt]);
          if (OG_DOWN_HOIST) og_fp8_step_scales(q, ws, src0, col0, col1, inv_max, s, c, f[u]);
        }
      }
    };
#pragma unroll
    for (int u = 0; u < OG_U2; ++u) {
      const int s = ch * OG_U2 + u;
      if (steps % OG_U2 == 0 || s < steps) {
        const long long off = (long long)(s * OG_DOWN_KS + c * (OG_DOWN_KS / 4));
        a[u] = K::template load<OG_DOWN_LOAD>(wrow + off);
        a8[u] = K::template load<OG_DOWN_LOAD>(wrow + row8 + off);
      }
    }
    if (EARLY && it == warp) {  // act's loads after the wait (the first item's), after the weights' in any case
      og_pdl_wait();
      OG_TS(1, 3);
    }
    load_act();
#pragma unroll
    for (int u = 0; u < OG_U2; ++u) {
      const int s = ch * OG_U2 + u;
      if (steps % OG_U2 == 0 || s < steps) {
        if (!OG_DOWN_HOIST) og_fp8_step_scales(q, ws, src0, col0, col1, inv_max, s, c, f[u]);
#pragma unroll
        for (int nt = 0; nt < OG_NT; ++nt) {
          if (nt * 8 < T) {
#if OG_DOWN_KS == 32
            const float f0 = f[u][0] * f[u][1 + 2 * nt], f1 = f[u][0] * f[u][2 + 2 * nt];
#else
            og_scale_f16(b[u][nt], f[u][1 + nt]);
            const float f0 = f[u][0] * m0[nt], f1 = f[u][0] * m1[nt];
#endif
            float d[4];
            og_mma_step(d, a[u], a8[u], b[u][nt]);
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[nt][k] = fmaf(d[k], k & 1 ? f1 : f0, acc[nt][k]);
          }
        }
      }
    }
  }

  OG_TS(1, 5);
  if (EARLY) og_pdl_wait();  // warps without items: out may alias x, which gate_up reads
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int k = 0; k < 4; ++k) s_red[warp][nt][k][lane] = acc[nt][k];
  __syncthreads();
  og_write_out<W>(p, s_red, h0, threadIdx.x, blockDim.x);
  __syncthreads();  // s_red is reused by the next tile
}
