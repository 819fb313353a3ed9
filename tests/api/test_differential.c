/* Randomized differential test of decode: whole engine scenarios run on two pools in lockstep, one on
 * the CPU backend (the reference, one thread) and one on the backend under test (PKV_BACKEND, or the
 * first that works; where that is the CPU too, it runs with several threads). Each scenario draws a
 * pool (every K x V format pair, head_dim 32-256, GQA 1-8, page sizes 1-1024, 1-3 layers), value
 * magnitudes from 1e-6 to 1e3 (tiny quantization scales included), and a sequence of engine calls:
 * alloc, ragged appends written in every layer (F32/F16/BF16 sources), forks, truncations followed by
 * overwrites, frees, speculative steps (1-8 tokens appended, written and decoded at once), and decodes
 * of random sub-batches (empty sequences, a sequence named more than once, 1-8 query tokens, every
 * chunk_pages mode, q and out in every I/O format, with and without lse). A third of the scenarios run
 * two such pool pairs of different shapes on the same contexts, their calls interleaved, so that a
 * backend's per-context buffers serve pools of different geometries in turn. Every decode's out and lse
 * are poisoned with NaN first and compared, on both pools, with the float64 oracle of the values the
 * test wrote; errors are measured relative to max(|ref|, sum_t p_t |v_t|). Where the backend under
 * test is the CPU too, its results must be the reference's bits (it plans alike for any thread
 * count). A third of the decodes ask for attention variants (a window, a soft-cap, sinks, small
 * ALiBi slopes; pagedkv.h, section 7a).
 *
 * PKV_TEST_SEED fixes the seed; PKV_DIFF_SCENARIOS (default 150) and PKV_DIFF_SECONDS (default 60:
 * no new scenario starts after that) bound the run; PKV_DIFF_SCENARIO=k runs scenario k of the seed
 * alone, printing its calls. A failure prints the command that reproduces it.
 *
 * One file past 500 lines: the scenario generator and the lockstep comparison share the model of
 * what every sequence holds; apart, that model would cross a file boundary on every call. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "oracle.h"
#include "poolutil.h"
#include "testutil.h"

enum { MAX_SEQS = 12 };

typedef struct side {
  pkv_pool *pool;
  pkv_seq seq[MAX_SEQS];
} side;

/* What one sequence's pages hold, per layer: [layer][cap][row] floats (rounded to the page formats). */
typedef struct seq_copy {
  int live;
  uint32_t len, cap;
  float *k, *v;
} seq_copy;

/* A pair of pools in lockstep (the CPU reference and the backend under test), the test's copy of what
 * they hold, and the values it draws for them. */
typedef struct world {
  pkv_pool_desc desc;
  uint32_t group, row;  /* query heads per KV head; values per token and layer */
  double mk, mv, mq;    /* magnitudes of K, V and q values */
  int per_token;        /* each token's values get a magnitude of their own: K 0.5-2, V 1e-3-10 times */
  float scale;          /* the decodes' softmax scale (0: 1/sqrt(head_dim)) */
  uint32_t max_step;    /* most tokens one append gives a sequence */
  side ref, tgt;
  seq_copy seqs[MAX_SEQS];
} world;

/* A scenario runs one world, or two of different shapes whose calls interleave (so the backend's
 * per-context state serves pools of different geometries in turn). */
typedef struct scenario {
  uint64_t index;
  tu_rng rng;
  world worlds[2];
  uint32_t n_worlds;
  int verbose, failed;
  char log[8192];       /* the scenario's calls so far, printed when it fails */
  size_t log_len;
} scenario;

static const pkv_format page_formats[] = {PKV_FORMAT_F32,  PKV_FORMAT_F16,      PKV_FORMAT_BF16,    PKV_FORMAT_Q8_0,
                                          PKV_FORMAT_Q4_0, PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2};
static const pkv_format io_formats[] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16};

static uint64_t g_seed;
static int g_target_is_cpu;

/* Log-uniform in [lo, hi]. */
static double log_uniform(tu_rng *r, double lo, double hi) { return exp(tu_uniform(r, log(lo), log(hi))); }
/* An integer drawn log-uniformly from [lo, hi]. */
static uint32_t log_int(tu_rng *r, uint32_t lo, uint32_t hi) {
  return tu_min_u32(hi, (uint32_t)floor(log_uniform(r, lo, (double)hi + 1.0)));
}

static void note(scenario *s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (s->verbose) {
    va_list copy;
    va_copy(copy, ap);
    vprintf(fmt, copy);
    va_end(copy);
  }
  if (s->log_len < sizeof s->log - 1) {
    int n = vsnprintf(s->log + s->log_len, sizeof s->log - s->log_len, fmt, ap);
    if (n > 0) s->log_len = tu_min_u32((uint32_t)(s->log_len + (size_t)n), (uint32_t)sizeof s->log - 1);
  }
  va_end(ap);
}

/* Marks the scenario failed and says why (once: later checks of the same call are not printed). */
static void failure(scenario *s, const char *fmt, ...) {
  if (s->failed++) return;
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL scenario %llu: ", (unsigned long long)s->index);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\n  calls so far:\n%s", s->log);
  printf("  reproduce: PKV_TEST_SEED=%llu PKV_DIFF_SCENARIO=%llu %s\n", (unsigned long long)g_seed,
         (unsigned long long)s->index, g_target_is_cpu ? "PKV_BACKEND=cpu" : "");
}

/* Runs a call on both pools: both must give the same status; a failure must say why. */
static pkv_status both(scenario *s, const char *what, pkv_status a, pkv_status b) {
  if (a != b) failure(s, "%s: the CPU reference returned %s, the backend under test %s (%s)", what,
                      pkv_status_string(a), pkv_status_string(b), pkv_last_error());
  return a;
}

/* ---------------------------------------------------------------------------------------------------
 * The pools and the test's copy of them
 * ------------------------------------------------------------------------------------------------- */

/* The two contexts serve every scenario (a GPU context loads its kernels once); each scenario opens a
 * pool on each. */
static pkv_context *g_ref_ctx, *g_tgt_ctx;

/* Opens the world's pools; a failure is the scenario's, with the library's text. */
static pkv_status open_pools(scenario *s, world *w) {
  pkv_status st = pkv_pool_create(g_ref_ctx, &w->desc, &w->ref.pool);
  if (st == PKV_OK && (st = pkv_pool_create(g_tgt_ctx, &w->desc, &w->tgt.pool)) != PKV_OK) {
    failure(s, "pkv_pool_create on the backend under test: %s (%s)", pkv_status_string(st), pkv_last_error());
    pkv_pool_destroy(w->ref.pool);
    w->ref.pool = NULL;
  } else if (st != PKV_OK) {
    failure(s, "pkv_pool_create on the CPU reference: %s (%s)", pkv_status_string(st), pkv_last_error());
  }
  return st;
}

static void close_pools(world *w) {
  pkv_pool_destroy(w->ref.pool);
  pkv_pool_destroy(w->tgt.pool);
  for (uint32_t i = 0; i < MAX_SEQS; i++) {
    free(w->seqs[i].k);
    free(w->seqs[i].v);
  }
}

static size_t copy_at(const world *w, const seq_copy *c, uint32_t layer, uint32_t pos) {
  return ((size_t)layer * c->cap + pos) * w->row;
}

/* Room in the copy for `len` tokens of every layer. */
static void reserve(world *w, seq_copy *c, uint32_t len) {
  if (len <= c->cap) return;
  uint32_t cap = c->cap ? c->cap : 16;
  while (cap < len) cap *= 2;
  const size_t bytes = (size_t)w->desc.layers * cap * w->row * sizeof(float);
  float *k = pu_malloc(bytes), *v = pu_malloc(bytes);
  for (uint32_t l = 0; l < w->desc.layers; l++)
    for (uint32_t p = 0; p < c->len; p++) {
      memcpy(k + ((size_t)l * cap + p) * w->row, c->k + copy_at(w, c, l, p), w->row * sizeof(float));
      memcpy(v + ((size_t)l * cap + p) * w->row, c->v + copy_at(w, c, l, p), w->row * sizeof(float));
    }
  free(c->k);
  free(c->v);
  c->k = k, c->v = v, c->cap = cap;
}

static int live_seqs(const world *w, uint32_t *idx) {
  int n = 0;
  for (uint32_t i = 0; i < MAX_SEQS; i++)
    if (w->seqs[i].live) idx[n++] = i;
  return n;
}

static int free_slot(const world *w) {
  for (int i = 0; i < MAX_SEQS; i++)
    if (!w->seqs[i].live) return i;
  return -1;
}

/* ---------------------------------------------------------------------------------------------------
 * Engine calls
 * ------------------------------------------------------------------------------------------------- */

static void op_alloc(scenario *s, world *w) {
  const int i = free_slot(w);
  if (i < 0) return;
  pkv_status st = both(s, "pkv_seq_alloc", pkv_seq_alloc(w->ref.pool, &w->ref.seq[i]), pkv_seq_alloc(w->tgt.pool, &w->tgt.seq[i]));
  note(s, "    alloc -> #%d (%s)\n", i, pkv_status_string(st));
  if (st == PKV_OK) w->seqs[i].live = 1, w->seqs[i].len = 0;
}

static void op_free(scenario *s, world *w, uint32_t i) {
  note(s, "    free #%u\n", i);
  both(s, "pkv_seq_free", pkv_seq_free(w->ref.pool, w->ref.seq[i]), pkv_seq_free(w->tgt.pool, w->tgt.seq[i]));
  w->seqs[i].live = 0;
}

static void op_fork(scenario *s, world *w, uint32_t parent) {
  const int i = free_slot(w);
  if (i < 0) return;
  pkv_status st = both(s, "pkv_seq_fork", pkv_seq_fork(w->ref.pool, w->ref.seq[parent], &w->ref.seq[i]),
                       pkv_seq_fork(w->tgt.pool, w->tgt.seq[parent], &w->tgt.seq[i]));
  note(s, "    fork #%u -> #%d (%s)\n", parent, i, pkv_status_string(st));
  if (st != PKV_OK) return;
  seq_copy *c = &w->seqs[i], *p = &w->seqs[parent];
  c->live = 1;
  c->len = 0;
  reserve(w, c, p->len);
  for (uint32_t l = 0; l < w->desc.layers && p->len; l++) {
    memcpy(c->k + copy_at(w, c, l, 0), p->k + copy_at(w, p, l, 0), (size_t)p->len * w->row * sizeof(float));
    memcpy(c->v + copy_at(w, c, l, 0), p->v + copy_at(w, p, l, 0), (size_t)p->len * w->row * sizeof(float));
  }
  c->len = p->len;
}

static void op_truncate(scenario *s, world *w, uint32_t i) {
  const uint32_t to = tu_below(&s->rng, 4) ? w->seqs[i].len - tu_min_u32(w->seqs[i].len, 1 + tu_below(&s->rng, 9))
                                           : tu_below(&s->rng, w->seqs[i].len + 1);
  note(s, "    truncate #%u %u -> %u\n", i, w->seqs[i].len, to);
  if (both(s, "pkv_seq_truncate", pkv_seq_truncate(w->ref.pool, w->ref.seq[i], to),
           pkv_seq_truncate(w->tgt.pool, w->tgt.seq[i], to)) == PKV_OK)
    w->seqs[i].len = to;
}

/* One value of a row: uniform in [-1, 1] times the magnitude (and the token's own factor). */
static float draw(scenario *s, double magnitude) { return (float)(tu_uniform(&s->rng, -1.0, 1.0) * magnitude); }

/* Appends n[j] tokens to sequences idx[j] and writes their rows in every layer (each layer's batch in
 * its own order, from a source format of its own). */
static pkv_status op_append(scenario *s, world *w, const uint32_t *idx, const uint32_t *n, uint32_t count) {
  pkv_seq rs[MAX_SEQS] = {{0}}, ts[MAX_SEQS] = {{0}};
  uint32_t order[MAX_SEQS], bn[MAX_SEQS];
  size_t total = 0;
  for (uint32_t j = 0; j < count; j++) rs[j] = w->ref.seq[idx[j]], ts[j] = w->tgt.seq[idx[j]], total += n[j];
  pkv_status st = both(s, "pkv_append", pkv_append(w->ref.pool, rs, n, count), pkv_append(w->tgt.pool, ts, n, count));
  note(s, "    append");
  for (uint32_t j = 0; j < count; j++) note(s, " #%u+%u", idx[j], n[j]);
  note(s, " (%s)\n", pkv_status_string(st));
  if (st != PKV_OK) return st;
  for (uint32_t j = 0; j < count; j++) {
    reserve(w, &w->seqs[idx[j]], w->seqs[idx[j]].len + n[j]);
    w->seqs[idx[j]].len += n[j];
  }
  const size_t values = total * w->row;
  void *kb = pu_malloc(values * 4), *vb = pu_malloc(values * 4);
  for (uint32_t l = 0; l < w->desc.layers; l++) {
    const pkv_format src = io_formats[tu_below(&s->rng, TU_COUNT(io_formats))];
    for (uint32_t j = 0; j < count; j++) order[j] = j;
    tu_shuffle(&s->rng, order, count);
    size_t r = 0;
    for (uint32_t j = 0; j < count; j++) {
      seq_copy *c = &w->seqs[idx[order[j]]];
      rs[j] = w->ref.seq[idx[order[j]]], ts[j] = w->tgt.seq[idx[order[j]]], bn[j] = n[order[j]];
      for (uint32_t pos = c->len - bn[j]; pos < c->len; pos++, r++) {
        const double fk = w->per_token ? log_uniform(&s->rng, 0.5, 2.0) : 1.0;
        const double fv = w->per_token ? log_uniform(&s->rng, 1e-3, 1e1) : 1.0;
        float *kept_k = c->k + copy_at(w, c, l, pos), *kept_v = c->v + copy_at(w, c, l, pos);
        for (uint32_t e = 0; e < w->row; e++) {
          tu_store(src, kb, r * w->row + e, draw(s, w->mk * fk));
          tu_store(src, vb, r * w->row + e, draw(s, w->mv * fv));
          kept_k[e] = tu_load(src, kb, r * w->row + e);
          kept_v[e] = tu_load(src, vb, r * w->row + e);
        }
        tu_round_trip(w->desc.k_format, kept_k, w->row, kept_k);
        tu_round_trip(w->desc.v_format, kept_v, w->row, kept_v);
      }
    }
    both(s, "pkv_write", pu_write(w->ref.pool, l, rs, bn, count, src, kb, vb),
         pu_write(w->tgt.pool, l, ts, bn, count, src, kb, vb));
  }
  free(kb);
  free(vb);
  return st;
}

/* ---------------------------------------------------------------------------------------------------
 * Decode and its check
 * ------------------------------------------------------------------------------------------------- */

enum { MAX_VARIANT_HEADS = 64 };

typedef struct decode_call {
  uint32_t layer, count, q_tokens, q_heads, chunk_pages;
  uint32_t idx[MAX_SEQS];
  pkv_format q_format, out_format;
  int with_lse;
  uint32_t window; /* the attention variants, each off at zero */
  float softcap;
  int has_sinks, has_slopes;
  float sinks[MAX_VARIANT_HEADS], slopes[MAX_VARIANT_HEADS];
} decode_call;

/* The GPU tensor-core decode (docs/testing.md) carries each token's softmax weight P_t into the P V
 * products in f16 parts: times the token's V group scale for Q8_0/Q4_0 V, as it is for F16 V. Where
 * a part falls in f16's subnormal range it is held to a multiple of 2^-24: each of a token's (at
 * most two) parts errs by up to 2^-25. The weights are relative to a base that may lie up to one
 * (log2 units, kMaxSlack) above the largest logit, so the kernel's softmax sum is at least z / 2:
 * output d may err by up to 2^-23 sum_t |b_td| / z beyond the relative bound, b the MMA's V operand
 * (the F16 value, or the stored integer of Q8_0/Q4_0) and z the softmax sum. BF16 V takes bf16
 * parts, whose range is float32's: no slack. The scales come back from the stored values: the
 * largest magnitude of a Q8_0 group is 127 d, of a Q4_0 group 8 d. */
static void f16_weight_slack(const world *w, const double *q, const float *k, const float *v, uint32_t n,
                             double scale, double *slack) {
  const uint32_t D = w->desc.head_dim;
  const pkv_format vf = w->desc.v_format;
  const double levels = vf == PKV_FORMAT_Q8_0 ? 127.0 : vf == PKV_FORMAT_Q4_0 ? 8.0 : 0.0;
  for (uint32_t d = 0; d < D; d++) slack[d] = 0.0;
  if (vf != PKV_FORMAT_F16 && !levels) return;
  double *logit = pu_malloc((n ? n : 1) * sizeof *logit), z = 0.0;
  const double top = oracle_logits(q, k, w->row, n, D, scale, logit);
  for (uint32_t t = 0; t < n; t++) {
    const float *row = v + (size_t)t * w->row;
    z += exp(logit[t] - top);
    for (uint32_t g = 0; g < D / 32; g++) {
      double most = 1.0; /* F16 V: the values themselves */
      if (levels) {
        most = 0.0;
        for (uint32_t d = 32 * g; d < 32 * g + 32; d++) most = fmax(most, fabs((double)row[d]));
        if (most == 0.0) continue;
        most /= levels;
      }
      for (uint32_t d = 32 * g; d < 32 * g + 32; d++) slack[d] += ldexp(1.0, -23) * fabs((double)row[d]) / most;
    }
  }
  for (uint32_t d = 0; d < D; d++) slack[d] /= z > 0.0 ? z : 1.0;
  free(logit);
}

/* Checks one side's results against the oracle; returns the worst error seen (relative to the bound). */
static void check_side(scenario *s, world *w, const decode_call *c, const char *who, int gpu, const void *q, const void *out,
                       const float *lse, double *worst) {
  const uint32_t D = w->desc.head_dim, T = c->q_tokens;
  const oracle_tolerance tol = oracle_tolerance_for(w->desc.k_format);
  const double scale = w->scale != 0.0f ? (double)w->scale : 1.0 / sqrt((double)D);
  double *qd = pu_malloc(D * sizeof *qd), *ref = pu_malloc(D * sizeof *ref), *mag = pu_malloc(D * sizeof *mag),
         *slack = pu_malloc(D * sizeof *slack);
  for (uint32_t b = 0; b < c->count && !s->failed; b++) {
    const seq_copy *sc = &w->seqs[c->idx[b]];
    for (uint32_t t = 0; t < T && !s->failed; t++)
      for (uint32_t h = 0; h < c->q_heads && !s->failed; h++) {
        const size_t row = ((size_t)b * T + t) * c->q_heads + h, o = row * D;
        const uint32_t visible = sc->len ? sc->len - T + t + 1 : 0;
        for (uint32_t d = 0; d < D; d++) qd[d] = tu_load(c->q_format, q, o + d);
        const size_t kv = copy_at(w, sc, c->layer, 0) + (size_t)(h / w->group) * D;
        const float *keys = visible ? sc->k + kv : NULL, *values = visible ? sc->v + kv : NULL;
        double ref_lse;
        const oracle_variants ov = {c->window, c->softcap, c->has_slopes ? c->slopes[h] : 0.0, c->has_sinks,
                                    c->has_sinks ? c->sinks[h] : 0.0};
        oracle_attend_variants(qd, keys, values, w->row, visible, NULL, visible ? visible - 1 : 0, &ov, D, scale, ref,
                               mag, &ref_lse);
        if (gpu) f16_weight_slack(w, qd, keys, values, visible, scale, slack);
        else memset(slack, 0, D * sizeof *slack);
        double size = 0.0, err = 0.0;
        for (uint32_t d = 0; d < D; d++) size = fmax(size, fmax(fabs(ref[d]), mag[d]));
        for (uint32_t d = 0; d < D; d++) {
          const double got = tu_load(c->out_format, out, o + d);
          const double e = fabs(got - ref[d]) - oracle_half_ulp(c->out_format, ref[d]) - slack[d];
          err = fmax(err, e > 0.0 ? e / (size > 0.0 ? size : 1.0) : 0.0);
          if (isnan(got) || (visible == 0 && got != 0.0)) err = INFINITY;
        }
        /* float32 arithmetic errs relative to the logits' terms: the bounds hold up to 8 */
        const double logits = oracle_logit_magnitude(qd, keys, w->row, visible, D, scale);
        const double widen = fmax(1.0, logits / 8.0);
        const double bound = tol.out_rel * widen + oracle_out_rounding(c->out_format);
        if (!(err <= bound))
          failure(s, "%s: decode layer %u, batch position %u (#%u, length %u), token %u, head %u: output error %.3g > %.3g "
                  "(ref[0] %.6g, got[0] %.6g, size %.3g)", who, c->layer, b, c->idx[b], sc->len, t, h, err, bound, ref[0],
                  (double)tu_load(c->out_format, out, o), size);
        else if (lse && !(isinf(ref_lse) ? isinf(lse[row]) && lse[row] < 0 : fabs((double)lse[row] - ref_lse) <= tol.lse_abs * widen))
          failure(s, "%s: decode layer %u, batch position %u (#%u, length %u), token %u, head %u: lse %.9g, expected %.9g",
                  who, c->layer, b, c->idx[b], sc->len, t, h, (double)lse[row], ref_lse);
        *worst = fmax(*worst, err / bound);
      }
  }
  free(qd);
  free(ref);
  free(mag);
  free(slack);
}

static pkv_status run_decode(const world *w, const side *d, const decode_call *c, const void *q, void *out,
                             float *lse, size_t rows) {
  pkv_seq seqs[MAX_SEQS];
  for (uint32_t b = 0; b < c->count; b++) seqs[b] = d->seq[c->idx[b]];
  for (size_t i = 0; i < rows; i++) lse[i] = NAN;
  pkv_decode_args a = pu_decode_args(c->layer, seqs, c->count, c->q_heads, q, out, c->with_lse ? lse : NULL);
  a.q_tokens = c->q_tokens;
  a.scale = w->scale;
  a.q_format = c->q_format;
  a.out_format = c->out_format;
  a.chunk_pages = c->chunk_pages;
  a.window = c->window;
  a.softcap = c->softcap;
  a.sinks = c->has_sinks ? c->sinks : NULL;
  a.alibi_slopes = c->has_slopes ? c->slopes : NULL;
  return pkv_decode(d->pool, &a);
}

static void decode(scenario *s, world *w, const decode_call *call, double *worst);

/* The rest of a decode's arguments, drawn: layer, chunking, q and out formats, lse. */
static void draw_call_args(scenario *s, world *w, decode_call *c) {
  static const uint32_t chunkings[] = {0, 0, 0, 1, 2, 3, 33, UINT32_MAX};
  c->layer = tu_below(&s->rng, w->desc.layers);
  c->q_heads = w->desc.kv_heads * w->group;
  c->chunk_pages = chunkings[tu_below(&s->rng, TU_COUNT(chunkings))];
  c->q_format = io_formats[tu_below(&s->rng, TU_COUNT(io_formats))];
  c->out_format = io_formats[tu_below(&s->rng, TU_COUNT(io_formats))];
  c->with_lse = tu_below(&s->rng, 4) != 0;
  if (c->q_heads > MAX_VARIANT_HEADS || tu_below(&s->rng, 3) != 0) return;
  /* Each variant half the time; slopes small enough that the bias over thousands of positions stays
   * within float32's precision at the oracle's tolerance. */
  if (tu_below(&s->rng, 2)) c->window = 1 + tu_below(&s->rng, 4 * w->desc.page_size + 64);
  if (tu_below(&s->rng, 2)) c->softcap = (float)tu_uniform(&s->rng, 1.0, 50.0);
  c->has_sinks = (int)tu_below(&s->rng, 2);
  c->has_slopes = (int)tu_below(&s->rng, 2);
  for (uint32_t h = 0; h < c->q_heads; h++) {
    c->sinks[h] = (float)tu_uniform(&s->rng, -4.0, 4.0);
    c->slopes[h] = (float)tu_uniform(&s->rng, 0.0, 0.01);
  }
}

/* A decode of a random part of the batch with random arguments; in a quarter of them sequences are
 * drawn with replacement, so a batch may name one several times. */
static void op_decode(scenario *s, world *w, double *worst) {
  uint32_t live[MAX_SEQS];
  const uint32_t n_live = (uint32_t)live_seqs(w, live);
  if (!n_live) return;
  decode_call c;
  memset(&c, 0, sizeof c);
  if (tu_below(&s->rng, 4) == 0) {
    c.count = 1 + tu_below(&s->rng, MAX_SEQS);
    for (uint32_t b = 0; b < c.count; b++) c.idx[b] = live[tu_below(&s->rng, n_live)];
  } else {
    tu_shuffle(&s->rng, live, n_live);
    c.count = 1 + tu_below(&s->rng, n_live);
    memcpy(c.idx, live, c.count * sizeof *live);
  }
  uint32_t shortest = 8;
  for (uint32_t b = 0; b < c.count; b++)
    if (w->seqs[c.idx[b]].len) shortest = tu_min_u32(shortest, w->seqs[c.idx[b]].len);
  c.q_tokens = 1 + tu_below(&s->rng, shortest);
  draw_call_args(s, w, &c);
  decode(s, w, &c, worst);
}

/* An engine's speculative step: 1-8 new tokens appended to part of the batch, written, and decoded
 * at once as that many query tokens. */
static void op_step(scenario *s, world *w, double *worst) {
  uint32_t live[MAX_SEQS], n[MAX_SEQS];
  const uint32_t n_live = (uint32_t)live_seqs(w, live);
  if (!n_live) return;
  decode_call c;
  memset(&c, 0, sizeof c);
  tu_shuffle(&s->rng, live, n_live);
  c.count = 1 + tu_below(&s->rng, n_live);
  c.q_tokens = 1 + tu_below(&s->rng, 8);
  memcpy(c.idx, live, c.count * sizeof *live);
  for (uint32_t b = 0; b < c.count; b++) n[b] = c.q_tokens;
  if (op_append(s, w, c.idx, n, c.count) != PKV_OK) return; /* refused alike by both: the pool is full */
  draw_call_args(s, w, &c);
  decode(s, w, &c, worst);
}

/* Decodes the call on both pools and checks both. */
static void decode(scenario *s, world *w, const decode_call *call, double *worst) {
  const decode_call c = *call;
  note(s, "    decode layer %u T=%u q=%s out=%s chunk_pages %u lse %d window %u softcap %g sinks %d alibi %d:", c.layer,
       c.q_tokens, pkv_format_name(c.q_format), pkv_format_name(c.out_format), c.chunk_pages, c.with_lse, c.window,
       (double)c.softcap, c.has_sinks, c.has_slopes);
  for (uint32_t b = 0; b < c.count; b++) note(s, " #%u(%u)", c.idx[b], w->seqs[c.idx[b]].len);
  note(s, "\n");

  const size_t rows = (size_t)c.count * c.q_tokens * c.q_heads, values = rows * w->desc.head_dim;
  void *q = pu_malloc(values * 4), *out_ref = pu_malloc(values * 4), *out_tgt = pu_malloc(values * 4);
  float *lse_ref = pu_malloc(rows * sizeof(float)), *lse_tgt = pu_malloc(rows * sizeof(float));
  for (size_t i = 0; i < values; i++) {
    tu_store(c.q_format, q, i, draw(s, w->mq));
    tu_store(c.out_format, out_ref, i, NAN);
    tu_store(c.out_format, out_tgt, i, NAN);
  }
  pkv_status st = both(s, "pkv_decode", run_decode(w, &w->ref, &c, q, out_ref, lse_ref, rows),
                       run_decode(w, &w->tgt, &c, q, out_tgt, lse_tgt, rows));
  if (st == PKV_OK) {
    check_side(s, w, &c, "the CPU reference", 0, q, out_ref, c.with_lse ? lse_ref : NULL, worst);
    check_side(s, w, &c, "the backend under test", !g_target_is_cpu, q, out_tgt, c.with_lse ? lse_tgt : NULL, worst);
    /* The CPU backend plans alike for any thread count: its 1- and 3-thread results are the same bits. */
    if (g_target_is_cpu && !s->failed && (memcmp(out_ref, out_tgt, values * tu_elem_bytes(c.out_format)) != 0 ||
                                          (c.with_lse && memcmp(lse_ref, lse_tgt, rows * sizeof(float)) != 0)))
      failure(s, "the CPU backend's 1- and 3-thread results differ in their bits");
  } else if (!s->failed) {
    failure(s, "pkv_decode failed on both: %s (%s)", pkv_status_string(st), pkv_last_error());
  }
  free(q);
  free(out_ref);
  free(out_tgt);
  free(lse_ref);
  free(lse_tgt);
}

/* ---------------------------------------------------------------------------------------------------
 * Scenarios
 * ------------------------------------------------------------------------------------------------- */

/* Draws the pool and the values' magnitudes. The softmax scale keeps the logits' spread (their
 * standard deviation, mq mk sqrt(head_dim) / 3 before scaling) at 0.1-8 for float K and 0.1-1 for
 * quantized K, which oracle_tolerance_for assumes, whatever the magnitudes. */
static void draw_scenario(scenario *s, world *w) {
  tu_rng *r = &s->rng;
  static const uint32_t head_dims[] = {32, 64, 64, 128, 128, 128, 256, 256};
  static const uint32_t page_sizes[] = {1, 2, 4, 8, 16, 16, 32, 64, 256, 1024};
  pkv_pool_desc *d = &w->desc;
  *d = (pkv_pool_desc)PKV_POOL_DESC_INIT;
  d->layers = 1 + tu_below(r, 3);
  d->head_dim = head_dims[tu_below(r, TU_COUNT(head_dims))];
  d->kv_heads = 1 + tu_below(r, d->head_dim == 256 ? 4 : 8);
  d->page_size = page_sizes[tu_below(r, TU_COUNT(page_sizes))];
  d->k_format = page_formats[tu_below(r, TU_COUNT(page_formats))];
  d->v_format = page_formats[tu_below(r, TU_COUNT(page_formats))];
  d->max_sequences = tu_below(r, 2) ? MAX_SEQS : 256; /* the plan buffer's layout follows it */
  d->page_order_seed = 1 + tu_below(r, 1000000);
  w->group = 1 + tu_below(r, 8);
  w->row = d->kv_heads * d->head_dim;
  /* Tokens the pool holds: a few thousand, fewer for wide rows (the oracle's time). */
  const uint32_t tokens = log_int(r, 64, w->row * d->layers > 2048 ? 3000 : 8000);
  d->pages = (tokens + d->page_size - 1) / d->page_size + 2 * MAX_SEQS;
  w->max_step = log_int(r, 1, tokens / 2 + 1);
  if (tu_below(r, 4) == 0) {
    w->mk = w->mv = w->mq = 1.0;
    w->scale = 0.0f;
  } else {
    w->mk = log_uniform(r, 1e-3, 1e3);
    w->mv = log_uniform(r, 1e-6, 1e3);
    w->mq = log_uniform(r, 1e-2, 1e2);
    const int quantized = d->k_format == PKV_FORMAT_Q8_0 || d->k_format == PKV_FORMAT_Q4_0;
    const double spread = log_uniform(r, 0.1, quantized ? 1.0 : 8.0);
    w->scale = (float)(spread / (w->mq * w->mk * sqrt((double)d->head_dim) / 3.0));
  }
  w->per_token = tu_below(r, 4) == 0;
}

/* One call of the scenario on world w. */
static void scenario_call(scenario *s, world *w, uint32_t k, double *worst) {
  uint32_t live[MAX_SEQS];
  const uint32_t n_live = (uint32_t)live_seqs(w, live);
  const uint32_t pick = n_live ? live[tu_below(&s->rng, n_live)] : 0;
  const uint32_t what = k == 0 ? 0 : tu_below(&s->rng, 18);
  if (what < 5 && n_live) { /* ragged append to a random part of the batch */
    uint32_t idx[MAX_SEQS], n[MAX_SEQS], count = 0;
    tu_shuffle(&s->rng, live, n_live);
    for (uint32_t j = 0; j < n_live; j++)
      if (j == 0 || tu_below(&s->rng, 2)) idx[count] = live[j], n[count++] = log_int(&s->rng, 1, w->max_step);
    op_append(s, w, idx, n, count);
  } else if (what < 6) {
    op_alloc(s, w);
  } else if (what < 7 && n_live) {
    op_fork(s, w, pick);
  } else if (what < 8 && n_live && w->seqs[pick].len) {
    op_truncate(s, w, pick);
  } else if (what < 9 && n_live > 1) {
    op_free(s, w, pick);
  } else if (what < 11) {
    op_step(s, w, worst);
  } else {
    op_decode(s, w, worst);
  }
}

static void run_scenario(scenario *s, double *worst) {
  s->n_worlds = tu_below(&s->rng, 3) == 0 ? 2 : 1;
  for (uint32_t i = 0; i < s->n_worlds; i++) {
    world *w = &s->worlds[i];
    draw_scenario(s, w);
    const pkv_pool_desc *d = &w->desc;
    note(s, "    pool %u: layers %u kv_heads %u q_heads %u head_dim %u page_size %u pages %u max_sequences %u k %s v %s; "
         "magnitudes k %.3g v %.3g q %.3g%s, scale %.6g, appends up to %u\n", i, d->layers, d->kv_heads,
         d->kv_heads * w->group, d->head_dim, d->page_size, d->pages, d->max_sequences, pkv_format_name(d->k_format),
         pkv_format_name(d->v_format), w->mk, w->mv, w->mq, w->per_token ? " (per token)" : "", (double)w->scale,
         w->max_step);
    if (open_pools(s, w) != PKV_OK) {
      s->n_worlds = i;
      break;
    }
    /* A prompt for a few sequences. */
    for (uint32_t j = 0, n = 1 + tu_below(&s->rng, 6); j < n; j++) op_alloc(s, w);
  }
  /* Engine calls, each on a world drawn at random; its first call appends. */
  uint32_t calls_made[2] = {0, 0}, current = UINT32_MAX;
  const uint32_t calls = (6 + tu_below(&s->rng, 20)) * s->n_worlds;
  for (uint32_t k = 0; k < calls && !s->failed; k++) {
    const uint32_t i = tu_below(&s->rng, s->n_worlds);
    if (s->n_worlds > 1 && i != current) note(s, "  pool %u:\n", i);
    current = i;
    scenario_call(s, &s->worlds[i], calls_made[i]++, worst);
  }
  for (uint32_t i = 0; i < s->n_worlds && !s->failed; i++) {
    if (s->n_worlds > 1) note(s, "  pool %u:\n", i);
    op_decode(s, &s->worlds[i], worst);
  }
  for (uint32_t i = 0; i < s->n_worlds; i++) close_pools(&s->worlds[i]);
}

/* ---------------------------------------------------------------------------------------------------
 * Fixed scenarios: batches on which the tensor-core decode once left one sequence's output unwritten
 * (NaN where the caller's buffer was poisoned). Values of magnitude 1, the default scale.
 * ------------------------------------------------------------------------------------------------- */

typedef struct fixed_decode {
  uint32_t layer, q_tokens, chunk_pages, count;
  pkv_format q_format, out_format;
  uint32_t idx[MAX_SEQS];
} fixed_decode;

typedef struct fixed_scenario {
  const char *name;
  uint32_t layers, kv_heads, group, head_dim, page_size, pages;
  pkv_format k, v;
  uint32_t n, prompt[MAX_SEQS];    /* sequences and their prompts */
  fixed_decode before;             /* a decode of the prompts (count 0: none) */
  uint32_t step_tokens, step_n, step[MAX_SEQS]; /* then step_tokens more tokens for these sequences */
  fixed_decode after;              /* and a decode of that */
} fixed_scenario;

static const fixed_scenario fixed[] = {
    {"split 208 tokens beside short ones, page 4", 2, 8, 6, 128, 4, 758, PKV_FORMAT_F16, PKV_FORMAT_BF16, 6,
     {208, 35, 35, 5, 35, 5},
     {1, 1, UINT32_MAX, 5, PKV_FORMAT_F32, PKV_FORMAT_BF16, {3, 1, 2, 5, 0}},
     2, 4, {3, 1, 5, 4},
     {0, 2, 2, 6, PKV_FORMAT_F16, PKV_FORMAT_F32, {3, 1, 0, 2, 5, 4}}},
    {"eight short sequences in pages of 1024, Q4_0 K", 1, 2, 4, 128, 1024, 8, PKV_FORMAT_Q4_0, PKV_FORMAT_BF16, 8,
     {34, 1, 36, 35, 26, 34, 39, 0},
     {0, 1, 0, 8, PKV_FORMAT_F16, PKV_FORMAT_BF16, {0, 1, 2, 3, 4, 5, 6, 7}},
     0, 0, {0},
     {0}},
    {"ten ragged sequences, 8 query tokens, head_dim 256", 1, 4, 6, 256, 1024, 16, PKV_FORMAT_BF16, PKV_FORMAT_F16, 10,
     {686, 38, 27, 14, 1738, 34, 12, 8, 841, 9},
     {0, 8, 0, 10, PKV_FORMAT_F16, PKV_FORMAT_BF16, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}},
     0, 0, {0},
     {0}},
};

static void fixed_decode_run(scenario *s, world *w, const fixed_decode *f, double *worst) {
  if (!f->count || s->failed) return;
  decode_call c;
  memset(&c, 0, sizeof c);
  c.layer = f->layer, c.q_tokens = f->q_tokens, c.chunk_pages = f->chunk_pages, c.count = f->count;
  c.q_heads = w->desc.kv_heads * w->group;
  c.q_format = f->q_format, c.out_format = f->out_format, c.with_lse = 1;
  memcpy(c.idx, f->idx, sizeof c.idx);
  decode(s, w, &c, worst);
}

static void run_fixed(scenario *s, world *w, const fixed_scenario *f, double *worst) {
  pkv_pool_desc *d = &w->desc;
  *d = (pkv_pool_desc)PKV_POOL_DESC_INIT;
  d->layers = f->layers, d->kv_heads = f->kv_heads, d->head_dim = f->head_dim, d->page_size = f->page_size;
  d->pages = f->pages, d->k_format = f->k, d->v_format = f->v, d->page_order_seed = 1 + tu_below(&s->rng, 1000);
  w->group = f->group, w->row = f->kv_heads * f->head_dim;
  w->mk = w->mv = w->mq = 1.0;
  note(s, "    fixed scenario: %s\n", f->name);
  if (open_pools(s, w) != PKV_OK) return;
  uint32_t idx[MAX_SEQS], n[MAX_SEQS], count = 0;
  for (uint32_t i = 0; i < f->n; i++) {
    op_alloc(s, w);
    if (f->prompt[i]) idx[count] = i, n[count++] = f->prompt[i];
  }
  op_append(s, w, idx, n, count);
  fixed_decode_run(s, w, &f->before, worst);
  for (uint32_t j = 0; j < f->step_n; j++) n[j] = f->step_tokens;
  if (f->step_n && !s->failed) op_append(s, w, f->step, n, f->step_n);
  fixed_decode_run(s, w, &f->after, worst);
  close_pools(w);
}

static uint64_t env_u64(const char *name, uint64_t fallback) {
  const char *v = getenv(name);
  return v && *v ? strtoull(v, NULL, 0) : fallback;
}

int main(void) {
  g_seed = tu_seed();
  /* The backend under test: skip where it cannot be had (PKV_BACKEND names one this machine lacks);
   * threads count on the CPU backend only. */
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  cd.threads = 3;
  pkv_status st = pkv_context_create(&cd, &g_tgt_ctx);
  if (tu_backend_missing(st)) {
    printf("SKIP: no backend under test: %s\n", pkv_last_error());
    return TU_EXIT_SKIP;
  }
  cd.backend = PKV_BACKEND_CPU;
  cd.threads = 1;
  if (st != PKV_OK || (st = pkv_context_create(&cd, &g_ref_ctx)) != PKV_OK) {
    printf("FAIL: pkv_context_create: %s (%s)\n", pkv_status_string(st), pkv_last_error());
    return 1;
  }
  pkv_backend backend = PKV_BACKEND_AUTO;
  pkv_context_backend(g_tgt_ctx, &backend);
  g_target_is_cpu = backend == PKV_BACKEND_CPU;
  printf("# the CPU backend (1 thread) against the %s backend%s\n", pkv_backend_name(backend),
         g_target_is_cpu ? " (3 threads)" : "");

  /* Scenario k < TU_COUNT(fixed) is fixed scenario k; the others are drawn. */
  const char *only = getenv("PKV_DIFF_SCENARIO");
  const uint64_t first = only && *only ? strtoull(only, NULL, 0) : 0;
  const uint64_t count = only && *only ? 1 : env_u64("PKV_DIFF_SCENARIOS", 150);
  const double seconds = (double)env_u64("PKV_DIFF_SECONDS", 60);
  const time_t start = time(NULL);
  uint64_t ran = 0, failed = 0;
  double worst = 0.0;
  for (uint64_t i = first; i < first + count && difftime(time(NULL), start) < seconds; i++) {
    scenario *s = calloc(1, sizeof *s);
    if (!s) return 1;
    s->index = i;
    s->rng = tu_rng_stream(g_seed, i);
    s->verbose = only && *only;
    if (i < TU_COUNT(fixed)) run_fixed(s, &s->worlds[0], &fixed[i], &worst);
    else run_scenario(s, &worst);
    ran++;
    failed += s->failed != 0;
    if (ran % 100 == 0) printf("# %llu scenarios, %llu failed\n", (unsigned long long)ran, (unsigned long long)failed);
    free(s);
  }
  printf("# %llu scenarios run, %llu failed; worst error %.3g of its bound\n", (unsigned long long)ran,
         (unsigned long long)failed, worst);
  pkv_context_destroy(g_ref_ctx);
  pkv_context_destroy(g_tgt_ctx);
  return failed ? 1 : 0;
}
