#define _POSIX_C_SOURCE 200112L /* setenv, unsetenv */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t tu_seed(void) {
  const char *env = getenv("PKV_TEST_SEED");
  uint64_t seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)clock() << 32;
  if (seed == 0) seed = 1;
  printf("# PKV_TEST_SEED=%llu\n", (unsigned long long)seed);
  return seed;
}

tu_rng tu_rng_make(uint64_t seed) {
  tu_rng r;
  r.s = seed ? seed : 0x9E3779B97F4A7C15ull;
  return r;
}

uint64_t tu_next(tu_rng *r) {
  r->s ^= r->s >> 12;
  r->s ^= r->s << 25;
  r->s ^= r->s >> 27;
  return r->s * 0x2545F4914F6CDD1Dull;
}

uint32_t tu_below(tu_rng *r, uint32_t n) { return n ? (uint32_t)(tu_next(r) % n) : 0; }

double tu_uniform(tu_rng *r, double lo, double hi) {
  return lo + (hi - lo) * ((double)(tu_next(r) >> 11) / 9007199254740992.0);
}

tu_rng tu_rng_stream(uint64_t seed, uint64_t index) {
  return tu_rng_make(seed ^ (index + 1) * 0x9E3779B97F4A7C15ull);
}

void tu_fill_uniform(tu_rng *r, float *x, size_t n, double lo, double hi) {
  for (size_t i = 0; i < n; i++) x[i] = (float)tu_uniform(r, lo, hi);
}

void tu_shuffle(tu_rng *r, uint32_t *a, uint32_t n) {
  for (uint32_t i = n; i > 1; i--) {
    uint32_t j = tu_below(r, i), t = a[i - 1];
    a[i - 1] = a[j];
    a[j] = t;
  }
}

static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
static float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* Via double arithmetic rather than bit tricks, so it is an independent check of the library's. */
uint16_t tu_f32_to_f16(float x) {
  uint16_t sign = (uint16_t)((bits_of(x) >> 16) & 0x8000u);
  double a = fabs((double)x);
  if (isnan(x)) return (uint16_t)(sign | 0x7e00u);
  if (a >= 65520.0) return (uint16_t)(sign | 0x7c00u); /* rounds past the largest finite half */
  if (a < ldexp(1.0, -14)) {                           /* subnormal: units of 2^-24 */
    double m = nearbyint(a * ldexp(1.0, 24));
    return (uint16_t)(sign | (uint16_t)m); /* m == 1024 lands on the smallest normal, as it should */
  }
  int e;
  double f = frexp(a, &e); /* a = f * 2^e, f in [0.5, 1) */
  double m = nearbyint(f * 2048.0);
  if (m == 2048.0) {
    m = 1024.0;
    e += 1;
  }
  int exp_field = e - 1 + 15;
  if (exp_field >= 31) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | (uint16_t)(exp_field << 10) | (uint16_t)((uint32_t)m - 1024u));
}

float tu_f16_to_f32(uint16_t h) {
  int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = ldexp((double)m, -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = ldexp((double)(m + 1024), e - 25);
  return (float)(sign ? -v : v);
}

uint16_t tu_f32_to_bf16(float x) {
  uint32_t u = bits_of(x);
  if (isnan(x)) return (uint16_t)((u >> 16) | 0x40u);
  uint32_t lower = u & 0xffffu, upper = u >> 16;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) upper += 1;
  return (uint16_t)upper;
}

float tu_bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

void tu_quantize_q8_0(const float *x, tu_q8_0 *out) {
  float amax = 0.0f;
  for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  out->d = tu_f32_to_f16(d);
  for (int j = 0; j < 32; j++) out->qs[j] = (int8_t)roundf(x[j] * id);
}

void tu_quantize_q4_0(const float *x, tu_q4_0 *out) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; j++) {
    if (amax < fabsf(x[j])) {
      amax = fabsf(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  out->d = tu_f32_to_f16(d);
  for (int j = 0; j < 16; j++) {
    int lo = (int)(x[j] * id + 8.5f), hi = (int)(x[j + 16] * id + 8.5f);
    if (lo > 15) lo = 15;
    if (hi > 15) hi = 15;
    out->qs[j] = (uint8_t)(lo | (hi << 4));
  }
}

void tu_dequantize_q8_0(const tu_q8_0 *b, float *x) {
  const float d = tu_f16_to_f32(b->d);
  for (int j = 0; j < 32; j++) x[j] = (float)b->qs[j] * d;
}

void tu_dequantize_q4_0(const tu_q4_0 *b, float *x) {
  const float d = tu_f16_to_f32(b->d);
  for (int j = 0; j < 16; j++) {
    x[j] = (float)((b->qs[j] & 15) - 8) * d;
    x[j + 16] = (float)((b->qs[j] >> 4) - 8) * d;
  }
}

int tu_quantized(pkv_format format) { return format == PKV_FORMAT_Q8_0 || format == PKV_FORMAT_Q4_0; }

int tu_fp8(pkv_format format) { return format == PKV_FORMAT_FP8_E4M3 || format == PKV_FORMAT_FP8_E5M2; }

/* From the bit fields, by the OCP definitions: sign, exponent, mantissa; exponent 0 subnormal. */
double tu_fp8_value(pkv_format format, uint8_t c) {
  const int e4m3 = format == PKV_FORMAT_FP8_E4M3;
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 15 : 31;
  const int e = (c & 0x7f) >> mbits, m = c & ((1 << mbits) - 1);
  const double sign = c & 0x80 ? -1.0 : 1.0;
  if (e4m3 && e == emax && m == (1 << mbits) - 1) return NAN;
  if (!e4m3 && e == emax) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * ldexp((double)m, 1 - bias - mbits);
  return sign * ldexp(1.0 + (double)m / (1 << mbits), e - bias);
}

/* By search: the nearest of the format's finite codes of x's sign, a tie going to the even code
 * (the one whose lowest mantissa bit is 0); past the largest finite value that value. */
uint8_t tu_f32_to_fp8(pkv_format format, float x) {
  const uint8_t sign = signbit(x) ? 0x80 : 0x00;
  if (isnan(x)) return sign | 0x7f;
  const double a = fabs((double)x);
  int largest = 0x7f;
  while (!isfinite(tu_fp8_value(format, (uint8_t)largest))) largest--;
  if (a >= tu_fp8_value(format, (uint8_t)largest)) return sign | (uint8_t)largest;
  uint8_t best = 0;
  double best_gap = INFINITY;
  for (int c = 0; c <= largest; c++) {
    const double gap = fabs(a - tu_fp8_value(format, (uint8_t)c));
    if (gap < best_gap || (gap == best_gap && (c & 1) == 0)) best = (uint8_t)c, best_gap = gap;
  }
  return sign | best;
}

float tu_fp8_to_f32(pkv_format format, uint8_t c) { return (float)tu_fp8_value(format, c); }

void tu_round_trip(pkv_format format, const float *src, size_t n, float *dst) {
  for (size_t g = 0; g < n; g += 32) {
    switch (format) {
    case PKV_FORMAT_Q8_0: {
      tu_q8_0 b;
      tu_quantize_q8_0(src + g, &b);
      tu_dequantize_q8_0(&b, dst + g);
      break;
    }
    case PKV_FORMAT_Q4_0: {
      tu_q4_0 b;
      tu_quantize_q4_0(src + g, &b);
      tu_dequantize_q4_0(&b, dst + g);
      break;
    }
    default:
      for (size_t j = g; j < g + 32 && j < n; j++) {
        unsigned char raw[4];
        tu_store(format, raw, 0, src[j]);
        dst[j] = tu_load(format, raw, 0);
      }
    }
  }
}

size_t tu_elem_bytes(pkv_format format) {
  switch (format) {
  case PKV_FORMAT_FP8_E4M3:
  case PKV_FORMAT_FP8_E5M2: return 1;
  case PKV_FORMAT_F32: return 4;
  case PKV_FORMAT_F16:
  case PKV_FORMAT_BF16: return 2;
  default: abort();
  }
}

void tu_store(pkv_format format, void *buf, size_t i, float x) {
  switch (format) {
  case PKV_FORMAT_F32: memcpy((char *)buf + 4 * i, &x, 4); break;
  case PKV_FORMAT_F16: {
    uint16_t h = tu_f32_to_f16(x);
    memcpy((char *)buf + 2 * i, &h, 2);
    break;
  }
  case PKV_FORMAT_BF16: {
    uint16_t h = tu_f32_to_bf16(x);
    memcpy((char *)buf + 2 * i, &h, 2);
    break;
  }
  case PKV_FORMAT_FP8_E4M3:
  case PKV_FORMAT_FP8_E5M2: ((uint8_t *)buf)[i] = tu_f32_to_fp8(format, x); break;
  default: abort();
  }
}

float tu_load(pkv_format format, const void *buf, size_t i) {
  switch (format) {
  case PKV_FORMAT_F32: {
    float x;
    memcpy(&x, (const char *)buf + 4 * i, 4);
    return x;
  }
  case PKV_FORMAT_F16: {
    uint16_t h;
    memcpy(&h, (const char *)buf + 2 * i, 2);
    return tu_f16_to_f32(h);
  }
  case PKV_FORMAT_BF16: {
    uint16_t h;
    memcpy(&h, (const char *)buf + 2 * i, 2);
    return tu_bf16_to_f32(h);
  }
  case PKV_FORMAT_FP8_E4M3:
  case PKV_FORMAT_FP8_E5M2: return tu_fp8_to_f32(format, ((const uint8_t *)buf)[i]);
  default: abort();
  }
}

int tu_backend_missing(pkv_status st) { return st == PKV_ERR_UNSUPPORTED || st == PKV_ERR_NO_DEVICE; }

void tu_set_env(const char *name, const char *value) {
#ifdef _WIN32
  _putenv_s(name, value ? value : "");
#else
  if (value) setenv(name, value, 1);
  else unsetenv(name);
#endif
}
