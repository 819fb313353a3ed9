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

#include <pthread.h>
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
  pkv_decode_args a = PKV_DECODE_ARGS_INIT;
  a.seqs = &w->seq;
  a.count = 1;
  a.q_heads = Q_HEADS;
  a.q = w->q;
  a.out = out;
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
    for (size_t i = 0; i < (size_t)LEN * HEAD_DIM * 2; i++) rows[i] = (float)tu_uniform(&rng, -2.0, 2.0);
    for (size_t i = 0; i < Q_HEADS * HEAD_DIM; i++) w[p].q[i] = (float)tu_uniform(&rng, -2.0, 2.0);
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
#if defined(__SANITIZE_ADDRESS__)
  skip(); /* AddressSanitizer's allocator stops the program on a 512 TiB request instead of failing it */
#endif
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

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(two_pools_two_threads),
                                     cmocka_unit_test(failed_pool_leaves_context_usable)};
  return tu_run_tests(tests, NULL, NULL);
}
