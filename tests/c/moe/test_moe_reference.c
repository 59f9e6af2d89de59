/* The CPU oracle opgraft_moe_reference against a brute-force fp64 implementation written here,
 * and its rounding to bf16/fp16. */
#include <math.h>

#include "og_test.h"

/* ---- 16-bit floats, decoded and rounded independently of the library ---- */

static double dec_bf16(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static double dec_fp16(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexp((double)m, -24);
  else v = ldexp(1.0 + m / 1024.0, e - 15);
  return (h & 0x8000) ? -v : v;
}

static double dec(int32_t dtype, uint16_t bits) {
  return dtype == OPGRAFT_DTYPE_BF16 ? dec_bf16(bits) : dec_fp16(bits);
}

/* Round to nearest, ties to even, of d on the grid of a format with `bits` significant bits and
 * smallest normal exponent min_exp: returns the rounded value. */
static double rne_grid(double a, int bits, int min_exp) {
  int e;
  frexp(a, &e); /* a in [2^(e-1), 2^e) */
  int lead = e - 1;
  if (lead < min_exp) lead = min_exp; /* subnormals share the smallest normal spacing */
  const double ulp = ldexp(1.0, lead - (bits - 1));
  return nearbyint(a / ulp) * ulp; /* a / ulp is exact: a power-of-two scaling */
}

static uint16_t rne_bf16(double d) {
  if (isnan(d)) return 0x7fc0;
  const uint16_t sign = signbit(d) ? 0x8000 : 0;
  const double a = fabs(d);
  if (a == 0) return sign;
  const double v = isinf(a) ? a : rne_grid(a, 8, -126);
  if (v >= ldexp(1.0, 128)) return sign | 0x7f80;
  const float f = (float)v; /* exact: at most 8 significant bits */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  assert_int_equal(u & 0xffffu, 0);
  return sign | (uint16_t)(u >> 16);
}

static uint16_t rne_fp16(double d) {
  if (isnan(d)) return 0x7e00;
  const uint16_t sign = signbit(d) ? 0x8000 : 0;
  const double a = fabs(d);
  if (a == 0) return sign;
  const double v = isinf(a) ? a : rne_grid(a, 11, -14);
  if (v >= 65536.0) return sign | 0x7c00;
  if (v < ldexp(1.0, -14)) return sign | (uint16_t)(v * ldexp(1.0, 24));
  int e;
  const double m = frexp(v, &e); /* v = m * 2^e, m in [0.5, 1) */
  return sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)((m * 2.0 - 1.0) * 1024.0);
}

static uint16_t rne(int32_t dtype, double d) { return dtype == OPGRAFT_DTYPE_BF16 ? rne_bf16(d) : rne_fp16(d); }

/* Encodes a value that the format represents exactly. */
static uint16_t enc_exact(int32_t dtype, double v) {
  const uint16_t b = rne(dtype, v);
  if (dec(dtype, b) != v) fail_msg("%.17g is not exact in %s", v, dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16");
  return b;
}

static const char *dtype_str(int32_t dtype) { return dtype == OPGRAFT_DTYPE_BF16 ? "bf16" : "fp16"; }

static void test_own_rounding(void **state) {
  /* The test's own converters, on values worked out by hand. */
  assert_int_equal(rne_bf16(1.0), 0x3f80);
  assert_int_equal(rne_bf16(-2.0), 0xc000);
  assert_int_equal(rne_bf16(1.0 + ldexp(1, -8)), 0x3f80);
  assert_int_equal(rne_bf16(1.0 + 3 * ldexp(1, -8)), 0x3f82);
  assert_int_equal(rne_bf16(1e39), 0x7f80);
  assert_int_equal(rne_fp16(1.0), 0x3c00);
  assert_int_equal(rne_fp16(65504.0), 0x7bff);
  assert_int_equal(rne_fp16(65520.0), 0x7c00);
  assert_int_equal(rne_fp16(ldexp(1, -24)), 0x0001);
  assert_int_equal(rne_fp16(-ldexp(1, -14)), 0x8400);
  assert_true(dec_fp16(0x7bff) == 65504.0);
  assert_true(dec_fp16(0x0001) == ldexp(1, -24));
  assert_true(dec_fp16(0xbc00) == -1.0);
  assert_true(dec_bf16(0x3f80) == 1.0);
}

/* ---- random problems ---- */

static uint64_t rng;

static uint64_t rnd(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}

/* Random bits of a value in [-1, 1]; fp16 includes subnormals. */
static uint16_t random_bits(int32_t dtype) {
  const uint64_t r = rnd();
  const uint16_t sign = (r & 1) ? 0x8000 : 0;
  if ((r >> 1) % 32 == 0) return sign | (dtype == OPGRAFT_DTYPE_BF16 ? 0x3f80 : 0x3c00); /* +-1 */
  if ((r >> 1) % 32 == 1) return sign;                                                   /* +-0 */
  if (dtype == OPGRAFT_DTYPE_BF16) return sign | (uint16_t)((112 + (r >> 8) % 15) << 7) | (uint16_t)((r >> 20) & 0x7f);
  return sign | (uint16_t)(((r >> 8) % 15) << 10) | (uint16_t)((r >> 20) & 0x3ff);
}

typedef struct problem {
  int32_t dtype;
  int ids64, on_input;
  int64_t T, H, I, E, k, x_stride;
  uint16_t *x, *w13, *w2;
  float *tw;
  int64_t *ids;  /* [T, k], as given to the library */
  void *ids_buf; /* the same ids as int32 or int64 */
} problem;

static void problem_init(problem *p, int32_t dtype, int ids64, int on_input, int64_t x_pad, uint64_t seed) {
  memset(p, 0, sizeof *p);
  rng = seed * 0x9e3779b97f4a7c15ull + 12345;
  p->dtype = dtype, p->ids64 = ids64, p->on_input = on_input;
  p->T = 3, p->H = 32, p->I = 24, p->E = 5, p->k = 2, p->x_stride = p->H + x_pad;
  p->x = malloc(sizeof(uint16_t) * (size_t)(p->T * p->x_stride));
  p->w13 = malloc(sizeof(uint16_t) * (size_t)(p->E * 2 * p->I * p->H));
  p->w2 = malloc(sizeof(uint16_t) * (size_t)(p->E * p->H * p->I));
  p->tw = malloc(sizeof(float) * (size_t)(p->T * p->k));
  p->ids = malloc(sizeof(int64_t) * (size_t)(p->T * p->k));
  p->ids_buf = malloc(sizeof(int64_t) * (size_t)(p->T * p->k));
  assert_true(p->x && p->w13 && p->w2 && p->tw && p->ids && p->ids_buf);
  /* Padding between hidden rows holds NaN, which must never be read. */
  const uint16_t nan_bits = dtype == OPGRAFT_DTYPE_BF16 ? 0x7fc0 : 0x7e00;
  for (int64_t i = 0; i < p->T * p->x_stride; ++i) p->x[i] = nan_bits;
  for (int64_t t = 0; t < p->T; ++t)
    for (int64_t h = 0; h < p->H; ++h) p->x[t * p->x_stride + h] = random_bits(dtype);
  for (int64_t i = 0; i < p->E * 2 * p->I * p->H; ++i) p->w13[i] = random_bits(dtype);
  for (int64_t i = 0; i < p->E * p->H * p->I; ++i) p->w2[i] = random_bits(dtype);
  for (int64_t i = 0; i < p->T * p->k; ++i) p->tw[i] = (float)((rnd() >> 11) * 0x1p-53);
  for (int64_t i = 0; i < p->T * p->k; ++i) p->ids[i] = (int64_t)(rnd() % (uint64_t)p->E);
}

static void problem_free(problem *p) {
  free(p->x), free(p->w13), free(p->w2), free(p->tw), free(p->ids), free(p->ids_buf);
}

static opgraft_moe_args problem_args(problem *p, void *out) {
  for (int64_t i = 0; i < p->T * p->k; ++i) {
    if (p->ids64) ((int64_t *)p->ids_buf)[i] = p->ids[i];
    else ((int32_t *)p->ids_buf)[i] = (int32_t)p->ids[i];
  }
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = p->dtype;
  a.activation = OPGRAFT_ACT_SILU;
  a.apply_router_weight_on_input = p->on_input;
  a.num_tokens = p->T, a.hidden = p->H, a.inter = p->I, a.num_experts = p->E, a.top_k = p->k;
  a.hidden_states = p->x;
  a.hidden_states_stride[0] = p->x_stride, a.hidden_states_stride[1] = 1;
  a.w13 = p->w13;
  a.w13_stride[0] = 2 * p->I * p->H, a.w13_stride[1] = p->H, a.w13_stride[2] = 1;
  a.w2 = p->w2;
  a.w2_stride[0] = p->H * p->I, a.w2_stride[1] = p->I, a.w2_stride[2] = 1;
  a.topk_weights = p->tw;
  a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_weights_stride[0] = p->k, a.topk_weights_stride[1] = 1;
  a.topk_ids = p->ids_buf;
  a.topk_ids_dtype = p->ids64 ? OPGRAFT_DTYPE_INT64 : OPGRAFT_DTYPE_INT32;
  a.topk_ids_stride[0] = p->k, a.topk_ids_stride[1] = 1;
  a.out = out;
  a.out_stride[0] = p->H, a.out_stride[1] = 1;
  return a;
}

/* out[t, h] = sum_j w * W2[e] (silu(G[e] x) * U[e] x), in plain loops over t, j, i, h. */
static void brute_force(const problem *p, double *out) {
  const int64_t T = p->T, H = p->H, I = p->I, E = p->E, K = p->k;
  double *act = malloc(sizeof(double) * (size_t)I);
  assert_non_null(act);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = p->ids[t * K + j];
      if (e < 0 || e >= E) continue;
      const double w = p->tw[t * K + j];
      const double in_scale = p->on_input ? w : 1.0, out_scale = p->on_input ? 1.0 : w;
      for (int64_t i = 0; i < I; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t h = 0; h < H; ++h) {
          const double xv = in_scale * dec(p->dtype, p->x[t * p->x_stride + h]);
          g += dec(p->dtype, p->w13[(e * 2 * I + i) * H + h]) * xv;
          u += dec(p->dtype, p->w13[(e * 2 * I + I + i) * H + h]) * xv;
        }
        act[i] = g / (1.0 + exp(-g)) * u;
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0.0;
        for (int64_t i = 0; i < I; ++i) y += dec(p->dtype, p->w2[(e * H + h) * I + i]) * act[i];
        out[t * H + h] += out_scale * y;
      }
    }
  }
  free(act);
}

/* Relative tolerance 1e-12, measured against max(|want|, 1e-6 * the largest |want|) so that
 * entries near zero after cancellation do not demand more than fp64 gives. */
static void compare(const problem *p, const double *got, const double *want, const char *what) {
  const int64_t n = p->T * p->H;
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = fmax(scale, fabs(want[i]));
  assert_true(scale > 0);
  for (int64_t i = 0; i < n; ++i) {
    const double tol = 1e-12 * fmax(fabs(want[i]), 1e-6 * scale);
    if (!(fabs(got[i] - want[i]) <= tol))
      fail_msg("%s (%s, ids%s, on_input %d): out[%lld][%lld] = %.17g, brute force %.17g", what,
               dtype_str(p->dtype), p->ids64 ? "64" : "32", p->on_input, (long long)(i / p->H),
               (long long)(i % p->H), got[i], want[i]);
  }
}

/* Runs the reference and the brute force on p and compares them; got receives the reference. */
static void check_problem(problem *p, double *got, const char *what) {
  const int64_t n = p->T * p->H;
  double *want = malloc(sizeof(double) * (size_t)n);
  assert_non_null(want);
  for (int64_t i = 0; i < n; ++i) got[i] = NAN;
  opgraft_moe_args a = problem_args(p, NULL);
  const int32_t st = opgraft_moe_reference(&a, got);
  if (st != OPGRAFT_OK) fail_msg("%s: %s: %s", what, opgraft_status_name(st), opgraft_last_error());
  brute_force(p, want);
  compare(p, got, want, what);
  free(want);
}

static const int32_t dtypes[] = {OPGRAFT_DTYPE_BF16, OPGRAFT_DTYPE_FP16};

static void run_case(int ids64, int on_input, int64_t x_pad, uint64_t seed, const char *what) {
  for (int d = 0; d < 2; ++d) {
    problem p;
    problem_init(&p, dtypes[d], ids64, on_input, x_pad, seed + (uint64_t)d);
    double got[3 * 32];
    check_problem(&p, got, what);
    problem_free(&p);
  }
}

static void test_int32_ids(void **state) { run_case(0, 0, 0, 1, "int32 ids"); }
static void test_int64_ids(void **state) { run_case(1, 0, 0, 2, "int64 ids"); }
static void test_weight_on_input(void **state) {
  run_case(0, 1, 0, 3, "weight on the input");
  run_case(1, 1, 0, 4, "weight on the input, int64 ids");
  /* The flag matters: the same problem gives a different result with and without it. */
  problem p;
  problem_init(&p, OPGRAFT_DTYPE_BF16, 0, 0, 0, 5);
  double off[3 * 32], on[3 * 32];
  check_problem(&p, off, "weight on the output");
  p.on_input = 1;
  check_problem(&p, on, "weight on the input");
  double diff = 0;
  for (int i = 0; i < 3 * 32; ++i) diff = fmax(diff, fabs(on[i] - off[i]));
  assert_true(diff > 1e-6);
  problem_free(&p);
}
static void test_noncontiguous_hidden(void **state) {
  run_case(0, 0, 8, 6, "hidden row stride H+8");
  run_case(1, 1, 8, 7, "hidden row stride H+8, int64 ids, weight on the input");
}

static void test_ids_outside_range(void **state) {
  for (int d = 0; d < 2; ++d)
    for (int ids64 = 0; ids64 < 2; ++ids64) {
      problem p;
      problem_init(&p, dtypes[d], ids64, 0, 0, 8 + (uint64_t)d);
      const int64_t big = ids64 ? (INT64_C(1) << 32) + 1 : INT32_MAX; /* int64: 1 if truncated */
      const int64_t ids[3][2] = {{-1, p.E}, {p.E, 2}, {big, 0}};
      memcpy(p.ids, ids, sizeof ids);
      double got[3 * 32];
      check_problem(&p, got, "ids outside [0, E)");
      /* A token routed nowhere gets exactly zero. */
      for (int h = 0; h < 32; ++h) assert_true(got[h] == 0.0);
      problem_free(&p);
    }
}

/* Expert parallelism: this rank holds global experts 1, 3, 4 as local 0, 1, 2; the map sends the
 * others to -1. The result must equal the global problem with the other ranks' slots removed. */
static void test_expert_map(void **state) {
  for (int d = 0; d < 2; ++d)
    for (int ids64 = 0; ids64 < 2; ++ids64) {
      problem p;
      problem_init(&p, dtypes[d], ids64, d, 0, 20 + (uint64_t)(2 * d + ids64));
      const int64_t ids[3][2] = {{1, 0}, {3, 4}, {2, 5}}; /* 5: outside the map */
      memcpy(p.ids, ids, sizeof ids);
      static const int32_t map[5] = {-1, 0, -1, 1, 2};
      static const int64_t local[3] = {1, 3, 4};
      const int64_t w13n = 2 * p.I * p.H, w2n = p.H * p.I;
      uint16_t *w13 = malloc(sizeof(uint16_t) * (size_t)(3 * w13n)), *w2 = malloc(sizeof(uint16_t) * (size_t)(3 * w2n));
      assert_true(w13 && w2);
      for (int e = 0; e < 3; ++e) {
        memcpy(w13 + e * w13n, p.w13 + local[e] * w13n, sizeof(uint16_t) * (size_t)w13n);
        memcpy(w2 + e * w2n, p.w2 + local[e] * w2n, sizeof(uint16_t) * (size_t)w2n);
      }
      double got[3 * 32], want[3 * 32];
      opgraft_moe_args a = problem_args(&p, NULL); /* the global ids, as vLLM passes them */
      a.w13 = w13, a.w2 = w2, a.num_experts = 3;
      a.w13_stride[0] = w13n, a.w2_stride[0] = w2n;
      a.expert_map = map, a.expert_map_len = 5;
      assert_int_equal(opgraft_moe_reference(&a, got), OPGRAFT_OK);
      for (int i = 0; i < 6; ++i) /* the global problem without the other ranks' experts */
        if (p.ids[i] >= 5 || map[p.ids[i]] < 0) p.ids[i] = -1;
      check_problem(&p, want, "the global problem restricted to this rank's experts");
      compare(&p, got, want, "expert_map");
      a.expert_map_len = 0;
      assert_int_equal(opgraft_moe_reference(&a, got), OPGRAFT_EINVAL);
      free(w13), free(w2);
      problem_free(&p);
    }
}

static void test_duplicate_ids(void **state) {
  for (int d = 0; d < 2; ++d)
    for (int on_input = 0; on_input < 2; ++on_input) {
      problem p;
      problem_init(&p, dtypes[d], 0, on_input, 0, 10 + (uint64_t)d);
      const int64_t ids[3][2] = {{3, 3}, {1, 4}, {0, 0}};
      memcpy(p.ids, ids, sizeof ids);
      p.tw[1] = p.tw[0];
      double twice[3 * 32], once[3 * 32];
      check_problem(&p, twice, "a duplicate id");
      /* The same row with the second copy routed nowhere gives exactly half. */
      p.ids[1] = -1;
      check_problem(&p, once, "the duplicate removed");
      for (int h = 0; h < 32; ++h)
        if (twice[h] != 2.0 * once[h]) fail_msg("%s on_input %d: h=%d: %.17g != 2 * %.17g", dtype_str(p.dtype),
                                                on_input, h, twice[h], once[h]);
      problem_free(&p);
    }
}

static void test_zero_tokens_and_bad_arguments(void **state) {
  problem p;
  problem_init(&p, OPGRAFT_DTYPE_BF16, 0, 0, 0, 12);
  double out[3 * 32];
  for (int i = 0; i < 3 * 32; ++i) out[i] = 7.0;
  opgraft_moe_args a = problem_args(&p, NULL);
  a.num_tokens = 0;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_OK);
  for (int i = 0; i < 3 * 32; ++i) assert_true(out[i] == 7.0);

  a = problem_args(&p, NULL);
  assert_int_equal(opgraft_moe_reference(NULL, out), OPGRAFT_EINVAL);
  a.struct_size = 8;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EINVAL);
  a = problem_args(&p, NULL);
  a.activation = OPGRAFT_ACT_GELU;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EUNSUPPORTED);
  a = problem_args(&p, NULL);
  a.dtype = OPGRAFT_DTYPE_FP32;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EUNSUPPORTED);
  a = problem_args(&p, NULL);
  a.hidden_states = NULL;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EINVAL);
  a = problem_args(&p, NULL); /* no out_f64 and no out */
  assert_int_equal(opgraft_moe_reference(&a, NULL), OPGRAFT_EINVAL);
  problem_free(&p);
}

/* ---- rounding to the output dtype ---- */

static void test_round_random(void **state) {
  for (int d = 0; d < 2; ++d) {
    problem p;
    problem_init(&p, dtypes[d], 0, 0, 0, 13 + (uint64_t)d);
    double f64[3 * 32];
    uint16_t bits[3 * 32];
    check_problem(&p, f64, "rounding");
    opgraft_moe_args a = problem_args(&p, bits);
    assert_int_equal(opgraft_moe_reference(&a, NULL), OPGRAFT_OK);
    for (int i = 0; i < 3 * 32; ++i)
      if (bits[i] != rne(p.dtype, f64[i]))
        fail_msg("%s: %.17g rounded to 0x%04x, expected 0x%04x", dtype_str(p.dtype), f64[i], bits[i], rne(p.dtype, f64[i]));
    problem_free(&p);
  }
}

/* One crafted output: out = sum_i coef[i] * act[i], exactly, and the expected 16-bit result. */
#define N_ACT 6
typedef struct crafted {
  double coef[N_ACT];
  uint16_t want;
} crafted;

/* Builds a problem whose outputs are exactly the crafted sums: T=1, E=1, k=1, weight 1, x = e_0,
 * gate rows 64 * x_0 (silu(64) is 64 in fp64), up rows act[i] / 64 * x_0, and w2 the
 * coefficients. Checks the fp64 outputs, then the rounded ones. */
static void check_crafted(int32_t dtype, const double act[N_ACT], const crafted *c, int n) {
  const int64_t H = n, I = N_ACT;
  uint16_t *x = calloc((size_t)H, sizeof *x), *w13 = calloc((size_t)(2 * I * H), sizeof *w13);
  uint16_t *w2 = calloc((size_t)(H * I), sizeof *w2), *bits = calloc((size_t)H, sizeof *bits);
  double *f64 = calloc((size_t)H, sizeof *f64);
  assert_true(x && w13 && w2 && bits && f64);
  x[0] = enc_exact(dtype, 1.0);
  for (int64_t i = 0; i < I; ++i) {
    w13[i * H] = enc_exact(dtype, 64.0);
    w13[(I + i) * H] = enc_exact(dtype, act[i] / 64.0);
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < I; ++i) w2[h * I + i] = enc_exact(dtype, c[h].coef[i]);
  const float tw = 1.0f;
  const int32_t id = 0;
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = dtype;
  a.activation = OPGRAFT_ACT_SILU;
  a.num_tokens = 1, a.hidden = H, a.inter = I, a.num_experts = 1, a.top_k = 1;
  a.hidden_states = x, a.hidden_states_stride[0] = H, a.hidden_states_stride[1] = 1;
  a.w13 = w13, a.w13_stride[0] = 2 * I * H, a.w13_stride[1] = H, a.w13_stride[2] = 1;
  a.w2 = w2, a.w2_stride[0] = H * I, a.w2_stride[1] = I, a.w2_stride[2] = 1;
  a.topk_weights = &tw, a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_weights_stride[0] = 1, a.topk_weights_stride[1] = 1;
  a.topk_ids = &id, a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  a.topk_ids_stride[0] = 1, a.topk_ids_stride[1] = 1;
  a.out = bits, a.out_stride[0] = H, a.out_stride[1] = 1;
  const int32_t st1 = opgraft_moe_reference(&a, f64), st2 = opgraft_moe_reference(&a, NULL);
  /* The first mismatch is reported after the buffers are freed. */
  char problem[256] = "";
  if (st1 != OPGRAFT_OK || st2 != OPGRAFT_OK) snprintf(problem, sizeof problem, "reference failed: %s", opgraft_last_error());
  for (int h = 0; h < n && !problem[0]; ++h) {
    double exact = 0;
    for (int i = 0; i < I; ++i) exact += c[h].coef[i] * act[i];
    if (f64[h] != exact)
      snprintf(problem, sizeof problem, "%s case %d: fp64 output %.17g, constructed %.17g", dtype_str(dtype), h,
               f64[h], exact);
    else if (rne(dtype, exact) != c[h].want)
      snprintf(problem, sizeof problem, "%s case %d: the test's own rounding of %.17g gives 0x%04x, not 0x%04x",
               dtype_str(dtype), h, exact, rne(dtype, exact), c[h].want);
    else if (bits[h] != c[h].want)
      snprintf(problem, sizeof problem, "%s case %d: %.17g was rounded to 0x%04x, round-to-nearest-even is 0x%04x",
               dtype_str(dtype), h, exact, bits[h], c[h].want);
  }
  free(x), free(w13), free(w2), free(bits), free(f64);
  if (problem[0]) fail_msg("%s", problem);
}

/* bf16 acts: 1, 2^-8 (half an ulp of 1), 2^-40 (far below a float ulp), 2^-7 (one ulp of 1),
 * 2^-120 (for subnormal results) and 2^100 (for overflow). */
static const double bf16_act[N_ACT] = {1.0, 0x1p-8, 0x1p-40, 0x1p-7, 0x1p-120, 0x1p100};
#define BF16_MAX (0x1.fep127) /* (2 - 2^-7) * 2^127 */

static void test_round_bf16(void **state) {
  const crafted c[] = {
      {{1, 1, 0, 0}, 0x3f80},    /* 1 + half ulp: tie, to even (down) */
      {{1, 1, 0, 1}, 0x3f82},    /* 1 + 3 half ulps: tie, to even (up) */
      {{1, 1, -1, 0}, 0x3f80},   /* just below a tie */
      {{-1, -1, 0, -1}, 0xbf82}, /* negative tie */
      {{1, 0, -1, 0}, 0x3f80},   /* 1 - 2^-40 */
      {{0, 1, 0, 1}, 0x3c40},    /* 1.5 * 2^-7, exact */
      {{3, 0, 0, 0}, 0x4040},    /* 3, exact */
      {{0, 0, 0, 0}, 0x0000},
      {{1, 1, 0, 127}, 0x4000},  /* 2 - 2^-8: tie, up into the next binade */
      {{0, 0, 0, 0, 1.25 * 0x1p-13}, 0x0001}, /* subnormal 1.25 * 2^-133 */
      {{0, 0, 0, 0, 1.5 * 0x1p-13}, 0x0002},  /* subnormal tie, to even (up) */
      {{0, 0, 0, 0, 0x1p-7}, 0x0040},         /* subnormal 2^-127, exact */
      {{0, 0, 0, 0, 0x1p-14}, 0x0000},        /* 2^-134: tie between 0 and the smallest subnormal */
      {{0, 0, 0, 0, 255 * 0x1p-14}, 0x0080},  /* 127.5 * 2^-133: up to the smallest normal */
      {{BF16_MAX, 0, 0, 0, 0, 0x1p18}, 0x7f7f},   /* max + a quarter ulp: the largest finite */
      {{BF16_MAX, 0, 0, 0, 0, 0x1p19}, 0x7f80},   /* max + half an ulp: overflows to infinity */
      {{-BF16_MAX, 0, 0, 0, 0, -0x1p19}, 0xff80}, /* to -infinity */
  };
  check_crafted(OPGRAFT_DTYPE_BF16, bf16_act, c, (int)(sizeof c / sizeof *c));
}

static void test_round_bf16_no_double_rounding(void **state) {
  /* Just above or below a bf16 tie by less than half a float ulp: rounding the fp64 value through
   * float first would land on the tie and round the wrong way. */
  const crafted c[] = {
      {{1, 1, 1, 0}, 0x3f81},    /* 1 + 2^-8 + 2^-40: above the tie, up */
      {{1, 1, -1, 1}, 0x3f81},   /* 1 + 3 * 2^-8 - 2^-40: below the tie, down */
      {{-1, -1, -1, 0}, 0xbf81}, /* negative, above the tie in magnitude */
      {{1, 1, -1, 127}, 0x3fff}, /* 2 - 2^-8 - 2^-40: below the tie, down to the largest below 2 */
  };
  check_crafted(OPGRAFT_DTYPE_BF16, bf16_act, c, (int)(sizeof c / sizeof *c));
}

static void test_round_fp16(void **state) {
  /* fp16 acts: 1, 2^-11 (half an ulp of 1), 2^-18, 2^-14 (the smallest normal). */
  const double act[N_ACT] = {1.0, 0x1p-11, 0x1p-18, 0x1p-14, 0, 0};
  const crafted c[] = {
      {{1, 1, 0, 0}, 0x3c00},             /* tie, to even (down) */
      {{1, 1, 1, 0}, 0x3c01},             /* above the tie */
      {{1, 3, 0, 0}, 0x3c02},             /* tie, to even (up) */
      {{0, -3, 0, 0}, 0x9600},            /* -3 * 2^-11, exact */
      {{1, 2047, 0, 0}, 0x4000},          /* 2 - 2^-11: tie, up into the next binade */
      {{1, 2047, 1, 0}, 0x4000},          /* just above it */
      {{1, 2047, -1, 0}, 0x3fff},         /* just below it */
      {{0, 0, 0, 1.25 * 0x1p-10}, 0x0001}, /* subnormal 1.25 * 2^-24 */
      {{0, 0, 0, 1.5 * 0x1p-10}, 0x0002},  /* subnormal tie, to even (up) */
      {{0, 0, 0, 0.5}, 0x0200},            /* subnormal 2^-15, exact */
      {{0, 0, 0, 0x1p-11}, 0x0000},        /* 2^-25: tie between 0 and the smallest subnormal */
      {{0, 0, 0, -0x1p-11}, 0x8000},       /* the same, negative */
      {{0, 0, 0, 2047 * 0x1p-11}, 0x0400}, /* 1023.5 * 2^-24: up to the smallest normal */
      {{65504, 30720, 0, 0}, 0x7bff},      /* 65519: the largest finite */
      {{65504, 32768, 0, 0}, 0x7c00},      /* 65520: overflows to infinity */
      {{-65504, -32768, 0, 0}, 0xfc00},    /* -65520: to -infinity */
  };
  check_crafted(OPGRAFT_DTYPE_FP16, act, c, (int)(sizeof c / sizeof *c));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_own_rounding),
      cmocka_unit_test(test_int32_ids),
      cmocka_unit_test(test_int64_ids),
      cmocka_unit_test(test_expert_map),
      cmocka_unit_test(test_weight_on_input),
      cmocka_unit_test(test_noncontiguous_hidden),
      cmocka_unit_test(test_ids_outside_range),
      cmocka_unit_test(test_duplicate_ids),
      cmocka_unit_test(test_zero_tokens_and_bad_arguments),
      cmocka_unit_test(test_round_random),
      cmocka_unit_test(test_round_bf16),
      cmocka_unit_test(test_round_bf16_no_double_rounding),
      cmocka_unit_test(test_round_fp16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
