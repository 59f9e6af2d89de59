/* Kernel parameters of the FP8 MoE kernels (moe_fp8.cu), shared by the host launcher (C11) and
 * the kernels (NVRTC C++): the bf16 kernels' parameters, then the scales. Strides are in
 * elements. */
#ifndef OPGRAFT_MOE_FP8_PARAMS_H
#define OPGRAFT_MOE_FP8_PARAMS_H

#include "moe_params.h"

typedef struct og_moe_fp8_params {
  og_moe_params b;          /* x, w13, w2 in e4m3; act: the workspace's [T*k, I] in f16 */
  const float *x_scale;     /* OG_SCALE 1: [T, ceil(H/OG_BK)]; 2: [1] */
  const float *w13_scale;   /* 1: [E, 2*ceil(I/OG_BN), ceil(H/OG_BK)]; 2: [E] or [E, 2] */
  const float *w2_scale;    /* 1: [E, ceil(H/OG_BN), ceil(I/OG_BK)]; 2: [E] */
  float *act_scale;         /* workspace: [T*k, I/16], one scale per slot and 16 rows of I */
  long long xs_stride[2];
  long long w13s_stride[3];
  long long w2s_stride[3];
} og_moe_fp8_params;

#endif
