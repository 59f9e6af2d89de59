/* CPU oracle for the linear op: fp64 accumulation on host pointers, for the tests. */
#include <stdlib.h>

#include "linear.h"

static double load(int32_t dtype, const void *base, int64_t idx) {
  return opgraft__half_to_double(dtype, ((const uint16_t *)base)[idx]);
}

int32_t opgraft_linear_reference(const opgraft_linear_args *a, double *out_f64) {
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "bad arguments");
  const int ok = (a->dtype == OPGRAFT_DTYPE_BF16 || a->dtype == OPGRAFT_DTYPE_FP16) && a->weight_dtype == a->dtype &&
                 (!a->bias || a->bias_dtype == a->dtype) && (out_f64 || a->out_dtype == a->dtype);
  if (!ok) return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference covers bf16/fp16 of one dtype");
  const int64_t M = a->rows, N = a->out_features, K = a->in_features;
  if (M < 0 || N < 1 || K < 1) return opgraft__fail(OPGRAFT_EINVAL, "bad sizes");
  if (M == 0) return OPGRAFT_OK;
  if (!a->x || !a->weight || (!out_f64 && !a->out)) return opgraft__fail(OPGRAFT_EINVAL, "NULL tensor");
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += load(a->dtype, a->x, m * a->x_stride[0] + k * a->x_stride[1]) *
               load(a->dtype, a->weight, n * a->weight_stride[0] + k * a->weight_stride[1]);
      if (a->bias) acc += load(a->dtype, a->bias, n);
      if (out_f64) out_f64[m * N + n] = acc;
      else ((uint16_t *)a->out)[m * a->out_stride[0] + n * a->out_stride[1]] = opgraft__double_to_half(a->dtype, acc);
    }
  }
  return OPGRAFT_OK;
}
