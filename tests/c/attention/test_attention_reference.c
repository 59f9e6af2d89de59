/* The fp64 oracle of paged decode attention against an independent brute force: the test keeps
 * every sequence's keys, values and queries in logical arrays, scatters them into a paged cache
 * through a shuffled block table (the unused cache rows hold NaN), and the brute force computes
 * each output from the logical arrays with a log-sum-exp softmax, never looking at the cache. */
#include <math.h>

#include "og_test.h"

static unsigned rng = 1;
static double urand(void) { /* uniform in [-1, 1) */
  rng = rng * 1664525u + 1013904223u;
  return (double)(rng >> 8) / (double)(1u << 23) - 1.0;
}

static uint16_t to_bf16(double d) { /* truncation is enough for test data */
  float f = (float)d;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}
static double from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t to_fp16(double d) { /* |d| < 4 here: normal numbers, truncated */
  if (d == 0) return 0;
  const uint16_t sign = d < 0 ? 0x8000u : 0u;
  int e;
  const double m = frexp(fabs(d), &e);
  if (e - 1 < -14) return sign;
  return sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)((long)(m * 2048.0) - 1024);
}
static double from_fp16(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  const double v = exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

typedef struct problem {
  int dtype, B, H, Hk, D, bs, layout; /* layout 0: vLLM's packed [blk][tok][head][K|V]; 1: HND, K and V apart */
  int lens[8];
  int window_left;
  double softcap;
  int sinks; /* 0 none, 1 fp32, 2 the dtype */
  int bad_blocks; /* sequence 1's first block id -1, its last num_blocks */
  int update;     /* every sequence's last key and value given as new ones, their cache rows NaN */
  int qknorm;     /* with update: q/k RMSNorm of the query and the new key */
  int rope;       /* with update: rotary embedding (OPGRAFT_ROPE_*); sequence 0's position is out of range */
  /* built */
  int nblocks, maxb;
  double *ql, *kl, *vl; /* [B][H][D], [B][Lmax][Hk][D] rounded values */
  double sink_val[32];
  uint16_t *q, *cache_k, *cache_v, *sinks16;
  float sinks32[32];
  int32_t *bt;
  uint16_t *knew, *vnew; /* update: [B][Hk][D + 8] */
  uint16_t *kstored;     /* update: [B][Hk][D] the new keys as the cache must hold them */
  int64_t *slots;
  uint16_t qw[256], kw[256], *cos_sin; /* qknorm, rope: the norm weights, the [64][D + 8] cos/sin rows */
  int64_t pos[8];
  opgraft_attention_args a;
} problem;

static uint16_t enc(const problem *p, double v) { return p->dtype == OPGRAFT_DTYPE_BF16 ? to_bf16(v) : to_fp16(v); }
static double dec(const problem *p, uint16_t h) { return p->dtype == OPGRAFT_DTYPE_BF16 ? from_bf16(h) : from_fp16(h); }

/* Round to nearest even at the dtype's precision (normal and subnormal; no overflow here). */
static double rne(const problem *p, double d) {
  if (d == 0) return d;
  const int bits = p->dtype == OPGRAFT_DTYPE_BF16 ? 8 : 11, emin = p->dtype == OPGRAFT_DTYPE_BF16 ? -133 : -24;
  int e;
  frexp(d, &e);
  const double ulp = ldexp(1, e - bits > emin ? e - bits : emin);
  return nearbyint(d / ulp) * ulp;
}

enum { ROPE_ROWS = 64 };

/* vLLM's q/k RMSNorm (eps 1e-6) and rotary embedding of one head (D values) of row b, in place. */
static void brute_prologue(const problem *p, double *x, const uint16_t *w, int b) {
  const int D = p->D;
  if (p->qknorm) {
    double ss = 0;
    for (int d = 0; d < D; ++d) ss += x[d] * x[d];
    const double r = 1.0 / sqrt(ss / D + 1e-6);
    for (int d = 0; d < D; ++d) x[d] = rne(p, rne(p, x[d] * r) * dec(p, w[d]));
  }
  if (!p->rope || p->pos[b] < 0 || p->pos[b] >= ROPE_ROWS) return;
  double y[256];
  const uint16_t *row = p->cos_sin + p->pos[b] * (D + 8);
  for (int i = 0; i < D / 2; ++i) {
    const double c = dec(p, row[i]), s = dec(p, row[D / 2 + i]);
    const int i1 = p->rope == OPGRAFT_ROPE_NEOX ? i : 2 * i, i2 = p->rope == OPGRAFT_ROPE_NEOX ? i + D / 2 : 2 * i + 1;
    y[i1] = x[i1] * c - x[i2] * s, y[i2] = x[i2] * c + x[i1] * s;
  }
  for (int d = 0; d < D; ++d) x[d] = rne(p, y[d]);
}

static int lmax(const problem *p) {
  int m = 1;
  for (int b = 0; b < p->B; ++b) m = p->lens[b] > m ? p->lens[b] : m;
  return m;
}

static void build(problem *p) {
  const int B = p->B, H = p->H, Hk = p->Hk, D = p->D, bs = p->bs, Lm = lmax(p);
  p->maxb = (Lm + bs - 1) / bs + 1;
  p->nblocks = B * p->maxb + 3;
  const size_t row = (size_t)Hk * D;
  p->ql = malloc(sizeof(double) * (size_t)B * H * D);
  p->kl = malloc(sizeof(double) * (size_t)B * Lm * row);
  p->vl = malloc(sizeof(double) * (size_t)B * Lm * row);
  p->q = malloc(2 * (size_t)B * H * D);
  const size_t cache_elems = (size_t)p->nblocks * bs * row * 2;
  uint16_t *cache = malloc(2 * cache_elems);
  for (size_t i = 0; i < cache_elems; ++i) cache[i] = p->dtype == OPGRAFT_DTYPE_BF16 ? 0x7fc0u : 0x7e00u; /* NaN */
  p->bt = malloc(sizeof(int32_t) * (size_t)B * p->maxb);
  /* A shuffled list of block ids, handed out in order. */
  int *ids = malloc(sizeof(int) * (size_t)p->nblocks);
  for (int i = 0; i < p->nblocks; ++i) ids[i] = i;
  for (int i = p->nblocks - 1; i > 0; --i) {
    rng = rng * 1664525u + 1013904223u;
    const int j = (int)((rng >> 8) % (unsigned)(i + 1)), t = ids[i];
    ids[i] = ids[j], ids[j] = t;
  }
  int next = 0;
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < p->maxb; ++i) p->bt[b * p->maxb + i] = ids[next++];
  free(ids);
  if (p->bad_blocks) {
    const int nb = (p->lens[1] + bs - 1) / bs;
    p->bt[1 * p->maxb + 0] = -1;
    p->bt[1 * p->maxb + nb - 1] = p->nblocks;
  }
  int64_t ks[4], vs[4];
  if (p->layout == 0) {
    const int64_t st[4] = {(int64_t)bs * Hk * 2 * D, (int64_t)Hk * 2 * D, 2 * D, 1};
    memcpy(ks, st, sizeof st), memcpy(vs, st, sizeof st);
    p->cache_k = cache, p->cache_v = cache + D;
  } else { /* [blk][head][tok][D], V in the second half of the buffer */
    const int64_t st[4] = {(int64_t)Hk * bs * D, D, (int64_t)bs * D, 1};
    memcpy(ks, st, sizeof st), memcpy(vs, st, sizeof st);
    p->cache_k = cache, p->cache_v = cache + (size_t)p->nblocks * bs * row;
  }
  p->cos_sin = NULL;
  if (p->qknorm || p->rope) {
    for (int d = 0; d < D; ++d) p->qw[d] = enc(p, 1 + 0.5 * urand()), p->kw[d] = enc(p, 1 + 0.5 * urand());
    p->cos_sin = malloc(2 * (size_t)ROPE_ROWS * (D + 8));
    for (int r = 0; r < ROPE_ROWS; ++r)
      for (int i = 0; i < D / 2; ++i) {
        const double f = r * pow(10000.0, -2.0 * i / D);
        p->cos_sin[r * (D + 8) + i] = enc(p, cos(f)), p->cos_sin[r * (D + 8) + D / 2 + i] = enc(p, sin(f));
      }
    for (int b = 0; b < B; ++b) p->pos[b] = b == 0 ? ROPE_ROWS : (p->lens[b] > 0 ? p->lens[b] - 1 : 0) % ROPE_ROWS;
  }
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < D; ++d) {
        const uint16_t e = enc(p, urand());
        p->q[((size_t)b * H + h) * D + d] = e;
        p->ql[((size_t)b * H + h) * D + d] = dec(p, e);
      }
      if (p->qknorm || p->rope) brute_prologue(p, p->ql + ((size_t)b * H + h) * D, p->qw, b);
    }
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < p->lens[b]; ++j) {
      const int blk = p->bt[b * p->maxb + j / bs];
      for (int kh = 0; kh < Hk; ++kh)
        for (int d = 0; d < D; ++d) {
          const uint16_t ek = enc(p, 2 * urand()), ev = enc(p, urand());
          const size_t li = (((size_t)b * Lm + j) * Hk + kh) * D + d;
          p->kl[li] = dec(p, ek), p->vl[li] = dec(p, ev);
          if (blk < 0 || blk >= p->nblocks) continue;
          const int64_t off = blk * ks[0] + (j % bs) * ks[1] + kh * ks[2] + d;
          p->cache_k[off] = ek;
          p->cache_v[blk * vs[0] + (j % bs) * vs[1] + kh * vs[2] + d] = ev;
        }
    }
  p->knew = p->vnew = p->kstored = NULL, p->slots = NULL;
  if (p->update) { /* the last key of each sequence moves out of the cache into the call */
    const size_t nrow = (size_t)D + 8;
    p->knew = malloc(2 * (size_t)B * Hk * nrow), p->vnew = malloc(2 * (size_t)B * Hk * nrow);
    p->slots = malloc(sizeof(int64_t) * (size_t)B);
    for (int b = 0; b < B; ++b) {
      const int j = p->lens[b] - 1, blk = j >= 0 ? p->bt[b * p->maxb + j / bs] : -1;
      p->slots[b] = blk >= 0 && blk < p->nblocks ? (int64_t)blk * bs + j % bs : -1;
      for (int kh = 0; kh < Hk && p->slots[b] >= 0; ++kh)
        for (int d = 0; d < D; ++d) {
          uint16_t *ck = &p->cache_k[blk * ks[0] + (j % bs) * ks[1] + kh * ks[2] + d];
          uint16_t *cv = &p->cache_v[blk * vs[0] + (j % bs) * vs[1] + kh * vs[2] + d];
          p->knew[((size_t)b * Hk + kh) * nrow + d] = *ck, p->vnew[((size_t)b * Hk + kh) * nrow + d] = *cv;
          *ck = *cv = p->dtype == OPGRAFT_DTYPE_BF16 ? 0x7fc0u : 0x7e00u;
        }
    }
    /* The key the cache must hold and attention must use: normalized and rotated where asked. */
    p->kstored = malloc(2 * (size_t)B * Hk * D);
    for (int b = 0; b < B; ++b)
      for (int kh = 0; kh < Hk && p->slots[b] >= 0; ++kh) {
        double *k = p->kl + (((size_t)b * Lm + p->lens[b] - 1) * Hk + kh) * D;
        if (p->qknorm || p->rope) brute_prologue(p, k, p->kw, b);
        for (int d = 0; d < D; ++d) p->kstored[((size_t)b * Hk + kh) * D + d] = enc(p, k[d]);
      }
  }
  p->sinks16 = malloc(2 * (size_t)H);
  for (int h = 0; h < H; ++h) {
    const double s = 3 * urand();
    p->sinks32[h] = (float)s;
    p->sinks16[h] = enc(p, s);
    p->sink_val[h] = p->sinks == 1 ? (double)p->sinks32[h] : dec(p, p->sinks16[h]);
  }
  opgraft_attention_args *a = &p->a;
  memset(a, 0, sizeof *a);
  a->struct_size = sizeof *a;
  a->dtype = a->kv_dtype = p->dtype;
  a->batch = B, a->query_len = 1, a->num_heads = H, a->num_kv_heads = Hk, a->head_size = D;
  a->block_size = bs, a->num_blocks = p->nblocks, a->max_blocks = p->maxb;
  a->scale = 1.0 / sqrt((double)D), a->softcap = p->softcap, a->window_left = p->window_left;
  a->q = p->q, a->q_stride[0] = (int64_t)H * D, a->q_stride[1] = D, a->q_stride[2] = 1;
  a->k_cache = p->cache_k, a->v_cache = p->cache_v;
  memcpy(a->k_stride, ks, sizeof ks), memcpy(a->v_stride, vs, sizeof vs);
  a->block_table = p->bt, a->block_table_dtype = OPGRAFT_DTYPE_INT32;
  a->block_table_stride[0] = p->maxb, a->block_table_stride[1] = 1;
  a->seq_lens = p->lens, a->seq_lens_dtype = OPGRAFT_DTYPE_INT32;
  if (p->sinks == 1) a->sinks = p->sinks32, a->sinks_dtype = OPGRAFT_DTYPE_FP32;
  if (p->sinks == 2) a->sinks = p->sinks16, a->sinks_dtype = p->dtype;
  a->out_stride[0] = (int64_t)H * D, a->out_stride[1] = D, a->out_stride[2] = 1;
  a->arch = 90;
  if (p->update) {
    a->k_new = p->knew, a->v_new = p->vnew, a->slot_mapping = p->slots;
    a->k_new_stride[0] = a->v_new_stride[0] = (int64_t)Hk * (D + 8), a->k_new_stride[1] = a->v_new_stride[1] = D + 8;
    a->slot_mapping_dtype = OPGRAFT_DTYPE_INT64, a->slot_count = B;
  }
  if (p->qknorm) {
    a->q_norm_weight = p->qw, a->k_norm_weight = p->kw, a->qk_norm_dtype = p->dtype, a->qk_norm_eps = 1e-6;
  }
  if (p->rope) {
    a->rope_style = p->rope, a->cos_sin_cache = p->cos_sin, a->cos_sin_dtype = p->dtype;
    a->cos_sin_stride = D + 8, a->rope_rows = ROPE_ROWS, a->positions = p->pos, a->positions_dtype = OPGRAFT_DTYPE_INT64;
  }
}

static void release(problem *p) {
  free(p->ql), free(p->kl), free(p->vl), free(p->q), free(p->bt), free(p->sinks16);
  free(p->knew), free(p->vnew), free(p->slots), free(p->kstored), free(p->cos_sin);
  free(p->cache_k < p->cache_v ? p->cache_k : p->cache_v);
}

/* out[b][h][d] from the logical arrays. */
static double brute(const problem *p, int b, int h, int d) {
  const int L = p->lens[b], Lm = lmax(p), G = p->H / p->Hk, kh = h / G, bs = p->bs;
  const int nb = (L + bs - 1) / bs;
  const int start = p->window_left >= 0 ? (L - 1 - p->window_left > 0 ? L - 1 - p->window_left : 0) : 0;
  double x[4096];
  int keys[4096], n = 0;
  for (int j = start; j < L; ++j) {
    if (p->bad_blocks && b == 1 && (j / bs == 0 || j / bs == nb - 1)) continue; /* no such block */
    double dot = 0;
    for (int e = 0; e < p->D; ++e)
      dot += p->ql[((size_t)b * p->H + h) * p->D + e] * p->kl[(((size_t)b * Lm + j) * p->Hk + kh) * p->D + e];
    double s = dot / sqrt((double)p->D);
    if (p->softcap > 0) s = p->softcap * tanh(s / p->softcap);
    x[n] = s, keys[n++] = j;
  }
  double mx = p->sinks ? p->sink_val[h] : -INFINITY;
  for (int i = 0; i < n; ++i) mx = fmax(mx, x[i]);
  if (!isfinite(mx)) return 0.0;
  double z = p->sinks ? exp(p->sink_val[h] - mx) : 0.0;
  for (int i = 0; i < n; ++i) z += exp(x[i] - mx);
  const double lse = mx + log(z);
  double out = 0;
  for (int i = 0; i < n; ++i) out += exp(x[i] - lse) * p->vl[(((size_t)b * Lm + keys[i]) * p->Hk + kh) * p->D + d];
  return out;
}

static void check(problem *p, const char *what) {
  build(p);
  const size_t n = (size_t)p->B * p->H * p->D;
  double *ref = malloc(sizeof(double) * n);
  assert_int_equal(opgraft_attention_reference(&p->a, ref), OPGRAFT_OK);
  for (int b = 0; p->update && b < p->B; ++b) /* the new rows are in the cache now */
    for (int kh = 0; kh < p->Hk && p->slots[b] >= 0; ++kh)
      for (int d = 0; d < p->D; ++d) {
        const int64_t blk = p->slots[b] / p->bs, row = p->slots[b] % p->bs;
        const size_t ni = ((size_t)b * p->Hk + kh) * (p->D + 8) + d;
        if (p->cache_k[blk * p->a.k_stride[0] + row * p->a.k_stride[1] + kh * p->a.k_stride[2] + d] !=
                p->kstored[((size_t)b * p->Hk + kh) * p->D + d] ||
            p->cache_v[blk * p->a.v_stride[0] + row * p->a.v_stride[1] + kh * p->a.v_stride[2] + d] != p->vnew[ni])
          fail_msg("%s: sequence %d's new key or value not in the cache", what, b);
      }
  double worst = 0;
  for (int b = 0; b < p->B; ++b)
    for (int h = 0; h < p->H; ++h)
      for (int d = 0; d < p->D; ++d) {
        const double want = brute(p, b, h, d), got = ref[((size_t)b * p->H + h) * p->D + d];
        const double err = fabs(got - want) / (1e-3 + fabs(want));
        if (!(err <= 1e-12)) fail_msg("%s: out[%d][%d][%d] = %.17g, brute force %.17g", what, b, h, d, got, want);
        worst = err > worst ? err : worst;
        if (p->lens[b] <= 0 && got != 0.0) fail_msg("%s: padded row %d not zero", what, b);
      }
  /* The rounding path: the same values in the dtype, into a strided output whose padding stays. */
  const int pad = 8;
  uint16_t *o = malloc(2 * (size_t)p->B * p->H * (p->D + pad));
  for (size_t i = 0; i < (size_t)p->B * p->H * (p->D + pad); ++i) o[i] = 0x1234;
  p->a.out = o, p->a.out_stride[0] = (int64_t)p->H * (p->D + pad), p->a.out_stride[1] = p->D + pad;
  assert_int_equal(opgraft_attention_reference(&p->a, NULL), OPGRAFT_OK);
  const double ulp = p->dtype == OPGRAFT_DTYPE_BF16 ? ldexp(1, -8) : ldexp(1, -11);
  for (int b = 0; b < p->B; ++b)
    for (int h = 0; h < p->H; ++h) {
      const uint16_t *row = o + (size_t)b * p->a.out_stride[0] + (size_t)h * p->a.out_stride[1];
      for (int d = 0; d < p->D; ++d) {
        const double want = ref[((size_t)b * p->H + h) * p->D + d], got = dec(p, row[d]);
        if (fabs(got - want) > ulp * fabs(want) + 1e-7) fail_msg("%s: rounded %g vs %g", what, got, want);
      }
      for (int d = p->D; d < p->D + pad; ++d)
        if (row[d] != 0x1234) fail_msg("%s: output padding written", what);
    }
  print_message("%s: worst relative difference %.1e\n", what, worst);
  free(o), free(ref);
  release(p);
}

static void test_qwen3_heads_vllm_layout(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_BF16, .B = 6, .H = 32, .Hk = 4, .D = 128, .bs = 16, .layout = 0,
               .lens = {0, 1, 17, 100, 300, 16}, .window_left = -1};
  check(&p, "bf16 32/4 heads, head 128, block 16, ragged with a padded row");
}

static void test_mha_window_softcap(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_FP16, .B = 4, .H = 4, .Hk = 4, .D = 64, .bs = 32, .layout = 1,
               .lens = {1, 20, 21, 333}, .window_left = 19, .softcap = 30.0};
  check(&p, "fp16 MHA, head 64, block 32, separate K/V, window 20, soft cap 30");
}

static void test_sinks_and_missing_blocks(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_BF16, .B = 3, .H = 8, .Hk = 2, .D = 64, .bs = 16, .layout = 0,
               .lens = {40, 70, 5}, .window_left = -1, .sinks = 1, .bad_blocks = 1};
  check(&p, "bf16 GQA 4, fp32 sinks, block ids -1 and num_blocks in a table");
  problem q = {.dtype = OPGRAFT_DTYPE_FP16, .B = 2, .H = 32, .Hk = 2, .D = 64, .bs = 48, .layout = 1,
               .lens = {0, 130}, .window_left = 63, .sinks = 2};
  check(&q, "fp16 GQA 16, fp16 sinks, block 48, window 64, a padded row");
}

static void test_head_256(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_BF16, .B = 2, .H = 8, .Hk = 1, .D = 256, .bs = 16, .layout = 0,
               .lens = {33, 2}, .window_left = -1, .softcap = 50.0};
  check(&p, "bf16 MQA 8, head 256, soft cap 50");
}

/* The call's cache write: the oracle stores each sequence's last key and value at its slot (their
 * rows were NaN) before attending, so its output is the brute force's. */
static void test_cache_write(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_BF16, .B = 5, .H = 32, .Hk = 4, .D = 128, .bs = 16, .layout = 0,
               .lens = {1, 0, 17, 300, 16}, .window_left = -1, .update = 1};
  check(&p, "bf16 32/4 heads with the cache write, a padded row");
  problem q = {.dtype = OPGRAFT_DTYPE_FP16, .B = 3, .H = 8, .Hk = 8, .D = 64, .bs = 32, .layout = 1,
               .lens = {33, 64, 2}, .window_left = 15, .update = 1};
  check(&q, "fp16 MHA, separate K/V, window 16, with the cache write");
}

/* vLLM's q/k RMSNorm and rotary embedding before the call (Qwen3's attention): the query and the
 * new key normalized and rotated by the oracle as by the brute force, the new key stored so. */
static void test_qk_norm_rope(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_BF16, .B = 4, .H = 32, .Hk = 4, .D = 128, .bs = 16, .layout = 0,
               .lens = {5, 0, 17, 40}, .window_left = -1, .update = 1, .qknorm = 1, .rope = OPGRAFT_ROPE_NEOX};
  check(&p, "bf16 32/4 heads, q/k norm and NeoX rotary embedding, a position out of range, a padded row");
  problem q = {.dtype = OPGRAFT_DTYPE_FP16, .B = 3, .H = 8, .Hk = 2, .D = 64, .bs = 32, .layout = 1,
               .lens = {9, 33, 2}, .window_left = 15, .update = 1, .rope = OPGRAFT_ROPE_GPTJ};
  check(&q, "fp16 GQA 4, head 64, GPT-J rotary embedding alone, window 16");
  problem r = {.dtype = OPGRAFT_DTYPE_BF16, .B = 2, .H = 8, .Hk = 1, .D = 256, .bs = 16, .layout = 0,
               .lens = {3, 21}, .window_left = -1, .update = 1, .qknorm = 1};
  check(&r, "bf16 MQA 8, head 256, q/k norm alone");
}

static void test_arguments(void **state) {
  problem p = {.dtype = OPGRAFT_DTYPE_BF16, .B = 1, .H = 4, .Hk = 4, .D = 64, .bs = 16, .lens = {3}, .window_left = -1};
  build(&p);
  double out[256];
  assert_int_equal(opgraft_attention_reference(NULL, out), OPGRAFT_EINVAL);
  p.a.flags = OPGRAFT_ATTN_ALIBI;
  assert_int_equal(opgraft_attention_reference(&p.a, out), OPGRAFT_EUNSUPPORTED);
  p.a.flags = OPGRAFT_ATTN_AFTER_QKV; /* a launch hint: the same answer */
  assert_int_equal(opgraft_attention_reference(&p.a, out), OPGRAFT_OK);
  p.a.flags = 0;
  p.a.kv_dtype = OPGRAFT_DTYPE_FP8_E4M3;
  assert_int_equal(opgraft_attention_reference(&p.a, out), OPGRAFT_EUNSUPPORTED);
  p.a.kv_dtype = p.a.dtype;
  p.a.query_len = 2;
  assert_int_equal(opgraft_attention_reference(&p.a, out), OPGRAFT_EUNSUPPORTED);
  p.a.query_len = 1;
  p.a.num_heads = 6;
  assert_int_equal(opgraft_attention_reference(&p.a, out), OPGRAFT_EINVAL);
  p.a.num_heads = 4;
  p.a.out = NULL;
  assert_int_equal(opgraft_attention_reference(&p.a, NULL), OPGRAFT_EINVAL);
  p.a.batch = 0;
  assert_int_equal(opgraft_attention_reference(&p.a, NULL), OPGRAFT_OK);
  p.a.batch = 1;
  p.a.rope_style = OPGRAFT_ROPE_NEOX; /* rotary embedding without new keys or a cos/sin cache */
  assert_int_equal(opgraft_attention_reference(&p.a, out), OPGRAFT_EINVAL);
  p.a.rope_style = OPGRAFT_ROPE_NONE;
  release(&p);
  problem q = {.dtype = OPGRAFT_DTYPE_BF16, .B = 1, .H = 4, .Hk = 4, .D = 64, .bs = 16, .lens = {3}, .window_left = -1,
               .update = 1, .qknorm = 1};
  build(&q);
  q.a.qk_norm_dtype = OPGRAFT_DTYPE_FP32;
  assert_int_equal(opgraft_attention_reference(&q.a, out), OPGRAFT_EUNSUPPORTED);
  q.a.qk_norm_dtype = q.a.dtype;
  q.a.k_norm_weight = NULL;
  assert_int_equal(opgraft_attention_reference(&q.a, out), OPGRAFT_EINVAL);
  release(&q);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_qwen3_heads_vllm_layout),
      cmocka_unit_test(test_mha_window_softcap),
      cmocka_unit_test(test_sinks_and_missing_blocks),
      cmocka_unit_test(test_head_256),
      cmocka_unit_test(test_cache_write),
      cmocka_unit_test(test_qk_norm_rope),
      cmocka_unit_test(test_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
