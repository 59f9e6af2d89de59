/* Kernel parameters of the linear kernels (linear.cu, linear_fp8.cu), shared by the host launcher
 * (C11) and the kernels (NVRTC C++): plain types only, passed by value as the kernel's single
 * parameter. Strides are in elements. */
#ifndef OPGRAFT_LINEAR_PARAMS_H
#define OPGRAFT_LINEAR_PARAMS_H

/* The add + RMSNorm form's normalized rows in shared memory are K + OG_LINEAR_NORM_PAD elements
 * apart: 64 bytes of padding put the 16-byte loads of rows g and g + 1 in different banks. */
#define OG_LINEAR_NORM_PAD 32

typedef struct og_linear_params {
  const void *x;    /* [M, K] */
  const void *w;    /* [N, K] */
  const void *bias; /* [N], or NULL */
  void *y;          /* [M, N] */
  long long x_stride, w_stride, y_stride;
  int M, N;
  /* FP8 weights: fp32 block scales [ceil(N / OG_BN), K / OG_BK] */
  const float *ws;
  long long ws_stride0, ws_stride1;
  /* Add + RMSNorm before the projection (OG_NORM): residual and residual_out [M, K], norm weight [K],
   * the normalized rows [M, K] or NULL */
  const void *r, *nw;
  void *ro, *ho;
  long long r_stride, ro_stride, ho_stride;
  float eps;
  /* The q/k epilogue (OG_QKPRO): RMSNorm weights [D] of a query and a key head (16-bit), the
   * rotary cache [rope_rows rows of cs_stride: D/2 cosines, then D/2 sines], positions int64 [M];
   * y's first q_heads heads are queries, the next qk_heads - q_heads keys, the rest values (as the
   * product gives them). */
  const void *qk_qw, *qk_kw, *cos_sin;
  const long long *positions;
  long long cs_stride, rope_rows;
  int q_heads, qk_heads;
  float qk_eps;
} og_linear_params;

#endif
