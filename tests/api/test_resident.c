/* Resident K/V over many engine steps: one pool keeps its pages across hundreds of steps while
 * sequences grow, fork, roll back, finish and are replaced (so freed pages are reused), and only
 * each step's new rows are written. A second pool is rebuilt from the full history every step. Both
 * decode the same queries: the outputs must be bit-identical, so a stale page, a missed page-table
 * update or two sequences aliasing one page cannot hide. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

enum { LAYERS = 2, KV_HEADS = 2, Q_HEADS = 8, HEAD_DIM = 64, PAGE = 8, MAX_LIVE = 16, MAX_LEN = 256 };
enum { ROW = KV_HEADS * HEAD_DIM, STEPS = 150 };

typedef struct history {
  int live;
  pkv_seq seq;     /* in the resident pool */
  uint32_t length; /* tokens with K/V */
  float *k, *v;    /* [LAYERS][MAX_LEN][ROW] */
} history;

static tu_rng rng;
static history live[MAX_LIVE];

static float *row_at(float *base, uint32_t layer, uint32_t pos) {
  return base + ((size_t)layer * MAX_LEN + pos) * ROW;
}

static void random_rows(float *dst, size_t n) { tu_fill_uniform(&rng, dst, n, -2.0, 2.0); }

static int pick_live(void) {
  int n = 0, idx[MAX_LIVE];
  for (int i = 0; i < MAX_LIVE; i++)
    if (live[i].live) idx[n++] = i;
  return n ? idx[tu_below(&rng, (uint32_t)n)] : -1;
}

static int free_slot(void) {
  for (int i = 0; i < MAX_LIVE; i++)
    if (!live[i].live) return i;
  return -1;
}

static void open_history(int i) {
  live[i].live = 1;
  live[i].length = 0;
  live[i].k = malloc(sizeof(float) * LAYERS * MAX_LEN * ROW);
  live[i].v = malloc(sizeof(float) * LAYERS * MAX_LEN * ROW);
  assert_non_null(live[i].k);
  assert_non_null(live[i].v);
}

static void close_history(int i) {
  free(live[i].k);
  free(live[i].v);
  memset(&live[i], 0, sizeof live[i]);
}

/* Sequences finish, fork and roll back in the resident pool; the model follows. */
static void churn(pkv_pool *pool) {
  if (tu_below(&rng, 4) == 0) { /* a sequence finishes */
    const int i = pick_live();
    if (i >= 0) {
      CHECK_OK(pkv_seq_free(pool, live[i].seq));
      close_history(i);
    }
  }
  if (tu_below(&rng, 6) == 0) { /* a fork: shares the parent's pages */
    const int parent = pick_live(), child = free_slot();
    if (parent >= 0 && child >= 0) {
      open_history(child);
      CHECK_OK(pkv_seq_fork(pool, live[parent].seq, &live[child].seq));
      live[child].length = live[parent].length;
      memcpy(live[child].k, live[parent].k, sizeof(float) * LAYERS * MAX_LEN * ROW);
      memcpy(live[child].v, live[parent].v, sizeof(float) * LAYERS * MAX_LEN * ROW);
    }
  }
  if (tu_below(&rng, 5) == 0) { /* rejected speculative tokens */
    const int i = pick_live();
    if (i >= 0 && live[i].length > 0) {
      live[i].length -= tu_below(&rng, live[i].length < 6 ? live[i].length + 1 : 6);
      CHECK_OK(pkv_seq_truncate(pool, live[i].seq, live[i].length));
    }
  }
  for (int n = 0; n < 2; n++) { /* new requests take the free slots (and the pages just freed) */
    const int i = free_slot();
    if (i < 0 || tu_below(&rng, 2)) continue;
    open_history(i);
    CHECK_OK(pkv_seq_alloc(pool, &live[i].seq));
  }
}

/* The batch of this step: every live sequence, with 0..4 new tokens (a prefill chunk now and then). */
static uint32_t grow(pkv_pool *pool, int *idx, pkv_seq *seqs, uint32_t *n_new) {
  uint32_t count = 0;
  for (int i = 0; i < MAX_LIVE; i++) {
    if (!live[i].live) continue;
    uint32_t n = tu_below(&rng, 8) == 0 ? 1 + tu_below(&rng, 40) : tu_below(&rng, 5);
    if (live[i].length + n > MAX_LEN) n = 0;
    idx[count] = i;
    seqs[count] = live[i].seq;
    n_new[count++] = n;
  }
  CHECK_OK(pkv_append(pool, seqs, n_new, count));
  return count;
}

static void write_new_rows(pkv_pool *pool, const int *idx, const pkv_seq *seqs, const uint32_t *n_new,
                           uint32_t count, float *k, float *v) {
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    size_t rows = 0;
    for (uint32_t b = 0; b < count; b++) {
      history *h = &live[idx[b]];
      for (uint32_t t = 0; t < n_new[b]; t++, rows++) {
        random_rows(row_at(h->k, layer, h->length + t), ROW);
        random_rows(row_at(h->v, layer, h->length + t), ROW);
        memcpy(k + rows * ROW, row_at(h->k, layer, h->length + t), sizeof(float) * ROW);
        memcpy(v + rows * ROW, row_at(h->v, layer, h->length + t), sizeof(float) * ROW);
      }
    }
    CHECK_OK(pu_write(pool, layer, seqs, n_new, count, PKV_FORMAT_F32, k, v));
  }
  for (uint32_t b = 0; b < count; b++) live[idx[b]].length += n_new[b];
}

/* The reference: a pool emptied and refilled with every sequence's whole history. */
static void rebuild(pkv_pool *ref, pkv_seq *ref_seqs, uint32_t *ref_count, const int *idx, uint32_t count, float *k,
                    float *v) {
  for (uint32_t b = 0; b < *ref_count; b++) CHECK_OK(pkv_seq_free(ref, ref_seqs[b]));
  uint32_t len[MAX_LIVE];
  for (uint32_t b = 0; b < count; b++) {
    CHECK_OK(pkv_seq_alloc(ref, &ref_seqs[b]));
    len[b] = live[idx[b]].length;
  }
  *ref_count = count;
  CHECK_OK(pkv_append(ref, ref_seqs, len, count));
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    size_t rows = 0;
    for (uint32_t b = 0; b < count; b++) {
      memcpy(k + rows * ROW, row_at(live[idx[b]].k, layer, 0), sizeof(float) * len[b] * ROW);
      memcpy(v + rows * ROW, row_at(live[idx[b]].v, layer, 0), sizeof(float) * len[b] * ROW);
      rows += len[b];
    }
    CHECK_OK(pu_write(ref, layer, ref_seqs, len, count, PKV_FORMAT_F32, k, v));
  }
}

static void decode(pkv_pool *pool, uint32_t layer, const pkv_seq *seqs, uint32_t count, const float *q, float *out,
                   float *lse) {
  for (size_t i = 0; i < (size_t)count * Q_HEADS * HEAD_DIM; i++) out[i] = NAN;
  for (size_t i = 0; i < (size_t)count * Q_HEADS; i++) lse[i] = NAN;
  const pkv_decode_args a = pu_decode_args(layer, seqs, count, Q_HEADS, q, out, lse);
  CHECK_OK(pkv_decode(pool, &a));
}

static void run(pkv_format k_format, pkv_format v_format) {
  rng = tu_rng_make(tu_seed());
  pkv_pool_desc d = pu_desc(LAYERS, KV_HEADS, HEAD_DIM, PAGE, MAX_LIVE * MAX_LEN / PAGE + 8, MAX_LIVE, k_format, v_format);
  d.page_order_seed = (uint32_t)tu_next(&rng) | 1u;
  d.max_sequence_length = MAX_LEN;
  pkv_context *ctx;
  pkv_pool *pool, *ref;
  pu_open(&d, &ctx, &pool);
  d.page_order_seed = 0;
  CHECK_OK(pkv_pool_create(ctx, &d, &ref));

  const size_t max_rows = (size_t)MAX_LIVE * MAX_LEN;
  float *k = malloc(sizeof(float) * max_rows * ROW), *v = malloc(sizeof(float) * max_rows * ROW);
  float *q = malloc(sizeof(float) * MAX_LIVE * Q_HEADS * HEAD_DIM);
  float *out = malloc(sizeof(float) * MAX_LIVE * Q_HEADS * HEAD_DIM), *ref_out = malloc(sizeof(float) * MAX_LIVE * Q_HEADS * HEAD_DIM);
  float lse[MAX_LIVE * Q_HEADS], ref_lse[MAX_LIVE * Q_HEADS];
  assert_true(k && v && q && out && ref_out);
  memset(live, 0, sizeof live);
  pkv_seq ref_seqs[MAX_LIVE];
  uint32_t ref_count = 0, steps_with_work = 0;

  for (int step = 0; step < STEPS; step++) {
    churn(pool);
    int idx[MAX_LIVE];
    pkv_seq seqs[MAX_LIVE];
    uint32_t n_new[MAX_LIVE];
    const uint32_t count = grow(pool, idx, seqs, n_new);
    write_new_rows(pool, idx, seqs, n_new, count, k, v);
    if (count == 0) continue;
    rebuild(ref, ref_seqs, &ref_count, idx, count, k, v);
    random_rows(q, (size_t)count * Q_HEADS * HEAD_DIM);
    const uint32_t layer = (uint32_t)step % LAYERS;
    decode(pool, layer, seqs, count, q, out, lse);
    decode(ref, layer, ref_seqs, count, q, ref_out, ref_lse);
    for (uint32_t b = 0; b < count; b++) {
      if (memcmp(out + (size_t)b * Q_HEADS * HEAD_DIM, ref_out + (size_t)b * Q_HEADS * HEAD_DIM,
                 sizeof(float) * Q_HEADS * HEAD_DIM) != 0 ||
          memcmp(lse + b * Q_HEADS, ref_lse + b * Q_HEADS, sizeof(float) * Q_HEADS) != 0)
        fail_msg("step %d, layer %u, sequence %u (length %u): resident pool and rebuilt pool disagree", step, layer, b,
                 live[idx[b]].length);
    }
    steps_with_work++;
  }
  assert_true(steps_with_work > STEPS / 2);

  for (int i = 0; i < MAX_LIVE; i++)
    if (live[i].live) close_history(i);
  free(k);
  free(v);
  free(q);
  free(out);
  free(ref_out);
  CHECK_OK(pkv_pool_destroy(ref));
  pu_close(ctx, pool);
}

static void resident_f16(void **state) {
  (void)state;
  run(PKV_FORMAT_F16, PKV_FORMAT_F16);
}

static void resident_q8_q4(void **state) {
  (void)state;
  run(PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(resident_f16),
      cmocka_unit_test(resident_q8_q4),
  };
  return tu_run_tests(tests, NULL, NULL);
}
