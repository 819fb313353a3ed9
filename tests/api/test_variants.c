/* The attention variants (sliding window, soft-capping, sinks, ALiBi) of pkv_decode and pkv_extend,
 * and pkv_seq_release_before, against the float64 oracle (oracle_attend_variants).
 *
 * The test keeps its own copy of what every page holds, as test_decode.c does; every call's out and
 * lse are poisoned with NaN first, and every element must be written. The cases:
 *   matrix   every K/V format pair, each with several of the 16 combinations of the variants: a ragged
 *            batch (an empty sequence, lengths within a page and over many) decoded with q_tokens
 *            1..8 under chunk_pages 0, 1, 2 and UINT32_MAX, and extended (causal, or tree masks),
 *            windows drawn from 1, within a page, ending inside a page and past the sequence;
 *   release  NaN rows before the window: a windowed decode and extend never read them, before and
 *            after pkv_seq_release_before gives their pages back (pool stats), and every call that
 *            needs a released position fails and changes nothing;
 *   fork     pages a fork shares survive the other holder's release: the fork reads them back.
 * Every case runs on every backend.
 *
 * PKV_TEST_SEED replays a run; PKV_TEST_FILTER picks cases by name. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "oracle.h"
#include "poolutil.h"
#include "testutil.h"

enum { MAX_SEQS = 8, MAX_Q_HEADS = 32, MAX_T = 8 };

static uint64_t g_seed;

/* A one-layer pool and the test's copy of what its pages hold. */
typedef struct model {
  pkv_format k, v;
  uint32_t head_dim, kv_heads, group, page_size, row, q_heads, cap, n;
  tu_rng rng;
  pkv_context *ctx;
  pkv_pool *pool;
  pkv_seq seq[MAX_SEQS];
  uint32_t len[MAX_SEQS];
  float *kk[MAX_SEQS], *vv[MAX_SEQS]; /* [cap][kv_heads][head_dim] */
} model;

/* One call's variants, as pkv_decode_args and pkv_extend_args take them. */
typedef struct variants {
  uint32_t window;
  float softcap;
  float sinks[MAX_Q_HEADS], slopes[MAX_Q_HEADS];
  int has_sinks, has_slopes;
} variants;

static void model_open(model *m, pkv_format k, pkv_format v, uint32_t head_dim, uint32_t kv_heads, uint32_t group,
                       uint32_t page_size, uint32_t cap, tu_rng rng) {
  memset(m, 0, sizeof *m);
  m->k = k, m->v = v, m->head_dim = head_dim, m->kv_heads = kv_heads, m->group = group, m->page_size = page_size;
  m->row = kv_heads * head_dim;
  m->q_heads = kv_heads * group;
  m->cap = cap;
  m->rng = rng;
  assert_true(m->q_heads <= MAX_Q_HEADS);
  CHECK_OK(pu_context(&m->ctx));
  pkv_pool_desc pd = pu_desc(1, kv_heads, head_dim, page_size, MAX_SEQS * ((cap + page_size - 1) / page_size + 1),
                             MAX_SEQS, k, v);
  pd.page_order_seed = 1 + tu_below(&m->rng, 0x7fffffff);
  pd.max_sequence_length = cap;
  CHECK_OK(pkv_pool_create(m->ctx, &pd, &m->pool));
}

static uint32_t model_alloc(model *m) {
  assert_true(m->n < MAX_SEQS);
  const uint32_t i = m->n++;
  CHECK_OK(pkv_seq_alloc(m->pool, &m->seq[i]));
  m->kk[i] = pu_malloc((size_t)m->cap * m->row * sizeof(float));
  m->vv[i] = pu_malloc((size_t)m->cap * m->row * sizeof(float));
  return i;
}

static void model_close(model *m) {
  CHECK_OK(pkv_pool_destroy(m->pool));
  CHECK_OK(pkv_context_destroy(m->ctx));
  for (uint32_t i = 0; i < m->n; i++) {
    free(m->kk[i]);
    free(m->vv[i]);
  }
}

/* Appends n_new tokens to sequence i and writes their rows: random ones, or NaN with poison. */
static void model_grow(model *m, uint32_t i, uint32_t n_new, int poison) {
  if (n_new == 0) return;
  assert_true(m->len[i] + n_new <= m->cap);
  CHECK_OK(pkv_append(m->pool, &m->seq[i], &n_new, 1));
  const size_t values = (size_t)n_new * m->row;
  float *kept_k = m->kk[i] + (size_t)m->len[i] * m->row, *kept_v = m->vv[i] + (size_t)m->len[i] * m->row;
  for (size_t e = 0; e < values; e++) {
    kept_k[e] = poison ? NAN : (float)tu_uniform(&m->rng, -1.0, 1.0);
    kept_v[e] = poison ? NAN : (float)tu_uniform(&m->rng, -1.0, 1.0);
  }
  CHECK_OK(pu_write(m->pool, 0, &m->seq[i], &n_new, 1, PKV_FORMAT_F32, kept_k, kept_v));
  tu_round_trip(m->k, kept_k, values, kept_k);
  tu_round_trip(m->v, kept_v, values, kept_v);
  m->len[i] += n_new;
}

/* bits: 1 window, 2 softcap, 4 sinks, 8 ALiBi. */
static variants draw_variants(model *m, uint32_t bits) {
  variants x;
  memset(&x, 0, sizeof x);
  const uint32_t p = m->page_size;
  const uint32_t windows[6] = {1, p > 1 ? p - 1 : 1, p + 3, 37, 2 * p + 5, 100000};
  if (bits & 1) x.window = windows[tu_below(&m->rng, 6)];
  if (bits & 2) x.softcap = (float)tu_uniform(&m->rng, 0.5, 8.0);
  x.has_sinks = (bits & 4) != 0;
  x.has_slopes = (bits & 8) != 0;
  for (uint32_t h = 0; h < m->q_heads; h++) {
    x.sinks[h] = (float)tu_uniform(&m->rng, -3.0, 3.0);
    x.slopes[h] = (float)tu_uniform(&m->rng, 0.0, 0.25);
  }
  return x;
}

static oracle_variants head_variants(const variants *x, uint32_t h) {
  const oracle_variants o = {x->window, x->softcap, x->has_slopes ? x->slopes[h] : 0.0, x->has_sinks,
                             x->sinks[h]};
  return o;
}

typedef struct worst {
  double out, lse;
} worst;

/* Query row (of q_heads heads, at q_row) of sequence s, at position `query`, seeing `seen` of
 * positions [0, query], against the oracle. */
static void check_row(const model *m, uint32_t s, uint32_t query, const uint8_t *seen, const variants *x,
                      const float *q, const float *out, const float *lse, size_t q_row, const char *what, worst *w) {
  const oracle_tolerance tol = oracle_tolerance_for(m->k);
  const uint32_t hd = m->head_dim;
  const double scale = 1.0 / sqrt((double)hd);
  double qd[256], ref[256], mag[256];
  for (uint32_t h = 0; h < m->q_heads; h++) {
    const size_t o = (q_row * m->q_heads + h) * hd, kv = (size_t)(h / m->group) * hd;
    for (uint32_t d = 0; d < hd; d++) qd[d] = q[o + d];
    const oracle_variants ov = head_variants(x, h);
    double ref_lse;
    const uint32_t n = m->len[s] ? query + 1 : 0;
    oracle_attend_variants(qd, m->kk[s] + kv, m->vv[s] + kv, m->row, n, seen, query, &ov, hd, scale, ref, mag,
                           &ref_lse);
    double err2 = 0.0, ref2 = 0.0;
    for (uint32_t d = 0; d < hd; d++) {
      const double diff = (double)out[o + d] - ref[d];
      err2 += diff * diff;
      ref2 += ref[d] * ref[d];
    }
    const double rel = ref2 > 0.0 ? sqrt(err2 / ref2) : sqrt(err2);
    if (!(rel <= tol.out_rel))
      fail_msg("%s: sequence %u (length %u), query at %u, head %u (window %u, softcap %g, sinks %d, alibi %d): "
               "relative error %.3g > %.3g", what, s, m->len[s], query, h, x->window, (double)x->softcap,
               x->has_sinks, x->has_slopes, rel, tol.out_rel);
    const double le = isinf(ref_lse) && lse[q_row * m->q_heads + h] == ref_lse ? 0.0 : fabs(lse[q_row * m->q_heads + h] - ref_lse);
    if (!(le <= tol.lse_abs))
      fail_msg("%s: sequence %u, query at %u, head %u: lse %.9g, expected %.9g", what, s, query, h,
               (double)lse[q_row * m->q_heads + h], ref_lse);
    w->out = fmax(w->out, rel);
    w->lse = fmax(w->lse, le);
  }
}

static void set_variants(const variants *x, uint32_t *window, float *softcap, const float **sinks,
                         const float **slopes) {
  *window = x->window;
  *softcap = x->softcap;
  *sinks = x->has_sinks ? x->sinks : NULL;
  *slopes = x->has_slopes ? x->slopes : NULL;
}

static void poison(float *out, float *lse, size_t rows, uint32_t head_dim) {
  for (size_t i = 0; i < rows * head_dim; i++) out[i] = NAN;
  for (size_t i = 0; i < rows; i++) lse[i] = NAN;
}

static void assert_written(const float *out, const float *lse, size_t rows, uint32_t head_dim, const char *what) {
  for (size_t i = 0; i < rows * head_dim; i++)
    if (isnan(out[i])) fail_msg("%s: out[%zu] was not written (or is NaN)", what, i);
  for (size_t i = 0; i < rows; i++)
    if (isnan(lse[i])) fail_msg("%s: lse[%zu] was not written (or is NaN)", what, i);
}

/* The decode args of sequences idx[0..count) with q_tokens T and the variants. */
static pkv_decode_args decode_args(const model *m, const uint32_t *idx, uint32_t count, pkv_seq *seqs, uint32_t T,
                                   uint32_t chunk_pages, const variants *x, const float *q, float *out, float *lse) {
  for (uint32_t b = 0; b < count; b++) seqs[b] = m->seq[idx[b]];
  pkv_decode_args a = pu_decode_args(0, seqs, count, m->q_heads, q, out, lse);
  a.q_tokens = T;
  a.chunk_pages = chunk_pages;
  set_variants(x, &a.window, &a.softcap, &a.sinks, &a.alibi_slopes);
  return a;
}

/* Decodes sequences idx[0..count) (q_tokens T) and checks every row against the oracle. */
static void decode_and_check(model *m, const uint32_t *idx, uint32_t count, uint32_t T, uint32_t chunk_pages,
                             const variants *x, const char *what, worst *w) {
  const size_t rows = (size_t)count * T;
  float *q = pu_malloc(rows * m->q_heads * m->head_dim * 4), *out = pu_malloc(rows * m->q_heads * m->head_dim * 4);
  float *lse = pu_malloc(rows * m->q_heads * 4);
  tu_fill_uniform(&m->rng, q, rows * m->q_heads * m->head_dim, -2.0, 2.0);
  poison(out, lse, rows * m->q_heads, m->head_dim);
  pkv_seq seqs[MAX_SEQS];
  const pkv_decode_args a = decode_args(m, idx, count, seqs, T, chunk_pages, x, q, out, lse);
  CHECK_OK(pkv_decode(m->pool, &a));
  assert_written(out, lse, rows * m->q_heads, m->head_dim, what);
  for (uint32_t b = 0; b < count; b++)
    for (uint32_t t = 0; t < T; t++) {
      const uint32_t s = idx[b], query = m->len[s] ? m->len[s] - T + t : 0;
      check_row(m, s, query, NULL, x, q, out, lse, (size_t)b * T + t, what, w);
    }
  free(q);
  free(out);
  free(lse);
}

/* Extends sequences idx[0..count), tokens[b] new queries each (a random tree mask each with masked),
 * and checks every row against the oracle. */
static void extend_and_check(model *m, const uint32_t *idx, const uint32_t *tokens, uint32_t count, int masked,
                             const variants *x, const char *what, worst *w) {
  uint32_t offsets[MAX_SEQS + 1] = {0};
  uint64_t mask_offsets[MAX_SEQS], mask_bytes = 0;
  for (uint32_t b = 0; b < count; b++) {
    offsets[b + 1] = offsets[b] + tokens[b];
    mask_offsets[b] = mask_bytes;
    mask_bytes += (uint64_t)tokens[b] * ((tokens[b] + 7) / 8);
  }
  uint8_t *mask = calloc(mask_bytes + 1, 1);
  assert_non_null(mask);
  /* Token i's parent is a random earlier new token (or none); it sees its ancestors and itself. */
  for (uint32_t b = 0; b < count && masked; b++) {
    const uint32_t n = tokens[b], rb = (n + 7) / 8;
    uint8_t *rows = mask + mask_offsets[b];
    for (uint32_t i = 0; i < n; i++) {
      if (i > 0 && tu_below(&m->rng, 4) != 0) memcpy(rows + (size_t)i * rb, rows + (size_t)tu_below(&m->rng, i) * rb, rb);
      rows[(size_t)i * rb + i / 8] |= (uint8_t)(1u << (i % 8));
    }
  }
  const size_t rows = offsets[count];
  float *q = pu_malloc(rows * m->q_heads * m->head_dim * 4 + 4), *out = pu_malloc(rows * m->q_heads * m->head_dim * 4 + 4);
  float *lse = pu_malloc(rows * m->q_heads * 4 + 4);
  tu_fill_uniform(&m->rng, q, rows * m->q_heads * m->head_dim, -2.0, 2.0);
  poison(out, lse, rows * m->q_heads, m->head_dim);
  pkv_seq seqs[MAX_SEQS];
  for (uint32_t b = 0; b < count; b++) seqs[b] = m->seq[idx[b]];
  pkv_extend_args a = pu_extend_args(0, seqs, count, m->q_heads, offsets, q, out, lse);
  if (masked) a.mask = mask, a.mask_offsets = mask_offsets, a.mask_bytes = mask_bytes;
  set_variants(x, &a.window, &a.softcap, &a.sinks, &a.alibi_slopes);
  CHECK_OK(pkv_extend(m->pool, &a));
  assert_written(out, lse, rows * m->q_heads, m->head_dim, what);
  uint8_t *seen = pu_malloc(m->cap);
  for (uint32_t b = 0; b < count; b++) {
    const uint32_t s = idx[b], n = tokens[b], before = m->len[s] - n, rb = (n + 7) / 8;
    for (uint32_t i = 0; i < n; i++) {
      memset(seen, 1, before);
      for (uint32_t j = 0; j <= i; j++)
        seen[before + j] = masked ? (mask[mask_offsets[b] + (size_t)i * rb + j / 8] >> (j % 8)) & 1 : 1;
      check_row(m, s, before + i, seen, x, q, out, lse, offsets[b] + i, what, w);
    }
  }
  free(seen);
  free(mask);
  free(q);
  free(out);
  free(lse);
}


/* ---------------------------------------------------------------------------------------------------
 * The matrix: 25 format pairs x 4 draws of the variants' 16 combinations.
 * ------------------------------------------------------------------------------------------------- */
static const pkv_format formats[5] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16, PKV_FORMAT_Q8_0,
                                      PKV_FORMAT_Q4_0};
enum { MATRIX = 100 };
static const uint32_t chunk_pages[4] = {0, 1, 2, UINT32_MAX};

static void matrix_case(void **state) {
  const uint32_t c = (uint32_t)(uintptr_t)*state;
  const uint32_t head_dims[3] = {32, 64, 128}, page_sizes[4] = {1, 4, 16, 8};
  model m;
  model_open(&m, formats[c % 5], formats[c / 5 % 5], head_dims[c % 3], 1 + c % 2, 1 + c % 4, page_sizes[c % 4], 320,
             tu_rng_stream(g_seed, c));
  /* an empty sequence, one within a page or two, and longer ones */
  const uint32_t lengths[5] = {0, 9 + tu_below(&m.rng, 8), 40 + tu_below(&m.rng, 40), 150 + tu_below(&m.rng, 100),
                               300};
  uint32_t idx[5];
  for (uint32_t i = 0; i < 5; i++) {
    idx[i] = model_alloc(&m);
    model_grow(&m, idx[i], lengths[i], 0);
  }
  worst w = {0, 0};
  char what[96];
  for (uint32_t round = 0; round < 4; round++) {
    const uint32_t bits = (c + round * 5) % 16;
    const variants x = draw_variants(&m, bits);
    snprintf(what, sizeof what, "decode, variants %u, chunk_pages %u", bits, chunk_pages[round]);
    decode_and_check(&m, idx, 5, 1 + tu_below(&m.rng, MAX_T), chunk_pages[round], &x, what, &w);
    const uint32_t tokens[4] = {1 + tu_below(&m.rng, 9), tu_below(&m.rng, 30), 1 + tu_below(&m.rng, 70), 0};
    const int masked = round % 2;
    snprintf(what, sizeof what, "extend, variants %u, %s", bits, masked ? "tree masks" : "causal");
    extend_and_check(&m, idx + 1, tokens, 4, masked, &x, what, &w);
  }
  print_message("    worst: out %.2e, lse %.2e\n", w.out, w.lse);
  model_close(&m);
}

/* ---------------------------------------------------------------------------------------------------
 * Release: NaN rows before the window are never read; their pages go back; released positions refuse.
 * ------------------------------------------------------------------------------------------------- */
static void release_case(void **state) {
  (void)state;
  const uint32_t page = 16, window = 40, dead = 100, live = 60;
  model m;
  model_open(&m, PKV_FORMAT_F16, PKV_FORMAT_BF16, 64, 2, 4, page, 256, tu_rng_stream(g_seed, 1000)); /* both keep NaN */
  const uint32_t s = model_alloc(&m);
  model_grow(&m, s, dead, 1); /* positions [0, 100): NaN */
  model_grow(&m, s, live, 0);
  const uint32_t length = dead + live; /* the windows below start at 160 - 8 - 40 + 1 = 113 at the earliest */
  worst w = {0, 0};
  variants x = draw_variants(&m, 1 | 4);
  x.window = window;
  for (int released = 0; released < 2; released++) {
    for (uint32_t c = 0; c < 4; c++) decode_and_check(&m, &s, 1, MAX_T, chunk_pages[c], &x, "windowed decode", &w);
    const uint32_t tokens = 50; /* queries from 110: windows from 71, past the NaN rows too */
    x.window = 11;
    extend_and_check(&m, &s, &tokens, 1, 0, &x, "windowed extend", &w);
    x.window = window;
    if (released) break;
    const pkv_pool_stats before = pu_stats(m.pool);
    CHECK_OK(pkv_seq_release_before(m.pool, m.seq[s], dead));
    const pkv_pool_stats after = pu_stats(m.pool);
    assert_int_equal(after.pages_free, before.pages_free + dead / page); /* 6 whole pages; the 7th holds 96..111 */
    assert_int_equal(pu_length(m.pool, m.seq[s]), length);
    /* Releasing again, or below, changes nothing. */
    CHECK_OK(pkv_seq_release_before(m.pool, m.seq[s], 50));
    assert_int_equal(pu_stats(m.pool).pages_free, after.pages_free);
  }

  /* Every call that needs a released position fails, names it, and changes nothing. */
  const pkv_pool_stats before = pu_stats(m.pool);
  float q[MAX_T * 8 * 64] = {0}, out[MAX_T * 8 * 64], lse[MAX_T * 8], rows[2 * 64 * 2];
  pkv_seq seqs[1];
  const variants plain = draw_variants(&m, 0);
  pkv_decode_args d = decode_args(&m, &s, 1, seqs, 1, 0, &plain, q, out, lse);
  pu_assert_fails(pkv_decode(m.pool, &d), PKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pkv_last_error(), "seqs[0]: the decode needs position 0"));
  pu_assert_fails(pkv_decode_prepare(m.pool, &d), PKV_ERR_INVALID_ARGUMENT);
  d.window = length - dead; /* the first query sees from 100 - ... : position 99 */
  d.q_tokens = 2;
  pu_assert_fails(pkv_decode(m.pool, &d), PKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pkv_last_error(), "position 99"));
  d.q_tokens = 1;
  CHECK_OK(pkv_decode(m.pool, &d)); /* from position 100 on: every row held */
  const uint32_t offsets[2] = {0, 1};
  pkv_extend_args e = pu_extend_args(0, seqs, 1, m.q_heads, offsets, q, out, NULL);
  pu_assert_fails(pkv_extend(m.pool, &e), PKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pkv_last_error(), "seqs[0]: the extend needs position 0"));
  pu_assert_fails(pu_read(m.pool, 0, m.seq[s], dead - 1, 2, PKV_FORMAT_F32, rows, NULL), PKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pkv_last_error(), "position 99"));
  CHECK_OK(pu_read(m.pool, 0, m.seq[s], dead, 2, PKV_FORMAT_F32, rows, NULL));
  pu_assert_fails(pkv_seq_truncate(m.pool, m.seq[s], dead - 1), PKV_ERR_INVALID_ARGUMENT);
  pu_assert_fails(pkv_seq_release_before(m.pool, m.seq[s], length + 1), PKV_ERR_INVALID_ARGUMENT);
  pkv_export_args ex = PKV_EXPORT_ARGS_INIT;
  uint64_t bytes = 0, spans = 0;
  ex.seq = m.seq[s];
  pu_assert_fails(pkv_seq_export_size(m.pool, &ex, &bytes), PKV_ERR_UNSUPPORTED);
  pu_assert_fails(pkv_seq_page_spans(m.pool, m.seq[s], 0, 0, NULL, 0, &spans), PKV_ERR_UNSUPPORTED);
  const pkv_pool_stats after = pu_stats(m.pool);
  pu_assert_stats_equal(&after, &before);
  assert_int_equal(pu_length(m.pool, m.seq[s]), length);

  /* Truncating to the released point keeps the sequence usable; freeing it returns every page. */
  CHECK_OK(pkv_seq_truncate(m.pool, m.seq[s], dead));
  model_grow(&m, s, 1, 0);
  CHECK_OK(pkv_seq_free(m.pool, m.seq[s]));
  assert_int_equal(pu_stats(m.pool).pages_free, pu_stats(m.pool).pages_total);
  print_message("    worst: out %.2e, lse %.2e\n", w.out, w.lse);
  model_close(&m);
}

/* ---------------------------------------------------------------------------------------------------
 * Fork: the pages a fork shares survive the other holder's release.
 * ------------------------------------------------------------------------------------------------- */
static void fork_case(void **state) {
  (void)state;
  const uint32_t page = 4, length = 30;
  model m;
  model_open(&m, PKV_FORMAT_BF16, PKV_FORMAT_F32, 32, 1, 2, page, 64, tu_rng_stream(g_seed, 2000));
  const uint32_t s = model_alloc(&m);
  model_grow(&m, s, length, 0);
  pkv_seq child;
  CHECK_OK(pkv_seq_fork(m.pool, m.seq[s], &child));
  const pkv_pool_stats before = pu_stats(m.pool);
  CHECK_OK(pkv_seq_release_before(m.pool, m.seq[s], 21)); /* 5 whole pages, still the fork's */
  assert_int_equal(pu_stats(m.pool).pages_free, before.pages_free);
  assert_int_equal(pu_stats(m.pool).pages_shared, before.pages_shared - 5);
  float k[30 * 32], v[30 * 32];
  CHECK_OK(pu_read(m.pool, 0, child, 0, length, PKV_FORMAT_F32, k, v));
  assert_memory_equal(k, m.kk[s], sizeof k);
  assert_memory_equal(v, m.vv[s], sizeof v);
  /* The fork of a released sequence inherits its released positions; freeing the first holder
   * returns no shared page. */
  pkv_seq grandchild;
  CHECK_OK(pkv_seq_fork(m.pool, m.seq[s], &grandchild));
  pu_assert_fails(pu_read(m.pool, 0, grandchild, 20, 1, PKV_FORMAT_F32, k, v), PKV_ERR_INVALID_ARGUMENT);
  CHECK_OK(pkv_seq_free(m.pool, m.seq[s]));
  CHECK_OK(pkv_seq_free(m.pool, grandchild));
  CHECK_OK(pu_read(m.pool, 0, child, 0, length, PKV_FORMAT_F32, k, v));
  assert_memory_equal(k, m.kk[s], sizeof k);
  CHECK_OK(pkv_seq_free(m.pool, child));
  assert_int_equal(pu_stats(m.pool).pages_free, pu_stats(m.pool).pages_total);
  model_close(&m);
}

int main(void) {
  g_seed = tu_seed();
  struct CMUnitTest tests[MATRIX + 2];
  char *names[MATRIX];
  size_t n = 0;
  const struct CMUnitTest fixed[2] = {cmocka_unit_test(release_case), cmocka_unit_test(fork_case)};
  for (size_t i = 0; i < 2; i++) tests[n++] = fixed[i];
  for (uint32_t c = 0; c < MATRIX; c++) {
    names[c] = pu_malloc(96);
    snprintf(names[c], 96, "matrix %u k=%s v=%s", c, pkv_format_name(formats[c % 5]), pkv_format_name(formats[c / 5 % 5]));
    memset(&tests[n], 0, sizeof tests[n]);
    tests[n].name = names[c];
    tests[n].test_func = matrix_case;
    tests[n].initial_state = (void *)(uintptr_t)c;
    n++;
  }
  const int failed = tu_run_group("variants", tests, n, NULL, NULL);
  for (uint32_t c = 0; c < MATRIX; c++) free(names[c]);
  return failed;
}
