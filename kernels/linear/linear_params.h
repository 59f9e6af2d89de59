/* Kernel parameters of the linear kernel, shared by the host launcher (C11) and the kernel (NVRTC
 * C++): plain types only, passed by value as the kernel's single parameter. Strides are in
 * elements. */
#ifndef OPGRAFT_LINEAR_PARAMS_H
#define OPGRAFT_LINEAR_PARAMS_H

typedef struct og_linear_params {
  const void *x;    /* [M, K] */
  const void *w;    /* [N, K] */
  const void *bias; /* [N], or NULL */
  void *y;          /* [M, N] */
  long long x_stride, w_stride, y_stride;
  int M, N;
} og_linear_params;

#endif
