/* Sequence handles: the zero handle, use after free, double free, handles from other pools, generation
 * counting across slot reuse, running out of slots, destroying pools with live sequences, and the
 * status / last-error strings. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <stdlib.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

#define HD 32        /* head_dim; one layer, one KV head */
#define PAGE 4       /* tokens per page */
#define PAGES 16
#define MAX_ISSUED 8192

static tu_rng rng;
static const pkv_seq zero_handle = {0};

static void open_pool(uint32_t max_sequences, pkv_context **ctx, pkv_pool **pool) {
  pkv_pool_desc d = pu_desc(1, 1, HD, PAGE, PAGES, max_sequences, PKV_FORMAT_F32, PKV_FORMAT_F32);
  pu_open(&d, ctx, pool);
}

static void append1(pkv_pool *pool, pkv_seq s, uint32_t n) {
  assert_int_equal(pkv_append(pool, &s, &n, 1), PKV_OK);
}

/* A sequence of n tokens with random K/V rows. */
static pkv_seq new_live(pkv_pool *pool, uint32_t n) {
  pkv_seq s;
  float k[HD * 8], v[HD * 8];
  assert_true(n >= 1 && n <= 8);
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  assert_true(s.id != 0);
  append1(pool, s, n);
  tu_fill_uniform(&rng, k, (size_t)n * HD, -1.0, 1.0);
  tu_fill_uniform(&rng, v, (size_t)n * HD, -1.0, 1.0);
  assert_int_equal(pu_write(pool, 0, &s, &n, 1, PKV_FORMAT_F32, k, v), PKV_OK);
  return s;
}

static void read_last_row(pkv_pool *pool, pkv_seq s, float *k, float *v) {
  assert_int_equal(pu_read(pool, 0, s, pu_length(pool, s) - 1, 1, PKV_FORMAT_F32, k, v), PKV_OK);
}

/* Every call that takes a handle rejects `bad` with PKV_ERR_STALE_HANDLE, also in a batch next to the
 * live sequence `live` (length >= 1, pages not shared), and nothing changes: stats, live's length,
 * live's newest row. */
static void check_stale_everywhere(pkv_pool *pool, pkv_seq bad, pkv_seq live) {
  const pkv_pool_stats before = pu_stats(pool);
  const uint32_t live_len = pu_length(pool, live);
  float k0[HD], v0[HD], k1[HD], v1[HD], rows[4 * HD], q[HD], out[HD];
  read_last_row(pool, live, k0, v0);
  tu_fill_uniform(&rng, rows, 4 * HD, -1.0, 1.0);
  tu_fill_uniform(&rng, q, HD, -1.0, 1.0);

  uint32_t len = 0, one[2] = {1, 1};
  pkv_seq child = {0}, pairs[2][2] = {{live, bad}, {bad, live}};
  pu_assert_fails(pkv_seq_length(pool, bad, &len), PKV_ERR_STALE_HANDLE);
  pu_assert_fails(pkv_seq_truncate(pool, bad, 0), PKV_ERR_STALE_HANDLE);
  pu_assert_fails(pkv_seq_fork(pool, bad, &child), PKV_ERR_STALE_HANDLE);
  pu_assert_fails(pkv_append(pool, &bad, one, 1), PKV_ERR_STALE_HANDLE);
  pu_assert_fails(pu_write(pool, 0, &bad, one, 1, PKV_FORMAT_F32, rows, rows + HD), PKV_ERR_STALE_HANDLE);
  for (int p = 0; p < 2; p++) {
    pu_assert_fails(pkv_append(pool, pairs[p], one, 2), PKV_ERR_STALE_HANDLE);
    pu_assert_fails(pu_write(pool, 0, pairs[p], one, 2, PKV_FORMAT_F32, rows, rows + 2 * HD), PKV_ERR_STALE_HANDLE);
  }
  pu_assert_fails(pu_read(pool, 0, bad, 0, 1, PKV_FORMAT_F32, out, NULL), PKV_ERR_STALE_HANDLE);
  const pkv_decode_args a = pu_decode_args(0, &bad, 1, 1, q, out, NULL);
  pu_assert_fails(pkv_decode(pool, &a), PKV_ERR_STALE_HANDLE);
  pu_assert_fails(pkv_seq_free(pool, bad), PKV_ERR_STALE_HANDLE);

  const pkv_pool_stats after = pu_stats(pool);
  pu_assert_stats_equal(&after, &before);
  assert_int_equal(pu_length(pool, live), live_len);
  read_last_row(pool, live, k1, v1);
  assert_memory_equal(k1, k0, sizeof k0);
  assert_memory_equal(v1, v0, sizeof v0);
}

static void test_zero_handle(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(4, &ctx, &pool);
  pkv_seq live = new_live(pool, 5);
  check_stale_everywhere(pool, zero_handle, live);
  pu_close(ctx, pool);
}

static void test_use_after_free(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(4, &ctx, &pool);
  pkv_seq live = new_live(pool, 3), s = new_live(pool, 6);
  const uint32_t free_before = pu_stats(pool).pages_free;
  assert_int_equal(pkv_seq_free(pool, s), PKV_OK);
  assert_int_equal(pu_stats(pool).pages_free, free_before + 2); /* 6 tokens held 2 pages */
  check_stale_everywhere(pool, s, live);                      /* includes a double free */

  /* The same after the slot is taken again. */
  pkv_seq again = new_live(pool, 2);
  assert_true(again.id != s.id);
  check_stale_everywhere(pool, s, again);
  check_stale_everywhere(pool, s, live);
  pu_close(ctx, pool);
}

static void test_handle_from_another_pool(void **state) {
  (void)state;
  pkv_context *ctx, *ctx2;
  pkv_pool *a_pool, *b_pool, *c_pool;
  open_pool(4, &ctx, &a_pool);
  pkv_pool_desc d = pu_desc(1, 1, HD, PAGE, PAGES, 4, PKV_FORMAT_F32, PKV_FORMAT_F32);
  assert_int_equal(pkv_pool_create(ctx, &d, &b_pool), PKV_OK);
  pu_open(&d, &ctx2, &c_pool); /* another context too */

  /* Each pool's first sequence probably sits in the same slot with the same generation. */
  pkv_seq a = new_live(a_pool, 3), b = new_live(b_pool, 7), c = new_live(c_pool, 2);
  check_stale_everywhere(b_pool, a, b);
  check_stale_everywhere(a_pool, b, a);
  check_stale_everywhere(c_pool, a, c);
  check_stale_everywhere(a_pool, c, a);

  assert_int_equal(pkv_pool_destroy(b_pool), PKV_OK);
  pu_close(ctx2, c_pool);
  pu_close(ctx, a_pool);
}

static int cmp_u64(const void *x, const void *y) {
  uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
  return a < b ? -1 : a > b;
}

static void assert_all_distinct(uint64_t *ids, size_t n) {
  qsort(ids, n, sizeof ids[0], cmp_u64);
  for (size_t i = 1; i < n; i++) assert_true(ids[i] != ids[i - 1]);
}

static void assert_stale(pkv_pool *pool, pkv_seq s) {
  uint32_t len;
  pu_assert_fails(pkv_seq_length(pool, s, &len), PKV_ERR_STALE_HANDLE);
}

/* One slot, reused thousands of times: every handle is new, old ones stay stale, and a stale handle
 * never reaches the slot's current sequence. */
static void test_slot_reuse_one_slot(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(1, &ctx, &pool);
  static uint64_t issued[MAX_ISSUED];
  const size_t cycles = 3000;
  for (size_t i = 0; i < cycles; i++) {
    pkv_seq s;
    assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
    assert_true(s.id != 0);
    assert_int_equal(pu_length(pool, s), 0); /* a reused slot starts empty */
    uint32_t n = tu_below(&rng, 7);
    if (n) append1(pool, s, n);
    if (i > 0) {
      pkv_seq prev = {issued[i - 1]}, older = {issued[tu_below(&rng, (uint32_t)i)]};
      assert_true(s.id != prev.id && s.id != older.id);
      assert_stale(pool, prev);
      assert_stale(pool, older);
      pu_assert_fails(pkv_seq_free(pool, older), PKV_ERR_STALE_HANDLE);
      pu_assert_fails(pkv_seq_truncate(pool, prev, 0), PKV_ERR_STALE_HANDLE);
      assert_int_equal(pu_length(pool, s), n); /* untouched by the stale calls */
    }
    issued[i] = s.id;
    assert_int_equal(pkv_seq_free(pool, s), PKV_OK);
  }
  for (size_t i = 0; i < cycles; i++) assert_stale(pool, (pkv_seq){issued[i]});
  const pkv_pool_stats st = pu_stats(pool);
  assert_int_equal(st.sequences_live, 0);
  assert_int_equal(st.pages_free, PAGES);
  assert_all_distinct(issued, cycles);
  pu_close(ctx, pool);
}

/* Two slots, random alloc / fork / append / free: live handles keep working with the right lengths,
 * retired ones stay stale, and no handle is ever issued twice. */
static void test_slot_reuse_two_slots(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(2, &ctx, &pool);
  static uint64_t issued[MAX_ISSUED];
  size_t n_issued = 0;
  pkv_seq live[2];
  uint32_t len[2], n_live = 0;
  for (int step = 0; step < 4000; step++) {
    uint32_t op = n_live == 0 ? 0 : tu_below(&rng, 4);
    pkv_seq s;
    if (op == 0 && n_live < 2) { /* alloc */
      assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
      len[n_live] = 0;
    } else if (op == 1 && n_live < 2) { /* fork */
      uint32_t p = tu_below(&rng, n_live);
      assert_int_equal(pkv_seq_fork(pool, live[p], &s), PKV_OK);
      len[n_live] = len[p];
    } else if (op == 2) { /* append a little while the pool has room */
      uint32_t i = tu_below(&rng, n_live), n = 1 + tu_below(&rng, 3);
      uint32_t st = pu_stats(pool).pages_free;
      if (st >= 4 && len[i] + n <= 16) {
        append1(pool, live[i], n);
        len[i] += n;
      }
      continue;
    } else { /* free */
      uint32_t i = tu_below(&rng, n_live);
      assert_int_equal(pkv_seq_free(pool, live[i]), PKV_OK);
      live[i] = live[n_live - 1];
      len[i] = len[n_live - 1];
      n_live--;
      continue;
    }
    assert_true(s.id != 0);
    for (uint32_t i = 0; i < n_live; i++) assert_true(s.id != live[i].id);
    live[n_live++] = s;
    assert_true(n_issued < MAX_ISSUED);
    issued[n_issued++] = s.id;

    /* a retired handle changes nothing */
    pkv_seq old = {issued[tu_below(&rng, (uint32_t)n_issued)]};
    int is_live = 0;
    for (uint32_t i = 0; i < n_live; i++) is_live |= old.id == live[i].id;
    if (!is_live) {
      assert_stale(pool, old);
      pu_assert_fails(pkv_seq_free(pool, old), PKV_ERR_STALE_HANDLE);
    }
    assert_int_equal(pu_stats(pool).sequences_live, n_live);
    for (uint32_t i = 0; i < n_live; i++) assert_int_equal(pu_length(pool, live[i]), len[i]);
  }
  assert_all_distinct(issued, n_issued);
  pu_close(ctx, pool);
}

/* With every slot live, alloc and fork fail with PKV_ERR_OUT_OF_SEQUENCES and change nothing. */
static void test_out_of_sequences(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(3, &ctx, &pool);
  pkv_seq a = new_live(pool, 6), b, c, extra;
  assert_int_equal(pkv_seq_alloc(pool, &b), PKV_OK);
  assert_int_equal(pkv_seq_fork(pool, a, &c), PKV_OK);

  for (int round = 0; round < 2; round++) {
    const pkv_pool_stats before = pu_stats(pool);
    assert_int_equal(before.sequences_live, 3);
    pu_assert_fails(pkv_seq_alloc(pool, &extra), PKV_ERR_OUT_OF_SEQUENCES);
    pu_assert_fails(pkv_seq_fork(pool, a, &extra), PKV_ERR_OUT_OF_SEQUENCES);
    pu_assert_fails(pkv_seq_fork(pool, c, &extra), PKV_ERR_OUT_OF_SEQUENCES);
    pu_assert_fails(pkv_seq_fork(pool, b, &extra), PKV_ERR_OUT_OF_SEQUENCES);
    const pkv_pool_stats after = pu_stats(pool);
    pu_assert_stats_equal(&after, &before);
    assert_int_equal(pu_length(pool, a), 6);
    assert_int_equal(pu_length(pool, c), 6);
    assert_int_equal(pu_length(pool, b), 0);

    /* a freed slot makes room for exactly one more */
    assert_int_equal(pkv_seq_free(pool, b), PKV_OK);
    if (round == 0) {
      assert_int_equal(pkv_seq_alloc(pool, &b), PKV_OK);
    } else {
      assert_int_equal(pkv_seq_fork(pool, a, &b), PKV_OK);
      const pkv_pool_stats forked = pu_stats(pool);
      assert_int_equal(forked.pages_free, after.pages_free); /* a fork takes no pages */
      assert_int_equal(forked.pages_shared, 2);
      assert_int_equal(pu_length(pool, b), 6);
    }
  }
  pu_assert_fails(pkv_seq_alloc(pool, &extra), PKV_ERR_OUT_OF_SEQUENCES);
  pu_close(ctx, pool);
}

/* A pool with live sequences, forks and pages in use can be destroyed (not its context first), and its
 * handles are stale in a pool created afterwards. */
static void test_destroy_with_live_sequences(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(8, &ctx, &pool);
  pkv_seq old[4];
  old[0] = new_live(pool, 5);
  old[1] = new_live(pool, 8);
  assert_int_equal(pkv_seq_fork(pool, old[0], &old[2]), PKV_OK);
  assert_int_equal(pkv_seq_alloc(pool, &old[3]), PKV_OK);

  pu_assert_fails(pkv_context_destroy(ctx), PKV_ERR_INVALID_ARGUMENT); /* it has a live pool */
  assert_int_equal(pu_length(pool, old[1]), 8);
  assert_int_equal(pkv_pool_destroy(pool), PKV_OK);
  assert_int_equal(pkv_pool_destroy(NULL), PKV_OK);

  pkv_pool_desc d = pu_desc(1, 1, HD, PAGE, PAGES, 8, PKV_FORMAT_F32, PKV_FORMAT_F32);
  assert_int_equal(pkv_pool_create(ctx, &d, &pool), PKV_OK);
  pkv_seq fresh[4];
  for (int i = 0; i < 4; i++) fresh[i] = new_live(pool, 1 + (uint32_t)i);
  for (int i = 0; i < 4; i++) check_stale_everywhere(pool, old[i], fresh[tu_below(&rng, 4)]);
  pu_close(ctx, pool);
  assert_int_equal(pkv_context_destroy(NULL), PKV_OK);
}

static void assert_no_error(void) {
  const char *e = pkv_last_error();
  assert_non_null(e);
  assert_string_equal(e, "");
}

/* pkv_last_error: a detail after each failure, empty after each success. */
static void test_last_error(void **state) {
  (void)state;
  pkv_context *ctx;
  pkv_pool *pool;
  open_pool(2, &ctx, &pool);
  uint32_t len, n = 3;
  pkv_seq s, c;
  pkv_pool_stats st = PKV_POOL_STATS_INIT;
  float x[32], y[32];
  tu_fill_uniform(&rng, x, 32, -1.0, 1.0);
#define FAIL_THEN(call)                                                                                  \
  do {                                                                                                   \
    pu_assert_fails(pkv_seq_length(pool, zero_handle, &len), PKV_ERR_STALE_HANDLE);                      \
    assert_int_equal(call, PKV_OK);                                                                      \
    assert_no_error();                                                                                   \
  } while (0)
  FAIL_THEN(pkv_seq_alloc(pool, &s));
  FAIL_THEN(pkv_append(pool, &s, &n, 1));
  FAIL_THEN(pkv_seq_length(pool, s, &len));
  FAIL_THEN(pkv_seq_fork(pool, s, &c));
  FAIL_THEN(pkv_seq_truncate(pool, c, 1));
  FAIL_THEN(pkv_pool_get_stats(pool, &st));
  FAIL_THEN(pkv_convert_from_f32(PKV_FORMAT_F16, x, 32, y));
  FAIL_THEN(pkv_seq_free(pool, c));
#undef FAIL_THEN
  pu_close(ctx, pool);
}

/* Every status has its own non-empty name; unknown values get a name of their own too. */
static void test_status_strings(void **state) {
  (void)state;
  const int n = PKV_ERR_INTERNAL + 1;
  for (int i = 0; i < n; i++) {
    const char *a = pkv_status_string((pkv_status)i);
    assert_non_null(a);
    assert_true(strlen(a) > 0);
    for (int j = 0; j < i; j++) assert_true(strcmp(a, pkv_status_string((pkv_status)j)) != 0);
  }
  const pkv_status unknown[] = {(pkv_status)(PKV_ERR_INTERNAL + 1), (pkv_status)1000, PKV_STATUS_MAX_};
  for (size_t u = 0; u < sizeof unknown / sizeof unknown[0]; u++) {
    const char *a = pkv_status_string(unknown[u]);
    assert_non_null(a);
    assert_true(strlen(a) > 0);
    for (int j = 0; j < n; j++) assert_true(strcmp(a, pkv_status_string((pkv_status)j)) != 0);
  }
}

int main(void) {
  rng = tu_rng_make(tu_seed());
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_zero_handle),
      cmocka_unit_test(test_use_after_free),
      cmocka_unit_test(test_handle_from_another_pool),
      cmocka_unit_test(test_slot_reuse_one_slot),
      cmocka_unit_test(test_slot_reuse_two_slots),
      cmocka_unit_test(test_out_of_sequences),
      cmocka_unit_test(test_destroy_with_live_sequences),
      cmocka_unit_test(test_last_error),
      cmocka_unit_test(test_status_strings),
  };
  return tu_run_tests(tests, NULL, NULL);
}
