/* Decode against a float64 oracle.
 *
 * The test keeps its own copy of what every page must hold: each K/V value written, as the source
 * format stores it, rounded to the page format (tu_round_trip, written independently of the library).
 * The oracle computes softmax(scale q.k) v and lse in double from those values and from q as q_format
 * stores it (tests/support/oracle.c), so what is left to compare is decode's own arithmetic, against
 * the tolerances oracle_tolerance_for gives (docs/testing.md explains them).
 *
 * Three tables drive the tests:
 *   matrix     every K/V format pair once, with head_dim, GQA, page size, source/q/out format and
 *              scale spread over the rows; ragged batches straddling page boundaries; three layers;
 *   split      a long sequence beside short ones, decoded with several split-K chunk sizes;
 *   interleave an engine's loop: append one token to some sequences, write every layer, decode.
 * All pools hand out pages in shuffled order and the sequences grow interleaved, so no sequence's pages
 * are contiguous.
 *
 * One file past 500 lines: the shapes, formats and plan modes all check through the one oracle
 * comparison here; split, each part would repeat its setup. */
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

/* ---------------------------------------------------------------------------------------------------
 * Tolerances
 * ------------------------------------------------------------------------------------------------- */

/* The error allowed against the oracle: tests/support/oracle.c (oracle_tolerance_for,
 * oracle_out_rounding). */

/* ---------------------------------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------------------------------- */

/* The run's seed. Each test case draws from a stream of its own (tu_rng_stream), so replaying a seed
 * reproduces any one case alone. */
static uint64_t g_seed;

static const char *fmt_name(pkv_format f) {
  switch (f) {
  case PKV_FORMAT_F32: return "f32";
  case PKV_FORMAT_F16: return "f16";
  case PKV_FORMAT_BF16: return "bf16";
  case PKV_FORMAT_Q8_0: return "q8_0";
  case PKV_FORMAT_Q4_0: return "q4_0";
  case PKV_FORMAT_FP8_E4M3: return "e4m3";
  case PKV_FORMAT_FP8_E5M2: return "e5m2";
  default: return "?";
  }
}

/* ---------------------------------------------------------------------------------------------------
 * A pool and the test's copy of what its pages hold
 * ------------------------------------------------------------------------------------------------- */

typedef struct shape {
  pkv_format k, v;                    /* page formats */
  uint32_t head_dim, kv_heads, group; /* group: query heads per KV head */
  uint32_t page_size;
  pkv_format src, q, out; /* formats of the written rows, of q and of the output */
  float scale;            /* 0: 1/sqrt(head_dim) */
} shape;

/* Split-K plans against the unsplit decode: the same arithmetic up to the order of the merge, so
 * float32 rounding only; outputs rounded to F16/BF16 may then land one ulp apart. Where K and V are
 * both quantized a GPU backend may round the softmax weights to f16 and multiply them by V's f16
 * scales in f16 (two roundings of half an ulp, 2^-12 each), each chunk against its own running max,
 * so a split and an unsplit weight may differ by four such roundings. */
static double split_out_tol(const shape *s) {
  const double weights = tu_quantized(s->k) && tu_quantized(s->v) ? ldexp(1.0, -10) : 0.0;
  return 1e-5 + weights + 2.0 * oracle_out_rounding(s->out);
}
#define SPLIT_LSE_TOL 1e-5

typedef struct model {
  shape s;
  uint32_t layers, n, row, q_heads; /* row: values per token and layer (kv_heads * head_dim) */
  uint32_t qt;                      /* query tokens per sequence (1, or more for speculative verification) */
  tu_rng rng;
  pkv_context *ctx;
  pkv_pool *pool;
  pkv_seq *seq;
  uint32_t *len, *cap;
  float **k, **v; /* per sequence: [layer][cap][kv_heads][head_dim], what its pages hold */
} model;

/* A context and a pool with exactly the pages n sequences of at most cap[i] tokens need. */
static void model_open(model *m, const shape *s, uint32_t layers, uint32_t n, const uint32_t *cap,
                       tu_rng rng) {
  memset(m, 0, sizeof *m);
  m->s = *s;
  m->layers = layers;
  m->n = n;
  m->row = s->kv_heads * s->head_dim;
  m->q_heads = s->kv_heads * s->group;
  m->qt = 1;
  m->rng = rng;

  CHECK_OK(pu_context(&m->ctx));
  pkv_pool_desc pd = PKV_POOL_DESC_INIT;
  pd.layers = layers;
  pd.kv_heads = s->kv_heads;
  pd.head_dim = s->head_dim;
  pd.page_size = s->page_size;
  for (uint32_t i = 0; i < n; i++) pd.pages += (cap[i] + s->page_size - 1) / s->page_size;
  pd.pages = tu_max_u32(pd.pages, 1);
  pd.k_format = s->k;
  pd.v_format = s->v;
  pd.page_order_seed = 1 + tu_below(&m->rng, 0x7fffffff);
  CHECK_OK(pkv_pool_create(m->ctx, &pd, &m->pool));

  m->seq = pu_malloc(n * sizeof *m->seq);
  m->len = calloc(n, sizeof *m->len);
  m->cap = pu_malloc(n * sizeof *m->cap);
  m->k = calloc(n, sizeof *m->k);
  m->v = calloc(n, sizeof *m->v);
  for (uint32_t i = 0; i < n; i++) {
    CHECK_OK(pkv_seq_alloc(m->pool, &m->seq[i]));
    m->cap[i] = cap[i];
    m->k[i] = pu_malloc((size_t)layers * cap[i] * m->row * sizeof(float));
    m->v[i] = pu_malloc((size_t)layers * cap[i] * m->row * sizeof(float));
  }
}

static void model_close(model *m) {
  CHECK_OK(pkv_pool_destroy(m->pool));
  CHECK_OK(pkv_context_destroy(m->ctx));
  for (uint32_t i = 0; i < m->n; i++) {
    free(m->k[i]);
    free(m->v[i]);
  }
  free(m->k);
  free(m->v);
  free(m->seq);
  free(m->len);
  free(m->cap);
}

/* Where token pos of sequence i in layer l starts in the copy. */
static size_t at(const model *m, uint32_t i, uint32_t l, uint32_t pos) {
  return ((size_t)l * m->cap[i] + pos) * m->row;
}

/* One token's random row: stored in the source format at packed row r of buf, and what the page keeps
 * of it (the source value rounded to the page format) into kept. */
static void fill_row(model *m, void *buf, size_t r, pkv_format page, float *kept) {
  for (uint32_t e = 0; e < m->row; e++) {
    tu_store(m->s.src, buf, r * m->row + e, (float)tu_uniform(&m->rng, -1.0, 1.0));
    kept[e] = tu_load(m->s.src, buf, r * m->row + e);
  }
  tu_round_trip(page, kept, m->row, kept); /* groups of 32 never straddle heads: head_dim % 32 == 0 */
}

/* Appends n_new[i] tokens to sequence i (those with n_new[i] > 0, in a shuffled batch order) and writes
 * fresh random rows for them in every layer, each layer's batch in its own order. */
static void model_grow(model *m, const uint32_t *n_new) {
  uint32_t *idx = pu_malloc(m->n * sizeof *idx), *bn = pu_malloc(m->n * sizeof *bn), cnt = 0;
  pkv_seq *bs = pu_malloc(m->n * sizeof *bs);
  size_t total = 0;
  for (uint32_t i = 0; i < m->n; i++) {
    if (!n_new[i]) continue;
    idx[cnt++] = i;
    total += n_new[i];
    assert_true(m->len[i] + n_new[i] <= m->cap[i]);
  }
  if (cnt) {
    tu_shuffle(&m->rng, idx, cnt);
    for (uint32_t j = 0; j < cnt; j++) bs[j] = m->seq[idx[j]], bn[j] = n_new[idx[j]];
    CHECK_OK(pkv_append(m->pool, bs, bn, cnt));
    for (uint32_t i = 0; i < m->n; i++) m->len[i] += n_new[i];

    size_t bytes = total * m->row * tu_elem_bytes(m->s.src);
    void *kb = pu_malloc(bytes), *vb = pu_malloc(bytes);
    for (uint32_t l = 0; l < m->layers; l++) {
      tu_shuffle(&m->rng, idx, cnt);
      size_t r = 0;
      for (uint32_t j = 0; j < cnt; j++) {
        uint32_t i = idx[j];
        bs[j] = m->seq[i];
        bn[j] = n_new[i];
        for (uint32_t pos = m->len[i] - n_new[i]; pos < m->len[i]; pos++, r++) {
          fill_row(m, kb, r, m->s.k, m->k[i] + at(m, i, l, pos));
          fill_row(m, vb, r, m->s.v, m->v[i] + at(m, i, l, pos));
        }
      }
      CHECK_OK(pu_write(m->pool, l, bs, bn, cnt, m->s.src, kb, vb));
    }
    free(kb);
    free(vb);
  }
  free(idx);
  free(bn);
  free(bs);
}

/* Grows every sequence to target[i] in rounds of a random number of tokens each, so the sequences'
 * pages interleave in the pool; long sequences take bigger steps to keep the number of calls low. */
static void grow_to(model *m, const uint32_t *target) {
  uint32_t *n_new = pu_malloc(m->n * sizeof *n_new);
  for (;;) {
    int any = 0;
    for (uint32_t i = 0; i < m->n; i++) {
      uint32_t rest = target[i] - m->len[i];
      uint32_t step = tu_max_u32(2 * m->s.page_size, target[i] / 16);
      n_new[i] = rest ? 1 + tu_below(&m->rng, tu_min_u32(rest, step)) : 0;
      any |= rest != 0;
    }
    if (!any) break;
    model_grow(m, n_new);
  }
  free(n_new);
}

static void check_lengths(model *m) {
  for (uint32_t i = 0; i < m->n; i++) {
    uint32_t len = UINT32_MAX;
    CHECK_OK(pkv_seq_length(m->pool, m->seq[i], &len));
    assert_int_equal(len, m->len[i]);
  }
}

/* Query rows of the batch: one per (sequence, query token, head). */
static size_t q_rows(const model *m) { return (size_t)m->n * m->qt * m->q_heads; }
static size_t q_values(const model *m) { return q_rows(m) * m->s.head_dim; }

/* Random q with a spread (|q| <= 2) that makes the softmax neither flat nor one-hot at the default
 * scale. */
static void random_q(model *m, void *q) {
  for (size_t i = 0; i < q_values(m); i++) tu_store(m->s.q, q, i, (float)tu_uniform(&m->rng, -2.0, 2.0));
}

/* Decodes one layer of the whole batch into NaN-poisoned out and lse, and checks every element was
 * written. */
static void model_decode(model *m, uint32_t layer, uint32_t chunk_pages, const void *q, void *out,
                         float *lse) {
  for (size_t i = 0; i < q_values(m); i++) tu_store(m->s.out, out, i, NAN);
  if (lse)
    for (size_t i = 0; i < q_rows(m); i++) lse[i] = NAN;

  pkv_decode_args a = pu_decode_args(layer, m->seq, m->n, m->q_heads, q, out, lse);
  a.q_tokens = m->qt;
  a.scale = m->s.scale;
  a.q_format = m->s.q;
  a.out_format = m->s.out;
  a.chunk_pages = chunk_pages;
  CHECK_OK(pkv_decode(m->pool, &a));

  for (size_t i = 0; i < q_values(m); i++)
    if (isnan(tu_load(m->s.out, out, i)))
      fail_msg("layer %u chunk_pages %u: out[%zu] was not written", layer, chunk_pages, i);
  if (lse)
    for (size_t i = 0; i < q_rows(m); i++)
      if (isnan(lse[i])) fail_msg("layer %u chunk_pages %u: lse[%zu] was not written", layer, chunk_pages, i);
}

typedef struct worst {
  double out, lse;
} worst;

/* Compares one decode of `layer` with the float64 oracle. */
static void check_oracle(const model *m, uint32_t layer, const void *q, const void *out, const float *lse,
                         const char *what, worst *w) {
  const oracle_tolerance tol = oracle_tolerance_for(m->s.k);
  const double out_tol = tol.out_rel + oracle_out_rounding(m->s.out);
  const uint32_t hd = m->s.head_dim;
  const double scale = m->s.scale != 0.0f ? (double)m->s.scale : 1.0 / sqrt((double)hd);
  double *qd = pu_malloc(hd * sizeof *qd), *ref = pu_malloc(hd * sizeof *ref), *mag = pu_malloc(hd * sizeof *mag);

  for (uint32_t bt = 0; bt < m->n * m->qt; bt++) {
    /* query token tok of sequence b sees positions [0, length - qt + tok] */
    const uint32_t b = bt / m->qt, tok = bt % m->qt, len = m->len[b] ? m->len[b] - m->qt + tok + 1 : 0;
    for (uint32_t h = 0; h < m->q_heads; h++) {
      const size_t li = (size_t)bt * m->q_heads + h, o = li * hd;
      if (len == 0) { /* exactly 0 and -inf, never NaN */
        for (uint32_t d = 0; d < hd; d++)
          if (tu_load(m->s.out, out, o + d) != 0.0f)
            fail_msg("%s: layer %u seq %u is empty but out[%u] = %g", what, layer, b, d,
                     (double)tu_load(m->s.out, out, o + d));
        if (lse && !(isinf(lse[li]) && lse[li] < 0))
          fail_msg("%s: layer %u seq %u is empty but lse = %g", what, layer, b, (double)lse[li]);
        continue;
      }
      const size_t kv = at(m, b, layer, 0) + (size_t)(h / m->s.group) * hd; /* GQA: the group's KV head */
      for (uint32_t d = 0; d < hd; d++) qd[d] = tu_load(m->s.q, q, o + d);
      double ref_lse;
      oracle_attend(qd, m->k[b] + kv, m->v[b] + kv, m->row, len, hd, scale, ref, mag, &ref_lse);
      double err2 = 0.0, ref2 = 0.0;
      for (uint32_t d = 0; d < hd; d++) {
        double e = (double)tu_load(m->s.out, out, o + d) - ref[d];
        err2 += e * e;
        ref2 += ref[d] * ref[d];
      }
      double rel = sqrt(err2 / fmax(ref2, 1e-300));
      if (rel > out_tol)
        fail_msg("%s: layer %u seq %u (length %u) head %u: relative error %.3g > %.3g", what, layer, b,
                 len, h, rel, out_tol);
      w->out = fmax(w->out, rel);
      if (lse) {
        double e = fabs((double)lse[li] - ref_lse);
        if (!(e <= tol.lse_abs))
          fail_msg("%s: layer %u seq %u (length %u) head %u: lse %.9g, expected %.9g", what, layer, b, len,
                   h, (double)lse[li], ref_lse);
        w->lse = fmax(w->lse, e);
      }
    }
  }
  free(qd);
  free(ref);
  free(mag);
}

static void report(const model *m, const worst *w) {
  const oracle_tolerance tol = oracle_tolerance_for(m->s.k);
  print_message("    worst: out %.2e (allowed %.2e), lse %.2e (allowed %.2e)\n", w->out,
                tol.out_rel + oracle_out_rounding(m->s.out), w->lse, tol.lse_abs);
}

/* Lengths that straddle page boundaries, one empty, in a random batch position. */
static void ragged_lengths(tu_rng *r, uint32_t page_size, uint32_t *len) {
  const uint32_t l[7] = {0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size + 1 + tu_below(r, page_size),
                         150 + tu_below(r, 250)};
  memcpy(len, l, sizeof l);
  tu_shuffle(r, len, 7);
}

/* ---------------------------------------------------------------------------------------------------
 * The matrix: every K/V format pair once; the other parameters spread so that each head_dim
 * (32/64/128/256), kv_heads (1..4), group (1/4/6/8), page size (2/4/8/16/64; pages under 8 tokens
 * make the tensor-core kernel copy float rows one by one), source/q/out format and both kinds of
 * scale appear several times. Explicit scales keep the logits' spread (about
 * 0.67 * scale * sqrt(head_dim)) between ~0.5 and ~5 for float K and <= ~1 for quantized K.
 * ------------------------------------------------------------------------------------------------- */
#define F32 PKV_FORMAT_F32
#define F16 PKV_FORMAT_F16
#define BF16 PKV_FORMAT_BF16
#define Q8_0 PKV_FORMAT_Q8_0
#define Q4_0 PKV_FORMAT_Q4_0
#define E4M3 PKV_FORMAT_FP8_E4M3
#define E5M2 PKV_FORMAT_FP8_E5M2

static const shape matrix[] = {
    /* k     v     hd  kvh grp page src   q     out   scale */
    {F32, F32, 128, 2, 4, 16, F32, F32, F32, 0.0f},
    {F32, F16, 64, 1, 8, 8, F16, F16, F32, 1.0f},
    {F32, BF16, 256, 4, 1, 64, BF16, BF16, F16, 0.0f},
    {F32, Q8_0, 32, 3, 6, 16, F32, F32, BF16, 0.5f},
    {F32, Q4_0, 128, 1, 1, 8, F16, F32, F32, 0.0f},
    {F16, F32, 256, 2, 6, 8, F32, F16, F16, 0.1f},
    {F16, F16, 128, 4, 8, 16, F16, F16, F16, 0.0f},
    {F16, BF16, 64, 3, 1, 64, BF16, F32, F32, 0.3f},
    {F16, Q8_0, 32, 1, 4, 8, F32, BF16, F32, 0.0f},
    {F16, Q4_0, 256, 3, 4, 2, BF16, F32, BF16, 0.3f},
    {BF16, F32, 64, 4, 4, 64, F16, F32, F32, 0.0f},
    {BF16, F16, 32, 2, 1, 16, F32, BF16, F16, 0.4f},
    {BF16, BF16, 128, 1, 6, 4, BF16, BF16, BF16, 0.0f},
    {BF16, Q8_0, 256, 1, 8, 64, F16, F16, F32, 0.25f},
    {BF16, Q4_0, 64, 2, 8, 16, F32, F32, F16, 0.0f},
    {Q8_0, F32, 128, 3, 1, 16, F32, F32, F32, 0.0f},
    {Q8_0, F16, 64, 4, 6, 8, F16, F16, BF16, 0.12f},
    {Q8_0, BF16, 256, 2, 4, 64, BF16, F32, F32, 0.0f},
    {Q8_0, Q8_0, 128, 2, 8, 8, F16, BF16, F16, 0.0f},
    {Q8_0, Q4_0, 32, 4, 4, 64, F32, F16, F32, 0.15f},
    {Q4_0, F32, 256, 1, 1, 16, F16, BF16, F32, 0.0f},
    {Q4_0, F16, 32, 1, 6, 64, F32, F32, F16, 0.2f},
    {Q4_0, BF16, 128, 4, 1, 8, BF16, F16, F32, 0.0f},
    {Q4_0, Q8_0, 64, 3, 8, 16, F16, F32, BF16, 0.1f},
    {Q4_0, Q4_0, 128, 2, 4, 64, F32, F32, F32, 0.0f},
    /* FP8 pages (at scale 1: test_fp8 sets scales) beside every format: the cases named "fp8", the
     * rows from the first with an FP8 side on (plain_rows) */
    {E4M3, F32, 64, 2, 4, 16, F16, F32, F32, 0.0f},
    {E4M3, F16, 128, 1, 8, 8, F32, F16, BF16, 0.2f},
    {E4M3, BF16, 256, 3, 1, 64, BF16, BF16, F32, 0.0f},
    {E4M3, Q8_0, 32, 4, 6, 16, F32, F32, F16, 0.3f},
    {E4M3, Q4_0, 128, 2, 4, 4, F16, F32, F32, 0.0f},
    {E4M3, E4M3, 64, 1, 1, 16, F32, BF16, F32, 0.1f},
    {E4M3, E5M2, 128, 3, 6, 64, BF16, F16, F16, 0.0f},
    {E5M2, F32, 256, 1, 4, 8, F32, F32, F32, 0.05f},
    {E5M2, F16, 32, 2, 1, 64, F16, F16, F32, 0.0f},
    {E5M2, BF16, 128, 4, 8, 16, F32, F32, BF16, 0.0f},
    {E5M2, Q8_0, 64, 2, 6, 8, BF16, F32, F32, 0.2f},
    {E5M2, Q4_0, 256, 1, 8, 16, F32, F16, F32, 0.0f},
    {E5M2, E4M3, 128, 2, 4, 2, F16, F32, F16, 0.0f},
    {E5M2, E5M2, 32, 3, 4, 16, F32, F32, F32, 0.3f},
    {E4M3, E4M3, 256, 2, 8, 16, F16, F16, F32, 0.0f},
    {E5M2, E5M2, 128, 1, 8, 64, F32, BF16, F16, 0.1f},
    {F32, E4M3, 128, 1, 6, 16, F32, F16, F32, 0.0f},
    {F16, E4M3, 64, 4, 4, 8, F16, F32, BF16, 0.1f},
    {BF16, E4M3, 256, 2, 1, 16, BF16, F32, F32, 0.0f},
    {Q8_0, E4M3, 128, 1, 8, 64, F32, BF16, F32, 0.0f},
    {Q4_0, E4M3, 32, 2, 4, 16, F16, F32, F16, 0.2f},
    {F32, E5M2, 32, 3, 8, 64, F32, F32, F16, 0.0f},
    {F16, E5M2, 128, 2, 4, 16, F16, F16, F32, 0.0f},
    {BF16, E5M2, 64, 1, 6, 8, F32, BF16, F32, 0.15f},
    {Q8_0, E5M2, 256, 2, 4, 16, BF16, F32, BF16, 0.0f},
    {Q4_0, E5M2, 128, 4, 1, 16, F32, F32, F32, 0.0f},
};

/* The matrix rows before its FP8 ones, which all come last. */
static size_t plain_rows(void) {
  size_t n = 0;
  while (n < TU_COUNT(matrix) && !tu_fp8(matrix[n].k) && !tu_fp8(matrix[n].v)) n++;
  for (size_t i = n; i < TU_COUNT(matrix); i++)
    if (!tu_fp8(matrix[i].k) && !tu_fp8(matrix[i].v)) {
      fprintf(stderr, "test_decode: matrix row %zu has no FP8 side but follows the first that has\n", i);
      abort();
    }
  return n;
}

/* Split-K: a long sequence beside short ones; the chunk sizes cover one page, a few, the planner, none. */
static const shape split[] = {
    {F32, F32, 128, 2, 4, 16, F32, F32, F32, 0.0f},
    {F16, BF16, 64, 1, 8, 8, F16, F16, F32, 0.3f},
    {Q8_0, Q4_0, 128, 4, 1, 64, BF16, BF16, F32, 0.0f},
    {Q4_0, Q8_0, 256, 1, 6, 16, F32, F32, BF16, 0.05f},
    {BF16, F16, 32, 2, 6, 8, F32, F32, F16, 0.0f},
};
static const uint32_t chunks[] = {UINT32_MAX, 0, 1, 2, 3}; /* the first is the reference */

/* Speculative verification: 2, 4 or 8 query tokens per sequence (by row), each seeing the context up
 * to itself, split and unsplit. Where K and V are quantized, 9-32 query rows a KV head take the
 * tensor-core kernel's narrow tile of 2 or 4 n-tiles (more rows: several of them), or for 17-32 rows
 * of Q4_0 K and V at head_dim 128 on sm_90 the group tile; the last three rows have 16, 32 and 32. */
static const shape spec[] = {
    {F16, F16, 128, 2, 4, 16, F16, F32, F32, 0.0f},
    {BF16, BF16, 256, 1, 6, 4, BF16, BF16, F32, 0.0f},
    {Q8_0, Q4_0, 64, 2, 8, 8, F32, F16, F16, 0.2f},
    {F32, Q8_0, 128, 1, 1, 64, F32, F32, F32, 0.0f},
    {Q4_0, Q4_0, 128, 2, 4, 16, F16, F16, F32, 0.0f},
    {Q8_0, Q8_0, 128, 1, 6, 64, BF16, F32, BF16, 0.1f},
    {Q4_0, Q8_0, 128, 1, 8, 16, F16, BF16, F32, 0.0f},
    {Q8_0, Q4_0, 128, 2, 8, 16, F32, F16, F16, 0.0f},
    {Q4_0, Q4_0, 128, 1, 4, 16, F16, F32, F32, 0.0f},
};
static const uint32_t spec_tokens[] = {2, 4, 8};

/* The engine loop. */
static const shape interleave[] = {
    {F16, F16, 128, 2, 4, 16, F16, F16, F16, 0.0f},
    {Q8_0, Q4_0, 64, 1, 6, 8, BF16, BF16, F32, 0.15f},
    {Q4_0, F32, 32, 3, 8, 64, F32, F32, BF16, 0.0f},
};


/* Ragged batch, three layers with different data, each layer decoded with its own chunking (planner,
 * one page, unsplit), lse left out in layer 0. */
static void matrix_case(void **state) {
  const shape *s = *state;
  tu_rng r = tu_rng_stream(g_seed, (uint64_t)(s - matrix));
  uint32_t len[7];
  ragged_lengths(&r, s->page_size, len);
  model m;
  model_open(&m, s, 3, 7, len, r);
  grow_to(&m, len);
  check_lengths(&m);

  void *q = pu_malloc(q_values(&m) * 4), *out = pu_malloc(q_values(&m) * 4);
  float *lse = pu_malloc((size_t)m.n * m.q_heads * sizeof *lse);
  const uint32_t layer_chunks[3] = {0, 1, UINT32_MAX};
  worst w = {0, 0};
  for (uint32_t l = 0; l < m.layers; l++) {
    random_q(&m, q);
    model_decode(&m, l, layer_chunks[l], q, out, l ? lse : NULL);
    check_oracle(&m, l, q, out, l ? lse : NULL, "matrix", &w);
  }
  report(&m, &w);
  free(q);
  free(out);
  free(lse);
  model_close(&m);
}

/* Per (sequence, head): the split decode agrees with the unsplit one. */
static void check_agree(const model *m, uint32_t chunk, const void *ref, const float *ref_lse, const void *out,
                        const float *lse) {
  const uint32_t hd = m->s.head_dim;
  const double tol = split_out_tol(&m->s);
  for (size_t sh = 0; sh < q_rows(m); sh++) {
    double d2 = 0.0, r2 = 0.0;
    for (uint32_t d = 0; d < hd; d++) {
      double a = tu_load(m->s.out, ref, sh * hd + d), b = tu_load(m->s.out, out, sh * hd + d);
      d2 += (a - b) * (a - b);
      r2 += a * a;
    }
    if (r2 > 0.0 && sqrt(d2 / r2) > tol)
      fail_msg("chunk_pages %u: query row %zu head %zu differs from the unsplit decode by %.3g > %.3g", chunk,
               sh / m->q_heads, sh % m->q_heads, sqrt(d2 / r2), tol);
    if (!isinf(ref_lse[sh]) && fabs((double)lse[sh] - ref_lse[sh]) > SPLIT_LSE_TOL)
      fail_msg("chunk_pages %u: query row %zu head %zu lse %.9g, unsplit %.9g", chunk, sh / m->q_heads,
               sh % m->q_heads, (double)lse[sh], (double)ref_lse[sh]);
  }
}

/* Decodes layer 1 with every chunking in chunks[]: each against the oracle, each split one against the
 * unsplit one too, and each twice: the same inputs must give the same bits. */
static void check_chunkings(model *m, const char *what) {
  const size_t n_out = q_values(m) * 4, n_lse = q_rows(m) * sizeof(float);
  void *q = pu_malloc(n_out), *ref = pu_malloc(n_out), *out = pu_malloc(n_out), *again = pu_malloc(n_out);
  float *ref_lse = pu_malloc(n_lse), *lse = pu_malloc(n_lse), *again_lse = pu_malloc(n_lse);
  worst w = {0, 0};
  random_q(m, q);
  for (size_t c = 0; c < TU_COUNT(chunks); c++) {
    void *got = c ? out : ref;
    float *got_lse = c ? lse : ref_lse;
    model_decode(m, 1, chunks[c], q, got, got_lse);
    check_oracle(m, 1, q, got, got_lse, what, &w);
    if (c) check_agree(m, chunks[c], ref, ref_lse, out, lse);
    model_decode(m, 1, chunks[c], q, again, again_lse);
    if (memcmp(got, again, q_values(m) * tu_elem_bytes(m->s.out)) != 0 || memcmp(got_lse, again_lse, n_lse) != 0)
      fail_msg("%s: chunk_pages %u: a second decode of the same inputs gave other bits", what, chunks[c]);
  }
  free(again);
  free(again_lse);
  report(m, &w);
  free(q);
  free(ref);
  free(out);
  free(ref_lse);
  free(lse);
}

static void split_case(void **state) {
  const shape *s = *state;
  tu_rng r = tu_rng_stream(g_seed, 1000 + (uint64_t)(s - split));
  uint32_t len[5] = {3000 + tu_below(&r, 2000), 0, 1, s->page_size + 1, 40 + tu_below(&r, 100)};
  tu_shuffle(&r, len, 5);
  model m;
  model_open(&m, s, 2, 5, len, r);
  grow_to(&m, len);
  check_lengths(&m);
  check_chunkings(&m, "split");
  model_close(&m);
}

static void spec_case(void **state) {
  const shape *s = *state;
  const uint32_t row = (uint32_t)(s - spec), qt = spec_tokens[row % TU_COUNT(spec_tokens)];
  tu_rng r = tu_rng_stream(g_seed, 3000 + row);
  uint32_t len[5] = {0, qt, qt + s->page_size + 1, 200 + tu_below(&r, 200), 2000 + tu_below(&r, 1000)};
  tu_shuffle(&r, len, 5);
  model m;
  model_open(&m, s, 2, 5, len, r);
  m.qt = qt;
  grow_to(&m, len);
  check_lengths(&m);
  print_message("    %u query tokens\n", qt);
  check_chunkings(&m, "spec");
  model_close(&m);
}

/* Prefill, then steps where a random subset of the sequences gains one token (the empty one starts
 * when it is first picked); each step writes every layer, then decodes every layer of the whole batch.
 * Now and then a sequence is rolled back a few tokens (rejected speculative tokens) and regrows over
 * positions that held other data. */
static void interleave_case(void **state) {
  const shape *s = *state;
  enum { STEPS = 40, N = 6 };
  tu_rng r = tu_rng_stream(g_seed, 2000 + (uint64_t)(s - interleave));
  uint32_t prompt[N] = {0, 1, s->page_size - 1, s->page_size, s->page_size + 1, 20 + tu_below(&r, 60)};
  uint32_t cap[N], n_new[N];
  tu_shuffle(&r, prompt, N);
  for (uint32_t i = 0; i < N; i++) cap[i] = prompt[i] + STEPS;
  model m;
  model_open(&m, s, 2, N, cap, r);
  grow_to(&m, prompt);

  void *q = pu_malloc(q_values(&m) * 4), *out = pu_malloc(q_values(&m) * 4);
  float *lse = pu_malloc((size_t)N * m.q_heads * sizeof *lse);
  worst w = {0, 0};
  for (uint32_t step = 0; step < STEPS; step++) {
    if (step % 8 == 7) {
      uint32_t i = tu_below(&m.rng, N);
      if (m.len[i]) {
        m.len[i] -= 1 + tu_below(&m.rng, tu_min_u32(m.len[i], 4));
        CHECK_OK(pkv_seq_truncate(m.pool, m.seq[i], m.len[i]));
      }
    }
    for (uint32_t i = 0; i < N; i++) n_new[i] = tu_below(&m.rng, 4) != 0;
    model_grow(&m, n_new);
    check_lengths(&m);
    for (uint32_t l = 0; l < m.layers; l++) {
      random_q(&m, q);
      model_decode(&m, l, 0, q, out, lse);
      check_oracle(&m, l, q, out, lse, "interleave", &w);
    }
  }
  report(&m, &w);
  free(q);
  free(out);
  free(lse);
  model_close(&m);
}

/* One cmocka test per table row, named after its shape. */
static void add_tests(struct CMUnitTest *t, size_t *n, const char *kind, const shape *rows, size_t count,
                      CMUnitTestFunction fn) {
  for (size_t i = 0; i < count; i++) {
    const shape *s = &rows[i];
    char *name = pu_malloc(128);
    snprintf(name, 128, "%s k=%s v=%s hd=%u kvh=%u qh=%u page=%u src=%s q=%s out=%s scale=%g", kind,
             fmt_name(s->k), fmt_name(s->v), s->head_dim, s->kv_heads, s->kv_heads * s->group,
             s->page_size, fmt_name(s->src), fmt_name(s->q), fmt_name(s->out), (double)s->scale);
    memset(&t[*n], 0, sizeof t[*n]);
    t[*n].name = name;
    t[*n].test_func = fn;
    t[*n].initial_state = (void *)s;
    ++*n;
  }
}

/* Slots appended but never written read as zeros on every backend: a pool whose memory an earlier
 * pool of the same size had filled with NaN (a GPU's allocator hands the same memory back), decoded
 * over unwritten slots only, gives out 0 and lse log(n) exactly as the CPU backend's zeroed pages do. */
static void unwritten_slots_read_as_zeros(void **state) {
  (void)state;
  enum { PAGES = 64, PAGE = 16, D = 128, KVH = 2, QH = 4 };
  const uint32_t n = PAGES * PAGE - 5;
  const pkv_pool_desc d = pu_desc(1, KVH, D, PAGE, PAGES, 4, PKV_FORMAT_F16, PKV_FORMAT_F16);
  pkv_context *ctx;
  pkv_pool *pool;
  pkv_seq s;
  pu_open(&d, &ctx, &pool);
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  assert_int_equal(pkv_append(pool, &s, &n, 1), PKV_OK);
  float *rows = pu_malloc((size_t)n * KVH * D * sizeof *rows);
  for (size_t i = 0; i < (size_t)n * KVH * D; i++) rows[i] = NAN;
  assert_int_equal(pu_write(pool, 0, &s, &n, 1, PKV_FORMAT_F32, rows, rows), PKV_OK);
  assert_int_equal(pkv_pool_destroy(pool), PKV_OK);

  assert_int_equal(pkv_pool_create(ctx, &d, &pool), PKV_OK);
  assert_int_equal(pkv_seq_alloc(pool, &s), PKV_OK);
  assert_int_equal(pkv_append(pool, &s, &n, 1), PKV_OK);
  float q[QH * D], out[QH * D], lse[QH];
  for (int i = 0; i < QH * D; i++) q[i] = 1.0f, out[i] = NAN;
  pkv_decode_args a = pu_decode_args(0, &s, 1, QH, q, out, lse);
  assert_int_equal(pkv_decode(pool, &a), PKV_OK);
  for (int i = 0; i < QH * D; i++)
    if (out[i] != 0.0f) fail_msg("out[%d] = %g over never-written slots: expected 0", i, (double)out[i]);
  for (int h = 0; h < QH; h++)
    if (!(fabs(lse[h] - log((double)n)) <= 1e-5)) fail_msg("lse[%d] = %.7f, expected log(%u)", h, (double)lse[h], n);
  free(rows);
  pu_close(ctx, pool);
}

int main(void) {
  pu_run_backend(); /* a run without its backend (PKV_BACKEND, PKV_CPU_KERNEL) skips */
  g_seed = tu_seed();
  struct CMUnitTest tests[TU_COUNT(matrix) + TU_COUNT(split) + TU_COUNT(spec) + TU_COUNT(interleave) + 1];
  size_t n = 0;
  const size_t plain = plain_rows();
  add_tests(tests, &n, "matrix", matrix, plain, matrix_case);
  add_tests(tests, &n, "fp8", matrix + plain, TU_COUNT(matrix) - plain, matrix_case);
  add_tests(tests, &n, "split", split, TU_COUNT(split), split_case);
  add_tests(tests, &n, "spec", spec, TU_COUNT(spec), spec_case);
  add_tests(tests, &n, "interleave", interleave, TU_COUNT(interleave), interleave_case);
  const size_t named = n; /* add_tests' names are allocated */
  tests[n++] = (struct CMUnitTest)cmocka_unit_test(unwritten_slots_read_as_zeros);
  int failed = tu_run_group("decode", tests, n, NULL, NULL);
  for (size_t i = 0; i < named; i++) free((void *)tests[i].name);
  return failed;
}
