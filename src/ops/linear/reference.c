/* CPU oracle for the linear op: fp64 accumulation on host pointers, for the tests (the add +
 * RMSNorm form: the norm in fp64, rounded where vLLM's function rounds; the q/k epilogue on the
 * rounded product, as the attention prologue's oracle). FP8 weights:
 * the activations are quantized in fp32 exactly as the kernel does (linear_fp8.cu), then every
 * product and sum is taken in fp64. */
#include <math.h>
#include <stdlib.h>

#include "linear.h"

static double load(int32_t dtype, const void *base, int64_t idx) {
  return opgraft__half_to_double(dtype, ((const uint16_t *)base)[idx]);
}

/* Row m of the add + RMSNorm form, in place on xin (x's row on entry): h = x + residual in fp64,
 * then the input the kernel multiplies, rounded to dtype where vLLM's function rounds
 * (include/opgraft/linear.h); residual_out's and normed_out's rows, rounded, where they are set. */
static void norm_row(const opgraft_linear_args *a, int64_t m, double *xin) {
  const int64_t K = a->in_features;
  double ss = 0;
  for (int64_t k = 0; k < K; ++k) {
    xin[k] += load(a->dtype, a->residual, m * a->residual_stride[0] + k * a->residual_stride[1]);
    ss += xin[k] * xin[k];
    if (a->residual_out)
      ((uint16_t *)a->residual_out)[m * a->residual_out_stride[0] + k * a->residual_out_stride[1]] =
          opgraft__double_to_half(a->dtype, xin[k]);
  }
  const double r = 1.0 / sqrt(ss / (double)K + (double)a->norm_eps);
  for (int64_t k = 0; k < K; ++k) {
    const double v = opgraft__half_to_double(a->dtype, opgraft__double_to_half(a->dtype, xin[k] * r));
    xin[k] = opgraft__half_to_double(a->dtype, opgraft__double_to_half(a->dtype, v * load(a->dtype, a->norm_weight, k)));
    if (a->normed_out)
      ((uint16_t *)a->normed_out)[m * a->normed_out_stride[0] + k * a->normed_out_stride[1]] =
          opgraft__double_to_half(a->dtype, xin[k]);
  }
}

/* The q/k epilogue of row m (its product rounded, in yrow): each query and key head normalized and
 * rotated as the attention prologue does, then stored (or written as doubles). */
static void qk_row(const opgraft_linear_args *a, int64_t m, uint16_t *yrow, double *out_f64) {
  const int64_t D = a->head_size, N = a->out_features;
  const int64_t pos = a->rope_style ? ((const int64_t *)a->positions)[m] : -1;
  for (int64_t h = 0; h < a->qk_heads; ++h)
    opgraft__qk_head_ref(a->dtype, D, yrow + h * D, h < a->q_heads ? a->q_norm_weight : a->k_norm_weight, a->qk_norm_eps,
                         a->rope_style, a->cos_sin_cache, a->cos_sin_stride, a->rope_rows, pos);
  for (int64_t n = 0; n < N; ++n) {
    if (out_f64) out_f64[m * N + n] = opgraft__half_to_double(a->dtype, yrow[n]);
    else ((uint16_t *)a->out)[m * a->out_stride[0] + n * a->out_stride[1]] = yrow[n];
  }
}

static int32_t reference_fp8(const opgraft_linear_args *a, double *out_f64) {
  const int64_t M = a->rows, N = a->out_features, K = a->in_features, bk = a->block_k, bn = a->block_n;
  if (bk < 1 || bn < 1 || K % bk || a->scale_dtype != OPGRAFT_DTYPE_FP32 || !a->weight_scale)
    return opgraft__fail(OPGRAFT_EINVAL, "FP8 reference: bad blocks or scales");
  const int64_t G = K / bk;
  double *q = malloc(sizeof(double) * (size_t)(K + G));
  if (!q) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  double *sx = q + K;
  const float *ws = a->weight_scale;
  const uint8_t *w = a->weight;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g)
      sx[g] = opgraft__e4m3_quantize_group(a->dtype, (const uint16_t *)a->x + m * a->x_stride[0] + g * bk * a->x_stride[1],
                                           a->x_stride[1], bk, q + g * bk);
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t g = 0; g < G; ++g) {
        double part = 0;
        for (int64_t k = g * bk; k < (g + 1) * bk; ++k)
          part += q[k] * opgraft__e4m3_to_double(w[n * a->weight_stride[0] + k * a->weight_stride[1]]);
        acc += part * ws[(n / bn) * a->weight_scale_stride[0] + g * a->weight_scale_stride[1]] * sx[g];
      }
      if (a->bias) acc += load(a->dtype, a->bias, n);
      if (out_f64) out_f64[m * N + n] = acc;
      else ((uint16_t *)a->out)[m * a->out_stride[0] + n * a->out_stride[1]] = opgraft__double_to_half(a->dtype, acc);
    }
  }
  free(q);
  return OPGRAFT_OK;
}

int32_t opgraft_linear_reference(const opgraft_linear_args *a, double *out_f64) {
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "bad arguments");
  const int fp8 = opgraft__linear_is_fp8(a);
  const int ok = (a->dtype == OPGRAFT_DTYPE_BF16 || a->dtype == OPGRAFT_DTYPE_FP16) &&
                 (a->weight_dtype == a->dtype || fp8) && (!a->bias || a->bias_dtype == a->dtype) &&
                 (out_f64 || a->out_dtype == a->dtype);
  if (!ok) return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference covers bf16/fp16 x with weights of its dtype or FP8");
  const int64_t M = a->rows, N = a->out_features, K = a->in_features;
  if (M < 0 || N < 1 || K < 1) return opgraft__fail(OPGRAFT_EINVAL, "bad sizes");
  if (M == 0) return OPGRAFT_OK;
  if (!a->x || !a->weight || (!out_f64 && !a->out)) return opgraft__fail(OPGRAFT_EINVAL, "NULL tensor");
  if (fp8) return reference_fp8(a, out_f64);
  if (a->residual && (a->norm_dtype != a->dtype || !a->norm_weight))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference's add + RMSNorm takes norm_dtype == dtype and a norm_weight");
  if (a->qk_heads && (a->head_size < 2 || a->head_size > 256 || N % a->head_size || a->qk_heads > N / a->head_size ||
                      !a->q_norm_weight != !a->k_norm_weight || a->rope_style < 0 || a->rope_style > 2 ||
                      (a->rope_style && (!a->cos_sin_cache || !a->positions))))
    return opgraft__fail(OPGRAFT_EINVAL, "q/k epilogue: bad heads, weights or rotary cache");
  double *xin = malloc(sizeof(double) * (size_t)K + sizeof(uint16_t) * (size_t)N);
  if (!xin) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  uint16_t *yrow = (uint16_t *)(xin + K); /* the q/k epilogue's row, rounded as the kernel stores it */
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xin[k] = load(a->dtype, a->x, m * a->x_stride[0] + k * a->x_stride[1]);
    if (a->residual) norm_row(a, m, xin);
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += xin[k] * load(a->dtype, a->weight, n * a->weight_stride[0] + k * a->weight_stride[1]);
      if (a->bias) acc += load(a->dtype, a->bias, n);
      if (a->qk_heads) yrow[n] = opgraft__double_to_half(a->dtype, acc);
      else if (out_f64) out_f64[m * N + n] = acc;
      else ((uint16_t *)a->out)[m * a->out_stride[0] + n * a->out_stride[1]] = opgraft__double_to_half(a->dtype, acc);
    }
    if (a->qk_heads) qk_row(a, m, yrow, out_f64);
  }
  free(xin);
  return OPGRAFT_OK;
}
