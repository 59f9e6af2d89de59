/* CPU oracle for paged decode attention: fp64 on host pointers, one (sequence, head) at a time,
 * softmax with the maximum subtracted (the sink's logit included); with new keys, the cache write
 * first. Used by the tests. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

static double bf16_to_double(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static double fp16_to_double(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0) v = ldexp(man, -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

/* Rounds straight from fp64 to nearest even (going through float first would round twice). */
static uint16_t double_to_bf16(double d) {
  const uint16_t sign = signbit(d) ? 0x8000u : 0u;
  const double a = fabs(d);
  if (isnan(d)) return 0x7fc0u;
  if (a >= ldexp(2.0 - ldexp(1, -8), 127)) return sign | 0x7f80u;
  if (a < ldexp(1, -126)) return sign | (uint16_t)nearbyint(a * ldexp(1, 133));
  int e;
  const double m = frexp(a, &e);
  long q = (long)nearbyint(m * 256.0);
  if (q == 256) q = 128, e += 1;
  const int exp = e - 1 + 127;
  if (exp >= 255) return sign | 0x7f80u;
  return sign | (uint16_t)(exp << 7) | (uint16_t)(q - 128);
}

static uint16_t double_to_fp16(double d) {
  const uint16_t sign = signbit(d) ? 0x8000u : 0u;
  const double a = fabs(d);
  if (isnan(d)) return 0x7e00u;
  if (a >= 65520.0) return sign | 0x7c00u;
  if (a < ldexp(1, -14)) return sign | (uint16_t)nearbyint(a * ldexp(1, 24));
  int e;
  const double m = frexp(a, &e);
  long q = (long)nearbyint(m * 2048.0);
  if (q == 2048) q = 1024, e += 1;
  const int exp = e - 1 + 15;
  if (exp >= 31) return sign | 0x7c00u;
  return sign | (uint16_t)(exp << 10) | (uint16_t)(q - 1024);
}

static double value16(int32_t dtype, uint16_t h) { return dtype == OPGRAFT_DTYPE_BF16 ? bf16_to_double(h) : fp16_to_double(h); }
static double load16(int32_t dtype, const void *base, int64_t idx) { return value16(dtype, ((const uint16_t *)base)[idx]); }

/* vLLM's q/k RMSNorm (weights w, or none) and rotary embedding of one head of row b, in place. */
static void prologue_head(const opgraft_attention_args *a, uint16_t *x, const void *w, int64_t b) {
  const int64_t pos = a->rope_style ? ((const int64_t *)a->positions)[b] : -1;
  opgraft__qk_head_ref(a->dtype, a->head_size, x, w, a->qk_norm_eps, a->rope_style, a->cos_sin_cache, a->cos_sin_stride,
                       a->rope_rows, pos);
}

/* The call with its query and new keys normalized and rotated (contiguous copies), then as without. */
static int32_t reference_prologue(const opgraft_attention_args *a, double *out_f64) {
  const int64_t B = a->batch, H = a->num_heads, Hk = a->num_kv_heads, D = a->head_size;
  if (!a->k_new || D > 256 || D % 2 || (a->rope_style && (!a->cos_sin_cache || !a->positions)) ||
      !a->q_norm_weight != !a->k_norm_weight || a->rope_style < 0 || a->rope_style > OPGRAFT_ROPE_GPTJ)
    return opgraft__fail(OPGRAFT_EINVAL, "q/k norm or rotary embedding without new keys, weights or a cos/sin cache");
  if ((a->q_norm_weight && a->qk_norm_dtype != a->dtype) || (a->rope_style && a->cos_sin_dtype != a->dtype))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference takes norm weights and cos/sin in the query's dtype");
  uint16_t *q = malloc(sizeof(uint16_t) * (size_t)(B * H * D + 1)), *k = malloc(sizeof(uint16_t) * (size_t)(B * Hk * D + 1));
  if (!q || !k) {
    free(q), free(k);
    return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d)
        q[(b * H + h) * D + d] = ((const uint16_t *)a->q)[b * a->q_stride[0] + h * a->q_stride[1] + d * a->q_stride[2]];
      prologue_head(a, q + (b * H + h) * D, a->q_norm_weight, b);
    }
    for (int64_t h = 0; h < Hk; ++h) {
      for (int64_t d = 0; d < D; ++d)
        k[(b * Hk + h) * D + d] = ((const uint16_t *)a->k_new)[b * a->k_new_stride[0] + h * a->k_new_stride[1] + d];
      prologue_head(a, k + (b * Hk + h) * D, a->k_norm_weight, b);
    }
  }
  opgraft_attention_args t = *a;
  t.q = q, t.q_stride[0] = H * D, t.q_stride[1] = D, t.q_stride[2] = 1;
  t.k_new = k, t.k_new_stride[0] = Hk * D, t.k_new_stride[1] = D;
  t.q_norm_weight = t.k_norm_weight = NULL, t.rope_style = OPGRAFT_ROPE_NONE;
  const int32_t st = opgraft_attention_reference(&t, out_f64);
  free(q), free(k);
  return st;
}

int32_t opgraft_attention_reference(const opgraft_attention_args *a, double *out_f64) {
  if (!a || a->struct_size < sizeof *a) return opgraft__fail(OPGRAFT_EINVAL, "bad arguments");
  /* The oracle covers what the guard takes (apart from the strides' 16-byte rule). */
  if ((a->flags & ~OPGRAFT_ATTN_AFTER_QKV) || (a->dtype != OPGRAFT_DTYPE_BF16 && a->dtype != OPGRAFT_DTYPE_FP16) ||
      a->kv_dtype != a->dtype ||
      a->query_len != 1 || a->block_table_dtype != OPGRAFT_DTYPE_INT32 || a->seq_lens_dtype != OPGRAFT_DTYPE_INT32 ||
      (a->sinks && a->sinks_dtype != OPGRAFT_DTYPE_FP32 && a->sinks_dtype != a->dtype))
    return opgraft__fail(OPGRAFT_EUNSUPPORTED, "the reference covers bf16/fp16 decoder decode attention");
  if (a->num_kv_heads < 1 || a->num_heads < 1 || a->num_heads % a->num_kv_heads || a->head_size < 1 ||
      a->block_size < 1 || a->batch < 0 || a->max_blocks < 1 || a->num_blocks < 1 || !(a->scale > 0))
    return opgraft__fail(OPGRAFT_EINVAL, "bad sizes");
  const int64_t B = a->batch, H = a->num_heads, D = a->head_size, G = H / a->num_kv_heads, bs = a->block_size;
  if (B == 0) return OPGRAFT_OK;
  if (!a->q || !a->k_cache || !a->v_cache || !a->block_table || !a->seq_lens || (!out_f64 && !a->out))
    return opgraft__fail(OPGRAFT_EINVAL, "NULL tensor");
  if (a->q_norm_weight || a->k_norm_weight || a->rope_style) return reference_prologue(a, out_f64);
  if (a->k_new) { /* the call's cache write first (the caller's cache is changed, as on the GPU) */
    if (!a->v_new || (a->slot_count > 0 && !a->slot_mapping) || a->slot_mapping_dtype != OPGRAFT_DTYPE_INT64)
      return opgraft__fail(OPGRAFT_EINVAL, "new keys without values or an int64 slot mapping");
    const int64_t *slots = a->slot_mapping;
    for (int64_t b = 0; b < B && b < a->slot_count; ++b) {
      const int64_t slot = slots[b], blk = slot / bs, row = slot % bs;
      if (slot < 0 || blk >= a->num_blocks) continue;
      for (int64_t h = 0; h < a->num_kv_heads; ++h)
        for (int64_t d = 0; d < D; ++d) {
          ((uint16_t *)a->k_cache)[blk * a->k_stride[0] + row * a->k_stride[1] + h * a->k_stride[2] + d * a->k_stride[3]] =
              ((const uint16_t *)a->k_new)[b * a->k_new_stride[0] + h * a->k_new_stride[1] + d];
          ((uint16_t *)a->v_cache)[blk * a->v_stride[0] + row * a->v_stride[1] + h * a->v_stride[2] + d * a->v_stride[3]] =
              ((const uint16_t *)a->v_new)[b * a->v_new_stride[0] + h * a->v_new_stride[1] + d];
        }
    }
  }
  const int32_t *bt = a->block_table, *lens = a->seq_lens;
  int64_t maxlen = 0;
  for (int64_t b = 0; b < B; ++b) maxlen = lens[b] > maxlen ? lens[b] : maxlen;
  double *s = malloc(sizeof(double) * (size_t)(maxlen + 1)), *acc = malloc(sizeof(double) * (size_t)D);
  int64_t *rows = malloc(sizeof(int64_t) * (size_t)(maxlen + 1));
  if (!s || !acc || !rows) {
    free(s), free(acc), free(rows);
    return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[b];
    const int64_t start = a->window_left >= 0 && L - 1 - a->window_left > 0 ? L - 1 - a->window_left : 0;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / G;
      /* The keys' cache rows (block * block stride + row * row stride), -1 for keys with no block. */
      int64_t nk = 0;
      double mx = -INFINITY;
      for (int64_t j = start; j < L; ++j) {
        const int64_t bi = j / bs;
        const int64_t blk = bi < a->max_blocks ? bt[b * a->block_table_stride[0] + bi * a->block_table_stride[1]] : -1;
        if (blk < 0 || blk >= a->num_blocks) continue;
        const int64_t kr = blk * a->k_stride[0] + (j % bs) * a->k_stride[1] + kvh * a->k_stride[2];
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += load16(a->dtype, a->q, b * a->q_stride[0] + h * a->q_stride[1] + d * a->q_stride[2]) *
                 load16(a->dtype, a->k_cache, kr + d * a->k_stride[3]);
        double x = a->scale * dot;
        if (a->softcap > 0) x = a->softcap * tanh(x / a->softcap);
        rows[nk] = blk * a->v_stride[0] + (j % bs) * a->v_stride[1] + kvh * a->v_stride[2];
        s[nk++] = x;
        mx = x > mx ? x : mx;
      }
      double sink = -INFINITY;
      if (a->sinks)
        sink = a->sinks_dtype == OPGRAFT_DTYPE_FP32 ? (double)((const float *)a->sinks)[h] : load16(a->dtype, a->sinks, h);
      if (a->sinks && sink > mx) mx = sink;
      memset(acc, 0, sizeof(double) * (size_t)D);
      double den = a->sinks && isfinite(mx) ? opgraft__exp(sink - mx) : 0.0;
      for (int64_t i = 0; i < nk; ++i) {
        const double w = opgraft__exp(s[i] - mx);
        den += w;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * load16(a->dtype, a->v_cache, rows[i] + d * a->v_stride[3]);
      }
      for (int64_t d = 0; d < D; ++d) {
        const double v = den > 0 ? acc[d] / den : 0.0; /* no keys (a padded row): zeros */
        if (out_f64) {
          out_f64[(b * H + h) * D + d] = v;
        } else {
          uint16_t *o = (uint16_t *)a->out + b * a->out_stride[0] + h * a->out_stride[1] + d * a->out_stride[2];
          *o = a->dtype == OPGRAFT_DTYPE_BF16 ? double_to_bf16(v) : double_to_fp16(v);
        }
      }
    }
  }
  free(s), free(acc), free(rows);
  return OPGRAFT_OK;
}
