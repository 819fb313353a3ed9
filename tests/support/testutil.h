/* Helpers shared by the tests: a seeded random source and reference encodings written here,
 * independently of the library, so the library's formats can be checked against them. Nothing here
 * needs cmocka (poolutil.h has the helpers that do). */
#ifndef PKV_TESTUTIL_H
#define PKV_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "pagedkv.h"

/* Random numbers: xorshift64*. The seed comes from PKV_TEST_SEED when set, else from the clock, and
 * is printed so a failure can be replayed. */
typedef struct tu_rng {
  uint64_t s;
} tu_rng;
uint64_t tu_seed(void);
tu_rng tu_rng_make(uint64_t seed);
uint64_t tu_next(tu_rng *r);
uint32_t tu_below(tu_rng *r, uint32_t n); /* uniform in [0, n) */
double tu_uniform(tu_rng *r, double lo, double hi);

/* Stream `index` of a seed: each case or scenario draws from a stream of its own, so replaying a seed
 * reproduces any one of them alone. */
tu_rng tu_rng_stream(uint64_t seed, uint64_t index);

/* x[0..n) drawn from tu_uniform(r, lo, hi) in order. */
void tu_fill_uniform(tu_rng *r, float *x, size_t n, double lo, double hi);

/* a[0..n) in a random order (Fisher-Yates). */
void tu_shuffle(tu_rng *r, uint32_t *a, uint32_t n);

#define TU_COUNT(a) (sizeof(a) / sizeof((a)[0]))
static inline uint32_t tu_min_u32(uint32_t a, uint32_t b) { return a < b ? a : b; }
static inline uint32_t tu_max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* Reference scalar conversions (round to nearest even). */
uint16_t tu_f32_to_f16(float x);
float tu_f16_to_f32(uint16_t h);
uint16_t tu_f32_to_bf16(float x);
float tu_bf16_to_f32(uint16_t h);

/* ggml's reference quantization of one 32-value block, and dequantization. */
typedef struct tu_q8_0 {
  uint16_t d;
  int8_t qs[32];
} tu_q8_0;
typedef struct tu_q4_0 {
  uint16_t d;
  uint8_t qs[16];
} tu_q4_0;
void tu_quantize_q8_0(const float *x, tu_q8_0 *out);
void tu_quantize_q4_0(const float *x, tu_q4_0 *out);
void tu_dequantize_q8_0(const tu_q8_0 *b, float *x);
void tu_dequantize_q4_0(const tu_q4_0 *b, float *x);

/* Whether format is one of ggml's block-quantized ones (Q8_0, Q4_0). */
int tu_quantized(pkv_format format);

/* FP8 (OCP E4M3 / E5M2), scale 1: the value of a code, as double and as float, and a float's code
 * (round to nearest even, saturating to the largest finite value, NaN to sign | 0x7f), found by a
 * search over the codes. */
int tu_fp8(pkv_format format);
double tu_fp8_value(pkv_format format, uint8_t c);
float tu_fp8_to_f32(pkv_format format, uint8_t c);
uint8_t tu_f32_to_fp8(pkv_format format, float x);

/* The value a page of `format` stores for a row of n floats (n a multiple of 32 for Q8_0/Q4_0):
 * what decode must see. */
void tu_round_trip(pkv_format format, const float *src, size_t n, float *dst);

/* Store a float as an element of an I/O format (F32/F16/BF16) or FP8 (scale 1) at index i of buf, and
 * read it back. */
void tu_store(pkv_format format, void *buf, size_t i, float x);
float tu_load(pkv_format format, const void *buf, size_t i);
size_t tu_elem_bytes(pkv_format format);

/* Whether pkv_context_create's status says the backend asked for (PKV_BACKEND) is one this machine
 * lacks: PKV_ERR_UNSUPPORTED (not built in) or PKV_ERR_NO_DEVICE. A test then skips rather than fails. */
int tu_backend_missing(pkv_status st);

/* The exit status of a test program that skipped: meson (and automake) count it as skipped, not
 * passed (tu_run.h). */
#define TU_EXIT_SKIP 77

/* Sets (value) or removes (NULL) an environment variable of this process. */
void tu_set_env(const char *name, const char *value);

#endif
