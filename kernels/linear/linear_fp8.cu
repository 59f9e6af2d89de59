// Linear for decode with block-FP8 weights (vLLM's Fp8LinearMethod with weight_block_size):
//   y[m, n] = sum_g ws[n / OG_BN][g] * sx[m][g] * sum_{k in g} q[m, k] * W[n, k]  (+ bias[n])
// W e4m3 [N, K], ws fp32, g the K / OG_BK groups of OG_BK columns, m < M <= 8. The activations
// are quantized here as vLLM's W8A8 block path quantizes them before its GEMM, per (row, group):
// amax = max(max_k |x[m, k]|, 1e-10), sx = amax / 448, q = e4m3(x * (448 / amax)) (nearest even,
// saturating); fp32 IEEE divisions, so the C oracle computes the same q bit for bit.
//
// The work: a block owns OG_TILES tiles of 16 rows of W; its OG_WARPS warps split the K groups
// into contiguous ranges, balanced to within one group. Per 64-k step a lane (4g + c) loads 16
// bytes of W rows g and g+8 of each tile (the A operand, og_mma_k64_f16) and 16 values of x row g
// (token g, the B operand) at physical k 16c..16c+15. Per group the lane takes the amax of its
// values, the four lanes of a row combine theirs (shuffles), and each lane rounds its values to
// e4m3 and on to f16 (exact); the group's products start from zero and are added to the fp32
// sums scaled by the tile's weight scale and the token's activation scale (tokens 2c and 2c+1
// are the lane's accumulator columns; their scales come from lanes 8c and 8c+4). The block then
// sums its warps' partials in warp order and adds the bias in fp32: no atomics, no split-K, the
// same bits every run.
//
// Compile-time constants (src/ops/linear/config.c): OG_DTYPE (x and y: 1 bf16, 2 fp16), OG_K,
// OG_BN (a multiple of 16: a tile lies in one block of rows), OG_BK (a multiple of 64 that divides
// OG_K), OG_WARPS, OG_TILES, OG_U (groups a warp loads before its MMAs), OG_MINB, OG_LOAD,
// OG_L2_FETCH, OG_PDL (0 or 1, as linear.cu: the first group's weights and scales are loaded
// before the wait, x after it), OG_TRIGGER (as linear.cu).
#include "og_fp8.cuh"
#include "linear_params.h"

#if !defined(OG_K) || !defined(OG_BN) || !defined(OG_BK)
#error "OG_K, OG_BN and OG_BK must be defined"
#endif
#if OG_BK % 64 != 0 || OG_BK < 64 || OG_K % OG_BK != 0 || OG_BN % 16 != 0 || OG_BN < 16
#error "OG_BK must be a multiple of 64 dividing OG_K, OG_BN a multiple of 16"
#endif
#ifndef OG_WARPS
#define OG_WARPS 8
#endif
#ifndef OG_TILES
#define OG_TILES 1
#endif
#ifndef OG_U
#define OG_U 2
#endif
#ifndef OG_MINB
#define OG_MINB 0
#endif
#ifndef OG_LOAD
#define OG_LOAD 4
#endif
#ifndef OG_PDL
#define OG_PDL 0
#endif
#ifndef OG_TRIGGER
#define OG_TRIGGER 0
#endif

#define OG_SPG (OG_BK / 64)   // 64-k steps a group
#define OG_G (OG_K / OG_BK)    // groups of a row
#define OG_ROWS (16 * OG_TILES)

extern "C" __global__ void __launch_bounds__(OG_WARPS * 32, OG_MINB)
    OG_SUFFIX(linear_gemv_fp8)(const og_linear_params p) {
  __shared__ float s_red[OG_WARPS][OG_TILES][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const long long n0 = (long long)blockIdx.x * OG_ROWS;
#if OG_TRIGGER
  og_pdl_launch_dependents();
#endif

  // This lane's W rows in each tile (rows n0 + 16t + g and + 8) at its 16 bytes of a step, and
  // the tile's row of weight scales.
  const char *wrow[OG_TILES][2];
  bool wok[OG_TILES][2];
  const float *wsrow[OG_TILES];
#pragma unroll
  for (int t = 0; t < OG_TILES; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long n = n0 + 16 * t + 8 * h + g;
      wok[t][h] = n < p.N;
      wrow[t][h] = (const char *)p.w + (wok[t][h] ? n : 0LL) * p.w_stride + 16 * c;
    }
    const long long nt = n0 + 16 * t < p.N ? n0 + 16 * t : 0LL;
    wsrow[t] = p.ws + (nt / OG_BN) * p.ws_stride0;
  }
  const bool xok = g < p.M;
  const char *xrow = (const char *)p.x + 2 * (long long)(xok ? g : 0) * p.x_stride + 32 * c;

  float acc[OG_TILES][4];
#pragma unroll
  for (int t = 0; t < OG_TILES; ++t)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[t][q] = 0.f;
  const og_vec4 zero = og_zero4();

  const int g_begin = warp * OG_G / OG_WARPS, g_end = (warp + 1) * OG_G / OG_WARPS;
  auto batch = [&](const int g0, const bool first) {
    og_vec4 w[OG_U][OG_SPG][OG_TILES][2], xv[OG_U][OG_SPG][2];
    float wsv[OG_U][OG_TILES];
#pragma unroll
    for (int q = 0; q < OG_U; ++q) {
      const bool ok = g0 + q < g_end;
      const long long k0 = (long long)(g0 + q) * OG_BK;
#pragma unroll
      for (int t = 0; t < OG_TILES; ++t) {
#pragma unroll
        for (int s = 0; s < OG_SPG; ++s)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            w[q][s][t][h] = !(ok && wok[t][h]) ? zero
                            : OG_PDL && first ? og_load_before_wait(wrow[t][h] + k0 + 64 * s)
                                              : og_load_stream<OG_LOAD>(wrow[t][h] + k0 + 64 * s);
        wsv[q][t] = ok ? __ldg(wsrow[t] + (g0 + q) * p.ws_stride1) : 0.f;
      }
    }
    if (OG_PDL && first) og_pdl_wait();  // x may be the previous kernel's output
#pragma unroll
    for (int q = 0; q < OG_U; ++q) {
      const long long k0 = (long long)(g0 + q) * OG_BK;
#pragma unroll
      for (int s = 0; s < OG_SPG; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xv[q][s][h] = g0 + q < g_end && xok ? og_load_activation<OG_PDL != 0>(xrow + 2 * (k0 + 64 * s) + 16 * h)
                                              : zero;
    }
#pragma unroll
    for (int q = 0; q < OG_U; ++q) {
      if (g0 + q >= g_end) continue;  // the same for the whole warp: mma.sync and shuffles need every lane
      float amax = 0.f;
#pragma unroll
      for (int s = 0; s < OG_SPG; ++s) amax = og_amax8(xv[q][s][1], og_amax8(xv[q][s][0], amax));
      float r;
      const float sx = og_group_scale(amax, r);
      const float sx0 = __shfl_sync(0xffffffffu, sx, 8 * c), sx1 = __shfl_sync(0xffffffffu, sx, 8 * c + 4);
      og_vec8 b[OG_SPG];
#pragma unroll
      for (int s = 0; s < OG_SPG; ++s) b[s].lo = og_quant8(xv[q][s][0], r), b[s].hi = og_quant8(xv[q][s][1], r);
#pragma unroll
      for (int t = 0; t < OG_TILES; ++t) {
        float d[4];
        og_mma_k64_f16<false>(d, w[q][0][t][0], w[q][0][t][1], b[0]);
#pragma unroll
        for (int s = 1; s < OG_SPG; ++s) og_mma_k64_f16<true>(d, w[q][s][t][0], w[q][s][t][1], b[s]);
        const float f0 = wsv[q][t] * sx0, f1 = wsv[q][t] * sx1;
        acc[t][0] += d[0] * f0, acc[t][1] += d[1] * f1, acc[t][2] += d[2] * f0, acc[t][3] += d[3] * f1;
      }
    }
  };
  int g0 = g_begin;
#if OG_PDL
  if (g0 < g_end) {
    batch(g0, true);
    g0 += OG_U;
  } else {
    og_pdl_wait();  // a warp without groups still writes y below
  }
#endif
  for (; g0 < g_end; g0 += OG_U) batch(g0, false);

  // acc[t] = D[row g][tokens 2c, 2c+1], D[row g+8][tokens 2c, 2c+1] of tile t.
#pragma unroll
  for (int t = 0; t < OG_TILES; ++t)
#pragma unroll
    for (int q = 0; q < 4; ++q) s_red[warp][t][q][lane] = acc[t][q];
  __syncthreads();
  for (int idx = threadIdx.x; idx < OG_TILES * 128; idx += OG_WARPS * 32) {
    const int t = idx >> 7, q = (idx >> 5) & 3, l = idx & 31;
    const int m = 2 * (l & 3) + (q & 1);
    const long long n = n0 + 16 * t + (l >> 2) + 8 * (q >> 1);
    if (m >= p.M || n >= p.N) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < OG_WARPS; ++w) sum += s_red[w][t][q][l];  // warp order: fixed
    if (p.bias) sum += og_to_float(((const og_u16 *)p.bias)[n]);
    ((og_u16 *)p.y)[(long long)m * p.y_stride + n] = og_from_float(sum);
  }
}
