/* pkv_extend against the float64 oracle.
 *
 * As in test_decode.c, the test keeps its own copy of what every page holds (each value written, as
 * the source format stores it, rounded to the page format by tu_round_trip) and the oracle computes,
 * in double, each query's attention over the positions it sees: causal, or the positions before the
 * new tokens plus the new tokens its mask row marks. Every call's out and lse are poisoned with NaN
 * first, and every element must be written.
 *
 * The cases:
 *   matrix   every K/V format pair x head_dim 32/64/128/256, GQA groups 1..8 (and 16) spread over
 *            them: a ragged batch (an empty sequence, T_b = 0, a sequence named twice, lengths
 *            straddling pages) in shuffled pages, over two layers of different data;
 *   chunks   a prompt fed as several chunks over the growing cache gives what one whole call gives;
 *   prefix   a prefix forked into children, each extended with its own new tokens in one call;
 *   tree     random tree masks (each new token sees its ancestors and itself), two over the same tokens;
 *   decode   extend with T_b <= 8 gives pkv_decode's bits (q_tokens = T_b, chunk_pages = UINT32_MAX),
 *            on the CPU backend;
 *   random   seeded engine scenarios: prefill chunks, decode steps, forks and truncations, masks;
 *   plans    one call of more blocks of 8 new tokens than one GPU plan holds (1024);
 *   tiles    random pools of F16/BF16/Q8_0/Q4_0 pairs or FP8 pairs (the GPU extend kernel's: entries
 *            of 64+ new tokens in tiles of 64 query rows, float K with quantized V and Q4_0 K below
 *            head_dim 256 left to the decode kernels) at head_dim 64/128/256, GQA 1..8, every q
 *            and out format, scales that sharpen the softmax: long and short entries in one call, a
 *            forked prefix's children, T_b = 0, pages shuffled; one layer again after
 *            pkv_extend_prepare, bit for bit.
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

#define F32 PKV_FORMAT_F32
#define F16 PKV_FORMAT_F16
#define BF16 PKV_FORMAT_BF16
#define Q8_0 PKV_FORMAT_Q8_0
#define Q4_0 PKV_FORMAT_Q4_0
#define E4M3 PKV_FORMAT_FP8_E4M3
#define E5M2 PKV_FORMAT_FP8_E5M2

enum { LAYERS = 2, MAX_SEQS = 16 };

static uint64_t g_seed;
static pkv_backend g_backend; /* the backend PKV_BACKEND picks here */

typedef struct shape {
  pkv_format k, v;
  uint32_t head_dim, kv_heads, group, page_size;
  pkv_format src, q, out;
  float scale; /* 0: 1/sqrt(head_dim) */
} shape;

/* A pool and the test's copy of what its pages hold. */
typedef struct model {
  shape s;
  uint32_t row, q_heads, cap, n; /* n: sequences made so far */
  tu_rng rng;
  pkv_context *ctx;
  pkv_pool *pool;
  pkv_seq seq[MAX_SEQS];
  uint32_t len[MAX_SEQS];
  float *k[MAX_SEQS], *v[MAX_SEQS]; /* [layer][cap][kv_heads][head_dim] */
} model;

/* One call's entries: sequence index and new tokens of each, and an optional mask. */
typedef struct batch {
  uint32_t count;
  uint32_t idx[MAX_SEQS + 4];
  uint32_t offsets[MAX_SEQS + 5];
  uint8_t *mask; /* NULL: causal */
  uint64_t mask_offsets[MAX_SEQS + 4], mask_bytes;
} batch;

static void model_open(model *m, const shape *s, uint32_t cap, uint32_t pages, tu_rng rng) {
  memset(m, 0, sizeof *m);
  m->s = *s;
  m->row = s->kv_heads * s->head_dim;
  m->q_heads = s->kv_heads * s->group;
  m->cap = cap;
  m->rng = rng;
  CHECK_OK(pu_context(&m->ctx));
  pkv_pool_desc pd = pu_desc(LAYERS, s->kv_heads, s->head_dim, s->page_size, pages, MAX_SEQS, s->k, s->v);
  pd.page_order_seed = 1 + tu_below(&m->rng, 0x7fffffff);
  pd.max_sequence_length = cap;
  CHECK_OK(pkv_pool_create(m->ctx, &pd, &m->pool));
}

static uint32_t model_alloc(model *m) {
  assert_true(m->n < MAX_SEQS);
  const uint32_t i = m->n++;
  CHECK_OK(pkv_seq_alloc(m->pool, &m->seq[i]));
  m->k[i] = pu_malloc((size_t)LAYERS * m->cap * m->row * sizeof(float));
  m->v[i] = pu_malloc((size_t)LAYERS * m->cap * m->row * sizeof(float));
  return i;
}

static uint32_t model_fork(model *m, uint32_t parent) {
  const uint32_t i = model_alloc(m);
  CHECK_OK(pkv_seq_free(m->pool, m->seq[i]));
  CHECK_OK(pkv_seq_fork(m->pool, m->seq[parent], &m->seq[i]));
  m->len[i] = m->len[parent];
  memcpy(m->k[i], m->k[parent], (size_t)LAYERS * m->cap * m->row * sizeof(float));
  memcpy(m->v[i], m->v[parent], (size_t)LAYERS * m->cap * m->row * sizeof(float));
  return i;
}

static void model_close(model *m) {
  CHECK_OK(pkv_pool_destroy(m->pool));
  CHECK_OK(pkv_context_destroy(m->ctx));
  for (uint32_t i = 0; i < m->n; i++) {
    free(m->k[i]);
    free(m->v[i]);
  }
}

static size_t at(const model *m, uint32_t layer, uint32_t pos) { return ((size_t)layer * m->cap + pos) * m->row; }

/* Appends n_new tokens to sequence i and writes random rows for them in every layer. */
static void model_grow(model *m, uint32_t i, uint32_t n_new) {
  if (n_new == 0) return;
  assert_true(m->len[i] + n_new <= m->cap);
  CHECK_OK(pkv_append(m->pool, &m->seq[i], &n_new, 1));
  m->len[i] += n_new;
  const size_t values = (size_t)n_new * m->row;
  void *kb = pu_malloc(values * 4), *vb = pu_malloc(values * 4);
  for (uint32_t l = 0; l < LAYERS; l++) {
    for (int part = 0; part < 2; part++) {
      void *buf = part ? vb : kb;
      float *kept = (part ? m->v[i] : m->k[i]) + at(m, l, m->len[i] - n_new);
      for (size_t e = 0; e < values; e++) {
        tu_store(m->s.src, buf, e, (float)tu_uniform(&m->rng, -1.0, 1.0));
        kept[e] = tu_load(m->s.src, buf, e);
      }
      tu_round_trip(part ? m->s.v : m->s.k, kept, values, kept); /* 32-groups never straddle heads */
    }
    CHECK_OK(pu_write(m->pool, l, &m->seq[i], &n_new, 1, m->s.src, kb, vb));
  }
  free(kb);
  free(vb);
}

static void batch_add(batch *b, uint32_t idx, uint32_t tokens) {
  assert_true(b->count < MAX_SEQS + 4);
  if (b->count == 0) b->offsets[0] = 0;
  b->idx[b->count] = idx;
  b->offsets[b->count + 1] = b->offsets[b->count] + tokens;
  b->count++;
}

static uint32_t batch_tokens(const batch *b, uint32_t e) { return b->offsets[e + 1] - b->offsets[e]; }
static size_t batch_rows(const model *m, const batch *b) { return (size_t)b->offsets[b->count] * m->q_heads; }

/* Random tree masks for every entry, packed one after another: token i's parent is a random earlier
 * new token (or none), and it sees its parent's ancestors and itself. */
static void batch_tree_masks(model *m, batch *b) {
  uint64_t bytes = 0;
  for (uint32_t e = 0; e < b->count; e++) {
    b->mask_offsets[e] = bytes;
    bytes += (uint64_t)batch_tokens(b, e) * ((batch_tokens(b, e) + 7) / 8);
  }
  b->mask = calloc(bytes + 1, 1);
  b->mask_bytes = bytes;
  for (uint32_t e = 0; e < b->count; e++) {
    const uint32_t n = batch_tokens(b, e), rb = (n + 7) / 8;
    uint8_t *mask = b->mask + b->mask_offsets[e];
    for (uint32_t i = 0; i < n; i++) {
      uint8_t *row = mask + (size_t)i * rb;
      if (i > 0 && tu_below(&m->rng, 4) != 0) memcpy(row, mask + (size_t)tu_below(&m->rng, i) * rb, rb);
      row[i / 8] |= (uint8_t)(1u << (i % 8));
    }
  }
}

static void random_q(model *m, const batch *b, void *q) {
  for (size_t i = 0; i < batch_rows(m, b) * m->s.head_dim; i++)
    tu_store(m->s.q, q, i, (float)tu_uniform(&m->rng, -2.0, 2.0));
}

static pkv_extend_args extend_args(model *m, const batch *b, pkv_seq *seqs, uint32_t layer, const void *q, void *out,
                                   float *lse) {
  for (uint32_t e = 0; e < b->count; e++) seqs[e] = m->seq[b->idx[e]];
  pkv_extend_args a = pu_extend_args(layer, seqs, b->count, m->q_heads, b->offsets, q, out, lse);
  a.scale = m->s.scale;
  a.q_format = m->s.q;
  a.out_format = m->s.out;
  a.mask = b->mask;
  a.mask_offsets = b->mask ? b->mask_offsets : NULL;
  a.mask_bytes = b->mask_bytes;
  return a;
}

/* Extends one layer of the batch into NaN-poisoned out and lse; every element must be written. */
static void run_extend(model *m, const batch *b, uint32_t layer, const void *q, void *out, float *lse) {
  const size_t values = batch_rows(m, b) * m->s.head_dim;
  for (size_t i = 0; i < values; i++) tu_store(m->s.out, out, i, NAN);
  for (size_t i = 0; i < batch_rows(m, b); i++) lse[i] = NAN;
  pkv_seq seqs[MAX_SEQS + 4];
  const pkv_extend_args a = extend_args(m, b, seqs, layer, q, out, lse);
  CHECK_OK(pkv_extend(m->pool, &a));
  for (size_t i = 0; i < values; i++)
    if (isnan(tu_load(m->s.out, out, i))) fail_msg("layer %u: out[%zu] was not written", layer, i);
  for (size_t i = 0; i < batch_rows(m, b); i++)
    if (isnan(lse[i])) fail_msg("layer %u: lse[%zu] was not written", layer, i);
}

typedef struct worst {
  double out, lse;
} worst;

/* Every row of one extend of `layer` against the oracle. */
static void check_oracle(const model *m, const batch *b, uint32_t layer, const void *q, const void *out,
                         const float *lse, const char *what, worst *w) {
  const oracle_tolerance tol = oracle_tolerance_for(m->s.k);
  const double out_tol = tol.out_rel + oracle_out_rounding(m->s.out);
  const uint32_t hd = m->s.head_dim;
  const double scale = m->s.scale != 0.0f ? (double)m->s.scale : 1.0 / sqrt((double)hd);
  double *qd = pu_malloc(hd * sizeof *qd), *ref = pu_malloc(hd * sizeof *ref), *mag = pu_malloc(hd * sizeof *mag);
  uint8_t *seen = pu_malloc(m->cap);
  for (uint32_t e = 0; e < b->count; e++) {
    const uint32_t s = b->idx[e], n = batch_tokens(b, e), before = m->len[s] - n, rb = (n + 7) / 8;
    for (uint32_t i = 0; i < n; i++) {
      /* Query i sees every position before the new tokens, and new token j where the mask (or
       * causality, j <= i) lets it. */
      memset(seen, 1, before);
      for (uint32_t j = 0; j < n; j++) {
        const uint8_t *row = b->mask ? b->mask + b->mask_offsets[e] + (size_t)i * rb : NULL;
        seen[before + j] = row ? (row[j / 8] >> (j % 8)) & 1 : j <= i;
      }
      for (uint32_t h = 0; h < m->q_heads; h++) {
        const size_t li = ((size_t)b->offsets[e] + i) * m->q_heads + h, o = li * hd;
        const size_t kv = at(m, layer, 0) + (size_t)(h / m->s.group) * hd;
        for (uint32_t d = 0; d < hd; d++) qd[d] = tu_load(m->s.q, q, o + d);
        double ref_lse;
        oracle_attend_seen(qd, m->k[s] + kv, m->v[s] + kv, m->row, before + i + 1, seen, hd, scale, ref, mag, &ref_lse);
        double err2 = 0.0, ref2 = 0.0;
        for (uint32_t d = 0; d < hd; d++) {
          const double diff = (double)tu_load(m->s.out, out, o + d) - ref[d];
          err2 += diff * diff;
          ref2 += ref[d] * ref[d];
        }
        const double rel = sqrt(err2 / fmax(ref2, 1e-300));
        if (rel > out_tol)
          fail_msg("%s: layer %u entry %u (length %u, %u new) query %u head %u: relative error %.3g > %.3g", what,
                   layer, e, m->len[s], n, i, h, rel, out_tol);
        const double le = fabs((double)lse[li] - ref_lse);
        if (!(le <= tol.lse_abs))
          fail_msg("%s: layer %u entry %u query %u head %u: lse %.9g, expected %.9g", what, layer, e, i, h,
                   (double)lse[li], ref_lse);
        w->out = fmax(w->out, rel);
        w->lse = fmax(w->lse, le);
      }
    }
  }
  free(seen);
  free(qd);
  free(ref);
  free(mag);
}

/* Extends every layer of the batch with fresh q and checks each against the oracle. */
static void extend_and_check(model *m, const batch *b, const char *what, worst *w) {
  const size_t rows = batch_rows(m, b);
  void *q = pu_malloc(rows * m->s.head_dim * 4), *out = pu_malloc(rows * m->s.head_dim * 4);
  float *lse = pu_malloc(rows * sizeof *lse);
  for (uint32_t l = 0; l < LAYERS; l++) {
    random_q(m, b, q);
    run_extend(m, b, l, q, out, lse);
    check_oracle(m, b, l, q, out, lse, what, w);
  }
  free(q);
  free(out);
  free(lse);
}

static void report(const model *m, const worst *w) {
  const oracle_tolerance tol = oracle_tolerance_for(m->s.k);
  print_message("    worst: out %.2e (allowed %.2e), lse %.2e (allowed %.2e)\n", w->out,
                tol.out_rel + oracle_out_rounding(m->s.out), w->lse, tol.lse_abs);
}

/* Extend's bits equal decode's on the CPU backend (its extend runs decode's attention item for item);
 * a GPU backend plans an extend's blocks of tokens under its own kernel configuration. */
static void need_cpu_bits(void) {
  if (g_backend != PKV_BACKEND_CPU) skip();
}

/* ---------------------------------------------------------------------------------------------------
 * The matrix: 25 format pairs x 4 head_dims; group, kv_heads, page size, I/O formats and scale spread.
 * ------------------------------------------------------------------------------------------------- */
static const pkv_format formats[7] = {F32, F16, BF16, Q8_0, Q4_0, E4M3, E5M2};
static const uint32_t head_dims[4] = {32, 64, 128, 256};
static const uint32_t page_sizes[5] = {1, 4, 16, 64, 8};
static const pkv_format io[3] = {F32, F16, BF16};
/* Cases 0-99: every pair of the first five formats at every head_dim; 100-123: the 24 pairs with an
 * FP8 side (at scale 1: test_fp8 sets scales), one head_dim each. */
enum { MATRIX = 124 };

static shape matrix_shape(uint32_t c) {
  shape s;
  if (c < 100) {
    s.k = formats[c / 20];
    s.v = formats[c / 4 % 5];
  } else { /* the (k, v) pairs of 7 formats with k or v one of the last two */
    uint32_t left = c - 100, pair = 0;
    for (;; pair++)
      if ((pair / 7 >= 5 || pair % 7 >= 5) && left-- == 0) break;
    s.k = formats[pair / 7];
    s.v = formats[pair % 7];
  }
  s.head_dim = head_dims[c % 4];
  s.group = c % 25 == 24 ? 16 : 1 + c % 8;
  s.kv_heads = 1 + c % 3;
  s.page_size = page_sizes[c % 5];
  s.src = io[c % 3];
  s.q = io[c / 3 % 3];
  s.out = io[c / 9 % 3];
  /* Keeps quantized K's logits' spread <= ~1 (oracle_tolerance_for); float K gets the default too. */
  s.scale = tu_quantized(s.k) ? 0.3f / sqrtf((float)s.head_dim) * 2.0f : (c % 2 ? 0.0f : 0.2f);
  return s;
}

static void matrix_case(void **state) {
  const uint32_t c = (uint32_t)(uintptr_t)*state;
  const shape s = matrix_shape(c);
  tu_rng r = tu_rng_stream(g_seed, c);
  model m;
  model_open(&m, &s, 400, 1024, r);
  const uint32_t p = s.page_size;
  /* lengths before the new tokens, and new tokens: crossing pages, from nothing, none */
  const uint32_t before[6] = {0, p - 1 + (p == 1), 2 * p + 1, 0, 90 + tu_below(&m.rng, 60), 5};
  const uint32_t fresh[6] = {p + 3, 2 * p + 1, 1, 0, 40 + tu_below(&m.rng, 40), 0};
  batch b = {0};
  for (uint32_t i = 0; i < 6; i++) {
    const uint32_t s_i = model_alloc(&m);
    model_grow(&m, s_i, before[i]);
  }
  for (uint32_t i = 0; i < 6; i++) model_grow(&m, i, fresh[i]);
  /* Shuffled entries; sequence 5 keeps all its tokens old (T_b = 0), sequence 3 is empty, sequence 1
   * is named twice with the same new tokens. */
  uint32_t order[6] = {0, 1, 2, 3, 4, 5};
  tu_shuffle(&m.rng, order, 6);
  for (uint32_t i = 0; i < 6; i++) batch_add(&b, order[i], fresh[order[i]]);
  batch_add(&b, 1, fresh[1]);
  worst w = {0, 0};
  extend_and_check(&m, &b, "matrix", &w);
  report(&m, &w);
  model_close(&m);
}

/* ---------------------------------------------------------------------------------------------------
 * Chunked prefill equals one whole call; a prefix hit; tree masks; decode's bits.
 * ------------------------------------------------------------------------------------------------- */
static const shape few[] = {
    {F16, F16, 128, 2, 4, 16, F16, F16, F32, 0.0f},
    {Q8_0, Q4_0, 64, 1, 8, 8, F32, BF16, F16, 0.15f},
    {F32, BF16, 256, 2, 1, 4, BF16, F32, F32, 0.0f},
    {Q4_0, F16, 32, 3, 6, 64, F32, F16, BF16, 0.2f},
    {BF16, Q8_0, 128, 1, 3, 16, F16, F32, F32, 0.0f},
};

/* The chunks and the whole call sum the same terms, so they agree within a bound and the output
 * format's rounding: 1e-5 on the CPU backend; a GPU backend may split them into other split-K chunks
 * (its plans follow each call's shape): 3e-5 (1.07e-5 measured for 500 tokens of BF16 K in 7 chunks);
 * and with quantized K a chunk of 64+ new tokens runs on the extend kernel, which rounds K's values
 * to f16 where the decode kernels quantize q to int8 in two parts, moving a logit by up to ~2^-11 of
 * its size: 1e-3 (1.8e-4 measured on lse, Q8_0 K at head_dim 64). Both on an H100, 2026-12-07,
 * test_extend of 4608525 (docs/cuda.md). */
static double agree_bound(const shape *s) {
  return g_backend == PKV_BACKEND_CPU ? 1e-5 : tu_quantized(s->k) ? 1e-3 : 3e-5;
}
static double agree_tol(const shape *s) { return agree_bound(s) + 2.0 * oracle_out_rounding(s->out); }

static void chunks_case(void **state) {
  const shape *s = *state;
  tu_rng r = tu_rng_stream(g_seed, 1000 + (uint64_t)(s - few));
  model m;
  model_open(&m, s, 700, 700, r);
  const uint32_t prompt = 300 + tu_below(&m.rng, 300), i = model_alloc(&m);
  const uint32_t hd = s->head_dim;
  const size_t rows = (size_t)prompt * m.q_heads;
  void *q = pu_malloc(rows * hd * 4), *chunked = pu_malloc(rows * hd * 4), *whole = pu_malloc(rows * hd * 4);
  float *chunked_lse = pu_malloc(rows * 4), *whole_lse = pu_malloc(rows * 4);
  batch all = {0};
  batch_add(&all, i, prompt);
  random_q(&m, &all, q);
  /* Chunks of random sizes, each extended over the cache grown so far, its q and out rows the prompt's. */
  const size_t row_q = (size_t)m.q_heads * hd * tu_elem_bytes(s->q), row_out = (size_t)m.q_heads * hd * tu_elem_bytes(s->out);
  worst w = {0, 0};
  uint32_t chunks = 0;
  for (uint32_t done = 0; done < prompt; chunks++) {
    const uint32_t n = tu_min_u32(prompt - done, 1 + tu_below(&m.rng, 130));
    model_grow(&m, i, n);
    batch b = {0};
    batch_add(&b, i, n);
    run_extend(&m, &b, 1, (const uint8_t *)q + done * row_q, (uint8_t *)chunked + done * row_out,
               chunked_lse + (size_t)done * m.q_heads);
    check_oracle(&m, &b, 1, (const uint8_t *)q + done * row_q, (uint8_t *)chunked + done * row_out,
                 chunked_lse + (size_t)done * m.q_heads, "chunk", &w);
    done += n;
  }
  run_extend(&m, &all, 1, q, whole, whole_lse);
  check_oracle(&m, &all, 1, q, whole, whole_lse, "whole", &w);
  for (size_t row = 0; row < rows; row++) {
    double d2 = 0.0, r2 = 0.0;
    for (uint32_t d = 0; d < hd; d++) {
      const double a = tu_load(s->out, whole, row * hd + d), c = tu_load(s->out, chunked, row * hd + d);
      d2 += (a - c) * (a - c);
      r2 += a * a;
    }
    if (sqrt(d2 / fmax(r2, 1e-300)) > agree_tol(s) || fabs((double)whole_lse[row] - chunked_lse[row]) > agree_bound(s))
      fail_msg("query %zu head %zu: %u chunks differ from the whole call by %.3g (lse %.9g vs %.9g)", row / m.q_heads,
               row % m.q_heads, chunks, sqrt(d2 / fmax(r2, 1e-300)), (double)chunked_lse[row], (double)whole_lse[row]);
  }
  print_message("    %u tokens in %u chunks\n", prompt, chunks);
  report(&m, &w);
  free(q);
  free(chunked);
  free(whole);
  free(chunked_lse);
  free(whole_lse);
  model_close(&m);
}

/* A cached prefix (ending inside a page) forked into children; each child appends its own tokens
 * (the first copies the shared partial page) and all are extended in one call, the prefix beside
 * them with none. */
static void prefix_case(void **state) {
  const shape *s = *state;
  tu_rng r = tu_rng_stream(g_seed, 2000 + (uint64_t)(s - few));
  model m;
  model_open(&m, s, 600, 600, r);
  const uint32_t parent = model_alloc(&m);
  model_grow(&m, parent, (100 + tu_below(&m.rng, 300)) | 1);
  batch b = {0};
  batch_add(&b, parent, 0);
  for (uint32_t c = 0; c < 4; c++) {
    const uint32_t child = model_fork(&m, parent), n = 1 + tu_below(&m.rng, 70);
    model_grow(&m, child, n);
    batch_add(&b, child, n);
  }
  worst w = {0, 0};
  extend_and_check(&m, &b, "prefix", &w);
  report(&m, &w);
  model_close(&m);
}

static void tree_case(void **state) {
  const shape *s = *state;
  tu_rng r = tu_rng_stream(g_seed, 3000 + (uint64_t)(s - few));
  model m;
  model_open(&m, s, 400, 1200, r);
  batch b = {0};
  for (uint32_t i = 0; i < 4; i++) {
    const uint32_t seq = model_alloc(&m), n = i == 3 ? 0 : 1 + tu_below(&m.rng, 40);
    model_grow(&m, seq, tu_below(&m.rng, 200) + n);
    batch_add(&b, seq, n);
  }
  batch_tree_masks(&m, &b);
  worst w = {0, 0};
  extend_and_check(&m, &b, "tree", &w);
  /* Another tree over the same new tokens: the call's blocks are the last call's, its mask is not. */
  free(b.mask);
  batch_tree_masks(&m, &b);
  extend_and_check(&m, &b, "second tree", &w);
  /* One mask shared by every entry of the same token count: equal offsets. */
  batch same = {0};
  for (uint32_t i = 0; i < 3; i++) batch_add(&same, i, 0);
  free(b.mask);
  const uint32_t n = tu_min_u32(tu_min_u32(m.len[0], m.len[1]), tu_min_u32(m.len[2], 20));
  same.offsets[1] = n, same.offsets[2] = 2 * n, same.offsets[3] = 3 * n;
  batch one = {0};
  batch_add(&one, 0, n);
  batch_tree_masks(&m, &one);
  same.mask = one.mask;
  same.mask_bytes = one.mask_bytes;
  extend_and_check(&m, &same, "shared tree", &w);
  report(&m, &w);
  free(one.mask);
  model_close(&m);
}

/* T_b <= 8 new tokens: pkv_decode with q_tokens = T_b over the unsplit sequence computes the same
 * sums in the same order, so the bits agree. */
static void decode_case(void **state) {
  need_cpu_bits();
  const shape *s = *state;
  tu_rng r = tu_rng_stream(g_seed, 4000 + (uint64_t)(s - few));
  model m;
  model_open(&m, s, 600, 1200, r);
  for (uint32_t i = 0; i < 4; i++) model_grow(&m, model_alloc(&m), i == 0 ? 0 : 8 + tu_below(&m.rng, 500));
  for (uint32_t t = 1; t <= 8; t++) {
    batch b = {0};
    pkv_seq seqs[4];
    for (uint32_t i = 0; i < 4; i++) batch_add(&b, i, m.len[i] ? t : 0);
    batch dec = {0}; /* decode's q rows: the empty sequence's too */
    for (uint32_t i = 0; i < 4; i++) batch_add(&dec, i, t), seqs[i] = m.seq[i];
    const size_t rows = batch_rows(&m, &dec), bytes = rows * s->head_dim * tu_elem_bytes(s->out);
    void *q = pu_malloc(rows * s->head_dim * 4), *out = pu_malloc(bytes), *dout = pu_malloc(bytes);
    float *lse = pu_malloc(rows * 4), *dlse = pu_malloc(rows * 4);
    random_q(&m, &dec, q);
    /* The empty sequence's rows come first: extend's q starts after them. */
    const size_t skip = (size_t)t * m.q_heads;
    run_extend(&m, &b, 0, (const uint8_t *)q + skip * s->head_dim * tu_elem_bytes(s->q),
               (uint8_t *)out + skip * s->head_dim * tu_elem_bytes(s->out), lse + skip);
    pkv_decode_args d = pu_decode_args(0, seqs, 4, m.q_heads, q, dout, dlse);
    d.q_tokens = t;
    d.scale = s->scale;
    d.q_format = s->q;
    d.out_format = s->out;
    d.chunk_pages = UINT32_MAX;
    CHECK_OK(pkv_decode(m.pool, &d));
    const size_t tail = (rows - skip) * s->head_dim * tu_elem_bytes(s->out);
    if (memcmp((uint8_t *)out + skip * s->head_dim * tu_elem_bytes(s->out),
               (uint8_t *)dout + skip * s->head_dim * tu_elem_bytes(s->out), tail) != 0 ||
        memcmp(lse + skip, dlse + skip, (rows - skip) * 4) != 0)
      fail_msg("%u new tokens: extend's bits differ from decode's", t);
    free(q);
    free(out);
    free(dout);
    free(lse);
    free(dlse);
  }
  model_close(&m);
}

/* ---------------------------------------------------------------------------------------------------
 * Random engine scenarios: each step either prefills a chunk of some sequences, decodes a token of
 * others, forks, truncates, or verifies a tree, all extended in one ragged call checked by the oracle.
 * ------------------------------------------------------------------------------------------------- */
enum { SCENARIOS = 12, STEPS = 10 };

static void random_case(void **state) {
  const uint32_t k = (uint32_t)(uintptr_t)*state;
  tu_rng r = tu_rng_stream(g_seed, 5000 + k);
  shape s = matrix_shape(tu_below(&r, MATRIX));
  s.page_size = 1u << tu_below(&r, 8);
  model m;
  model_open(&m, &s, 512, 4096, r);
  print_message("    k=%s v=%s hd=%u kvh=%u group=%u page=%u\n", pkv_format_name(s.k), pkv_format_name(s.v), s.head_dim,
                s.kv_heads, s.group, s.page_size);
  for (uint32_t i = 0; i < 4; i++) model_alloc(&m);
  worst w = {0, 0};
  for (uint32_t step = 0; step < STEPS; step++) {
    const uint32_t action = tu_below(&m.rng, 4);
    if (action == 0 && m.n < MAX_SEQS) model_fork(&m, tu_below(&m.rng, m.n));
    if (action == 1) {
      const uint32_t i = tu_below(&m.rng, m.n), keep = tu_below(&m.rng, m.len[i] + 1);
      CHECK_OK(pkv_seq_truncate(m.pool, m.seq[i], keep));
      m.len[i] = keep;
    }
    batch b = {0};
    for (uint32_t i = 0; i < m.n; i++) {
      if (tu_below(&m.rng, 3) == 0) continue;
      const uint32_t room = m.cap - m.len[i], kind = tu_below(&m.rng, 3);
      const uint32_t n = tu_min_u32(room, kind == 0 ? 1 : kind == 1 ? 1 + tu_below(&m.rng, 8) : tu_below(&m.rng, 100));
      model_grow(&m, i, n);
      batch_add(&b, i, n);
    }
    if (b.count == 0) continue;
    if (action == 3) batch_tree_masks(&m, &b);
    extend_and_check(&m, &b, "random", &w);
    free(b.mask);
  }
  report(&m, &w);
  model_close(&m);
}

/* ---------------------------------------------------------------------------------------------------
 * An extend the GPU backends plan in several parts (1024 blocks of 8 new tokens each): 16 entries of
 * 513-552 new tokens over 0-63 cached, so that a part ends inside an entry; small heads keep the
 * oracle cheap, the formats random. A decode of the sequences' last tokens, prepared before the
 * extend and run again after it, gives the same bits: an extend leaves the decode's plan in place.
 * ------------------------------------------------------------------------------------------------- */

/* A decode of every sequence's last token into NaN-poisoned out and lse. */
static void decode_last(model *m, const void *q, void *out, float *lse) {
  pkv_seq seqs[MAX_SEQS];
  for (uint32_t i = 0; i < m->n; i++) seqs[i] = m->seq[i];
  const size_t rows = (size_t)m->n * m->q_heads;
  for (size_t i = 0; i < rows * m->s.head_dim; i++) tu_store(m->s.out, out, i, NAN);
  for (size_t i = 0; i < rows; i++) lse[i] = NAN;
  pkv_decode_args d = pu_decode_args(0, seqs, m->n, m->q_heads, q, out, lse);
  d.scale = m->s.scale;
  d.q_format = m->s.q;
  d.out_format = m->s.out;
  CHECK_OK(pkv_decode(m->pool, &d));
}

static void plans_case(void **state) {
  (void)state;
  tu_rng r = tu_rng_stream(g_seed, 6000);
  shape s = {formats[tu_below(&r, 7)], formats[tu_below(&r, 7)], 32, 1, 1 + tu_below(&r, 2), 16, F16, F16, F32, 0.0f};
  s.scale = tu_quantized(s.k) ? 0.3f / sqrtf(32.0f) * 2.0f : 0.0f;
  model m;
  model_open(&m, &s, 640, MAX_SEQS * 40, r);
  print_message("    k=%s v=%s group=%u\n", pkv_format_name(s.k), pkv_format_name(s.v), s.group);
  batch b = {0};
  for (uint32_t i = 0; i < MAX_SEQS; i++) model_grow(&m, model_alloc(&m), tu_below(&m.rng, 64));
  for (uint32_t i = 0; i < MAX_SEQS; i++) {
    const uint32_t n = 513 + tu_below(&m.rng, 40);
    model_grow(&m, i, n);
    batch_add(&b, i, n);
  }
  batch last = {0};
  for (uint32_t i = 0; i < MAX_SEQS; i++) batch_add(&last, i, 1);
  const size_t rows = batch_rows(&m, &last), bytes = rows * s.head_dim * tu_elem_bytes(s.out);
  void *q = pu_malloc(rows * s.head_dim * 4), *before = pu_malloc(bytes), *after = pu_malloc(bytes);
  float *before_lse = pu_malloc(rows * 4), *after_lse = pu_malloc(rows * 4);
  random_q(&m, &last, q);
  decode_last(&m, q, before, before_lse);
  worst w = {0, 0};
  extend_and_check(&m, &b, "plans", &w);
  decode_last(&m, q, after, after_lse);
  if (memcmp(before, after, bytes) != 0 || memcmp(before_lse, after_lse, rows * 4) != 0)
    fail_msg("a decode after the extend differs from the same decode before it");
  report(&m, &w);
  free(q);
  free(before);
  free(after);
  free(before_lse);
  free(after_lse);
  model_close(&m);
}

/* ---------------------------------------------------------------------------------------------------
 * The GPU extend kernel's pools: any pair of F16, BF16, Q8_0 and Q4_0, or of the FP8 formats, at
 * head_dim 64/128/256; a call mixes entries of 64-250 new tokens (tiles of 64 query rows, the last one
 * partly past the entry's rows) with short ones (decode's blocks) and none, over 0-400 cached
 * positions, and a prefix's forked children.
 * ------------------------------------------------------------------------------------------------- */
enum { TILES = 12 };

/* pkv_extend_prepare (q and out not read, NULL here) and an extend of the batch that follows give a
 * direct extend's bits, also where an extend of another batch came between (the prepared plans
 * replaced, then put back by a second prepare). */
static void prepared_bits(model *m, const batch *b, uint32_t layer) {
  batch other = {0}; /* the first entry alone, or with every token of one more */
  batch_add(&other, b->idx[0], batch_tokens(b, 0));
  if (b->count > 1) batch_add(&other, b->idx[1], m->len[b->idx[1]]);
  const size_t rows = batch_rows(m, b), most = rows > batch_rows(m, &other) ? rows : batch_rows(m, &other);
  const size_t bytes = rows * m->s.head_dim * tu_elem_bytes(m->s.out);
  void *q = pu_malloc(most * m->s.head_dim * 4), *prepared = pu_malloc(most * m->s.head_dim * 4);
  void *direct = pu_malloc(bytes);
  float *direct_lse = pu_malloc(rows * 4), *prepared_lse = pu_malloc(most * 4);
  random_q(m, rows == most ? b : &other, q);
  run_extend(m, b, layer, q, direct, direct_lse);
  pkv_seq seqs[MAX_SEQS + 4];
  const pkv_extend_args bare = extend_args(m, b, seqs, layer, NULL, NULL, NULL);
  CHECK_OK(pkv_extend_prepare(m->pool, &bare));
  run_extend(m, &other, layer, q, prepared, prepared_lse);
  CHECK_OK(pkv_extend_prepare(m->pool, &bare));
  run_extend(m, b, layer, q, prepared, prepared_lse);
  if (memcmp(direct, prepared, bytes) != 0 || memcmp(direct_lse, prepared_lse, rows * 4) != 0)
    fail_msg("layer %u: the extend after pkv_extend_prepare differs from a direct one", layer);
  free(q);
  free(direct);
  free(prepared);
  free(direct_lse);
  free(prepared_lse);
}

static void tiles_case(void **state) {
  const uint32_t k = (uint32_t)(uintptr_t)*state;
  tu_rng r = tu_rng_stream(g_seed, 7000 + k);
  static const float scales[3] = {0.0f, 0.2f, 1.5f}; /* 1.5: sharp weights, the running max moves often */
  static const pkv_format paired[6] = {F16, BF16, Q8_0, Q4_0, E4M3, E5M2};
  const uint32_t fp8 = tu_below(&r, 5) == 0 ? 4 : 0; /* FP8 K with FP8 V, else two of the first four */
  shape s = {paired[fp8 + tu_below(&r, fp8 ? 2 : 4)], paired[fp8 + tu_below(&r, fp8 ? 2 : 4)], 64u << tu_below(&r, 3),
             1 + tu_below(&r, 2), 1 + tu_below(&r, 8), 1u << tu_below(&r, 7), io[tu_below(&r, 3)], io[tu_below(&r, 3)],
             io[tu_below(&r, 3)], scales[tu_below(&r, 3)]};
  if (tu_below(&r, 2)) s.q = s.k == BF16 ? BF16 : F16; /* q in the format of K's MMAs enters them whole */
  /* Quantized K: logits' spread <= ~1 (oracle_tolerance_for). */
  if (tu_quantized(s.k)) s.scale = 0.3f / sqrtf((float)s.head_dim) * 2.0f;
  model m;
  model_open(&m, &s, 700, 4096, r);
  print_message("    k=%s v=%s hd=%u kvh=%u group=%u page=%u q=%s out=%s scale=%g\n", pkv_format_name(s.k),
                pkv_format_name(s.v), s.head_dim, s.kv_heads, s.group, s.page_size, pkv_format_name(s.q),
                pkv_format_name(s.out), (double)s.scale);
  batch b = {0};
  for (uint32_t i = 0; i < 5; i++) model_grow(&m, model_alloc(&m), tu_below(&m.rng, 400));
  const uint32_t child = model_fork(&m, 0);
  const uint32_t fresh[6] = {64 + tu_below(&m.rng, 187), 64, 1 + tu_below(&m.rng, 63), 0, 64 + tu_below(&m.rng, 187),
                             64 + tu_below(&m.rng, 100)};
  uint32_t order[6] = {0, 1, 2, 3, 4, 5};
  tu_shuffle(&m.rng, order, 6);
  for (uint32_t i = 0; i < 6; i++) {
    const uint32_t seq = order[i] == 5 ? child : order[i];
    model_grow(&m, seq, fresh[order[i]]);
    batch_add(&b, seq, fresh[order[i]]);
  }
  worst w = {0, 0};
  extend_and_check(&m, &b, "tiles", &w);
  prepared_bits(&m, &b, tu_below(&m.rng, LAYERS));
  report(&m, &w);
  model_close(&m);
}

static void add(struct CMUnitTest *t, size_t *n, const char *name, CMUnitTestFunction fn, void *state) {
  memset(&t[*n], 0, sizeof t[*n]);
  char *copy = pu_malloc(strlen(name) + 1);
  strcpy(copy, name);
  t[*n].name = copy;
  t[*n].test_func = fn;
  t[*n].initial_state = state;
  ++*n;
}

int main(void) {
  g_seed = tu_seed();
  g_backend = pu_run_backend();
  struct CMUnitTest tests[MATRIX + 4 * TU_COUNT(few) + SCENARIOS + 1 + TILES];
  size_t n = 0;
  char name[160];
  for (uint32_t c = 0; c < MATRIX; c++) {
    const shape s = matrix_shape(c);
    snprintf(name, sizeof name, "matrix k=%s v=%s hd=%u kvh=%u group=%u page=%u", pkv_format_name(s.k),
             pkv_format_name(s.v), s.head_dim, s.kv_heads, s.group, s.page_size);
    add(tests, &n, name, matrix_case, (void *)(uintptr_t)c);
  }
  const char *kinds[4] = {"chunks", "prefix", "tree", "decode"};
  const CMUnitTestFunction fns[4] = {chunks_case, prefix_case, tree_case, decode_case};
  for (uint32_t k = 0; k < 4; k++)
    for (size_t i = 0; i < TU_COUNT(few); i++) {
      snprintf(name, sizeof name, "%s k=%s v=%s hd=%u group=%u", kinds[k], pkv_format_name(few[i].k),
               pkv_format_name(few[i].v), few[i].head_dim, few[i].group);
      add(tests, &n, name, fns[k], (void *)&few[i]);
    }
  for (uint32_t k = 0; k < SCENARIOS; k++) {
    snprintf(name, sizeof name, "random %u", k);
    add(tests, &n, name, random_case, (void *)(uintptr_t)k);
  }
  add(tests, &n, "plans", plans_case, NULL);
  for (uint32_t k = 0; k < TILES; k++) {
    snprintf(name, sizeof name, "tiles %u", k);
    add(tests, &n, name, tiles_case, (void *)(uintptr_t)k);
  }
  const int failed = tu_run_group("extend", tests, n, NULL, NULL);
  for (size_t i = 0; i < n; i++) free((void *)tests[i].name);
  return failed;
}
