// The gate/up stage: act[t*k+j, :] = w[t,j] * silu(G[e] x_t) * (U[e] x_t) for one tile of 16 rows
// of I of one expert, on tensor cores with the (token, slot) pairs as the N dimension.
#pragma once
#include "moe_routing.cuh"

// A warp's gate and up partials of one tile, into its row of the block's reduction buffer.
template <int NP>
__device__ __forceinline__ void og_stash_gate_up(float (*s_red_w)[2][4][32], const float (&acc_g)[NP][4],
                                                 const float (&acc_u)[NP][4], int lane) {
#pragma unroll
  for (int pt = 0; pt < NP; ++pt)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      s_red_w[pt][0][q][lane] = acc_g[pt][q];
      s_red_w[pt][1][q][lane] = acc_u[pt][q];
    }
}

// gate_up's epilogue for pairs p0.. of one tile: sums the W warps' gate and up partials in warp
// order and writes act = w * silu(gate) * up (or with the router weight on the input) for each
// pair. Threads tid, tid + nthreads, ... share the work.
template <int W, int NP, int NB = NP>
__device__ __forceinline__ void og_write_act(const og_moe_params &p, const float (*s_red)[NB][2][4][32],
                                             const int *s_pairs, int npairs, int p0, int tile, int tid,
                                             int nthreads) {
  for (int idx = tid; idx < NP * 4 * 32; idx += nthreads) {
    const int pt = idx / 128, q = (idx / 32) & 3, l = idx & 31;
    const int n = p0 + pt * 8 + (l & 3) * 2 + (q & 1);
    if (n >= npairs) continue;
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      gs += s_red[w][pt][0][q][l];
      us += s_red[w][pt][1][q][l];
    }
    const int i = s_pairs[n];
    const int t = i / OG_K, j = i - t * OG_K;
    const float rw = og_topk_weight(p, t, j);
#if OG_ON_INPUT
    const float a = og_silu(gs * rw) * (us * rw);
#else
    const float a = og_silu(gs) * us * rw;
#endif
    const int row = tile * 16 + (l >> 2) + (q >> 1) * 8;
    ((og_u16 *)p.act)[(long long)i * OG_I + row] = og_from_float(a);
  }
}

// gate_up's passes over one tile's npairs (token, slot) pairs: NT 8-pair MMA tiles a pass, U k-steps
// of loads in flight per warp; s_red is the block's reduction buffer (NB >= NT tiles a warp).
template <int W, int NT, int U, int NB>
__device__ __forceinline__ void og_gate_up_passes(const og_moe_params &p, int e, int tile, const int *s_pairs,
                                                  int npairs, float (*s_red)[NB][2][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const char *wg = (const char *)p.w13 +
                   2 * (e * p.w13_estride + (long long)(tile * 16 + g) * p.w13_rstride);
  const long long row8 = 2 * 8 * p.w13_rstride, up_off = 2 * (long long)OG_I * p.w13_rstride;
  const int steps = OG_H / 32;

  for (int p0 = 0; p0 < npairs; p0 += 8 * NT) {
    const char *xrow[NT];
    bool xval[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = p0 + nt * 8 + g;
      xval[nt] = n < npairs;
      const int t = xval[nt] ? s_pairs[n] / OG_K : 0;
      xrow[nt] = (const char *)p.x + 2 * (long long)t * p.x_stride;
    }
    float acc_g[NT][4], acc_u[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc_g[nt][q] = acc_u[nt][q] = 0.f;

    for (int s0 = warp * U; s0 < steps; s0 += W * U) {
      og_vec4 ag[U], ag8[U], au[U], au8[U], bx[U][NT];
#pragma unroll
      for (int q = 0; q < U; ++q) {
        const int s = s0 + q;
        if (steps % (W * U) == 0 || s < steps) {
          const long long off = 2 * (long long)(s * 32 + c * 8);
          ag[q] = og_load_stream<OG_LOAD>(wg + off);
          ag8[q] = og_load_stream<OG_LOAD>(wg + row8 + off);
          au[q] = og_load_stream<OG_LOAD>(wg + up_off + off);
          au8[q] = og_load_stream<OG_LOAD>(wg + up_off + row8 + off);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            bx[q][nt] = xval[nt] ? og_load_shared_operand(xrow[nt] + off) : og_zero4();
        }
      }
#pragma unroll
      for (int q = 0; q < U; ++q) {
        const int s = s0 + q;
        if (steps % (W * U) == 0 || s < steps) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (p0 + nt * 8 < npairs) {
              og_mma_k32(acc_g[nt], ag[q], ag8[q], bx[q][nt]);
              og_mma_k32(acc_u[nt], au[q], au8[q], bx[q][nt]);
            }
          }
        }
      }
    }

    og_stash_gate_up<NT>(s_red[warp], acc_g, acc_u, lane);
    __syncthreads();
    og_write_act<W, NT, NB>(p, s_red, s_pairs, npairs, p0, tile, threadIdx.x, blockDim.x);
    __syncthreads();
  }
}

// gate_up for one tile of expert e over its npairs (token, slot) pairs s_pairs[0..npairs).
template <int W>
__device__ __forceinline__ void og_gate_up_pairs(const og_moe_params &p, int e, int tile, const int *s_pairs,
                                                 int npairs, float (*s_red)[OG_NT][2][4][32]) {
#if OG_GU_NT < OG_NT
  if (npairs > 8 * OG_GU_NT) {  // more pairs than one pass of the hot path holds (rare; see OG_GU_NT)
    og_gate_up_passes<W, OG_NT, 1, OG_NT>(p, e, tile, s_pairs, npairs, s_red);
    return;
  }
#endif
  og_gate_up_passes<W, OG_GU_NT, OG_U1, OG_NT>(p, e, tile, s_pairs, npairs, s_red);
}

// gate_up for one tile: 16 rows of I of used expert number u, for every token routed to it.
template <int W>
__device__ __forceinline__ void og_gate_up_tile(const og_moe_params &p, const og_routing &r, int u, int tile,
                                                int *s_pairs, int &s_npairs, float (*s_red)[OG_NT][2][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nk = p.T * OG_K;
  const int e = r.experts[u];
  if (warp == 0) og_pairs_of(r, nk, e, lane, s_pairs, s_npairs);
  __syncthreads();
  og_gate_up_pairs<W>(p, e, tile, s_pairs, s_npairs, s_red);
}
