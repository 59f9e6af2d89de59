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
// act's workspace row `row` (or zeros for -1), 8 values from element off.
__device__ __forceinline__ og_vec4 og_load_act(const unsigned short *act, int row, long long off) {
  if (row >= 0) return og_load_coherent(act + (long long)row * OG_I + off);
  og_vec4 z;
  z.x = z.y = z.z = z.w = 0u;
  return z;
}

// The scales of k-step s: the weight block's (f[0]) and, for the lane's two accumulator columns
// of each token tile, the column token's act scale (f[1 + 2 nt], f[2 + 2 nt]; 0 without a
// token). Loaded with the step's operands where registers allow (OG_DOWN_HOIST) and multiplied
// only where used: loaded next to their use, each k-step waited a round trip for its scales after
// its MMAs were ready.
#ifndef OG_DOWN_HOIST
#define OG_DOWN_HOIST (OG_NT * OG_U2 <= 16 && OG_W2 <= 8)  // at 16 warps (128 registers) they would spill
#endif
__device__ __forceinline__ void og_fp8_col_scales(const og_moe_fp8_params &q, const float *ws, const int *col0,
                                                  const int *col1, int s, float *f) {
#if OG_SCALE == 1
  f[0] = ws[((unsigned)s * 32u / OG_BK) * q.w2s_stride[2]];  // unsigned: the steps of one block share a load
#else
  f[0] = ws[0];
#endif
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt) {
    f[1 + 2 * nt] = col0[nt] >= 0 ? og_load_coherent_f32(q.act_scale + (long long)col0[nt] * OG_AS + s) : 0.f;
    f[2 + 2 * nt] = col1[nt] >= 0 ? og_load_coherent_f32(q.act_scale + (long long)col1[nt] * OG_AS + s) : 0.f;
  }
}

template <int W, bool EARLY = false>
__device__ __forceinline__ void og_fp8_down_tile(const og_moe_fp8_params &q, const og_routing &r, int htile,
                                                 float (*s_red)[OG_NT][4][32]) {
  const og_moe_params &p = q.b;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int T = p.T;
  const int h0 = htile * 16;
  const int steps = OG_I / 32;
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
  const char *wrow = 0;
  const float *ws = 0;  // this tile's row of w2 scales for the current expert
  int src0[OG_NT], src1[OG_NT], col0[OG_NT], col1[OG_NT];
  for (int it = warp; it < items; it += W) {
    const int uu = it / nchunks, ch = it - uu * nchunks;
    if (uu != cur_u) {  // warp-uniform: every lane takes the shuffles
      cur_u = uu;
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
    og_vec2 a[OG_U2], a8[OG_U2];
    og_vec4 b[OG_U2][OG_NT];
    float f[OG_U2][1 + 2 * OG_NT];  // the k-steps' scales (og_fp8_col_scales)
#pragma unroll
    for (int u = 0; u < OG_U2; ++u) {
      const int s = ch * OG_U2 + u;
      if (steps % OG_U2 == 0 || s < steps) {
        const long long off = (long long)(s * 32 + c * 8);
        a[u] = og_load_stream8<OG_DOWN_LOAD>(wrow + off);
        a8[u] = og_load_stream8<OG_DOWN_LOAD>(wrow + row8 + off);
        if (!EARLY) {
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt) b[u][nt] = og_load_act(act, src0[nt], off);
          if (OG_DOWN_HOIST) og_fp8_col_scales(q, ws, col0, col1, s, f[u]);
        }
      }
    }
    if (EARLY) {  // act's loads after the wait (the first item's), after the weights' in any case
      if (it == warp) {
        og_pdl_wait();
        OG_TS(1, 3);
      }
#pragma unroll
      for (int u = 0; u < OG_U2; ++u) {
        const int s = ch * OG_U2 + u;
        if (steps % OG_U2 == 0 || s < steps) {
          const long long off = (long long)(s * 32 + c * 8);
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt) b[u][nt] = og_load_act(act, src0[nt], off);
          if (OG_DOWN_HOIST) og_fp8_col_scales(q, ws, col0, col1, s, f[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < OG_U2; ++u) {
      const int s = ch * OG_U2 + u;
      if (steps % OG_U2 == 0 || s < steps) {
        if (!OG_DOWN_HOIST) og_fp8_col_scales(q, ws, col0, col1, s, f[u]);
#pragma unroll
        for (int nt = 0; nt < OG_NT; ++nt) {
          if (nt * 8 < T) {
            const float f0 = f[u][0] * f[u][1 + 2 * nt], f1 = f[u][0] * f[u][2 + 2 * nt];
            float d[4];
            og_mma_e4m3_f16(d, a[u], a8[u], b[u][nt]);
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
