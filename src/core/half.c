/* bf16 and fp16 to and from double, and e4m3 to double, on the host, for the ops' CPU oracles. Rounding goes straight
 * from fp64 to the nearest even 16-bit value (through float it would round twice). */
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
