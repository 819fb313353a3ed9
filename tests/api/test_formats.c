/* Format conversions and quantization: the public converters against the reference encodings in
 * testutil (ggml's block layout for Q8_0/Q4_0), and rows written into and read back from pools of
 * every page format.
 *
 * One file past 500 lines: every format's conversions and its round trip through pages, one
 * format table for both. A write of several megabytes read back whole. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

static tu_rng rng;

static const pkv_format all_formats[] = {PKV_FORMAT_F32,  PKV_FORMAT_F16,      PKV_FORMAT_BF16,     PKV_FORMAT_Q8_0,
                                         PKV_FORMAT_Q4_0, PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2};
static const pkv_format io_formats[] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16};
#define N_ALL 7
#define N_IO 3
#define GUARD 64 /* bytes past a row that a converter must leave alone */

static size_t ref_row_bytes(pkv_format f, size_t n) {
  switch (f) {
  case PKV_FORMAT_F32: return 4 * n;
  case PKV_FORMAT_F16:
  case PKV_FORMAT_BF16: return 2 * n;
  case PKV_FORMAT_Q8_0: return n % 32 ? 0 : n / 32 * 34;
  case PKV_FORMAT_Q4_0: return n % 32 ? 0 : n / 32 * 18;
  case PKV_FORMAT_FP8_E4M3:
  case PKV_FORMAT_FP8_E5M2: return n;
  default: return 0;
  }
}

/* ---- reference encodings, built from testutil's scalar and block references ---- */

static void ref_encode(pkv_format f, const float *x, size_t n, unsigned char *out) {
  if (f == PKV_FORMAT_Q8_0) {
    for (size_t b = 0; b < n / 32; b++) {
      tu_q8_0 q;
      tu_quantize_q8_0(x + 32 * b, &q);
      memcpy(out + 34 * b, &q.d, 2);
      memcpy(out + 34 * b + 2, q.qs, 32);
    }
  } else if (f == PKV_FORMAT_Q4_0) {
    for (size_t b = 0; b < n / 32; b++) {
      tu_q4_0 q;
      tu_quantize_q4_0(x + 32 * b, &q);
      memcpy(out + 18 * b, &q.d, 2);
      memcpy(out + 18 * b + 2, q.qs, 16);
    }
  } else {
    for (size_t i = 0; i < n; i++) tu_store(f, out, i, x[i]);
  }
}

static void ref_decode(pkv_format f, const unsigned char *in, size_t n, float *x) {
  if (f == PKV_FORMAT_Q8_0) {
    for (size_t b = 0; b < n / 32; b++) {
      tu_q8_0 q;
      memcpy(&q.d, in + 34 * b, 2);
      memcpy(q.qs, in + 34 * b + 2, 32);
      tu_dequantize_q8_0(&q, x + 32 * b);
    }
  } else if (f == PKV_FORMAT_Q4_0) {
    for (size_t b = 0; b < n / 32; b++) {
      tu_q4_0 q;
      memcpy(&q.d, in + 18 * b, 2);
      memcpy(q.qs, in + 18 * b + 2, 16);
      tu_dequantize_q4_0(&q, x + 32 * b);
    }
  } else {
    for (size_t i = 0; i < n; i++) x[i] = tu_load(f, in, i);
  }
}

/* ---- comparisons ---- */

static uint32_t f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static int elem_is_nan(pkv_format f, const unsigned char *buf, size_t i) {
  if (f == PKV_FORMAT_F32 || tu_fp8(f)) return isnan(tu_load(f, buf, i));
  uint16_t h;
  memcpy(&h, buf + 2 * i, 2);
  if (f == PKV_FORMAT_F16) return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
  return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu);
}

/* Encodings must match byte for byte, except that a NaN may carry any payload (NaN stays NaN). */
static void assert_same_encoding(pkv_format f, const unsigned char *got, const unsigned char *want, size_t n,
                                 const char *what) {
  if (tu_quantized(f)) {
    size_t bytes = ref_row_bytes(f, n), blk = f == PKV_FORMAT_Q8_0 ? 34 : 18;
    for (size_t i = 0; i < bytes; i++) {
      if (got[i] != want[i]) {
        print_error("%s %s: block %zu byte %zu: got 0x%02x want 0x%02x\n", what, pkv_format_name(f), i / blk,
                    i % blk, got[i], want[i]);
        fail();
      }
    }
    return;
  }
  size_t eb = tu_elem_bytes(f);
  for (size_t i = 0; i < n; i++) {
    if (elem_is_nan(f, want, i) ? elem_is_nan(f, got, i) : !memcmp(got + eb * i, want + eb * i, eb)) continue;
    print_error("%s %s: element %zu: got %a want %a\n", what, pkv_format_name(f), i, (double)tu_load(f, got, i),
                (double)tu_load(f, want, i));
    fail();
  }
}

static void assert_same_floats(const float *got, const float *want, size_t n, const char *what) {
  for (size_t i = 0; i < n; i++) {
    if (isnan(want[i]) ? isnan(got[i]) : f32_bits(got[i]) == f32_bits(want[i])) continue;
    print_error("%s: element %zu: got %a (0x%08x) want %a (0x%08x)\n", what, i, (double)got[i], f32_bits(got[i]),
                (double)want[i], f32_bits(want[i]));
    fail();
  }
}

static void assert_guard(const unsigned char *p, size_t n, unsigned char poison) {
  for (size_t i = 0; i < n; i++) assert_int_equal(p[i], poison);
}

/* ---- converter checks ---- */

/* Decodes `bytes` (n values of f) with the library, into buffers poisoned two different ways: both runs
 * must agree byte for byte (so every element was written) and match the reference decoding. */
static void check_decode(pkv_format f, const unsigned char *bytes, size_t n) {
  float *want = pu_malloc(4 * n);
  unsigned char *got[2];
  const unsigned char poison[2] = {0xff, 0x00};
  ref_decode(f, bytes, n, want);
  for (int r = 0; r < 2; r++) {
    got[r] = pu_malloc(4 * n + GUARD);
    memset(got[r], poison[r], 4 * n + GUARD);
    assert_int_equal(pkv_convert_to_f32(f, bytes, n, (float *)(void *)got[r]), PKV_OK);
    assert_guard(got[r] + 4 * n, GUARD, poison[r]);
  }
  assert_same_floats((const float *)(void *)got[0], want, n, pkv_format_name(f));
  assert_memory_equal(got[0], got[1], 4 * n);
  free(got[0]);
  free(got[1]);
  free(want);
}

/* Encodes x with the library (same two-poison scheme) and compares with the reference encoding, checks
 * pkv_format_row_bytes, then decodes the reference bytes back. */
static void check_convert(pkv_format f, const float *x, size_t n) {
  const size_t bytes = ref_row_bytes(f, n);
  assert_true(bytes > 0);
  assert_int_equal(pkv_format_row_bytes(f, n), bytes);
  unsigned char *want = pu_malloc(bytes), *got[2];
  const unsigned char poison[2] = {0xff, 0x00};
  ref_encode(f, x, n, want);
  for (int r = 0; r < 2; r++) {
    got[r] = pu_malloc(bytes + GUARD);
    memset(got[r], poison[r], bytes + GUARD);
    assert_int_equal(pkv_convert_from_f32(f, x, n, got[r]), PKV_OK);
    assert_guard(got[r] + bytes, GUARD, poison[r]);
  }
  assert_same_encoding(f, got[0], want, n, "pkv_convert_from_f32");
  assert_memory_equal(got[0], got[1], bytes);
  check_decode(f, want, n);
  free(got[0]);
  free(got[1]);
  free(want);
}

static void check_all_formats(const float *x, size_t n) {
  for (int i = 0; i < N_ALL; i++) check_convert(all_formats[i], x, n);
}

/* ---- tests: converters ---- */

static void test_row_bytes(void **state) {
  (void)state;
  for (size_t n = 1; n <= 512; n++)
    for (int i = 0; i < N_ALL; i++)
      assert_int_equal(pkv_format_row_bytes(all_formats[i], n), ref_row_bytes(all_formats[i], n));
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_INVALID, 32), 0);
  assert_int_equal(pkv_format_row_bytes((pkv_format)99, 32), 0);
}

/* Hand-built rows that hit the corners of the quantizers; expected bytes come from the reference. */
static void test_hand_vectors(void **state) {
  (void)state;
  float x[64];

  /* Two blocks of a signed ramp: block order and scale per block. */
  for (int j = 0; j < 64; j++) x[j] = (float)(j - 20) * 0.37f;
  check_all_formats(x, 64);
  check_all_formats(x, 32);

  /* Q8_0 ties: amax 127 makes d = 1, so k + 0.5 is an exact tie that ggml's roundf sends away from 0. */
  x[0] = 127.0f;
  for (int j = 1; j < 32; j++) x[j] = (j & 1 ? -1.0f : 1.0f) * ((float)(j / 2) + 0.5f);
  check_all_formats(x, 32);

  /* Q4_0 ties: max -8 makes d = 1, so x + 8.5 lands exactly on integers that (int) truncates. */
  for (int j = 0; j < 32; j++) x[j] = -8.0f + 0.5f * (float)j;
  check_all_formats(x, 32);

  /* Q4_0: equal magnitudes of both signs: the first one decides the sign of d; with a positive max
   * the most negative value maps to 16 and must clamp to 15. */
  for (int order = 0; order < 2; order++) {
    tu_fill_uniform(&rng, x, 32, -1.0, 1.0);
    x[3] = order ? -5.0f : 5.0f;
    x[19] = order ? 5.0f : -5.0f;
    check_all_formats(x, 32);
  }

  /* All zero: d = 0, Q8_0 quants 0, Q4_0 quants 8 (0x88). Negative zeros first in the second block:
   * Q4_0's d is +0 / -8 whatever the zeros' signs (its largest magnitude never moves off +0). */
  memset(x, 0, sizeof x);
  check_all_formats(x, 64);
  for (int j = 32; j < 64; j += 2) x[j] = -0.0f;
  check_all_formats(x, 64);

  /* A single non-zero value of either sign. */
  for (int sign = 0; sign < 2; sign++) {
    memset(x, 0, sizeof x);
    x[tu_below(&rng, 64)] = (sign ? -1.0f : 1.0f) * (float)tu_uniform(&rng, 0.01, 100.0);
    check_all_formats(x, 64);
  }

  /* Near the fp16 limit: the scales are large but finite. */
  for (int j = 0; j < 64; j++) x[j] = (float)tu_uniform(&rng, -65504.0, 65504.0);
  x[5] = 65504.0f;
  x[40] = -65504.0f;
  x[41] = 65503.0f;
  check_all_formats(x, 64);
  x[5] = -65504.0f; /* negative extreme first: Q4_0's d changes sign */
  check_all_formats(x, 64);

  /* Tiny values mixed with large ones: the tiny ones quantize to 0. */
  for (int j = 0; j < 64; j++) x[j] = (float)((j & 1 ? -1e-30 : 1e-30) * tu_uniform(&rng, 0.5, 2.0));
  x[7] = 1000.0f;
  x[39] = -3.0f;
  x[40] = 1e-20f;
  check_all_formats(x, 64);

  /* A block of only tiny values: the fp16 scale underflows while the float scale ggml divides by does
   * not, so the quants are non-zero with d = 0. */
  for (int j = 0; j < 32; j++) x[j] = (float)((j & 1 ? -1e-30 : 1e-30) * tu_uniform(&rng, 0.1, 1.0));
  check_all_formats(x, 32);
}

/* Non-finite values quantize to defined bits (docs/api.md), the GPU's: a float converts to an integer
 * with NaN to 0. A NaN in a block of finite values: the scale is the finite values' and its quant is
 * Q8_0's 0, Q4_0's nibble 0 (in either half of the byte: the high half once shifted a negative
 * value). An infinity: the scale is infinite (Q4_0: its sign negated), every other quant 0 (Q4_0:
 * nibble 8), its own as a NaN's. */
static void test_non_finite(void **state) {
  (void)state;
  const float inf = INFINITY;
  for (int pos = 0; pos < 32; pos += 21) { /* low half, then high half of Q4_0's bytes */
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 12) * 0.25f; /* amax 4.75 (j = 31), max 4.75 */
    unsigned char q8[34], q4[18];
    x[pos] = NAN;
    assert_int_equal(pkv_convert_from_f32(PKV_FORMAT_Q8_0, x, 32, q8), PKV_OK);
    assert_int_equal(pkv_convert_from_f32(PKV_FORMAT_Q4_0, x, 32, q4), PKV_OK);
    uint16_t d8, d4;
    memcpy(&d8, q8, 2);
    memcpy(&d4, q4, 2);
    assert_int_equal(d8, tu_f32_to_f16(4.75f / 127.0f));
    assert_int_equal(d4, tu_f32_to_f16(4.75f / -8.0f));
    assert_int_equal(q8[2 + pos], 0);
    assert_int_equal(pos < 16 ? q4[2 + pos] & 15 : q4[2 + pos - 16] >> 4, 0);
    assert_int_equal((signed char)q8[2 + 31], 127); /* the finite values as before */
    assert_int_equal(q4[2 + 15] >> 4, 0);         /* 4.75 / d4 + 8.5 = 0.5: nibble 0 */

    x[pos] = pos ? -inf : inf;
    assert_int_equal(pkv_convert_from_f32(PKV_FORMAT_Q8_0, x, 32, q8), PKV_OK);
    assert_int_equal(pkv_convert_from_f32(PKV_FORMAT_Q4_0, x, 32, q4), PKV_OK);
    memcpy(&d8, q8, 2);
    memcpy(&d4, q4, 2);
    assert_int_equal(d8, 0x7c00);             /* +inf */
    assert_int_equal(d4, pos ? 0x7c00 : 0xfc00); /* max / -8 */
    for (int j = 0; j < 32; j++) {
      assert_int_equal(q8[2 + j], 0);
      assert_int_equal(j < 16 ? q4[2 + j] & 15 : q4[2 + j - 16] >> 4, j == pos ? 0 : 8);
    }
  }
}

/* A group whose largest magnitude is below ~2.3e-38: the scale's inverse overflows to infinity, so
 * each value times it is infinite (or NaN for 0). The quants are defined (the GPU's conversion: NaN
 * to 0, saturating) rather than a shift of a negative value, and the scale rounds to a zero half, so
 * the row reads back as zeros. Under UBSan the shift stopped the test. */
static void test_tiny_groups(void **state) {
  (void)state;
  for (int sign = -1; sign <= 1; sign += 2) {
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = (float)((j % 3) - 1) * 1e-40f; /* -, 0, + */
    x[7] = (float)sign * 1e-39f;                                       /* the largest: max */
    unsigned char q4[18], q8[34];
    assert_int_equal(pkv_convert_from_f32(PKV_FORMAT_Q4_0, x, 32, q4), PKV_OK);
    assert_int_equal(pkv_convert_from_f32(PKV_FORMAT_Q8_0, x, 32, q8), PKV_OK);
    uint16_t d4;
    memcpy(&d4, q4, 2);
    assert_int_equal(d4, sign > 0 ? 0x8000 : 0x0000); /* max / -8 rounds to a signed zero half */
    for (int j = 0; j < 32; j++) {
      const int nibble = j < 16 ? q4[2 + j] & 15 : q4[2 + j - 16] >> 4;
      /* x * id: -inf for values of max's sign (to INT32_MIN: low nibble 0), +inf for the others
       * (saturating, then min(15, .)), NaN for 0 (to 0). */
      const int want = x[j] == 0.0f ? 0 : (x[j] > 0.0f) == (sign > 0) ? 0 : 15;
      if (nibble != want) fail_msg("max sign %d, value %d (%g): nibble %d, want %d", sign, j, (double)x[j], nibble, want);
    }
    float back[32];
    assert_int_equal(pkv_convert_to_f32(PKV_FORMAT_Q4_0, q4, 32, back), PKV_OK);
    for (int j = 0; j < 32; j++) assert_true(back[j] == 0.0f);
    assert_int_equal(pkv_convert_to_f32(PKV_FORMAT_Q8_0, q8, 32, back), PKV_OK);
    for (int j = 0; j < 32; j++) assert_true(back[j] == 0.0f);
  }
}

/* FP8: every one of the 256 codes decodes to its value by the bit fields (NaN as NaN), and every
 * finite code's value encodes back to it; a sweep of floats encodes as the search over the codes
 * does: each code's value and its float neighbours, the midpoints between neighbouring codes (ties
 * to even) and their float neighbours, values past the largest finite one (saturating), infinities,
 * NaNs, zeros, the float subnormals, and random floats over 2^-40..2^20 of both signs. */
static void fp8_sweep_point(float x, size_t *n, float *buf) {
  buf[(*n)++] = x;
  buf[(*n)++] = nextafterf(x, INFINITY);
  buf[(*n)++] = nextafterf(x, -INFINITY);
}

static void test_fp8(void **state) {
  (void)state;
  enum { CAP = 1 << 16 };
  float *x = pu_malloc(CAP * sizeof(float));
  for (int fi = 0; fi < 2; fi++) {
    const pkv_format f = fi ? PKV_FORMAT_FP8_E5M2 : PKV_FORMAT_FP8_E4M3;
    unsigned char codes[256], again[256];
    float values[256];
    for (int c = 0; c < 256; c++) codes[c] = (unsigned char)c;
    assert_int_equal(pkv_convert_to_f32(f, codes, 256, values), PKV_OK);
    for (int c = 0; c < 256; c++) {
      const float want = tu_fp8_to_f32(f, (uint8_t)c);
      if (isnan(want) ? !isnan(values[c]) : f32_bits(values[c]) != f32_bits(want))
        fail_msg("%s code 0x%02x: got %a, want %a", pkv_format_name(f), c, (double)values[c], (double)want);
    }
    assert_int_equal(pkv_convert_from_f32(f, values, 256, again), PKV_OK);
    for (int c = 0; c < 256; c++) {
      const uint8_t want = isnan(values[c]) ? (uint8_t)((c & 0x80) | 0x7f) : isinf(values[c]) ? (uint8_t)(c - 1) : (uint8_t)c;
      if (again[c] != want) fail_msg("%s: code 0x%02x's value %a encodes as 0x%02x", pkv_format_name(f), c,
                                     (double)values[c], again[c]);
    }

    size_t n = 0;
    for (int c = 0; c < 0x7f; c++) {
      const double v = tu_fp8_value(f, (uint8_t)c), next = tu_fp8_value(f, (uint8_t)(c + 1));
      if (!isfinite(v)) continue;
      for (int sign = 0; sign < 2; sign++) {
        const double sv = sign ? -v : v;
        fp8_sweep_point((float)sv, &n, x);
        if (isfinite(next)) fp8_sweep_point((float)(sign ? -(v + next) / 2 : (v + next) / 2), &n, x);
        else fp8_sweep_point((float)(sign ? -1.5 * v : 1.5 * v), &n, x); /* past the largest */
      }
    }
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f, 1e-38f, FLT_MAX, -FLT_MAX,
                             3e38f, 1e10f, -65536.0f};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) x[n++] = special[i];
    while (n < CAP) {
      const double m = tu_uniform(&rng, 1.0, 2.0) * ldexp(1.0, (int)tu_below(&rng, 61) - 40);
      x[n++] = (float)(tu_below(&rng, 2) ? -m : m);
    }
    unsigned char *got = pu_malloc(n);
    assert_int_equal(pkv_convert_from_f32(f, x, n, got), PKV_OK);
    for (size_t i = 0; i < n; i++) {
      const uint8_t want = tu_f32_to_fp8(f, x[i]);
      if (got[i] != want && !(isnan(x[i]) && (got[i] & 0x7f) == 0x7f))
        fail_msg("%s: %a encodes as 0x%02x, want 0x%02x", pkv_format_name(f), (double)x[i], got[i], want);
    }
    free(got);
  }
  free(x);
}

/* Random rows of random lengths and magnitudes. */
static void test_random_rows(void **state) {
  (void)state;
  float x[32 * 12];
  for (int it = 0; it < 400; it++) {
    size_t n = 32 * (1 + tu_below(&rng, 12));
    double scale = ldexp(1.0, (int)tu_below(&rng, 36) - 20); /* 2^-20 .. 2^15 */
    tu_fill_uniform(&rng, x, n, -scale, scale);
    if (it % 4 == 0) /* some zeros and repeated values inside blocks */
      for (int k = 0; k < 8; k++) x[tu_below(&rng, (uint32_t)n)] = (it & 8) ? 0.0f : x[0];
    check_all_formats(x, n);
    /* the element formats take any n */
    size_t m = 1 + tu_below(&rng, (uint32_t)n);
    for (int i = 0; i < N_IO; i++) check_convert(io_formats[i], x, m);
  }
}

/* Inputs around every rounding boundary of a 16-bit format: each representable value v of one sign,
 * the midpoint to the next one (an exact tie), and the floats on either side of the midpoint. */
static size_t boundary_inputs(pkv_format f, float *out) {
  size_t n = 0;
  for (uint32_t h = 0; h < 0x10000u; h++) {
    const int f16 = f == PKV_FORMAT_F16;
    if (f16 ? (h & 0x7fffu) >= 0x7c00u : (h & 0x7f80u) == 0x7f80u) continue; /* inf / NaN */
    double v = f16 ? tu_f16_to_f32((uint16_t)h) : tu_bf16_to_f32((uint16_t)h);
    double next = f16 ? tu_f16_to_f32((uint16_t)(h + 1)) : tu_bf16_to_f32((uint16_t)(h + 1));
    if (isinf(next)) { /* past the largest finite value: one more step of the same size */
      double prev = f16 ? tu_f16_to_f32((uint16_t)(h - 1)) : tu_bf16_to_f32((uint16_t)(h - 1));
      next = 2.0 * v - prev;
    }
    float mid = (float)((v + next) / 2.0); /* exact: both have few mantissa bits */
    out[n++] = (float)v;
    out[n++] = mid;
    out[n++] = nextafterf(mid, 0.0f);
    out[n++] = nextafterf(mid, 2.0f * mid);
  }
  return n;
}

static size_t special_inputs(float *out) {
  const uint32_t bits[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                           0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7f7fffffu, 0xff7fffffu, 0x00000001u,
                           0x80000001u, 0x007fffffu, 0x00800000u, 0x33000000u, 0x33000001u, 0x33c00000u,
                           0x387fc000u, 0x38800000u, 0x477fefffu, 0x477ff000u, 0x477ff001u, 0x47800000u};
  for (size_t i = 0; i < sizeof bits / sizeof bits[0]; i++) memcpy(&out[i], &bits[i], 4);
  return sizeof bits / sizeof bits[0];
}

static size_t random_bit_inputs(float *out, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t u = (uint32_t)tu_next(&rng);
    memcpy(&out[i], &u, 4);
  }
  return n;
}

/* fp16 and bf16: round to nearest even at every tie, subnormals, overflow to inf, NaN stays NaN, and
 * every one of the 65536 codes decodes right. */
static void test_half_rounding(void **state) {
  (void)state;
  const pkv_format halves[2] = {PKV_FORMAT_F16, PKV_FORMAT_BF16};
  float *x = pu_malloc(4 * 4 * 0x10000u);
  unsigned char codes[2 * 0x10000];
  for (uint32_t h = 0; h < 0x10000u; h++) {
    uint16_t c = (uint16_t)h;
    memcpy(codes + 2 * h, &c, 2);
  }
  for (int k = 0; k < 2; k++) {
    check_decode(halves[k], codes, 0x10000u);
    check_convert(halves[k], x, boundary_inputs(halves[k], x));
    check_convert(halves[k], x, special_inputs(x));
    check_convert(halves[k], x, random_bit_inputs(x, 0x40000u));
  }
  /* F32 is the identity, NaNs included. */
  check_convert(PKV_FORMAT_F32, x, random_bit_inputs(x, 0x10000u));
  check_convert(PKV_FORMAT_F32, x, special_inputs(x));
  free(x);
}

/* Invalid arguments fail with PKV_ERR_INVALID_ARGUMENT and a detail text, and write nothing. */
static void test_bad_arguments(void **state) {
  (void)state;
  float src[64], dstf[64], dstf0[64];
  unsigned char dst[256], dst0[256];
  tu_fill_uniform(&rng, src, 64, -1.0, 1.0);
  memset(dst0, 0xa5, sizeof dst0);
  memset(dstf0, 0xa5, sizeof dstf0);
  unsigned char enc[256];
  memset(enc, 0x11, sizeof enc);
#define EXPECT_INVALID(call)                                                                              \
  do {                                                                                                    \
    memcpy(dst, dst0, sizeof dst);                                                                        \
    memcpy(dstf, dstf0, sizeof dstf);                                                                     \
    pu_assert_fails(call, PKV_ERR_INVALID_ARGUMENT);                                                      \
    assert_memory_equal(dst, dst0, sizeof dst);                                                           \
    assert_memory_equal(dstf, dstf0, sizeof dstf);                                                        \
  } while (0)

  for (int i = 0; i < N_ALL; i++) {
    pkv_format f = all_formats[i];
    EXPECT_INVALID(pkv_convert_from_f32(f, NULL, 32, dst));
    EXPECT_INVALID(pkv_convert_from_f32(f, src, 32, NULL));
    EXPECT_INVALID(pkv_convert_to_f32(f, NULL, 32, dstf));
    EXPECT_INVALID(pkv_convert_to_f32(f, enc, 32, NULL));
  }
  const size_t bad_n[] = {1, 16, 31, 33, 48, 63};
  for (size_t j = 0; j < sizeof bad_n / sizeof bad_n[0]; j++) {
    for (int i = 0; i < N_ALL; i++) {
      pkv_format f = all_formats[i];
      if (!tu_quantized(f)) continue;
      EXPECT_INVALID(pkv_convert_from_f32(f, src, bad_n[j], dst));
      EXPECT_INVALID(pkv_convert_to_f32(f, enc, bad_n[j], dstf));
      assert_int_equal(pkv_format_row_bytes(f, bad_n[j]), 0);
    }
  }
  const pkv_format bad_formats[] = {PKV_FORMAT_INVALID, (pkv_format)8, (pkv_format)99, PKV_FORMAT_MAX_};
  for (size_t j = 0; j < sizeof bad_formats / sizeof bad_formats[0]; j++) {
    EXPECT_INVALID(pkv_convert_from_f32(bad_formats[j], src, 32, dst));
    EXPECT_INVALID(pkv_convert_to_f32(bad_formats[j], enc, 32, dstf));
    assert_int_equal(pkv_format_row_bytes(bad_formats[j], 32), 0);
  }
#undef EXPECT_INVALID
}

/* ---- tests: rows through a pool ---- */

/* The values a pool was given, by [seq][layer][position][kv_head * head_dim + i]. */
typedef struct row_model {
  uint32_t nseq, layers, max_len, width;
  float *k, *v;
} row_model;

static size_t model_index(const row_model *m, uint32_t s, uint32_t l, uint32_t pos) {
  return (((size_t)s * m->layers + l) * m->max_len + pos) * m->width;
}

/* The bytes a read in dst format must return for rows [start, start+count) of one sequence and layer:
 * the source values as the page format stores them (per head_dim row), then encoded as dst. */
static void expected_rows(const float *model_rows, uint32_t count, uint32_t kv_heads, uint32_t head_dim,
                          pkv_format page, pkv_format dst, unsigned char *out) {
  float tmp[256];
  for (uint32_t r = 0; r < count * kv_heads; r++) {
    tu_round_trip(page, model_rows + (size_t)r * head_dim, head_dim, tmp);
    for (uint32_t i = 0; i < head_dim; i++) tu_store(dst, out, (size_t)r * head_dim + i, tmp[i]);
  }
}

static void check_read(pkv_pool *pool, const row_model *m, const pkv_pool_desc *d, pkv_seq seq, uint32_t s,
                       uint32_t layer, uint32_t start, uint32_t count, pkv_format dst, int want_k, int want_v) {
  const size_t n = (size_t)count * m->width, bytes = n * tu_elem_bytes(dst);
  unsigned char *got_k = pu_malloc(bytes), *got_v = pu_malloc(bytes), *want = pu_malloc(bytes);
  memset(got_k, 0xff, bytes); /* NaN in every format: an element left unwritten cannot match */
  memset(got_v, 0xff, bytes);
  assert_int_equal(pu_read(pool, layer, seq, start, count, dst, want_k ? got_k : NULL, want_v ? got_v : NULL),
                   PKV_OK);
  for (int kv = 0; kv < 2; kv++) {
    if (!(kv ? want_v : want_k)) continue;
    const float *src = (kv ? m->v : m->k) + model_index(m, s, layer, start);
    expected_rows(src, count, d->kv_heads, d->head_dim, kv ? d->v_format : d->k_format, dst, want);
    const unsigned char *got = kv ? got_v : got_k;
    if (memcmp(got, want, bytes) != 0) {
      size_t eb = tu_elem_bytes(dst), i = 0;
      while (!memcmp(got + i * eb, want + i * eb, eb)) i++;
      print_error("%s page %s -> %s, head_dim %u, seq %u layer %u: position %zu head %zu elem %zu: got %a want %a\n",
                  kv ? "V" : "K", pkv_format_name(kv ? d->v_format : d->k_format), pkv_format_name(dst),
                  d->head_dim, s, layer, start + i / m->width, i % m->width / d->head_dim, i % d->head_dim,
                  (double)tu_load(dst, got, i), (double)tu_load(dst, want, i));
      fail();
    }
  }
  free(got_k);
  free(got_v);
  free(want);
}

/* Fills the newest n[s] positions of every sequence in one layer with fresh random rows given in src
 * format, and records the values the library was handed. */
static void write_layer(pkv_pool *pool, row_model *m, const pkv_seq *seqs, const uint32_t *len, const uint32_t *n,
                        uint32_t layer, pkv_format src) {
  size_t total = 0;
  for (uint32_t s = 0; s < m->nseq; s++) total += n[s];
  const size_t eb = tu_elem_bytes(src);
  unsigned char *kb = pu_malloc(total * m->width * eb), *vb = pu_malloc(total * m->width * eb);
  size_t row = 0;
  for (uint32_t s = 0; s < m->nseq; s++) {
    for (uint32_t pos = len[s] - n[s]; pos < len[s]; pos++, row++) {
      for (int kv = 0; kv < 2; kv++) {
        unsigned char *buf = kv ? vb : kb;
        float *dst = (kv ? m->v : m->k) + model_index(m, s, layer, pos);
        double scale = 1.0;
        for (uint32_t i = 0; i < m->width; i++) {
          if (i % 32 == 0) scale = ldexp(1.0, (int)tu_below(&rng, 16) - 8); /* Q scales vary per group */
          size_t at = row * m->width + i;
          tu_store(src, buf, at, (float)tu_uniform(&rng, -scale, scale));
          dst[i] = tu_load(src, buf, at);
        }
      }
    }
  }
  assert_int_equal(pu_write(pool, layer, seqs, n, m->nseq, src, kb, vb), PKV_OK);
  free(kb);
  free(vb);
}

static void run_pool_case(uint32_t head_dim, pkv_format kf, pkv_format vf, uint32_t case_no) {
  const uint32_t page_sizes[4] = {4, 16, 1, 8};
  /* case_no runs over a pair's head_dims fastest: the page size shifts with it and per pair of cases */
  const uint32_t layers = 3, kv_heads = 2 + case_no % 3, page_size = page_sizes[(case_no + case_no / 4) % 4];
  const uint32_t nseq = 3;
  const uint32_t max_step = 2 * page_size + 2, steps = 2, max_len = steps * max_step;
  const uint32_t pages = nseq * ((max_len + page_size - 1) / page_size) + 1;
  pkv_pool_desc d = pu_desc(layers, kv_heads, head_dim, page_size, pages, 8, kf, vf);
  d.page_order_seed = tu_below(&rng, 2) ? (uint32_t)tu_next(&rng) | 1u : 0; /* scattered pages too */
  pkv_context *ctx;
  pkv_pool *pool;
  pu_open(&d, &ctx, &pool);

  row_model m = {nseq, layers, max_len, kv_heads * head_dim, NULL, NULL};
  const size_t model_floats = (size_t)nseq * layers * max_len * m.width;
  m.k = pu_malloc(model_floats * sizeof(float));
  m.v = pu_malloc(model_floats * sizeof(float));
  pkv_seq seqs[3];
  uint32_t len[3] = {0, 0, 0}, n[3];
  for (uint32_t s = 0; s < nseq; s++) assert_int_equal(pkv_seq_alloc(pool, &seqs[s]), PKV_OK);

  for (uint32_t step = 0; step < steps; step++) {
    for (uint32_t s = 0; s < nseq; s++) {
      n[s] = 1 + tu_below(&rng, max_step);
      len[s] += n[s];
    }
    assert_int_equal(pkv_append(pool, seqs, n, nseq), PKV_OK);
    for (uint32_t l = 0; l < layers; l++) /* every source format reaches every layer over the cases */
      write_layer(pool, &m, seqs, len, n, l, io_formats[(l + step + case_no) % N_IO]);
  }

  /* All layers are checked after all writes, so a layer or sequence that aliases another shows. */
  for (uint32_t s = 0; s < nseq; s++) {
    assert_int_equal(pu_length(pool, seqs[s]), len[s]);
    for (uint32_t l = 0; l < layers; l++) {
      for (int f = 0; f < N_IO; f++) check_read(pool, &m, &d, seqs[s], s, l, 0, len[s], io_formats[f], 1, 1);
      uint32_t start = tu_below(&rng, len[s]), count = 1 + tu_below(&rng, len[s] - start);
      int only_v = (int)tu_below(&rng, 2);
      check_read(pool, &m, &d, seqs[s], s, l, start, count, io_formats[tu_below(&rng, N_IO)], !only_v, only_v);
    }
  }
  free(m.k);
  free(m.v);
  pu_close(ctx, pool);
}

/* The backend's own quantization of non-finite rows (a GPU's scatter kernel, where there is one)
 * against the host conversion's: the same quants, so rows read back as the host conversion gives
 * them (NaN where it gives NaN; payloads may differ). */
static void non_finite_pool(pkv_format kf, pkv_format vf) {
  float rows[2][32], back[2][32], want[2][32];
  unsigned char k_row[34], v_row[34];
  for (int t = 0; t < 2; t++)
    for (int j = 0; j < 32; j++) rows[t][j] = (float)(j - 12) * 0.25f;
  rows[0][3] = NAN;
  rows[0][21] = NAN;
  rows[1][7] = -INFINITY;
  rows[1][8] = 1e30f; /* saturates an FP8 page */
  pkv_pool_desc d = pu_desc(1, 1, 32, 4, 1, 1, kf, vf);
  pkv_context *ctx;
  pkv_pool *pool;
  pu_open(&d, &ctx, &pool);
  pkv_seq seq;
  const uint32_t n = 2;
  assert_int_equal(pkv_seq_alloc(pool, &seq), PKV_OK);
  assert_int_equal(pkv_append(pool, &seq, &n, 1), PKV_OK);
  assert_int_equal(pu_write(pool, 0, &seq, &n, 1, PKV_FORMAT_F32, rows, rows), PKV_OK);
  for (int plane = 0; plane < 2; plane++) {
    const pkv_format f = plane ? vf : kf;
    unsigned char *encoded = plane ? v_row : k_row;
    for (int t = 0; t < 2; t++) {
      assert_int_equal(pkv_convert_from_f32(f, rows[t], 32, encoded), PKV_OK);
      assert_int_equal(pkv_convert_to_f32(f, encoded, 32, want[t]), PKV_OK);
    }
    memset(back, 0x5a, sizeof back);
    assert_int_equal(pu_read(pool, 0, seq, 0, 2, PKV_FORMAT_F32, plane ? NULL : back, plane ? back : NULL), PKV_OK);
    for (int t = 0; t < 2; t++)
      for (int j = 0; j < 32; j++)
        if (isnan(want[t][j]) ? !isnan(back[t][j]) : memcmp(&want[t][j], &back[t][j], 4) != 0)
          fail_msg("%s row %d value %d: read back %g, the host conversion gives %g", pkv_format_name(f), t, j,
                   (double)back[t][j], (double)want[t][j]);
  }
  pu_close(ctx, pool);
}

static void test_non_finite_pool(void **state) {
  (void)state;
  non_finite_pool(PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0);
  non_finite_pool(PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2);
}

/* Every ordered pair of different formats at two head_dims, the pairs taking 32 and 128 or 64 and 256
 * in turn. Named apart from the test_* conversion tests, which alone run under an emulator. */
static void pool_round_trips(void **state) {
  (void)state;
  const uint32_t head_dims[4] = {32, 128, 64, 256};
  uint32_t case_no = 0, pair = 0;
  for (int kf = 0; kf < N_ALL; kf++)
    for (int vf = 0; vf < N_ALL; vf++)
      if (kf != vf) {
        for (int h = 0; h < 2; h++) run_pool_case(head_dims[2 * (pair % 2) + h], all_formats[kf], all_formats[vf], case_no++);
        pair++;
      }
}

/* One write of several megabytes from host memory (three ragged sequences, 8 KV heads of 128 values:
 * ~17 MB of F16 rows), read back whole: a GPU backend packs it a chunk at a time, with one packing
 * thread and with three. */
static void large_write_round_trip(void **state) {
  (void)state;
  for (uint32_t threads = 1; threads <= 3; threads += 2) {
    const uint32_t nseq = 3, kv_heads = 8, head_dim = 128, page_size = 16;
    uint32_t n[3] = {1800 + tu_below(&rng, 400), 1000 + tu_below(&rng, 600), 1 + tu_below(&rng, 900)}, len[3];
    uint32_t max_len = 0, pages = 1;
    for (uint32_t s = 0; s < nseq; s++) {
      len[s] = n[s];
      max_len = n[s] > max_len ? n[s] : max_len;
      pages += (n[s] + page_size - 1) / page_size;
    }
    pkv_pool_desc d = pu_desc(1, kv_heads, head_dim, page_size, pages, 4, PKV_FORMAT_F16, PKV_FORMAT_BF16);
    d.page_order_seed = (uint32_t)tu_next(&rng) | 1u;
    pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
    cd.threads = threads;
    pkv_context *ctx;
    pkv_pool *pool;
    const pkv_status st = pkv_context_create(&cd, &ctx);
    if (tu_backend_missing(st)) {
      print_message("    skipped: %s\n", pkv_last_error());
      skip();
    }
    assert_int_equal(st, PKV_OK);
    assert_int_equal(pkv_pool_create(ctx, &d, &pool), PKV_OK);
    row_model m = {nseq, 1, max_len, kv_heads * head_dim, NULL, NULL};
    const size_t model_floats = (size_t)nseq * max_len * m.width;
    m.k = pu_malloc(model_floats * sizeof(float));
    m.v = pu_malloc(model_floats * sizeof(float));
    pkv_seq seqs[3];
    for (uint32_t s = 0; s < nseq; s++) assert_int_equal(pkv_seq_alloc(pool, &seqs[s]), PKV_OK);
    assert_int_equal(pkv_append(pool, seqs, n, nseq), PKV_OK);
    write_layer(pool, &m, seqs, len, n, 0, PKV_FORMAT_F16);
    for (uint32_t s = 0; s < nseq; s++) check_read(pool, &m, &d, seqs[s], s, 0, 0, len[s], PKV_FORMAT_F32, 1, 1);
    free(m.k);
    free(m.v);
    pu_close(ctx, pool);
  }
}

int main(void) {
  rng = tu_rng_make(tu_seed());
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_row_bytes),        cmocka_unit_test(test_hand_vectors),
      cmocka_unit_test(test_random_rows),      cmocka_unit_test(test_half_rounding),
      cmocka_unit_test(test_bad_arguments),    cmocka_unit_test(pool_round_trips),
      cmocka_unit_test(test_non_finite),       cmocka_unit_test(test_non_finite_pool),
      cmocka_unit_test(test_tiny_groups),      cmocka_unit_test(test_fp8),
      cmocka_unit_test(large_write_round_trip),
  };
  return tu_run_tests(tests, NULL, NULL);
}
