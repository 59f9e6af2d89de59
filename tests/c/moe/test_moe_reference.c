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

/* ---- expert parallelism with fewer local experts than a token's picks ---- */

/* A rank of DeepSeek-V3 at EP 64 holds 4 experts and each token picks 8: here 8 global experts,
 * k = 6 distinct picks a token, this rank holds globals 2 and 5 (local 0 and 1). The oracle with
 * the map equals the global problem with the other ranks' slots removed. */
static void test_expert_map_fewer_local_than_topk(void **state) {
  for (int d = 0; d < 2; ++d) {
    problem p;
    problem_init(&p, dtypes[d], d, 0, 0, 40 + (uint64_t)d);
    free(p.w13), free(p.w2), free(p.tw), free(p.ids), free(p.ids_buf);
    p.E = 8, p.k = 6;
    p.w13 = malloc(sizeof(uint16_t) * (size_t)(p.E * 2 * p.I * p.H));
    p.w2 = malloc(sizeof(uint16_t) * (size_t)(p.E * p.H * p.I));
    p.tw = malloc(sizeof(float) * (size_t)(p.T * p.k));
    p.ids = malloc(sizeof(int64_t) * (size_t)(p.T * p.k));
    p.ids_buf = malloc(sizeof(int64_t) * (size_t)(p.T * p.k));
    assert_true(p.w13 && p.w2 && p.tw && p.ids && p.ids_buf);
    for (int64_t i = 0; i < p.E * 2 * p.I * p.H; ++i) p.w13[i] = random_bits(p.dtype);
    for (int64_t i = 0; i < p.E * p.H * p.I; ++i) p.w2[i] = random_bits(p.dtype);
    for (int64_t i = 0; i < p.T * p.k; ++i) p.tw[i] = (float)((rnd() >> 11) * 0x1p-53);
    /* token 0 picks both local experts, token 1 one of them, token 2 none */
    const int64_t ids[3][6] = {{0, 2, 7, 5, 1, 3}, {6, 4, 3, 5, 0, 1}, {0, 1, 3, 4, 6, 7}};
    memcpy(p.ids, ids, sizeof ids);
    static const int32_t map[8] = {-1, -1, 0, -1, -1, 1, -1, -1};
    const int64_t w13n = 2 * p.I * p.H, w2n = p.H * p.I;
    uint16_t *w13 = malloc(sizeof(uint16_t) * (size_t)(2 * w13n)), *w2 = malloc(sizeof(uint16_t) * (size_t)(2 * w2n));
    assert_true(w13 && w2);
    memcpy(w13, p.w13 + 2 * w13n, sizeof(uint16_t) * (size_t)w13n);
    memcpy(w13 + w13n, p.w13 + 5 * w13n, sizeof(uint16_t) * (size_t)w13n);
    memcpy(w2, p.w2 + 2 * w2n, sizeof(uint16_t) * (size_t)w2n);
    memcpy(w2 + w2n, p.w2 + 5 * w2n, sizeof(uint16_t) * (size_t)w2n);
    double got[3 * 32], want[3 * 32];
    opgraft_moe_args a = problem_args(&p, NULL);
    a.w13 = w13, a.w2 = w2, a.num_experts = 2;
    a.w13_stride[0] = w13n, a.w2_stride[0] = w2n;
    a.expert_map = map, a.expert_map_len = 8;
    assert_int_equal(opgraft_moe_reference(&a, got), OPGRAFT_OK);
    for (int i = 0; i < 18; ++i)
      if (map[p.ids[i]] < 0) p.ids[i] = -1;
    check_problem(&p, want, "the global problem restricted to 2 local experts, k = 6");
    compare(&p, got, want, "expert_map with k > local experts");
    for (int h = 0; h < 32; ++h) assert_true(got[2 * 32 + h] == 0.0); /* token 2: nothing here */
    free(w13), free(w2);
    problem_free(&p);
  }
}

/* ---- FP8 weights ---- */

/* float8_e4m3fn by its own rule here: a table of the 126 positive finite values in increasing
 * order (subnormals j * 2^-9, then (8 + m) * 2^(e - 10)), indexed by the bits. */
static double e4m3_table[128];

static void build_e4m3_table(void) {
  for (int b = 0; b < 128; ++b) {
    const int e = b >> 3, m = b & 7;
    double v = 0;
    if (e == 0) {
      for (int j = 0; j < m; ++j) v += 0x1p-9;
    } else {
      v = 1.0;
      for (int j = 7; j < e; ++j) v *= 2.0;
      for (int j = e; j < 7; ++j) v /= 2.0;
      v *= 1.0 + m / 8.0;
    }
    e4m3_table[b] = (b == 127) ? NAN : v;
  }
}

static double dec_e4m3(uint8_t b) { return (b & 0x80) ? -e4m3_table[b & 0x7f] : e4m3_table[b & 0x7f]; }

static void test_e4m3_values(void **state) {
  build_e4m3_table();
  assert_true(dec_e4m3(0x38) == 1.0);
  assert_true(dec_e4m3(0x7e) == 448.0);
  assert_true(dec_e4m3(0xfe) == -448.0);
  assert_true(dec_e4m3(0x08) == 0x1p-6);
  assert_true(dec_e4m3(0x01) == 0x1p-9);
  assert_true(dec_e4m3(0x07) == 7 * 0x1p-9);
  assert_true(dec_e4m3(0x3c) == 1.5);
  assert_true(isnan(dec_e4m3(0x7f)) && isnan(dec_e4m3(0xff)));
  for (int b = 1; b < 126; ++b) assert_true(e4m3_table[b] < e4m3_table[b + 1]);
}

/* An FP8 problem: e4m3 bytes of x, w13, w2 (never NaN), scales in realistic ranges, and the scale
 * tensors in a layout given by strides (transposed when `transposed`). */
typedef struct fp8_problem {
  int32_t layout, bn, bk, out_dtype;
  int x_groups; /* per-tensor weights with activations in 1 x bk groups (xs [T, H/bk]) */
  int64_t T, H, I, E, k;
  uint8_t *x, *w13, *w2;
  float *xs, *s13, *s2, *tw;
  int64_t xs_stride[2], s13_stride[3], s2_stride[3];
  int32_t *ids;
} fp8_problem;

static int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

static uint8_t random_e4m3(void) {
  uint8_t b;
  do b = (uint8_t)(rnd() >> 24);
  while ((b & 0x7f) == 0x7f);
  return b;
}

static float random_scale(double lo_exp, double hi_exp) {
  const double u = (rnd() >> 11) * 0x1p-53;
  return (float)exp2(lo_exp + (hi_exp - lo_exp) * u);
}

/* layout: OPGRAFT_MOE_SCALE_BLOCK with bn x bk blocks, or _TENSOR (w13 scales [E, 2] when
 * two_halves, else [E] with stride 0 for the half). */
static void fp8_init(fp8_problem *p, int32_t layout, int bn, int bk, int64_t H, int64_t I, int transposed,
                     int two_halves, uint64_t seed) {
  memset(p, 0, sizeof *p);
  rng = seed * 0x9e3779b97f4a7c15ull + 777;
  p->layout = layout, p->bn = bn, p->bk = bk, p->out_dtype = OPGRAFT_DTYPE_BF16;
  p->T = 3, p->H = H, p->I = I, p->E = 4, p->k = 2;
  const int64_t T = p->T, E = p->E;
  p->x = malloc((size_t)(T * H));
  p->w13 = malloc((size_t)(E * 2 * I * H));
  p->w2 = malloc((size_t)(E * H * I));
  p->tw = malloc(sizeof(float) * (size_t)(T * p->k));
  p->ids = malloc(sizeof(int32_t) * (size_t)(T * p->k));
  for (int64_t i = 0; i < T * H; ++i) p->x[i] = random_e4m3();
  for (int64_t i = 0; i < E * 2 * I * H; ++i) p->w13[i] = random_e4m3();
  for (int64_t i = 0; i < E * H * I; ++i) p->w2[i] = random_e4m3();
  for (int64_t i = 0; i < T * p->k; ++i) p->tw[i] = (float)((rnd() >> 11) * 0x1p-53);
  const int32_t ids[6] = {1, 3, 0, 2, 3, 1};
  memcpy(p->ids, ids, sizeof ids);
  if (layout == OPGRAFT_MOE_SCALE_BLOCK) {
    const int64_t kbh = cdiv64(H, bk), nbi = cdiv64(I, bn), kbi = cdiv64(I, bk), nbh = cdiv64(H, bn);
    p->xs = malloc(sizeof(float) * (size_t)(T * kbh));
    p->s13 = malloc(sizeof(float) * (size_t)(E * 2 * nbi * kbh));
    p->s2 = malloc(sizeof(float) * (size_t)(E * nbh * kbi));
    /* activations ~ 1 / 448 (vLLM's absmax / 448), weights ~ 0.02 / 448 */
    for (int64_t i = 0; i < T * kbh; ++i) p->xs[i] = random_scale(-10, -8);
    for (int64_t i = 0; i < E * 2 * nbi * kbh; ++i) p->s13[i] = random_scale(-16, -13);
    for (int64_t i = 0; i < E * nbh * kbi; ++i) p->s2[i] = random_scale(-16, -13);
    p->xs_stride[0] = kbh, p->xs_stride[1] = 1;
    if (transposed) { /* [E][kb][nb]: the two block indices swapped in memory */
      p->s13_stride[0] = 2 * nbi * kbh, p->s13_stride[1] = 1, p->s13_stride[2] = 2 * nbi;
      p->s2_stride[0] = nbh * kbi, p->s2_stride[1] = 1, p->s2_stride[2] = nbh;
      p->xs_stride[0] = 1, p->xs_stride[1] = T;
    } else {
      p->s13_stride[0] = 2 * nbi * kbh, p->s13_stride[1] = kbh, p->s13_stride[2] = 1;
      p->s2_stride[0] = nbh * kbi, p->s2_stride[1] = kbi, p->s2_stride[2] = 1;
    }
  } else {
    p->xs = malloc(sizeof(float));
    p->s13 = malloc(sizeof(float) * (size_t)(2 * E));
    p->s2 = malloc(sizeof(float) * (size_t)E);
    p->xs[0] = random_scale(-10, -8);
    for (int64_t i = 0; i < 2 * E; ++i) p->s13[i] = random_scale(-16, -13);
    for (int64_t i = 0; i < E; ++i) p->s2[i] = random_scale(-16, -13);
    p->s13_stride[0] = two_halves ? 2 : 1, p->s13_stride[1] = two_halves ? 1 : 0;
    p->s2_stride[0] = 1;
  }
}

static void fp8_free(fp8_problem *p) {
  free(p->x), free(p->w13), free(p->w2), free(p->xs), free(p->s13), free(p->s2), free(p->tw), free(p->ids);
}

static opgraft_moe_args fp8_args(const fp8_problem *p) {
  opgraft_moe_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.dtype = p->out_dtype;
  a.activation = OPGRAFT_ACT_SILU;
  a.num_tokens = p->T, a.hidden = p->H, a.inter = p->I, a.num_experts = p->E, a.top_k = p->k;
  a.hidden_states = p->x, a.hidden_states_stride[0] = p->H, a.hidden_states_stride[1] = 1;
  a.w13 = p->w13, a.w13_stride[0] = 2 * p->I * p->H, a.w13_stride[1] = p->H, a.w13_stride[2] = 1;
  a.w2 = p->w2, a.w2_stride[0] = p->H * p->I, a.w2_stride[1] = p->I, a.w2_stride[2] = 1;
  a.topk_weights = p->tw, a.topk_weights_dtype = OPGRAFT_DTYPE_FP32;
  a.topk_weights_stride[0] = p->k, a.topk_weights_stride[1] = 1;
  a.topk_ids = p->ids, a.topk_ids_dtype = OPGRAFT_DTYPE_INT32;
  a.topk_ids_stride[0] = p->k, a.topk_ids_stride[1] = 1;
  a.out_stride[0] = p->H, a.out_stride[1] = 1;
  a.weight_dtype = OPGRAFT_DTYPE_FP8_E4M3, a.scale_layout = p->layout, a.scale_dtype = OPGRAFT_DTYPE_FP32;
  a.block_n = p->bn, a.block_k = p->bk;
  a.hidden_scale = p->xs, a.w13_scale = p->s13, a.w2_scale = p->s2;
  memcpy(a.hidden_scale_stride, p->xs_stride, sizeof p->xs_stride);
  memcpy(a.w13_scale_stride, p->s13_stride, sizeof p->s13_stride);
  memcpy(a.w2_scale_stride, p->s2_stride, sizeof p->s2_stride);
  return a;
}

/* Dequantizes everything into dense fp64 matrices with loops of its own (block coordinates by
 * counting rows into blocks), then the dense SwiGLU MoE. */
static void fp8_brute_force(const fp8_problem *p, double *out) {
  const int64_t T = p->T, H = p->H, I = p->I, E = p->E, K = p->k;
  double *x = malloc(sizeof(double) * (size_t)(T * H)), *w13 = malloc(sizeof(double) * (size_t)(E * 2 * I * H));
  double *w2 = malloc(sizeof(double) * (size_t)(E * H * I)), *act = malloc(sizeof(double) * (size_t)I);
  assert_true(x && w13 && w2 && act);
  const int block = p->layout == OPGRAFT_MOE_SCALE_BLOCK;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0, kb = 0, in = 0; h < H; ++h, in = (in + 1 == p->bk) ? (++kb, 0) : in + 1)
      x[t * H + h] = dec_e4m3(p->x[t * H + h]) *
                     (block || p->x_groups ? p->xs[t * p->xs_stride[0] + kb * p->xs_stride[1]] : p->xs[0]);
  const int64_t nbi = block ? cdiv64(I, p->bn) : 0;
  for (int64_t e = 0; e < E; ++e)
    for (int half = 0; half < 2; ++half)
      for (int64_t i = 0; i < I; ++i) {
        const int64_t rb = half * nbi + i / (block ? p->bn : 1);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = half * I + i;
          const double sc = block ? p->s13[e * p->s13_stride[0] + rb * p->s13_stride[1] + (h / p->bk) * p->s13_stride[2]]
                                  : p->s13[e * p->s13_stride[0] + half * p->s13_stride[1]];
          w13[(e * 2 * I + r) * H + h] = dec_e4m3(p->w13[(e * 2 * I + r) * H + h]) * sc;
        }
      }
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < I; ++i) {
        const double sc = block ? p->s2[e * p->s2_stride[0] + (h / p->bn) * p->s2_stride[1] + (i / p->bk) * p->s2_stride[2]]
                                : p->s2[e * p->s2_stride[0]];
        w2[(e * H + h) * I + i] = dec_e4m3(p->w2[(e * H + h) * I + i]) * sc;
      }
  for (int64_t i = 0; i < T * H; ++i) out[i] = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = p->ids[t * K + j];
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < H; ++h) {
          g += w13[(e * 2 * I + i) * H + h] * x[t * H + h];
          u += w13[(e * 2 * I + I + i) * H + h] * x[t * H + h];
        }
        act[i] = g / (1 + exp(-g)) * u;
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += w2[(e * H + h) * I + i] * act[i];
        out[t * H + h] += p->tw[t * K + j] * y;
      }
    }
  free(x), free(w13), free(w2), free(act);
}

static void fp8_check(fp8_problem *p, const char *what) {
  const int64_t n = p->T * p->H;
  double *got = malloc(sizeof(double) * (size_t)n), *want = malloc(sizeof(double) * (size_t)n);
  assert_true(got && want);
  opgraft_moe_args a = fp8_args(p);
  const int32_t st = opgraft_moe_reference(&a, got);
  if (st != OPGRAFT_OK) fail_msg("%s: %s: %s", what, opgraft_status_name(st), opgraft_last_error());
  fp8_brute_force(p, want);
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = fmax(scale, fabs(want[i]));
  assert_true(scale > 0);
  for (int64_t i = 0; i < n; ++i)
    if (!(fabs(got[i] - want[i]) <= 1e-12 * fmax(fabs(want[i]), 1e-6 * scale)))
      fail_msg("%s: out[%lld][%lld] = %.17g, brute force %.17g", what, (long long)(i / p->H), (long long)(i % p->H),
               got[i], want[i]);
  /* The rounded output is the fp64 one rounded to bf16. */
  uint16_t *bits = malloc(sizeof(uint16_t) * (size_t)n);
  assert_non_null(bits);
  a.out = bits;
  assert_int_equal(opgraft_moe_reference(&a, NULL), OPGRAFT_OK);
  for (int64_t i = 0; i < n; ++i)
    if (bits[i] != rne_bf16(got[i])) fail_msg("%s: %.17g rounded to 0x%04x", what, got[i], bits[i]);
  free(got), free(want), free(bits);
}

static void test_fp8_block(void **state) {
  build_e4m3_table();
  const struct { int bn, bk; int64_t H, I; } cases[] = {
      {32, 32, 64, 64}, /* whole blocks */
      {64, 64, 96, 96}, /* the last block of H and I half full (ceil) */
      {32, 64, 64, 96}, /* blocks of two sizes */
      {128, 128, 96, 64}, /* one block smaller than the matrix's rows and columns */
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; ++c)
    for (int tr = 0; tr < 2; ++tr) {
      fp8_problem p;
      fp8_init(&p, OPGRAFT_MOE_SCALE_BLOCK, cases[c].bn, cases[c].bk, cases[c].H, cases[c].I, tr, 0, 50 + c * 2 + tr);
      char what[96];
      snprintf(what, sizeof what, "fp8 %dx%d blocks H=%lld I=%lld%s", cases[c].bn, cases[c].bk, (long long)cases[c].H,
               (long long)cases[c].I, tr ? " transposed scales" : "");
      fp8_check(&p, what);
      fp8_free(&p);
    }
}

static void test_fp8_tensor(void **state) {
  build_e4m3_table();
  for (int two = 0; two < 2; ++two) {
    fp8_problem p;
    fp8_init(&p, OPGRAFT_MOE_SCALE_TENSOR, 0, 0, 64, 96, 0, two, 60 + (uint64_t)two);
    fp8_check(&p, two ? "fp8 per-tensor, [E, 2] w13 scales" : "fp8 per-tensor, [E] w13 scales");
    fp8_free(&p);
  }
}

/* The e4m3 encoding nearest to v by a search of the table, ties to the even encoding, finite
 * values past 448 saturated. */
static uint8_t nearest_e4m3_bits(float v) {
  const double a = fabs((double)v);
  int best = 0;
  double best_err = INFINITY;
  for (int b = 0; b < 127; ++b) {
    const double err = fabs(e4m3_table[b] - a);
    if (err < best_err || (err == best_err && (b & 1) == 0)) best_err = err, best = b;
  }
  return (uint8_t)((v < 0 ? 0x80 : 0) | best);
}

/* 16-bit hidden states with FP8 weights (ABI 9): the oracle quantizes each token's 1 x bk groups
 * itself (amax = max(max |x|, 1e-10) in fp32, scale amax / 448, q = e4m3(x * (448 / amax))), in
 * groups of 128 with per-tensor weight scales; the brute force quantizes them by its own rule
 * into the e4m3 form and checks that. */
static void test_fp8_hidden_quantized(void **state) {
  build_e4m3_table();
  for (int c = 0; c < 3; ++c) {
    fp8_problem p;
    const int bk = c == 2 ? 128 : c ? 64 : 32;
    if (c == 2) { /* per-tensor weights, one scale a half; the activations' groups are the kernel's */
      fp8_init(&p, OPGRAFT_MOE_SCALE_TENSOR, 0, 0, 256, 64, 0, 1, 82);
      free(p.xs);
      p.xs = malloc(sizeof(float) * (size_t)(p.T * p.H / bk));
      assert_non_null(p.xs);
      p.bk = bk, p.x_groups = 1, p.xs_stride[0] = p.H / bk, p.xs_stride[1] = 1;
    } else {
      fp8_init(&p, OPGRAFT_MOE_SCALE_BLOCK, 32, bk, 128, 64, 0, 0, 80 + (uint64_t)c);
    }
    uint16_t *x16 = malloc(sizeof(uint16_t) * (size_t)(p.T * p.H));
    assert_non_null(x16);
    for (int64_t i = 0; i < p.T * p.H; ++i) { /* values over a few decades, a zero group in token 1 */
      const double u = (rnd() >> 11) * 0x1p-53 - 0.5;
      x16[i] = (i / p.H == 1 && i % p.H < bk) ? 0 : rne_bf16(u * exp2((double)(rnd() % 12) - 6));
    }
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t g = 0; g < p.H / bk; ++g) {
        float amax = 0.f;
        for (int64_t h = g * bk; h < (g + 1) * bk; ++h) amax = fmaxf(amax, fabsf((float)dec_bf16(x16[t * p.H + h])));
        amax = fmaxf(amax, 1e-10f);
        const float r = 448.f / amax;
        p.xs[t * p.xs_stride[0] + g * p.xs_stride[1]] = amax / 448.f;
        for (int64_t h = g * bk; h < (g + 1) * bk; ++h)
          p.x[t * p.H + h] = nearest_e4m3_bits((float)dec_bf16(x16[t * p.H + h]) * r);
      }
    const int64_t n = p.T * p.H;
    double *got = malloc(sizeof(double) * (size_t)n), *want = malloc(sizeof(double) * (size_t)n);
    assert_true(got && want);
    opgraft_moe_args a = fp8_args(&p);
    a.hidden_states = x16, a.hidden_dtype = OPGRAFT_DTYPE_BF16, a.hidden_scale = NULL;
    const int32_t st = opgraft_moe_reference(&a, got);
    if (st != OPGRAFT_OK) fail_msg("%s: %s", opgraft_status_name(st), opgraft_last_error());
    fp8_brute_force(&p, want);
    for (int64_t i = 0; i < n; ++i)
      if (!(fabs(got[i] - want[i]) <= 1e-12 * fmax(fabs(want[i]), 1e-9)))
        fail_msg("case %d (bk %d): out[%lld] = %.17g, brute force %.17g", c, bk, (long long)i, got[i], want[i]);
    if (c == 2) {
      a.hidden = 192; /* not a multiple of 128 */
      a.inter = 64, a.w13_stride[1] = 192, a.w13_stride[0] = 2 * 64 * 192;
    } else {
      a.block_k = 48; /* 128 is not a multiple of 48 */
    }
    assert_int_equal(opgraft_moe_reference(&a, got), OPGRAFT_EUNSUPPORTED);
    free(got), free(want), free(x16);
    fp8_free(&p);
  }
}

/* The scales are read where they belong: doubling one w2 block's scale (rows 0..31 of H) changes
 * those outputs and leaves the others' bits alone. */
static void test_fp8_scales_are_used(void **state) {
  build_e4m3_table();
  fp8_problem p;
  fp8_init(&p, OPGRAFT_MOE_SCALE_BLOCK, 32, 32, 64, 64, 0, 0, 70);
  opgraft_moe_args a = fp8_args(&p);
  double base[3 * 64], moved[3 * 64];
  assert_int_equal(opgraft_moe_reference(&a, base), OPGRAFT_OK);
  /* w2 of every expert, block (h 0..31, i 0..31): rows h >= 32 of every token keep their value */
  for (int64_t e = 0; e < p.E; ++e) p.s2[e * p.s2_stride[0]] *= 2.0f;
  assert_int_equal(opgraft_moe_reference(&a, moved), OPGRAFT_OK);
  for (int t = 0; t < 3; ++t)
    for (int h = 0; h < 64; ++h) {
      if (h >= 32) assert_true(moved[t * 64 + h] == base[t * 64 + h]);
      else assert_true(moved[t * 64 + h] != base[t * 64 + h]);
    }
  fp8_free(&p);
}

static void test_fp8_bad_arguments(void **state) {
  build_e4m3_table();
  fp8_problem p;
  fp8_init(&p, OPGRAFT_MOE_SCALE_BLOCK, 32, 32, 64, 64, 0, 0, 71);
  double out[3 * 64];
  opgraft_moe_args a = fp8_args(&p);
  a.scale_dtype = OPGRAFT_DTYPE_BF16;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EUNSUPPORTED);
  a = fp8_args(&p);
  a.scale_layout = 7;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EUNSUPPORTED);
  a = fp8_args(&p);
  a.block_k = 0;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EINVAL);
  a = fp8_args(&p);
  a.w2_scale = NULL;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EINVAL);
  a = fp8_args(&p);
  a.weight_dtype = OPGRAFT_DTYPE_UINT8;
  assert_int_equal(opgraft_moe_reference(&a, out), OPGRAFT_EUNSUPPORTED);
  fp8_free(&p);
}

/* FP8 under expert parallelism with fewer local experts (2 of 8) than picks (k = 6). */
static void test_fp8_expert_map_fewer_local_than_topk(void **state) {
  build_e4m3_table();
  fp8_problem g;
  fp8_init(&g, OPGRAFT_MOE_SCALE_BLOCK, 32, 32, 64, 64, 0, 0, 72);
  /* a global problem of 8 experts: regrow the weights and scales */
  free(g.w13), free(g.w2), free(g.s13), free(g.s2), free(g.ids), free(g.tw);
  g.E = 8, g.k = 6;
  const int64_t w13n = 2 * g.I * g.H, w2n = g.H * g.I, s13n = 2 * 2 * 2, s2n = 2 * 2;
  g.w13 = malloc((size_t)(g.E * w13n)), g.w2 = malloc((size_t)(g.E * w2n));
  g.s13 = malloc(sizeof(float) * (size_t)(g.E * s13n)), g.s2 = malloc(sizeof(float) * (size_t)(g.E * s2n));
  g.ids = malloc(sizeof(int32_t) * 18), g.tw = malloc(sizeof(float) * 18);
  for (int64_t i = 0; i < g.E * w13n; ++i) g.w13[i] = random_e4m3();
  for (int64_t i = 0; i < g.E * w2n; ++i) g.w2[i] = random_e4m3();
  for (int64_t i = 0; i < g.E * s13n; ++i) g.s13[i] = random_scale(-16, -13);
  for (int64_t i = 0; i < g.E * s2n; ++i) g.s2[i] = random_scale(-16, -13);
  for (int i = 0; i < 18; ++i) g.tw[i] = (float)((rnd() >> 11) * 0x1p-53);
  const int32_t ids[18] = {0, 2, 7, 5, 1, 3, 6, 4, 3, 5, 0, 1, 0, 1, 3, 4, 6, 7};
  memcpy(g.ids, ids, sizeof ids);
  g.s13_stride[0] = s13n, g.s2_stride[0] = s2n;
  /* this rank: globals 5 and 2 as local 0 and 1 */
  static const int32_t map[8] = {-1, -1, 1, -1, -1, 0, -1, -1};
  uint8_t *w13 = malloc((size_t)(2 * w13n)), *w2 = malloc((size_t)(2 * w2n));
  float *s13 = malloc(sizeof(float) * (size_t)(2 * s13n)), *s2 = malloc(sizeof(float) * (size_t)(2 * s2n));
  const int local[2] = {5, 2};
  for (int l = 0; l < 2; ++l) {
    memcpy(w13 + l * w13n, g.w13 + local[l] * w13n, (size_t)w13n);
    memcpy(w2 + l * w2n, g.w2 + local[l] * w2n, (size_t)w2n);
    memcpy(s13 + l * s13n, g.s13 + local[l] * s13n, sizeof(float) * (size_t)s13n);
    memcpy(s2 + l * s2n, g.s2 + local[l] * s2n, sizeof(float) * (size_t)s2n);
  }
  double got[3 * 64], want[3 * 64];
  opgraft_moe_args a = fp8_args(&g);
  a.num_experts = 2, a.w13 = w13, a.w2 = w2, a.w13_scale = s13, a.w2_scale = s2;
  a.expert_map = map, a.expert_map_len = 8;
  assert_int_equal(opgraft_moe_reference(&a, got), OPGRAFT_OK);
  /* the global problem with the other ranks' slots on a zero-weight copy: route them to expert 0
   * with router weight 0 */
  for (int i = 0; i < 18; ++i)
    if (map[g.ids[i]] < 0) g.ids[i] = 0, g.tw[i] = 0.f;
  fp8_brute_force(&g, want);
  for (int i = 0; i < 3 * 64; ++i)
    if (!(fabs(got[i] - want[i]) <= 1e-12 * fmax(fabs(want[i]), 1e-300)))
      fail_msg("fp8 expert_map k > E: out %d = %.17g, brute force %.17g", i, got[i], want[i]);
  for (int h = 0; h < 64; ++h) assert_true(got[2 * 64 + h] == 0.0);
  free(w13), free(w2), free(s13), free(s2);
  fp8_free(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_expert_map_fewer_local_than_topk),
      cmocka_unit_test(test_e4m3_values),
      cmocka_unit_test(test_fp8_block),
      cmocka_unit_test(test_fp8_tensor),
      cmocka_unit_test(test_fp8_scales_are_used),
      cmocka_unit_test(test_fp8_hidden_quantized),
      cmocka_unit_test(test_fp8_bad_arguments),
      cmocka_unit_test(test_fp8_expert_map_fewer_local_than_topk),
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
