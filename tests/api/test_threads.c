/* The context's lock, which its pools' backend calls take (they share its backend: buffers, worker
 * threads, stream).
 * - Two pools of one context, used from two threads at once: each thread decodes its own pool over
 *   and over, and every result must be bit-identical to the one its pool gave before the other
 *   thread started (decode is deterministic). The shapes make each decode a single work item (one
 *   KV head, one chunk), which the CPU backend runs on the calling thread.
 * - A pool the backend cannot allocate: the failure must leave the lock free, so that the context
 *   still serves another pool (a held lock would hang this test). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

enum { HEAD_DIM = 64, Q_HEADS = 4, LEN = 200, ROUNDS = 2000 };

typedef struct worker {
  pkv_pool *pool;
  pkv_seq seq;
  float q[Q_HEADS * HEAD_DIM], want[Q_HEADS * HEAD_DIM];
  int mismatches; /* written by the worker's thread only */
  pkv_status failed;
} worker;

static void decode(worker *w, float *out) {
  const pkv_decode_args a = pu_decode_args(0, &w->seq, 1, Q_HEADS, w->q, out, NULL);
  const pkv_status st = pkv_decode(w->pool, &a);
  if (st != PKV_OK) w->failed = st;
}

static void *run(void *arg) {
  worker *w = arg;
  float out[Q_HEADS * HEAD_DIM];
  for (int i = 0; i < ROUNDS && w->failed == PKV_OK; i++) {
    memset(out, 0xff, sizeof out); /* NaN: a decode that writes nothing cannot pass */
    decode(w, out);
    if (memcmp(out, w->want, sizeof out) != 0) w->mismatches++;
  }
  return NULL;
}

static void two_pools_two_threads(void **state) {
  (void)state;
  tu_rng rng = tu_rng_make(tu_seed());
  pkv_pool_desc d = pu_desc(1, 1, HEAD_DIM, 16, LEN / 16 + 2, 1, PKV_FORMAT_F16, PKV_FORMAT_F16);
  pkv_context *ctx;
  worker w[2];
  memset(w, 0, sizeof w);
  pu_open(&d, &ctx, &w[0].pool);
  assert_int_equal(pkv_pool_create(ctx, &d, &w[1].pool), PKV_OK);
  float *rows = malloc(sizeof(float) * LEN * HEAD_DIM * 2);
  assert_non_null(rows);
  const uint32_t len = LEN;
  for (int p = 0; p < 2; p++) {
    tu_fill_uniform(&rng, rows, (size_t)LEN * HEAD_DIM * 2, -2.0, 2.0);
    tu_fill_uniform(&rng, w[p].q, Q_HEADS * HEAD_DIM, -2.0, 2.0);
    assert_int_equal(pkv_seq_alloc(w[p].pool, &w[p].seq), PKV_OK);
    assert_int_equal(pkv_append(w[p].pool, &w[p].seq, &len, 1), PKV_OK);
    assert_int_equal(pu_write(w[p].pool, 0, &w[p].seq, &len, 1, PKV_FORMAT_F32, rows, rows + (size_t)LEN * HEAD_DIM),
                     PKV_OK);
    decode(&w[p], w[p].want);
    assert_int_equal(w[p].failed, PKV_OK);
  }
  free(rows);

  pthread_t threads[2];
  for (int p = 0; p < 2; p++) assert_int_equal(pthread_create(&threads[p], NULL, run, &w[p]), 0);
  for (int p = 0; p < 2; p++) assert_int_equal(pthread_join(threads[p], NULL), 0);
  for (int p = 0; p < 2; p++) {
    if (w[p].failed != PKV_OK) fail_msg("pool %d: a decode failed: %s", p, pkv_status_string(w[p].failed));
    if (w[p].mismatches) fail_msg("pool %d: %d of %d decodes differ from the one before the threads", p, w[p].mismatches, ROUNDS);
  }
  assert_int_equal(pkv_pool_destroy(w[1].pool), PKV_OK);
  pu_close(ctx, w[0].pool);
}

static void failed_pool_leaves_context_usable(void **state) {
  (void)state;
  pu_skip_under_asan("its allocator stops the program on a 512 TiB request instead of failing it");
  pkv_pool_desc huge = pu_desc(65536, 4096, 256, 1024, 1, 1, PKV_FORMAT_F32, PKV_FORMAT_F32); /* 8 GiB x 65536 */
  const pkv_pool_desc small = pu_desc(1, 1, HEAD_DIM, 16, 4, 1, PKV_FORMAT_F16, PKV_FORMAT_F16);
  pkv_context *ctx;
  pkv_pool *pool, *none = NULL;
  pu_open(&small, &ctx, &pool);
  pu_assert_fails(pkv_pool_create(ctx, &huge, &none), PKV_ERR_OUT_OF_MEMORY);
  assert_null(none);
  pkv_pool *other;
  assert_int_equal(pkv_pool_create(ctx, &small, &other), PKV_OK);
  assert_int_equal(pkv_context_synchronize(ctx), PKV_OK);
  assert_int_equal(pkv_pool_destroy(other), PKV_OK);
  pu_close(ctx, pool);
}

/* One pool, four threads, eight shared handle slots: each thread allocates into an empty slot,
 * forks, appends and writes, reads, decodes, truncates and frees whatever handle it finds in a slot,
 * its own or another thread's. A call on a handle another thread freed meanwhile must say
 * PKV_ERR_STALE_HANDLE; every other call succeeds or fails for a reason the test allows (no pages,
 * no slots, a page shared with a fork); every row read back is whole, one some thread wrote (each
 * writes rows of its own value) or zero.
 * Afterwards the pool's statistics agree with the sequences left. Under ThreadSanitizer (tools/tsan)
 * this is the test that shows a data race in the pool's bookkeeping. */
enum { SHARED_SLOTS = 8, THREADS = 4, STEPS = 4000, PAGE = 4, MANY_DIM = 32 };

typedef struct many {
  pkv_pool *pool;
  uint64_t slots[SHARED_SLOTS]; /* handles, 0 where none; taken and put with atomic exchanges */
  int bad;                      /* first unexpected status, or a wrong row */
  char why[256];
} many;

typedef struct many_thread {
  many *m;
  tu_rng rng; /* the thread's own stream of the run's seed */
  int value; /* 1..THREADS: every K element this thread writes; V gets its negative */
} many_thread;

static void many_fail(many *m, const char *what, pkv_status st) {
  if (__atomic_exchange_n(&m->bad, 1, __ATOMIC_SEQ_CST) == 0)
    snprintf(m->why, sizeof m->why, "%s: %s (%s)", what, pkv_status_string(st), pkv_last_error());
}

/* Statuses a racing call may get besides PKV_OK. */
static int allowed(pkv_status st) {
  return st == PKV_OK || st == PKV_ERR_STALE_HANDLE || st == PKV_ERR_OUT_OF_PAGES || st == PKV_ERR_OUT_OF_SEQUENCES ||
         st == PKV_ERR_INVALID_ARGUMENT;
}

static void *many_run(void *arg) {
  many_thread *t = arg;
  many *m = t->m;
  tu_rng r = t->rng;
  float k[16 * MANY_DIM], v[16 * MANY_DIM], q[2 * MANY_DIM], out[2 * MANY_DIM * 2 + 4];
  for (int step = 0; step < STEPS && !__atomic_load_n(&m->bad, __ATOMIC_SEQ_CST); step++) {
    const uint32_t i = tu_below(&r, SHARED_SLOTS);
    pkv_seq s = {__atomic_load_n(&m->slots[i], __ATOMIC_SEQ_CST)};
    pkv_status st = PKV_OK;
    const char *what = "";
    switch (tu_below(&r, 8)) {
    case 0: { /* alloc or fork into the slot if it is empty */
      pkv_seq n;
      const pkv_seq from = {__atomic_load_n(&m->slots[tu_below(&r, SHARED_SLOTS)], __ATOMIC_SEQ_CST)};
      what = from.id && tu_below(&r, 2) ? "fork" : "alloc";
      st = from.id && what[0] == 'f' ? pkv_seq_fork(m->pool, from, &n) : pkv_seq_alloc(m->pool, &n);
      if (st == PKV_OK) {
        uint64_t empty = 0;
        if (!__atomic_compare_exchange_n(&m->slots[i], &empty, n.id, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
          st = pkv_seq_free(m->pool, n); /* the slot filled meanwhile */
      }
      break;
    }
    case 1: /* free whatever is in the slot, taking it out first */
      what = "free";
      s.id = __atomic_exchange_n(&m->slots[i], 0, __ATOMIC_SEQ_CST);
      if (s.id) st = pkv_seq_free(m->pool, s);
      if (s.id && st != PKV_OK) many_fail(m, "free of a handle taken out of its slot", st);
      break;
    case 2: {
      const uint32_t n = 1 + tu_below(&r, 9);
      what = "append and write";
      st = pkv_append(m->pool, &s, &n, 1);
      if (st != PKV_OK) break;
      /* Another thread may append or truncate before the write lands, so the rows' positions are
       * not known here: every row this thread writes holds its own value. */
      for (int e = 0; e < (int)n * MANY_DIM; e++) {
        k[e] = (float)t->value;
        v[e] = -(float)t->value;
      }
      st = pu_write(m->pool, 0, &s, &n, 1, PKV_FORMAT_F32, k, v);
      break;
    }
    case 3: {
      uint32_t len = 0;
      what = "read";
      if ((st = pkv_seq_length(m->pool, s, &len)) != PKV_OK || len == 0) break;
      const uint32_t count = len < 16 ? len : 16;
      st = pu_read(m->pool, 0, s, len - count, count, PKV_FORMAT_F32, k, v);
      for (uint32_t row = 0; st == PKV_OK && row < count; row++)
        for (int e = 0; e < MANY_DIM; e++) {
          const float x = k[row * MANY_DIM + e];
          if (x != floorf(x) || x < 0.0f || x > THREADS || v[row * MANY_DIM + e] != -x || x != k[row * MANY_DIM])
            many_fail(m, "a row read back is none any thread wrote", PKV_OK);
        }
      break;
    }
    case 4: {
      const pkv_decode_args a = pu_decode_args(0, &s, 1, 2, q, out, out + 2 * MANY_DIM);
      for (int e = 0; e < 2 * MANY_DIM; e++) q[e] = 0.5f;
      what = "decode";
      st = pkv_decode(m->pool, &a);
      break;
    }
    case 5:
      what = "truncate";
      st = pkv_seq_truncate(m->pool, s, tu_below(&r, 6));
      break;
    default: {
      pkv_pool_stats ps = PKV_POOL_STATS_INIT;
      what = "stats";
      st = pkv_pool_get_stats(m->pool, &ps);
      if (st == PKV_OK && ps.pages_free > ps.pages_total) many_fail(m, "more pages free than the pool has", st);
      break;
    }
    }
    if (!allowed(st)) many_fail(m, what, st);
    if (st == PKV_ERR_STALE_HANDLE && !pkv_last_error()[0]) many_fail(m, "a stale handle with no text", st);
  }
  return NULL;
}

static void one_pool_many_threads(void **state) {
  (void)state;
  const pkv_pool_desc d = pu_desc(1, 1, MANY_DIM, PAGE, 40, SHARED_SLOTS + 2, PKV_FORMAT_F32, PKV_FORMAT_F32);
  pkv_context *ctx;
  static many m;
  memset(&m, 0, sizeof m);
  pu_open(&d, &ctx, &m.pool);
  const uint64_t seed = tu_seed();
  pthread_t threads[THREADS];
  many_thread args[THREADS];
  for (int i = 0; i < THREADS; i++) {
    args[i].m = &m;
    args[i].rng = tu_rng_stream(seed, (uint64_t)i);
    args[i].value = i + 1;
    assert_int_equal(pthread_create(&threads[i], NULL, many_run, &args[i]), 0);
  }
  for (int i = 0; i < THREADS; i++) assert_int_equal(pthread_join(threads[i], NULL), 0);
  if (m.bad) fail_msg("%s", m.why);
  /* What is left: the statistics count exactly the sequences in the slots. */
  uint64_t tokens = 0;
  uint32_t live = 0;
  for (int i = 0; i < SHARED_SLOTS; i++) {
    const pkv_seq s = {m.slots[i]};
    if (!s.id) continue;
    tokens += pu_length(m.pool, s);
    live++;
  }
  const pkv_pool_stats st = pu_stats(m.pool);
  assert_int_equal(st.sequences_live, live);
  assert_int_equal(st.tokens_live, tokens);
  for (int i = 0; i < SHARED_SLOTS; i++)
    if (m.slots[i]) assert_int_equal(pkv_seq_free(m.pool, (pkv_seq){m.slots[i]}), PKV_OK);
  const pkv_pool_stats empty = pu_stats(m.pool);
  assert_int_equal(empty.pages_free, empty.pages_total);
  assert_int_equal(empty.tokens_live, 0);
  pu_close(ctx, m.pool);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(two_pools_two_threads),
                                     cmocka_unit_test(failed_pool_leaves_context_usable),
                                     cmocka_unit_test(one_pool_many_threads)};
  return tu_run_tests(tests, NULL, NULL);
}
