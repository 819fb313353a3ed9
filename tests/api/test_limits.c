/* Limits and sizes at the boundary: every size and count a caller passes is checked before the
 * library spends memory or time on it, and answered with the status that says what is wrong.
 * - append and write with more sequences than the pool holds: refused at once (no per-sequence
 *   arrays of that many entries first);
 * - a pool the host cannot hold: PKV_ERR_OUT_OF_MEMORY before any per-page bookkeeping is built;
 * - q_heads past PKV_MAX_Q_HEADS (one that made q_tokens * group wrap in 32 bits among them);
 * - pkv_format_row_bytes and the conversions for a row whose bytes pass size_t;
 * - pkv_context_read_bandwidth of more bytes than any host holds;
 * - append/truncate cycles with no write between: the queue of page-table changes grows
 *   geometrically (and drops overwritten changes), so 20000 cycles take milliseconds;
 * - a handle of a live pool is refused by every other pool, however many pools came and went;
 * - decode numerics: one token far above the rest must not drop the others from the output's
 *   numerator while they count in its normaliser (V rows all 1.0: the output is exactly 1). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if !defined(_WIN32)
#include <sys/resource.h>
#endif

#include "poolutil.h"
#include "testutil.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The process's peak resident memory in MiB (0 on Windows, which has no getrusage: time alone). */
static long peak_mib(void) {
#if defined(_WIN32)
  return 0;
#else
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
#endif
}

static pkv_pool_desc small_desc(void) { return pu_desc(1, 1, 32, 4, 16, 4, PKV_FORMAT_F32, PKV_FORMAT_F32); }

static void batch_count_past_max_sequences(void **state) {
  (void)state;
  const pkv_pool_desc d = small_desc();
  pkv_context *ctx;
  pkv_pool *pool;
  pu_open(&d, &ctx, &pool);
  pkv_seq s;
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  const uint32_t n = 1;
  const pkv_pool_stats before = pu_stats(pool);
  const long mib = peak_mib();
  const double t0 = now();
  pu_assert_fails(pkv_append(pool, &s, &n, UINT32_MAX), PKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pkv_last_error(), "count"));
  pu_assert_fails(pkv_append(pool, &s, &n, d.max_sequences + 1), PKV_ERR_INVALID_ARGUMENT);
  float rows[32] = {0};
  pu_assert_fails(pu_write(pool, 0, &s, &n, UINT32_MAX, PKV_FORMAT_F32, rows, rows), PKV_ERR_INVALID_ARGUMENT);
  const double took = now() - t0;
  const pkv_pool_stats after = pu_stats(pool);
  pu_assert_stats_equal(&after, &before);
  if (took > 0.5 || peak_mib() - mib > 64)
    fail_msg("refusing the counts took %.2f s and %ld MiB", took, peak_mib() - mib);
  pu_close(ctx, pool);
}

static void pool_too_large_for_the_host(void **state) {
  (void)state;
  pu_skip_under_asan("its allocator stops the program on a 2^61-byte request instead of failing it");
  /* 2^28 pages of 8 GiB each (every layer's K and V): the page memory fails at once; the host's
   * bookkeeping for that many pages would take 2 GiB and a second. */
  pkv_pool_desc huge = pu_desc(1, 4096, 256, 1024, 1u << 28, 1, PKV_FORMAT_F32, PKV_FORMAT_F32);
  const pkv_pool_desc d = small_desc();
  pkv_context *ctx;
  pkv_pool *pool, *none = NULL;
  pu_open(&d, &ctx, &pool);
  const long mib = peak_mib();
  const double t0 = now();
  pu_assert_fails(pkv_pool_create(ctx, &huge, &none), PKV_ERR_OUT_OF_MEMORY);
  const double took = now() - t0;
  assert_null(none);
  if (took > 0.5 || peak_mib() - mib > 64)
    fail_msg("the failed pool took %.2f s and %ld MiB of host memory first", took, peak_mib() - mib);
  pu_close(ctx, pool);
}

static void q_heads_bound(void **state) {
  (void)state;
  const pkv_pool_desc d = small_desc();
  pkv_context *ctx;
  pkv_pool *pool;
  pu_open(&d, &ctx, &pool);
  pkv_seq s;
  const uint32_t n = 8;
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  assert_int_equal(pkv_append(pool, &s, &n, 1), PKV_OK);
  static float q[PKV_MAX_Q_HEADS * 8 * 32], out[PKV_MAX_Q_HEADS * 8 * 32];
  pkv_decode_args a = pu_decode_args(0, &s, 1, PKV_MAX_Q_HEADS, q, out, NULL);
  a.q_tokens = 8;
  assert_int_equal(pkv_decode(pool, &a), PKV_OK);
  /* 2^29 heads times 8 tokens is 2^32 rows: 0 in 32 bits. */
  const uint32_t bad[] = {PKV_MAX_Q_HEADS + 1, 1u << 29, UINT32_MAX};
  for (int i = 0; i < 3; i++) {
    a.q_heads = bad[i];
    pu_assert_fails(pkv_decode(pool, &a), PKV_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(pkv_last_error(), "q_heads"));
    pu_assert_fails(pkv_decode_prepare(pool, &a), PKV_ERR_INVALID_ARGUMENT);
  }
  pu_close(ctx, pool);
}

static void row_bytes_past_size_t(void **state) {
  (void)state;
  const size_t huge = ((size_t)1 << 62) + 1; /* times 4 wraps to 4 */
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_F32, huge), 0);
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_F16, SIZE_MAX / 2 + 1), 0);
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_F16, SIZE_MAX / 2), SIZE_MAX - 1);
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_F32, 3), 12);
  float x[1] = {0};
  uint8_t y[4] = {0};
  pu_assert_fails(pkv_convert_from_f32(PKV_FORMAT_F32, x, huge, y), PKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pkv_last_error(), "size_t"));
  pu_assert_fails(pkv_convert_to_f32(PKV_FORMAT_BF16, y, SIZE_MAX, x), PKV_ERR_INVALID_ARGUMENT);
}

static void read_bandwidth_past_the_host(void **state) {
  (void)state;
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  cd.backend = PKV_BACKEND_CPU;
  pkv_context *ctx;
  assert_int_equal(pkv_context_create(&cd, &ctx), PKV_OK);
  double gbs = -1.0;
  const uint64_t sizes[] = {UINT64_MAX, UINT64_MAX - 15, (uint64_t)1 << 62, ((uint64_t)1 << 48) + 1};
  for (int i = 0; i < 4; i++) {
    pu_assert_fails(pkv_context_read_bandwidth(ctx, sizes[i], &gbs), PKV_ERR_OUT_OF_MEMORY);
    assert_true(gbs == -1.0);
  }
  assert_int_equal(pkv_context_destroy(ctx), PKV_OK);
}

static void append_truncate_cycles(void **state) {
  (void)state;
  const pkv_pool_desc d = pu_desc(1, 1, 32, 1, 16, 4, PKV_FORMAT_F32, PKV_FORMAT_F32);
  pkv_context *ctx;
  pkv_pool *pool;
  pu_open(&d, &ctx, &pool);
  pkv_seq s;
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  const uint32_t n = 16; /* 16 pages, 16 page-table changes a cycle */
  enum { CYCLES = 20000 };
  const double t0 = now();
  for (int i = 0; i < CYCLES; i++) {
    if (pkv_append(pool, &s, &n, 1) != PKV_OK) fail_msg("cycle %d: %s", i, pkv_last_error());
    if (pkv_seq_truncate(pool, s, 0) != PKV_OK) fail_msg("cycle %d: %s", i, pkv_last_error());
  }
  const double took = now() - t0;
  print_message("    %d append/truncate cycles: %.3f s\n", CYCLES, took);
  if (took > 3.0) fail_msg("%d append/truncate cycles took %.1f s: the change queue grows quadratically", CYCLES, took);
  assert_int_equal(pu_length(pool, s), 0);
  /* The queued changes still reach the pages: a write and read after the cycles see the rows. */
  float k[16 * 32], v[16 * 32], back[16 * 32];
  for (int i = 0; i < 16 * 32; i++) k[i] = (float)i, v[i] = (float)-i;
  assert_int_equal(pkv_append(pool, &s, &n, 1), PKV_OK);
  assert_int_equal(pu_write(pool, 0, &s, &n, 1, PKV_FORMAT_F32, k, v), PKV_OK);
  assert_int_equal(pu_read(pool, 0, s, 0, 16, PKV_FORMAT_F32, back, NULL), PKV_OK);
  assert_memory_equal(back, k, sizeof k);
  pu_close(ctx, pool);
}

static void handles_of_live_pools_never_cross(void **state) {
  (void)state;
  const pkv_pool_desc d = small_desc();
  pkv_context *ctx;
  pkv_pool *first;
  pu_open(&d, &ctx, &first);
  pkv_seq a;
  assert_int_equal(pkv_seq_alloc(first, &a), PKV_OK);
  /* Enough pools made and destroyed for a 12-bit tag counter to come round to the first pool's. */
  for (int i = 0; i < 4100; i++) {
    pkv_pool *p;
    if (pkv_pool_create(ctx, &d, &p) != PKV_OK) fail_msg("pool %d: %s", i, pkv_last_error());
    pkv_seq b;
    assert_int_equal(pkv_seq_alloc(p, &b), PKV_OK);
    if (pkv_seq_free(p, a) != PKV_ERR_STALE_HANDLE)
      fail_msg("pool %d accepted a live handle of another pool (0x%016llx)", i, (unsigned long long)a.id);
    assert_int_equal(pkv_pool_destroy(p), PKV_OK);
  }
  assert_int_equal(pu_length(first, a), 0);
  pu_close(ctx, first);
}

/* Live pools at once: the 4096th is refused with a clear status, and room comes back with a destroy. */
static void live_pool_limit(void **state) {
  (void)state;
  const pkv_pool_desc d = pu_desc(1, 1, 32, 1, 1, 1, PKV_FORMAT_Q4_0, PKV_FORMAT_Q4_0);
  pkv_context *ctx;
  pkv_pool *first;
  pu_open(&d, &ctx, &first);
  enum { MORE = 4094 };
  pkv_pool **pools = calloc(MORE, sizeof *pools);
  assert_non_null(pools);
  for (int i = 0; i < MORE; i++)
    if (pkv_pool_create(ctx, &d, &pools[i]) != PKV_OK) fail_msg("pool %d: %s", i + 2, pkv_last_error());
  pkv_pool *none = NULL;
  pu_assert_fails(pkv_pool_create(ctx, &d, &none), PKV_ERR_UNSUPPORTED);
  assert_null(none);
  assert_non_null(strstr(pkv_last_error(), "4095 pools"));
  assert_int_equal(pkv_pool_destroy(pools[7]), PKV_OK);
  assert_int_equal(pkv_pool_create(ctx, &d, &pools[7]), PKV_OK);
  for (int i = 0; i < MORE; i++) assert_int_equal(pkv_pool_destroy(pools[i]), PKV_OK);
  free(pools);
  pu_close(ctx, first);
}

/* One sequence: token 0's logit is `gap` above every other token's (q . k with scale 1), every V
 * row 1.0, so the exact output is 1.0 in every element and lse = log(e^gap + n - 1), gap as the
 * page format stores it. F32 pages at head_dim 32 take a GPU's generic kernel, F16 and BF16 at 128
 * its tensor-core one (and the CUDA-core one where the tensor-core kernels are absent). Each must keep
 * float K's documented bound; F32 pages ten times tighter. */
static void dominant_token(uint32_t tokens, double gap, uint32_t chunk_pages, uint32_t head_dim, pkv_format format) {
  pkv_pool_desc d = pu_desc(1, 1, head_dim, 16, (tokens + 15) / 16, 1, format, format);
  pkv_context *ctx;
  pkv_pool *pool;
  pu_open(&d, &ctx, &pool);
  pkv_seq s;
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  assert_int_equal(pkv_append(pool, &s, &tokens, 1), PKV_OK);
  const size_t values = (size_t)tokens * head_dim;
  float *k = calloc(values, sizeof *k), *v = malloc(values * sizeof *v), *q = calloc(head_dim, sizeof *q),
        *out = malloc(head_dim * sizeof *out);
  assert_non_null(k);
  assert_non_null(v);
  assert_non_null(q);
  assert_non_null(out);
  for (size_t i = 0; i < values; i++) v[i] = 1.0f;
  k[0] = (float)gap;
  tu_round_trip(format, k, 1, k);
  gap = k[0];
  q[0] = 1.0f;
  assert_int_equal(pu_write(pool, 0, &s, &tokens, 1, PKV_FORMAT_F32, k, v), PKV_OK);
  float lse;
  pkv_decode_args a = pu_decode_args(0, &s, 1, 1, q, out, &lse);
  a.scale = 1.0f;
  a.chunk_pages = chunk_pages;
  assert_int_equal(pkv_decode(pool, &a), PKV_OK);
  double worst = 0.0;
  for (uint32_t i = 0; i < head_dim; i++) worst = fmax(worst, fabs(out[i] - 1.0));
  const double want_lse = gap + log1p((tokens - 1) * exp(-gap));
  print_message("    %s, head_dim %u, %u tokens, gap %.4f, chunk_pages %u: out error %.3g, lse error %.3g\n",
                pkv_format_name(format), head_dim, tokens, gap, chunk_pages, worst, fabs(lse - want_lse));
  const double bound = format == PKV_FORMAT_F32 ? 1e-5 : 1e-4;
  if (worst > bound) fail_msg("output off by %.3g from 1.0 (bound %.0e)", worst, bound);
  if (fabs(lse - want_lse) > 1e-4) fail_msg("lse %.7f, want %.7f", (double)lse, want_lse);
  free(k);
  free(v);
  free(q);
  free(out);
  pu_close(ctx, pool);
}

static void dominant_token_numerics(void **state) {
  (void)state;
  static const pkv_format formats[] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16};
  for (size_t f = 0; f < sizeof formats / sizeof *formats; f++) {
    const uint32_t head_dim = formats[f] == PKV_FORMAT_F32 ? 32 : 128;
    dominant_token(4096, 16.65, UINT32_MAX, head_dim, formats[f]);
    dominant_token(16384, 17.0, UINT32_MAX, head_dim, formats[f]);
    dominant_token(16384, 17.0, 0, head_dim, formats[f]);
    dominant_token(16384, 17.0, 4, head_dim, formats[f]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(batch_count_past_max_sequences), cmocka_unit_test(pool_too_large_for_the_host),
      cmocka_unit_test(q_heads_bound),                  cmocka_unit_test(row_bytes_past_size_t),
      cmocka_unit_test(read_bandwidth_past_the_host),   cmocka_unit_test(append_truncate_cycles),
      cmocka_unit_test(handles_of_live_pools_never_cross), cmocka_unit_test(live_pool_limit),
      cmocka_unit_test(dominant_token_numerics),
  };
  return tu_run_tests(tests, NULL, NULL);
}
