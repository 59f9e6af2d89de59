/* The CPU oracle opgraft_linear_reference against a brute-force fp64 loop written here (its own
 * 16-bit decoding and rounding), with strides, bias, odd sizes and both dtypes; with FP8 weights,
 * against a brute force with its own e4m3 decoding and rounding of the quantized activations; the
 * add + RMSNorm form against a brute force of vLLM's function with this file's rounding. */
#include <math.h>

#include "og_test.h"

/* ---- 16-bit floats, decoded and rounded independently of the library ---- */

static double dec(int32_t dtype, uint16_t h) {
  if (dtype == OPGRAFT_DTYPE_BF16) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexp((double)m, -24);
  else v = ldexp(1.0 + m / 1024.0, e - 15);
  return (h & 0x8000) ? -v : v;
}

/* The 16-bit value nearest to d, ties to the even encoding, found by search over the encodings
 * of d's sign (slow and plain; finite values only). */
static uint16_t nearest(int32_t dtype, double d) {
  const uint16_t sign = signbit(d) ? 0x8000 : 0;
  const uint16_t top = dtype == OPGRAFT_DTYPE_BF16 ? 0x7f80 : 0x7c00; /* infinity */
  uint16_t best = sign;
  double best_err = INFINITY;
  for (uint32_t b = 0; b <= top; ++b) {
    const double v = dec(dtype, (uint16_t)(sign | b));
    if (isinf(v)) continue;
    const double err = fabs(v - d);
    if (err < best_err || (err == best_err && (b & 1) == 0)) best = (uint16_t)(sign | b), best_err = err;
  }
  return best;
}

/* Deterministic pseudo-random 16-bit values with a bounded exponent (bf16 in [2^-7, 2), fp16 in
 * [2^-5, 2), either sign): every product then has few enough bits, and the sums of up to a few
 * hundred terms stay exact in fp64, so the oracle must match the brute force exactly. */
static uint32_t rng_state = 12345;
static uint32_t rnd(void) {
  rng_state = rng_state * 1664525u + 1013904223u;
  return rng_state >> 8;
}
static uint16_t rand_half(int32_t dtype) {
  const uint32_t r = rnd();
  const uint16_t sign = (r & 1) ? 0x8000 : 0;
  if (dtype == OPGRAFT_DTYPE_BF16) return sign | (uint16_t)((120 + (r >> 1) % 8) << 7) | (uint16_t)((r >> 4) & 0x7f);
  return sign | (uint16_t)((10 + (r >> 1) % 6) << 10) | (uint16_t)((r >> 4) & 0x3ff);
}

typedef struct problem {
  int32_t dtype;
  int64_t M, N, K, xs, ws, os; /* row strides in elements */
  int bias;
  uint16_t *x, *w, *b, *out;
} problem;

static problem make(int32_t dtype, int64_t M, int64_t N, int64_t K, int64_t x_pad, int64_t w_pad, int64_t o_pad,
                    int bias) {
  problem p = {dtype, M, N, K, K + x_pad, K + w_pad, N + o_pad, bias, NULL, NULL, NULL, NULL};
  p.x = calloc((size_t)(M * p.xs + 1), 2);
  p.w = calloc((size_t)(N * p.ws + 1), 2);
  p.b = calloc((size_t)N + 1, 2);
  p.out = calloc((size_t)(M * p.os + 1), 2);
  assert_non_null(p.x);
  assert_non_null(p.w);
  assert_non_null(p.b);
  assert_non_null(p.out);
  /* A 16-bit value the brute-force decoder will recognise if the oracle reads past a row. */
  const uint16_t poison = dtype == OPGRAFT_DTYPE_BF16 ? 0x7fc1 : 0x7e01;
  for (int64_t i = 0; i < M * p.xs; ++i) p.x[i] = i % p.xs < K ? rand_half(dtype) : poison;
  for (int64_t i = 0; i < N * p.ws; ++i) p.w[i] = i % p.ws < K ? rand_half(dtype) : poison;
  for (int64_t i = 0; i < N; ++i) p.b[i] = rand_half(dtype);
  for (int64_t i = 0; i < M * p.os; ++i) p.out[i] = poison;
  return p;
}

static void release(problem *p) { free(p->x), free(p->w), free(p->b), free(p->out); }

static opgraft_linear_args args_of(const problem *p) {
  opgraft_linear_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.weight_dtype = a.bias_dtype = a.out_dtype = p->dtype;
  a.rows = p->M, a.out_features = p->N, a.in_features = p->K;
  a.x = p->x, a.x_stride[0] = p->xs, a.x_stride[1] = 1;
  a.weight = p->w, a.weight_stride[0] = p->ws, a.weight_stride[1] = 1;
  a.bias = p->bias ? p->b : NULL;
  a.out = p->out, a.out_stride[0] = p->os, a.out_stride[1] = 1;
  return a;
}

/* The brute force: y[m][n] = sum_k x[m][k] w[n][k] + b[n], term by term in long double. */
static long double brute(const problem *p, int64_t m, int64_t n) {
  long double acc = 0;
  for (int64_t k = 0; k < p->K; ++k)
    acc += (long double)dec(p->dtype, p->x[m * p->xs + k]) * (long double)dec(p->dtype, p->w[n * p->ws + k]);
  if (p->bias) acc += dec(p->dtype, p->b[n]);
  return acc;
}

static void check(int32_t dtype, int64_t M, int64_t N, int64_t K, int64_t x_pad, int64_t w_pad, int64_t o_pad,
                  int bias, const char *what) {
  problem p = make(dtype, M, N, K, x_pad, w_pad, o_pad, bias);
  opgraft_linear_args a = args_of(&p);
  double *y = malloc(sizeof(double) * (size_t)(M * N + 1));
  assert_non_null(y);
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_OK);
  assert_int_equal(opgraft_linear_reference(&a, NULL), OPGRAFT_OK); /* rounded into out */
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const long double want = brute(&p, m, n);
      const double got = y[m * N + n];
      if ((long double)got != want)
        fail_msg("%s: y[%lld][%lld] = %.17g, brute force %.17Lg", what, (long long)m, (long long)n, got, want);
      const uint16_t r = p.out[m * p.os + n], w = nearest(dtype, (double)want);
      if (r != w) fail_msg("%s: out[%lld][%lld] = 0x%04x, nearest to %.17Lg is 0x%04x", what, (long long)m, (long long)n,
                           r, want, w);
    }
    for (int64_t n = N; n < p.os; ++n) /* the padding of out is never written */
      assert_int_equal(p.out[m * p.os + n], dtype == OPGRAFT_DTYPE_BF16 ? 0x7fc1 : 0x7e01);
  }
  free(y);
  release(&p);
}

static void test_own_helpers(void **state) {
  assert_int_equal(nearest(OPGRAFT_DTYPE_BF16, 1.0), 0x3f80);
  assert_int_equal(nearest(OPGRAFT_DTYPE_BF16, -2.0), 0xc000);
  assert_int_equal(nearest(OPGRAFT_DTYPE_BF16, 1.0 + ldexp(1, -8)), 0x3f80); /* a tie: to even */
  assert_int_equal(nearest(OPGRAFT_DTYPE_BF16, 1.0 + 3 * ldexp(1, -8)), 0x3f82);
  assert_int_equal(nearest(OPGRAFT_DTYPE_FP16, 1.0), 0x3c00);
  assert_int_equal(nearest(OPGRAFT_DTYPE_FP16, 65504.0), 0x7bff);
  assert_int_equal(nearest(OPGRAFT_DTYPE_FP16, ldexp(1, -24)), 0x0001);
  assert_true(dec(OPGRAFT_DTYPE_FP16, 0x3555) > 0.333 && dec(OPGRAFT_DTYPE_FP16, 0x3555) < 0.334);
}

static void test_shapes_bf16(void **state) {
  check(OPGRAFT_DTYPE_BF16, 1, 1, 8, 0, 0, 0, 0, "M=1 N=1 K=8");
  check(OPGRAFT_DTYPE_BF16, 3, 7, 72, 0, 0, 0, 1, "M=3 N=7 K=72 bias");
  check(OPGRAFT_DTYPE_BF16, 8, 129, 40, 8, 16, 5, 1, "M=8 N=129 K=40 padded rows, bias");
  check(OPGRAFT_DTYPE_BF16, 5, 33, 256, 0, 8, 0, 0, "M=5 N=33 K=256");
}

static void test_shapes_fp16(void **state) {
  check(OPGRAFT_DTYPE_FP16, 1, 5, 8, 0, 0, 0, 1, "fp16 M=1 N=5 K=8 bias");
  check(OPGRAFT_DTYPE_FP16, 8, 17, 96, 24, 8, 3, 1, "fp16 M=8 N=17 K=96 padded rows, bias");
  check(OPGRAFT_DTYPE_FP16, 2, 64, 136, 0, 0, 0, 0, "fp16 M=2 N=64 K=136");
}

static void test_rounding_at_ties(void **state) {
  /* x = [1, 2^-8] and w = [1, 1]: the sum 1 + 2^-8 is a bf16 tie and rounds to even (1.0); with
   * 3 * 2^-8 it rounds up. The oracle rounds once, from fp64. */
  uint16_t x[2] = {0x3f80, 0x3b80}, w[2] = {0x3f80, 0x3f80}, out[1] = {0};
  opgraft_linear_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = a.weight_dtype = a.out_dtype = OPGRAFT_DTYPE_BF16;
  a.rows = 1, a.out_features = 1, a.in_features = 2;
  a.x = x, a.x_stride[0] = 2, a.x_stride[1] = 1;
  a.weight = w, a.weight_stride[0] = 2, a.weight_stride[1] = 1;
  a.out = out, a.out_stride[0] = 1, a.out_stride[1] = 1;
  assert_int_equal(opgraft_linear_reference(&a, NULL), OPGRAFT_OK);
  assert_int_equal(out[0], 0x3f80);
  x[1] = 0x3c40; /* 3 * 2^-8 */
  assert_int_equal(opgraft_linear_reference(&a, NULL), OPGRAFT_OK);
  assert_int_equal(out[0], 0x3f82);
}

static void test_zero_rows_and_bad_arguments(void **state) {
  problem p = make(OPGRAFT_DTYPE_BF16, 1, 4, 8, 0, 0, 0, 1);
  opgraft_linear_args a = args_of(&p);
  double y[4];
  a.rows = 0;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_OK);
  a.rows = 1;
  assert_int_equal(opgraft_linear_reference(NULL, y), OPGRAFT_EINVAL);
  a.struct_size = 8;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EINVAL);
  a.struct_size = sizeof a;
  a.weight_dtype = OPGRAFT_DTYPE_FP16;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EUNSUPPORTED);
  a.weight_dtype = OPGRAFT_DTYPE_BF16;
  a.dtype = a.weight_dtype = a.bias_dtype = a.out_dtype = OPGRAFT_DTYPE_FP32;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EUNSUPPORTED);
  a = args_of(&p);
  a.in_features = 0;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EINVAL);
  a = args_of(&p);
  a.x = NULL;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EINVAL);
  release(&p);
}

/* ---- add + RMSNorm before the projection ---- */

/* The brute force of the norm form: vLLM's fused_add_rms_norm (h = x + residual, then
 * round(round(h * rsqrt(mean h^2 + eps)) * w_norm)) with this file's decoding and rounding, then
 * the products in long double. */
static void check_norm(int32_t dtype, int64_t M, int64_t N, int64_t K, int64_t r_pad, float eps, const char *what) {
  problem p = make(dtype, M, N, K, 8, 0, 0, 1);
  const int64_t rs = K + r_pad;
  uint16_t *res = calloc((size_t)(M * rs + 1), 2), *ro = calloc((size_t)(M * rs + 1), 2), *nw = calloc((size_t)K, 2);
  uint16_t *ho = calloc((size_t)(M * rs + 1), 2);
  assert_non_null(res);
  assert_non_null(ro);
  assert_non_null(nw);
  assert_non_null(ho);
  for (int64_t i = 0; i < M * rs; ++i) res[i] = rand_half(dtype), ro[i] = ho[i] = 0x1234;
  for (int64_t k = 0; k < K; ++k) nw[k] = rand_half(dtype);
  opgraft_linear_args a = args_of(&p);
  a.norm_dtype = dtype, a.norm_eps = eps, a.norm_weight = nw;
  a.residual = res, a.residual_stride[0] = rs, a.residual_stride[1] = 1;
  a.residual_out = ro, a.residual_out_stride[0] = rs, a.residual_out_stride[1] = 1;
  a.normed_out = ho, a.normed_out_stride[0] = rs, a.normed_out_stride[1] = 1;
  double *y = malloc(sizeof(double) * (size_t)(M * N));
  long double *u = malloc(sizeof(long double) * (size_t)K);
  assert_non_null(y);
  assert_non_null(u);
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_OK);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double h = dec(dtype, p.x[m * p.xs + k]) + dec(dtype, res[m * rs + k]);
      ss += h * h;
      if (ro[m * rs + k] != nearest(dtype, h))
        fail_msg("%s: residual_out[%lld][%lld] = 0x%04x, want 0x%04x", what, (long long)m, (long long)k,
                 ro[m * rs + k], nearest(dtype, h));
    }
    const double r = 1.0 / sqrt(ss / (double)K + (double)eps);
    for (int64_t k = 0; k < K; ++k) {
      const double h = dec(dtype, p.x[m * p.xs + k]) + dec(dtype, res[m * rs + k]);
      u[k] = dec(dtype, nearest(dtype, dec(dtype, nearest(dtype, h * r)) * dec(dtype, nw[k])));
      if (ho[m * rs + k] != nearest(dtype, (double)u[k]))
        fail_msg("%s: normed_out[%lld][%lld] = 0x%04x, want 0x%04x", what, (long long)m, (long long)k,
                 ho[m * rs + k], nearest(dtype, (double)u[k]));
    }
    for (int64_t n = 0; n < N; ++n) {
      long double want = dec(dtype, p.b[n]);
      for (int64_t k = 0; k < K; ++k) want += u[k] * (long double)dec(dtype, p.w[n * p.ws + k]);
      if (fabsl((long double)y[m * N + n] - want) > 1e-12L * (fabsl(want) + 1))
        fail_msg("%s: y[%lld][%lld] = %.17g, brute force %.17Lg", what, (long long)m, (long long)n, y[m * N + n], want);
    }
    for (int64_t k = K; k < rs; ++k) { /* padding untouched */
      assert_int_equal(ro[m * rs + k], 0x1234);
      assert_int_equal(ho[m * rs + k], 0x1234);
    }
  }
  /* Without normed_out the same output. */
  double *y2 = malloc(sizeof(double) * (size_t)(M * N));
  assert_non_null(y2);
  a.normed_out = NULL;
  assert_int_equal(opgraft_linear_reference(&a, y2), OPGRAFT_OK);
  assert_memory_equal(y, y2, sizeof(double) * (size_t)(M * N));
  free(y2);
  /* A norm dtype unlike x's, or no norm weight: refused. */
  a.norm_dtype = dtype == OPGRAFT_DTYPE_BF16 ? OPGRAFT_DTYPE_FP16 : OPGRAFT_DTYPE_BF16;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EUNSUPPORTED);
  a.norm_dtype = dtype, a.norm_weight = NULL;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EUNSUPPORTED);
  free(u), free(y), free(nw), free(ho), free(ro), free(res);
  release(&p);
}

/* The q/k epilogue against the plain product, normalized and rotated here head by head in long
 * double (rounded where vLLM rounds: the normalized value, its product with the weight, the
 * rotated value): query heads with their weights, key heads with theirs, value heads untouched,
 * a position outside the rotary cache not rotated. Within one 16-bit step of the brute force
 * (its rsqrt in long double may round a value the other way). */
static void check_qk(int32_t dtype, int64_t M, int64_t D, int q_heads, int qk_heads, int heads, int norm, int rope,
                     const char *what) {
  const int64_t N = D * heads, K = 72, rows = 50;
  problem p = make(dtype, M, N, K, 8, 0, 0, 1);
  uint16_t *w = malloc(sizeof(uint16_t) * 2 * (size_t)D), *cs = malloc(sizeof(uint16_t) * (size_t)(rows * D));
  int64_t pos[8];
  assert_non_null(w);
  assert_non_null(cs);
  for (int64_t i = 0; i < 2 * D; ++i) w[i] = nearest(dtype, 0.5 + (double)(rnd() % 1000) / 1000.0);
  for (int64_t i = 0; i < rows * D; ++i) cs[i] = nearest(dtype, (double)(rnd() % 2001) / 1000.0 - 1.0);
  for (int64_t m = 0; m < M; ++m) pos[m] = m == 1 ? rows + 3 : (int64_t)(rnd() % rows); /* row 1: outside */
  opgraft_linear_args a = args_of(&p);
  assert_int_equal(opgraft_linear_reference(&a, NULL), OPGRAFT_OK);
  uint16_t *plain = malloc(sizeof(uint16_t) * (size_t)(M * p.os));
  assert_non_null(plain);
  memcpy(plain, p.out, sizeof(uint16_t) * (size_t)(M * p.os));
  a.head_size = (int32_t)D, a.q_heads = q_heads, a.qk_heads = qk_heads, a.rope_style = rope, a.qk_norm_eps = 1e-6f;
  if (norm) a.q_norm_weight = w, a.k_norm_weight = w + D;
  if (rope) a.cos_sin_cache = cs, a.cos_sin_stride = D, a.rope_rows = rows, a.positions = pos;
  double *y = malloc(sizeof(double) * (size_t)(M * N));
  assert_non_null(y);
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_OK);
  assert_int_equal(opgraft_linear_reference(&a, NULL), OPGRAFT_OK);
  long double h[256], r[256];
  for (int64_t m = 0; m < M; ++m)
    for (int hd = 0; hd < heads; ++hd) {
      for (int64_t d = 0; d < D; ++d) h[d] = dec(dtype, plain[m * p.os + hd * D + d]);
      if (hd < qk_heads && norm) {
        long double ss = 0;
        for (int64_t d = 0; d < D; ++d) ss += h[d] * h[d];
        const long double rs = 1.0L / sqrtl(ss / (long double)D + (long double)1e-6f);
        const uint16_t *wt = w + (hd < q_heads ? 0 : D);
        for (int64_t d = 0; d < D; ++d)
          h[d] = dec(dtype, nearest(dtype, (double)(dec(dtype, nearest(dtype, (double)(h[d] * rs))) * dec(dtype, wt[d]))));
      }
      const int rot = hd < qk_heads && rope && pos[m] < rows;
      for (int64_t i = 0; i < D / 2 && rot; ++i) {
        const long double c = dec(dtype, cs[pos[m] * D + i]), sn = dec(dtype, cs[pos[m] * D + D / 2 + i]);
        const int64_t i1 = rope == OPGRAFT_ROPE_NEOX ? i : 2 * i, i2 = rope == OPGRAFT_ROPE_NEOX ? i + D / 2 : 2 * i + 1;
        r[i1] = h[i1] * c - h[i2] * sn, r[i2] = h[i2] * c + h[i1] * sn;
      }
      for (int64_t d = 0; d < D; ++d) {
        const uint16_t want = nearest(dtype, (double)(rot ? r[d] : h[d])), got = p.out[m * p.os + hd * D + d];
        const double step = fabs(dec(dtype, want)) * (dtype == OPGRAFT_DTYPE_BF16 ? 1.0 / 128 : 1.0 / 1024) + 1e-30;
        if (hd >= qk_heads) {
          if (got != plain[m * p.os + hd * D + d]) fail_msg("%s: a value head changed at [%lld][%d]", what, (long long)m, hd);
        } else if (fabs(dec(dtype, got) - dec(dtype, want)) > step) {
          fail_msg("%s: out[%lld] head %d dim %lld = %g, brute force %g", what, (long long)m, hd, (long long)d,
                   dec(dtype, got), dec(dtype, want));
        }
        if (y[m * N + hd * D + d] != dec(dtype, got)) fail_msg("%s: out_f64 is not the rounded output", what);
      }
    }
  free(y), free(plain), free(w), free(cs);
  release(&p);
}

static void test_qk_epilogue(void **state) {
  check_qk(OPGRAFT_DTYPE_BF16, 3, 128, 4, 5, 6, 1, OPGRAFT_ROPE_NEOX, "head 128, norm + NeoX, bf16");
  check_qk(OPGRAFT_DTYPE_FP16, 2, 64, 2, 3, 4, 1, OPGRAFT_ROPE_GPTJ, "head 64, norm + GPT-J, fp16");
  check_qk(OPGRAFT_DTYPE_BF16, 8, 256, 1, 2, 3, 1, OPGRAFT_ROPE_NONE, "head 256, norm alone");
  check_qk(OPGRAFT_DTYPE_BF16, 2, 64, 3, 3, 3, 0, OPGRAFT_ROPE_NEOX, "head 64, NeoX alone, no value heads");
}

static void test_norm_shapes(void **state) {
  check_norm(OPGRAFT_DTYPE_BF16, 1, 5, 64, 0, 1e-6f, "norm M=1 N=5 K=64");
  check_norm(OPGRAFT_DTYPE_BF16, 3, 17, 40, 8, 1e-5f, "norm M=3 N=17 K=40 padded residual rows");
  check_norm(OPGRAFT_DTYPE_FP16, 8, 9, 96, 16, 0.0f, "norm fp16 M=8 N=9 K=96 eps 0");
}

/* ---- FP8 weights ---- */

static double dec_e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? m / 512.0 : (1.0 + m / 8.0) * ldexp(1, e - 7);
  return (b & 0x80) ? -v : v;
}

/* The e4m3 value nearest to v, ties to the even encoding, finite values past 448 saturated: a
 * search over the finite encodings of v's sign. */
static double nearest_e4m3(float v) {
  const uint8_t sign = signbit(v) ? 0x80 : 0;
  double best = 0, best_err = INFINITY;
  int best_b = 0;
  for (int b = 0; b < 0x7f; ++b) { /* 0x7f is NaN */
    const double q = dec_e4m3((uint8_t)(sign | b)), err = fabs(q - (double)v);
    if (err < best_err || (err == best_err && (b & 1) == 0 && (best_b & 1))) best = q, best_err = err, best_b = b;
  }
  return best;
}

static void check_fp8(int32_t dtype, int64_t M, int64_t N, int64_t K, int64_t bn, int64_t bk, int transposed,
                      int bias, const char *what) {
  problem p = make(dtype, M, N, K, 0, 0, 0, bias);
  uint8_t *w = malloc((size_t)(N * K));
  const int64_t nb = (N + bn - 1) / bn, kb = K / bk;
  float *ws = malloc(sizeof(float) * (size_t)(nb * kb));
  assert_non_null(w);
  assert_non_null(ws);
  for (int64_t i = 0; i < N * K; ++i) {
    uint8_t b = (uint8_t)(rnd() & 0xff);
    w[i] = (b & 0x7f) == 0x7f ? 0x3e : b;
  }
  for (int64_t i = 0; i < nb * kb; ++i) ws[i] = ldexpf(1.0f + (float)(rnd() % 1000) / 1000.0f, -8 - (int)(rnd() % 4));
  /* One row of zeros (amax clamps at 1e-10) and one with a large value (others round to 0). */
  if (M > 1)
    for (int64_t k = 0; k < K; ++k) p.x[p.xs + k] = 0;
  if (M > 2) p.x[2 * p.xs + 3] = dtype == OPGRAFT_DTYPE_BF16 ? 0x4780 : 0x7800; /* 65536 / 32768 */
  opgraft_linear_args a = args_of(&p);
  a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.weight = w, a.weight_stride[0] = K, a.weight_stride[1] = 1;
  a.scale_dtype = OPGRAFT_DTYPE_FP32, a.block_n = (int32_t)bn, a.block_k = (int32_t)bk, a.weight_scale = ws;
  a.weight_scale_stride[0] = transposed ? 1 : kb, a.weight_scale_stride[1] = transposed ? nb : 1;
  double *y = malloc(sizeof(double) * (size_t)(M * N));
  assert_non_null(y);
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_OK);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      long double want = 0, mag = 0;
      for (int64_t g = 0; g < kb; ++g) {
        float amax = 0;
        for (int64_t k = g * bk; k < (g + 1) * bk; ++k) amax = fmaxf(amax, fabsf((float)dec(dtype, p.x[m * p.xs + k])));
        amax = fmaxf(amax, 1e-10f);
        const float r = 448.0f / amax, sx = amax / 448.0f;
        const float sw = ws[transposed ? (n / bn) + g * nb : (n / bn) * kb + g];
        for (int64_t k = g * bk; k < (g + 1) * bk; ++k) {
          const long double t = (long double)nearest_e4m3((float)dec(dtype, p.x[m * p.xs + k]) * r) * dec_e4m3(w[n * K + k]) *
                                sw * sx;
          want += t, mag += fabsl(t);
        }
      }
      if (bias) want += dec(dtype, p.b[n]), mag += fabsl((long double)dec(dtype, p.b[n]));
      const double got = y[m * N + n];
      if (fabsl((long double)got - want) > 1e-12L * mag + 1e-300L)
        fail_msg("%s: y[%lld][%lld] = %.17g, brute force %.17Lg", what, (long long)m, (long long)n, got, want);
    }
  }
  if (M > 1) /* the zero row: zero outputs but the bias */
    for (int64_t n = 0; n < N; ++n) assert_true(y[N + n] == (bias ? dec(dtype, p.b[n]) : 0.0));
  free(y), free(ws), free(w);
  release(&p);
}

static void test_fp8_helpers(void **state) {
  assert_true(nearest_e4m3(448.0f) == 448.0 && nearest_e4m3(1e6f) == 448.0 && nearest_e4m3(-500.0f) == -448.0);
  assert_true(nearest_e4m3(1.0625f) == 1.0);  /* a tie between 1 and 1.125: to the even encoding */
  assert_true(nearest_e4m3(1.1875f) == 1.25); /* a tie between 1.125 and 1.25 */
  assert_true(nearest_e4m3(ldexpf(1, -10)) == 0.0 && nearest_e4m3(ldexpf(3, -10)) == ldexp(2, -9));
  assert_true(dec_e4m3(0x7e) == 448.0 && dec_e4m3(0x01) == ldexp(1, -9));
}

static void test_fp8_shapes(void **state) {
  check_fp8(OPGRAFT_DTYPE_BF16, 1, 16, 128, 16, 128, 0, 0, "fp8 M=1 N=16 K=128");
  check_fp8(OPGRAFT_DTYPE_BF16, 3, 40, 256, 16, 64, 1, 1, "fp8 M=3 N=40 K=256 16x64 blocks, transposed scales, bias");
  check_fp8(OPGRAFT_DTYPE_FP16, 8, 33, 384, 128, 128, 0, 1, "fp8 fp16 M=8 N=33 K=384 bias");
  /* Refusals the oracle shares with the guard's arguments. */
  problem p = make(OPGRAFT_DTYPE_BF16, 1, 16, 128, 0, 0, 0, 0);
  opgraft_linear_args a = args_of(&p);
  uint8_t w[16 * 128] = {0};
  a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.weight = w, a.scale_dtype = OPGRAFT_DTYPE_FP32;
  a.block_n = 16, a.block_k = 96; /* does not divide K */
  float one = 1.0f;
  a.weight_scale = &one;
  double y[16];
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EINVAL);
  a.block_k = 128, a.weight_scale = NULL;
  assert_int_equal(opgraft_linear_reference(&a, y), OPGRAFT_EINVAL);
  release(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_own_helpers),
      cmocka_unit_test(test_shapes_bf16),
      cmocka_unit_test(test_shapes_fp16),
      cmocka_unit_test(test_rounding_at_ties),
      cmocka_unit_test(test_zero_rows_and_bad_arguments),
      cmocka_unit_test(test_norm_shapes),
      cmocka_unit_test(test_qk_epilogue),
      cmocka_unit_test(test_fp8_helpers),
      cmocka_unit_test(test_fp8_shapes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
