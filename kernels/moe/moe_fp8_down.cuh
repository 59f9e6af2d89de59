// The FP8 down stage: out[t, h] = sum over used experts e of W2[e][h, :] . act(t, e) for one tile
// of 16 rows of H, e4m3 weights times the f16 intermediate, each k-step's products scaled into
// fp32 accumulators that sum over experts.
#pragma once
#include "moe_down.cuh"
#include "moe_fp8.cuh"

// down for one tile: 16 rows of H, summed over every used expert and token. The B operand of
// token tile nt is act (f16) of the lane's token nt*8 + g for the item's expert (workspace row
// src0), or zero. A token that lists the expert twice has one act row (og_fp8_write_act), its
// first slot's: src0. EARLY as in og_down_tile.
//
// Scales. A lane's k of a step (8 at OG_DOWN_KS 32, 16 at 64: from s * KS + c * KS / 4) lie in
// one of act's 16-row groups, but a step spans two or four. So a lane multiplies its B values by
// its group's scale over the largest scale of the slot (og_fp8_slot_max; <= 1, so f16 stays in
// range), and the step's product is scaled by the weight block's scale times that largest scale
// of each accumulator column's token (column 2c, 2c+1: shuffled from lane 8c, 8c+4, which hold
// those tokens as their B column).

// act's workspace row `row` (or zeros for -1) from element off: 8 values (KS 32) or 16 (KS 64).
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

// The k-steps' scales loaded with act (og_fp8_step_scales): b is scaled before its MMA, so loaded
// in the loop each step waits a round trip of its own (four an item in the SASS at one token tile).
// At 16 warps (128 registers) only where they are few (one token tile, 4 steps: 8 registers).
#ifndef OG_DOWN_HOIST
#define OG_DOWN_HOIST (OG_NT * OG_U2 <= 16 && (OG_W2 <= 8 || OG_NT * OG_U2 <= 4))
#endif

// The scales of k-step s: the weight block's (f[0]) and, for each token tile, the lane's B group
// scale over its slot's largest (f[1 + nt]; 0 without a token; SCALED false: not yet over it, the
// maxima still to come). Loaded with the step's operands where OG_DOWN_HOIST allows.
template <bool SCALED>
__device__ __forceinline__ void og_fp8_step_scales(const og_moe_fp8_params &q, const float *ws, const int *src0,
                                                   const float *inv_max, int s, int c, float *f) {
#if OG_SCALE == 1
  f[0] = ws[((unsigned)s * OG_DOWN_KS / OG_BK) * q.w2s_stride[2]];  // unsigned: the steps of one block share a load
#else
  f[0] = ws[0];
#endif
  const int grp = (s * OG_DOWN_KS + c * (OG_DOWN_KS / 4)) / 16;
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
    f[1 + nt] = src0[nt] >= 0 ? og_load_coherent_f32(q.act_scale + (long long)src0[nt] * OG_AS + grp) *
                                    (SCALED ? inv_max[nt] : 1.f)
                              : 0.f;
}

// The scale loads og_fp8_slot_max keeps in flight, in 16-byte chunks a lane: 4 (16 registers)
// unless the launch bounds cap a thread at fewer than 128 registers, where those spill.
#define OG_DOWN_SCALE_UNROLL (65536 / (OG_W2 * 32 * (OG_DOWN_MIN > 0 ? OG_DOWN_MIN : 1)) >= 128 ? 4 : 1)
// For each token tile: 1 / (the largest act scale of the lane's B column's slot) and that largest
// scale of the lane's two accumulator columns (m0, m1; 0 without a token). The four lanes of a
// B column share its loads (up to 16 scales a lane at once, OG_DOWN_SCALE_UNROLL: one round for
// I <= 1024) and their maxima. Warp-uniform.
__device__ __forceinline__ void og_fp8_slot_max(const og_moe_fp8_params &q, const int *src0, int c, float *inv_max,
                                                float *m0, float *m1) {
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt) {
    float m = 0.f;
    if (src0[nt] >= 0) {
      const float *row = q.act_scale + (long long)src0[nt] * OG_AS;
      if (OG_AS % 4 == 0) {  // 16-byte chunks, round robin over the four lanes (rows are 16-byte aligned)
#pragma unroll(OG_DOWN_SCALE_UNROLL)
        for (int j = 4 * c; j < OG_AS; j += 16) {
          const og_vec4 v = og_load_coherent(row + j);
          m = fmaxf(m, fmaxf(fmaxf(__uint_as_float(v.x), __uint_as_float(v.y)),
                             fmaxf(__uint_as_float(v.z), __uint_as_float(v.w))));
        }
      } else {
#pragma unroll(4 * OG_DOWN_SCALE_UNROLL)
        for (int j = c; j < OG_AS; j += 4) m = fmaxf(m, og_load_coherent_f32(row + j));
      }
    }
    m = fmaxf(m, __shfl_xor_sync(OG_FULL, m, 1));
    m = fmaxf(m, __shfl_xor_sync(OG_FULL, m, 2));
    inv_max[nt] = m > 0.f ? 1.f / m : 0.f;
    m0[nt] = __shfl_sync(OG_FULL, m, 8 * c);
    m1[nt] = __shfl_sync(OG_FULL, m, 8 * c + 4);
  }
}

// A fresh item's act loads go out before its maxima's where those take one round of scale loads
// (I <= 1024 at 4 chunks a lane): both then come back in one round trip. With more rounds the act
// operands held across them spill (Qwen3-235B-A22B's 32-k steps).
#define OG_DOWN_ACT_FIRST (OG_AS <= 16 * OG_DOWN_SCALE_UNROLL)

// b's f16 values times v (f16x2 products, rounded to nearest).
__device__ __forceinline__ og_u32 og_hmul2(og_u32 a, og_u32 b) {
  og_u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ og_u32 og_f16x2_of(float v) {
  og_u32 h;
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(h) : "f"(v));
  return h;
}
__device__ __forceinline__ void og_scale_f16(og_vec4 &b, float v) {
  const og_u32 h = og_f16x2_of(v);
  b.x = og_hmul2(b.x, h), b.y = og_hmul2(b.y, h), b.z = og_hmul2(b.z, h), b.w = og_hmul2(b.w, h);
}
__device__ __forceinline__ void og_scale_f16(og_vec8 &b, float v) {
  og_scale_f16(b.lo, v);
  og_scale_f16(b.hi, v);
}

template <int W, bool EARLY = false>
__device__ __forceinline__ void og_fp8_down_tile(const og_moe_fp8_params &q, const og_routing &r, int htile,
                                                 float (*s_red)[OG_NT][4][32]) {
  const og_moe_params &p = q.b;
  typedef og_kstep<OG_DOWN_KS> K;
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
  bool fresh = false;  // the item is the first of its expert: its slot maxima still to load
  const char *wrow = 0;
  const float *ws = 0;  // this tile's row of w2 scales for the current expert
  int src0[OG_NT], src1[OG_NT];
  float inv_max[OG_NT], m0[OG_NT], m1[OG_NT];  // og_fp8_slot_max
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
    }
    typename K::w a[OG_U2], a8[OG_U2];
    typename K::act b[OG_U2][OG_NT];
    float f[OG_U2][1 + OG_NT];  // the k-steps' scales (og_fp8_step_scales)
    // act, its scales (written by gate_up) and the slot maxima they give: after the wait with EARLY
    auto load_act = [&]() {
      if (!OG_DOWN_ACT_FIRST && fresh) og_fp8_slot_max(q, src0, c, inv_max, m0, m1);
#pragma unroll
      for (int u = 0; u < OG_U2; ++u) {
        const int s = ch * OG_U2 + u;
        if (steps % OG_U2 == 0 || s < steps) {
          const long long off = (long long)(s * OG_DOWN_KS + c * (OG_DOWN_KS / 4));
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt) og_load_act(act, src0[nt], off, b[u][nt]);
          if (OG_DOWN_HOIST) og_fp8_step_scales<!OG_DOWN_ACT_FIRST>(q, ws, src0, inv_max, s, c, f[u]);
        }
      }
      if (OG_DOWN_ACT_FIRST) {
        if (fresh) og_fp8_slot_max(q, src0, c, inv_max, m0, m1);
#pragma unroll
        for (int u = 0; u < OG_U2; ++u)
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt)
            if (OG_DOWN_HOIST && (steps % OG_U2 == 0 || ch * OG_U2 + u < steps)) f[u][1 + nt] *= inv_max[nt];
      }
      fresh = false;
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
        if (!OG_DOWN_HOIST) og_fp8_step_scales<true>(q, ws, src0, inv_max, s, c, f[u]);
#pragma unroll
        for (int nt = 0; nt < OG_NT; ++nt) {
          if (nt * 8 < T) {
            og_scale_f16(b[u][nt], f[u][1 + nt]);
            const float f0 = f[u][0] * m0[nt], f1 = f[u][0] * m1[nt];
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
