// The FP8 gate/up stage: for one tile of OG_GU_ROWS (16 or 32) rows of I of one expert, act =
// w * silu(G x) * (U x) in f16 with one fp32 scale per (routing slot, 16 rows), from e4m3 weights
// and e4m3 activations (or, OG_XQ, 16-bit ones quantized here in 1 x OG_XG groups).
#pragma once
#include "moe_fp8.cuh"

// The epilogue for the pairs p0..p0+8*NT-1 of one tile: sums the W warps' gate and up partials in
// warp order, applies the per-tensor scales, and writes act (f16) and its scales. A warp takes one
// pair, a lane one of its rows (row r = lane: half r / 16, then row (r % 16) of the MMA tile). A
// token that lists the expert more than once gets one act row, at its first such slot, with the
// sum of those slots' router weights (in slot order): moe_down reads only that row.
template <int W, int NT>
__device__ __forceinline__ void og_fp8_write_act(const og_moe_fp8_params &q,
                                                 const float (*s_red)[NT][OG_GU_HALVES][2][4][32],
                                                 const int *s_pairs, int npairs, int p0, int e, int tile) {
  const og_moe_params &p = q.b;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = lane >> 4, rr = lane & 15;
  const int end = npairs < p0 + 8 * NT ? npairs : p0 + 8 * NT;
  for (int n = p0 + warp; n < end; n += W) {
    const int i = s_pairs[n], t = i / OG_K;
    if (n > 0 && s_pairs[n - 1] / OG_K == t) continue;  // a later slot of the same token
    float rw = 0.f;
    for (int m = n; m < npairs && s_pairs[m] / OG_K == t; ++m) rw += og_topk_weight(p, t, s_pairs[m] - t * OG_K);
    // D fragment of (row rr of the half, column nn % 8): lane (rr % 8) * 4 + column / 2, element
    // (rr / 8) * 2 + column % 2.
    const int nn = n - p0, nt = nn >> 3, cn = nn & 7;
    const int qi = (rr >> 3) * 2 + (cn & 1), l = (rr & 7) * 4 + (cn >> 1);
    float gs = 0.f, us = 0.f;
    if (h < OG_GU_HALVES) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        gs += s_red[w][nt][h][0][qi][l];
        us += s_red[w][nt][h][1][qi][l];
      }
    }
#if OG_SCALE == 2 && !OG_XQ  // OG_XQ: applied a k-step at a time with the group scales
    const float sx = q.x_scale[0];
    gs *= sx * q.w13_scale[e * q.w13s_stride[0]];
    us *= sx * q.w13_scale[e * q.w13s_stride[0] + q.w13s_stride[1]];
#endif
    const float a = og_silu(gs) * us * rw;
    float amax = fabsf(a);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(OG_FULL, amax, o));  // over the half
    // vLLM's group scale, max(absmax, 1e-10) / 448, over 16 rows; a / scale in f16 (the scale
    // keeps f16 in range whatever the model's activations are).
    const float scale = fmaxf(amax, 1e-10f) / 448.f;
    if (h < OG_GU_HALVES) {
      ((unsigned short *)p.act)[(long long)i * OG_I + tile * OG_GU_ROWS + lane] = og_f16_bits(a / scale);
      if (rr == 0) q.act_scale[(long long)i * OG_AS + tile * OG_GU_HALVES + h] = scale;
    }
  }
}

// One k-step's products of a lane's gate and up rows (a[0..1], a[2..3]) with its B operand b,
// scaled into the fp32 accumulators of its columns 2c, 2c+1 (gate factors fg0, fg1; up fu0, fu1).
template <class W4, class B>
__device__ __forceinline__ void og_fp8_gu_step(float (&acc_g)[4], float (&acc_u)[4], const W4 (&a)[4], const B &b,
                                               float fg0, float fg1, float fu0, float fu1) {
  float d[4];
  og_mma_step(d, a[0], a[1], b);
  acc_g[0] += d[0] * fg0, acc_g[1] += d[1] * fg1;
  acc_g[2] += d[2] * fg0, acc_g[3] += d[3] * fg1;
  og_mma_step(d, a[2], a[3], b);
  acc_u[0] += d[0] * fu0, acc_u[1] += d[1] * fu1;
  acc_u[2] += d[2] * fu0, acc_u[3] += d[3] * fu1;
}

// gate_up over one tile of expert e for its npairs (token, slot) pairs s_pairs[0..npairs): NT
// 8-pair MMA tiles a pass (an expert with more pairs, only where a token lists it more than once,
// takes more passes), U k-steps (OG_GU_KS k each: a lane's 8 or 16 bytes of a row) of loads in
// flight a warp, W warps splitting H. The tile's halves of 16 rows (one, or two at 32 rows) are
// passes over H, so that only one half's accumulators and operands are in registers. Each
// k-step's products are scaled into the fp32 accumulators at once (block scales: the weight
// block's scale times each column token's activation scale; per-tensor scales: in the
// epilogue), so no product is accumulated over more than one k-step inside the tensor core.
template <int W, int NT, int U>
__device__ __forceinline__ void og_fp8_gate_up(const og_moe_fp8_params &q, int e, int tile, const int *s_pairs,
                                               int npairs, float (*s_red)[NT][OG_GU_HALVES][2][4][32]) {
  const og_moe_params &p = q.b;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const long long rs = p.w13_rstride;
  const long long up_off = (long long)OG_I * rs;
  typedef og_kstep<OG_GU_KS> K;
  const int steps = OG_H / OG_GU_KS;
#if OG_SCALE == 1
  const float *wsg = q.w13_scale + e * q.w13s_stride[0] + (long long)((tile * OG_GU_ROWS) / OG_BN) * q.w13s_stride[1];
  const float *wsu =
      q.w13_scale + e * q.w13s_stride[0] + (long long)(OG_IB + (tile * OG_GU_ROWS) / OG_BN) * q.w13s_stride[1];
#elif OG_XQ
  const float wtg = q.w13_scale[e * q.w13s_stride[0]], wtu = q.w13_scale[e * q.w13s_stride[0] + q.w13s_stride[1]];
#endif

  for (int p0 = 0; p0 < npairs; p0 += 8 * NT) {
    int xoff[NT];  // this lane's B row (pair p0 + nt*8 + g): its token's row of x, or -1
#if OG_SCALE == 1 && !OG_XQ
    int xs0[NT], xs1[NT];  // the tokens of this lane's columns 2c, 2c+1, or -1
#endif
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = p0 + nt * 8 + g;
      xoff[nt] = n < npairs ? s_pairs[n] / OG_K : -1;
#if OG_SCALE == 1 && !OG_XQ
      const int m = p0 + nt * 8 + 2 * c;
      xs0[nt] = m < npairs ? s_pairs[m] / OG_K : -1;
      xs1[nt] = m + 1 < npairs ? s_pairs[m + 1] / OG_K : -1;
#endif
    }
#pragma unroll 1
    for (int hf = 0; hf < OG_GU_HALVES; ++hf) {
      const char *wg = (const char *)p.w13 + e * p.w13_estride + (long long)(tile * OG_GU_ROWS + hf * 16 + g) * rs;
      float acc_g[NT][4], acc_u[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc_g[nt][k] = acc_u[nt][k] = 0.f;

      for (int s0 = warp * U; s0 < steps; s0 += W * U) {
        typename K::w a[U][4];  // gate rows g, g+8 of the half, then up rows g, g+8
#if OG_XQ
        og_vec4 bx[U][NT][OG_GU_KS / 32];  // the lane's 16-bit x values (8 a vector)
#else
        typename K::w bx[U][NT];
#endif
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int s = s0 + u;
          if (steps % (W * U) == 0 || s < steps) {
            const long long off = (long long)(s * OG_GU_KS + c * (OG_GU_KS / 4));
            a[u][0] = K::template load<OG_LOAD>(wg + off);
            a[u][1] = K::template load<OG_LOAD>(wg + 8 * rs + off);
            a[u][2] = K::template load<OG_LOAD>(wg + up_off + off);
            a[u][3] = K::template load<OG_LOAD>(wg + up_off + 8 * rs + off);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#if OG_XQ
              const char *xr = (const char *)p.x + 2 * ((long long)xoff[nt] * p.x_stride + off);
#pragma unroll
              for (int h = 0; h < OG_GU_KS / 32; ++h)
                bx[u][nt][h] = xoff[nt] >= 0 ? og_load_activation<OG_PDL_IN != 0>(xr + 16 * h) : og_zero4();
#else
              bx[u][nt] = xoff[nt] >= 0 ? K::operand((const char *)p.x + (long long)xoff[nt] * p.x_stride + off)
                                        : K::zero();
#endif
            }
          }
        }
#if OG_XQ
        // Each group of SPG k-steps: its absmax per column (token) over the lane's values and the
        // row's four lanes, then its e4m3 values and products, scaled by the weight block's (or
        // matrix's) scale and the group scales of the lane's columns 2c, 2c+1 (lanes 8c and 8c + 4).
        constexpr int SPG = OG_XG / OG_GU_KS;
        static_assert(U % SPG == 0, "OG_XQ: a warp's k-steps a round hold whole groups");
#pragma unroll
        for (int j = 0; j < U / SPG; ++j) {
          const int sj = s0 + j * SPG;
          if (steps % (W * U) == 0 || sj < steps) {
#if OG_SCALE == 1
            const int kb = sj / SPG;
            const float sg = wsg[kb * q.w13s_stride[2]], su = wsu[kb * q.w13s_stride[2]];
#else
            const float sg = wtg, su = wtu;
#endif
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              if (p0 + nt * 8 < npairs) {
                float amax = 0.f;
#pragma unroll
                for (int u = j * SPG; u < (j + 1) * SPG; ++u)
#pragma unroll
                  for (int h = 0; h < OG_GU_KS / 32; ++h) amax = og_amax8(bx[u][nt][h], amax);
                float r;
                const float sx = og_group_scale(amax, r);
                const float x0 = __shfl_sync(OG_FULL, sx, 8 * c), x1 = __shfl_sync(OG_FULL, sx, 8 * c + 4);
                const float fg0 = sg * x0, fg1 = sg * x1, fu0 = su * x0, fu1 = su * x1;
#pragma unroll
                for (int u = j * SPG; u < (j + 1) * SPG; ++u) {
                  typename K::act b;
                  og_xq_operand(b, bx[u][nt], r);
                  og_fp8_gu_step(acc_g[nt], acc_u[nt], a[u], b, fg0, fg1, fu0, fu1);
                }
              }
            }
          }
        }
#else
        // The scale factors of the lane's two columns for gate and up, reloaded where a step
        // starts a new k-block: steps s0.. start at multiples of U, so where U and the block's
        // steps divide one another that is known at compile time.
        float fg0[NT], fg1[NT], fu0[NT], fu1[NT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int s = s0 + u;
          if (steps % (W * U) == 0 || s < steps) {
#if OG_SCALE == 1
            constexpr int SPB = OG_BK / OG_GU_KS;  // k-steps a weight block
            const bool fresh = u == 0 || (SPB % U == 0 || U % SPB == 0 ? u % SPB == 0 : s % SPB == 0);
            if (fresh) {
              const int kb = s / SPB;
              const float sg = wsg[kb * q.w13s_stride[2]], su = wsu[kb * q.w13s_stride[2]];
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                const float x0 = xs0[nt] >= 0 ? q.x_scale[xs0[nt] * q.xs_stride[0] + kb * q.xs_stride[1]] : 0.f;
                const float x1 = xs1[nt] >= 0 ? q.x_scale[xs1[nt] * q.xs_stride[0] + kb * q.xs_stride[1]] : 0.f;
                fg0[nt] = sg * x0, fg1[nt] = sg * x1, fu0[nt] = su * x0, fu1[nt] = su * x1;
              }
            }
#else
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) fg0[nt] = fg1[nt] = fu0[nt] = fu1[nt] = 1.f;
#endif
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              if (p0 + nt * 8 < npairs)
                og_fp8_gu_step(acc_g[nt], acc_u[nt], a[u], bx[u][nt], fg0[nt], fg1[nt], fu0[nt], fu1[nt]);
            }
          }
        }
#endif
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          s_red[warp][nt][hf][0][k][lane] = acc_g[nt][k];
          s_red[warp][nt][hf][1][k][lane] = acc_u[nt][k];
        }
    }
    OG_TS(0, 5);
    __syncthreads();
    og_fp8_write_act<W, NT>(q, s_red, s_pairs, npairs, p0, e, tile);
    __syncthreads();
  }
}
