// The FP8 down stage: out[t, h] = sum over used experts e of W2[e][h, :] . act(t, e) for one tile
// of 16 rows of H, e4m3 weights times each of the intermediate's two e4m3 terms, each k-step's
// products scaled into fp32 accumulators that sum over experts.
#pragma once
#include "moe_down.cuh"
#include "moe_fp8.cuh"

// down for one tile: 16 rows of H, summed over every used expert and token. The B operands of
// token tile nt are act's two terms of the lane's token nt*8 + g for the item's expert (workspace
// row src0), or zero: two MMAs on the same weights, hi + lo / 16; the accumulators of column 2c (2c+1) take the scale of that column's token, found by
// shuffle from lane 8c (8c+4), which holds its row. A token that lists the expert twice has one
// act row (og_fp8_write_act), its first slot's: src0. EARLY as in og_down_tile.
// Both terms of act's workspace row `row` (or zeros for -1) at byte offset off.
__device__ __forceinline__ void og_load_act2(const unsigned char *hi, const unsigned char *lo, int row, long long off,
                                             og_vec2 &b, og_vec2 &bl) {
  if (row >= 0) {
    b = og_load_coherent8(hi + (long long)row * OG_I + off);
    bl = og_load_coherent8(lo + (long long)row * OG_I + off);
  } else {
    b = bl = og_zero2();
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
  const unsigned char *act = (const unsigned char *)p.act, *act_lo = (const unsigned char *)q.act_lo;

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
    og_vec2 a[OG_U2], a8[OG_U2], b[OG_U2][OG_NT], bl[OG_U2][OG_NT];
#pragma unroll
    for (int u = 0; u < OG_U2; ++u) {
      const int s = ch * OG_U2 + u;
      if (steps % OG_U2 == 0 || s < steps) {
        const long long off = (long long)(s * 32 + c * 8);
        a[u] = og_load_stream8<OG_DOWN_LOAD>(wrow + off);
        a8[u] = og_load_stream8<OG_DOWN_LOAD>(wrow + row8 + off);
        if (!EARLY)
#pragma unroll
          for (int nt = 0; nt < OG_NT; ++nt) og_load_act2(act, act_lo, src0[nt], off, b[u][nt], bl[u][nt]);
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
          for (int nt = 0; nt < OG_NT; ++nt) og_load_act2(act, act_lo, src0[nt], off, b[u][nt], bl[u][nt]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < OG_U2; ++u) {
      const int s = ch * OG_U2 + u;
      if (steps % OG_U2 == 0 || s < steps) {
#if OG_SCALE == 1
        const float w = ws[((s * 32) / OG_BK) * q.w2s_stride[2]];
#else
        const float w = ws[0];
#endif
#pragma unroll
        for (int nt = 0; nt < OG_NT; ++nt) {
          if (nt * 8 < T) {
            const float f0 = col0[nt] >= 0 ? w * og_load_coherent_f32(q.act_scale + (long long)col0[nt] * OG_AS + s) : 0.f;
            const float f1 = col1[nt] >= 0 ? w * og_load_coherent_f32(q.act_scale + (long long)col1[nt] * OG_AS + s) : 0.f;
            float d[4], dl[4];
            og_mma_e4m3(d, a[u], a8[u], b[u][nt]);
            og_mma_e4m3(dl, a[u], a8[u], bl[u][nt]);
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[nt][k] += fmaf(dl[k], 0.0625f, d[k]) * (k & 1 ? f1 : f0);
          }
        }
      }
    }
  }

  if (EARLY) og_pdl_wait();  // warps without items: out may alias x, which gate_up reads
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int k = 0; k < 4; ++k) s_red[warp][nt][k][lane] = acc[nt][k];
  __syncthreads();
  og_write_out<W>(p, s_red, h0, threadIdx.x, blockDim.x);
  __syncthreads();  // s_red is reused by the next tile
}
