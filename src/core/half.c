/* bf16 and fp16 to and from double, e4m3 to double and the FP8 kernels' activation quantization,
 * on the host, for the ops' CPU oracles. Rounding goes straight from fp64 to the nearest even
 * 16-bit value (through float it would round twice). */
#include <math.h>
#include <string.h>

#include "internal.h"

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

static uint16_t double_to_bf16(double d) {
  const uint16_t sign = signbit(d) ? 0x8000u : 0u;
  const double a = fabs(d);
  if (isnan(d)) return 0x7fc0u;
  if (a >= ldexp(2.0 - ldexp(1, -8), 127)) return sign | 0x7f80u; /* rounds to infinity */
  if (a < ldexp(1, -126)) return sign | (uint16_t)nearbyint(a * ldexp(1, 133)); /* subnormal */
  int e;
  const double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  long q = (long)nearbyint(m * 256.0); /* 8 significant bits */
  if (q == 256) q = 128, e += 1;
  const int exp = e - 1 + 127;
  if (exp >= 255) return sign | 0x7f80u;
  return sign | (uint16_t)(exp << 7) | (uint16_t)(q - 128);
}

static uint16_t double_to_fp16(double d) {
  const uint16_t sign = signbit(d) ? 0x8000u : 0u;
  const double a = fabs(d);
  if (isnan(d)) return 0x7e00u;
  if (a >= 65520.0) return sign | 0x7c00u; /* rounds to infinity */
  if (a < ldexp(1, -14)) return sign | (uint16_t)nearbyint(a * ldexp(1, 24)); /* subnormal: multiples of 2^-24 */
  int e;
  const double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  long q = (long)nearbyint(m * 2048.0); /* 11 significant bits */
  if (q == 2048) q = 1024, e += 1;
  const int exp = e - 1 + 15;
  if (exp >= 31) return sign | 0x7c00u;
  return sign | (uint16_t)(exp << 10) | (uint16_t)(q - 1024);
}

double opgraft__half_to_double(int32_t dtype, uint16_t h) {
  return dtype == OPGRAFT_DTYPE_BF16 ? bf16_to_double(h) : fp16_to_double(h);
}

uint16_t opgraft__double_to_half(int32_t dtype, double d) {
  return dtype == OPGRAFT_DTYPE_BF16 ? double_to_bf16(d) : double_to_fp16(d);
}

/* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN. */
double opgraft__e4m3_to_double(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  double v;
  if (exp == 15 && man == 7) v = NAN;
  else if (exp == 0) v = ldexp(man, -9);
  else v = ldexp(8 + man, exp - 10);
  return sign ? -v : v;
}

/* v rounded to the nearest e4m3 value (ties to even), finite values past 448 saturated. */
static double e4m3_round(float v) {
  if (isnan(v)) return NAN;
  const double a = fabs((double)v);
  double q;
  if (a >= 448.0) q = 448.0;
  else if (a < ldexp(1, -6)) q = nearbyint(a * 512.0) / 512.0; /* subnormals: multiples of 2^-9 */
  else {
    int e;
    frexp(a, &e); /* a in [2^(e-1), 2^e) */
    const double step = ldexp(1, e - 4); /* 3 mantissa bits */
    q = nearbyint(a / step) * step;
  }
  return v < 0 ? -q : q;
}

float opgraft__e4m3_quantize_group(int32_t dtype, const uint16_t *x, int64_t stride, int64_t n, double *q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf((float)opgraft__half_to_double(dtype, x[i * stride])));
  amax = fmaxf(amax, 1e-10f);
  const float r = 448.f / amax;
  for (int64_t i = 0; i < n; ++i) q[i] = e4m3_round((float)opgraft__half_to_double(dtype, x[i * stride]) * r);
  return amax / 448.f;
}

void opgraft__qk_head_ref(int32_t dtype, int64_t D, uint16_t *x, const void *w, double eps, int32_t rope_style,
                          const void *cos_sin, int64_t cs_stride, int64_t rope_rows, int64_t pos) {
  const uint16_t *wt = w, *cs = cos_sin;
  if (wt) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += opgraft__half_to_double(dtype, x[d]) * opgraft__half_to_double(dtype, x[d]);
    const double r = 1.0 / sqrt(ss / (double)D + eps);
    for (int64_t d = 0; d < D; ++d)
      x[d] = opgraft__double_to_half(
          dtype, opgraft__half_to_double(dtype, opgraft__double_to_half(dtype, opgraft__half_to_double(dtype, x[d]) * r)) *
                     opgraft__half_to_double(dtype, wt[d]));
  }
  if (!rope_style || pos < 0 || pos >= rope_rows) return;
  double y[256];
  const int64_t half = D / 2, row = pos * cs_stride;
  for (int64_t i = 0; i < half; ++i) {
    const double c = opgraft__half_to_double(dtype, cs[row + i]), s = opgraft__half_to_double(dtype, cs[row + half + i]);
    const int64_t i1 = rope_style == 1 ? i : 2 * i, i2 = rope_style == 1 ? i + half : 2 * i + 1;
    const double x1 = opgraft__half_to_double(dtype, x[i1]), x2 = opgraft__half_to_double(dtype, x[i2]);
    y[i1] = x1 * c - x2 * s, y[i2] = x2 * c + x1 * s;
  }
  for (int64_t d = 0; d < D; ++d) x[d] = opgraft__double_to_half(dtype, y[d]);
}
