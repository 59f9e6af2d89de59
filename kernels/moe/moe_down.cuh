// The down stage: out[t, h] = sum over used experts e of W2[e][h, :] . act(t, e) for one tile of
// 16 rows of H, the sum over experts taken by the MMA accumulator itself.
#pragma once
#include "moe_routing.cuh"

// down: for each token tile, the workspace row of this lane's token (nt*8 + g) for expert e, or
// -1; src1 != -1 where the token lists e more than once (its rows are summed, og_sum_copies).
__device__ __forceinline__ void og_act_sources(const og_routing &r, int T, int e, int g, int (&src0)[OG_NT],
                                               int (&src1)[OG_NT]) {
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt) {
    const int t = nt * 8 + g;
    src0[nt] = src1[nt] = -1;
    if (t < T) {
      for (int j = 0; j < OG_K; ++j) {
        if (r.ids[t * OG_K + j] == e) {
          if (src0[nt] < 0) src0[nt] = t * OG_K + j;
          else src1[nt] = -2;
        }
      }
    }
  }
}

// The sum of token t's act rows for expert e (a token routed to it more than once), 8 elements at
// one k offset; load(i) returns workspace row i's 16 bytes there.
template <class L>
__device__ __forceinline__ og_vec4 og_sum_copies(const og_routing &r, int t, int e, L load) {
  float v[8];
  for (int z = 0; z < 8; ++z) v[z] = 0.f;
  for (int j = 0; j < OG_K; ++j) {
    if (r.ids[t * OG_K + j] != e) continue;
    const og_vec4 x = load(t * OG_K + j);
    v[0] += og_lo(x.x), v[1] += og_hi(x.x), v[2] += og_lo(x.y), v[3] += og_hi(x.y);
    v[4] += og_lo(x.z), v[5] += og_hi(x.z), v[6] += og_lo(x.w), v[7] += og_hi(x.w);
  }
  og_vec4 b;
  b.x = og_pack2(v[0], v[1]), b.y = og_pack2(v[2], v[3]);
  b.z = og_pack2(v[4], v[5]), b.w = og_pack2(v[6], v[7]);
  return b;
}

// down's epilogue for rows h0..h0+15: sums the W warps' partials in warp order, writes out.
template <int W>
__device__ __forceinline__ void og_write_out(const og_moe_params &p, const float (*s_red)[OG_NT][4][32], int h0,
                                             int tid, int nthreads) {
  for (int idx = tid; idx < OG_NT * 4 * 32; idx += nthreads) {
    const int nt = idx / 128, q = (idx / 32) & 3, l = idx & 31;
    const int t = nt * 8 + (l & 3) * 2 + (q & 1);
    if (t >= p.T) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += s_red[w][nt][q][l];
    const int h = h0 + (l >> 2) + (q >> 1) * 8;
    ((og_u16 *)p.out)[(long long)t * p.out_stride + h] = og_from_float(sum);
  }
}

// down's B operand at one k offset: act of each token tile's lane token for the current expert
// (workspace row src0[nt]), or zero where that token did not pick it.
__device__ __forceinline__ void og_load_act(const og_moe_params &p, const int (&src0)[OG_NT], long long off,
                                            og_vec4 (&b)[OG_NT]) {
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
    b[nt] = src0[nt] >= 0 ? og_load_coherent((const char *)p.act + 2 * ((long long)src0[nt] * OG_I) + off)
                          : og_zero4();
}

// down for one tile: 16 rows of H, summed over every used expert and token. EARLY (moe_down under
// programmatic dependent launch with OG_DOWN_EARLY): each warp issues its first work item's weight
// loads, which depend on nothing gate_up writes, before it waits for gate_up's grid; act is read
// and out written only after the wait.
template <int W, bool EARLY = false>
__device__ __forceinline__ void og_down_tile(const og_moe_params &p, const og_routing &r, int htile,
                                             float (*s_red)[OG_NT][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int T = p.T;
  const int h0 = htile * 16;
  const int nused = r.nused;
  const int steps = OG_I / 32;
  const int nchunks = (steps + OG_U2 - 1) / OG_U2;
  const int items = nused * nchunks;
  const long long row8 = 2 * 8 * p.w2_rstride;

  float acc[OG_NT][4];
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;

  int cur_u = -1;
  const char *wrow = 0;
  // For each token tile: the workspace row of this lane's token for the current expert, or -1
  // (og_act_sources).
  int src0[OG_NT], src1[OG_NT];
  for (int it = warp; it < items; it += W) {
    const int uu = it / nchunks, ch = it - uu * nchunks;
    if (uu != cur_u) {
      cur_u = uu;
      const int e = r.experts[uu];
      wrow = (const char *)p.w2 + 2 * (e * p.w2_estride + (long long)(h0 + g) * p.w2_rstride);
      og_act_sources(r, T, e, g, src0, src1);
    }
    og_vec4 a[OG_U2], a8[OG_U2], b[OG_U2][OG_NT];
#pragma unroll
    for (int q = 0; q < OG_U2; ++q) {
      const int s = ch * OG_U2 + q;
      if (steps % OG_U2 == 0 || s < steps) {
        const long long off = 2 * (long long)(s * 32 + c * 8);
        a[q] = og_load_stream<OG_DOWN_LOAD>(wrow + off);
        a8[q] = og_load_stream<OG_DOWN_LOAD>(wrow + row8 + off);
        if (!EARLY) og_load_act(p, src0, off, b[q]);
      }
    }
    if (EARLY) {  // act's loads after the wait (the first item's), after the weights' in any case
      if (it == warp) {
        og_pdl_wait();
        OG_TS(1, 3);
      }
#pragma unroll
      for (int q = 0; q < OG_U2; ++q) {
        const int s = ch * OG_U2 + q;
        if (steps % OG_U2 == 0 || s < steps) og_load_act(p, src0, 2 * (long long)(s * 32 + c * 8), b[q]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < OG_NT; ++nt) {
      if (src1[nt] != -1) {  // rare: a token routed to this expert more than once
        const int e = r.experts[uu];
        const int t = nt * 8 + g;
#pragma unroll
        for (int q = 0; q < OG_U2; ++q) {
          const int s = ch * OG_U2 + q;
          if (steps % OG_U2 == 0 || s < steps) {
            const long long off = 2 * (long long)(s * 32 + c * 8);
            b[q][nt] = og_sum_copies(r, t, e, [&](int i) {
              return og_load_coherent((const char *)p.act + 2 * ((long long)i * OG_I) + off);
            });
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < OG_U2; ++q) {
      const int s = ch * OG_U2 + q;
      if (steps % OG_U2 == 0 || s < steps) {
#pragma unroll
        for (int nt = 0; nt < OG_NT; ++nt)
          if (nt * 8 < T) og_mma_k32(acc[nt], a[q], a8[q], b[q][nt]);
      }
    }
  }

  if (EARLY) og_pdl_wait();  // warps without items: out may alias x, which gate_up reads
#pragma unroll
  for (int nt = 0; nt < OG_NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) s_red[warp][nt][q][lane] = acc[nt][q];
  __syncthreads();
  og_write_out<W>(p, s_red, h0, threadIdx.x, blockDim.x);
  __syncthreads();  // s_red is reused by the next tile
}
