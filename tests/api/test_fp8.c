/* FP8 pages' scales (pagedkv.h, section 5a) on whichever backend PKV_BACKEND picks, against the codes of
 * testutil's search (tu_f32_to_fp8) and the float64 oracle:
 *  - scales per tensor or per KV head, set on a new pool for all its layers: rows read back as
 *    value(fp8(x / s)) * s, bit for bit; decode and extend (of a few new tokens, and of 64-71, a GPU's
 *    extend kernel) agree with the oracle over those values;
 *  - a scale set after the rows are written applies to the stored codes: V's scale times 2 doubles
 *    every output, K's times 2 doubles every logit (the oracle over doubled K);
 *  - scales read back as set (per tensor: the same for every head; 1.0 for a plane of another format);
 *  - the backend's own conversions (a GPU's kernels) give the reference's codes for all 256 codes and
 *    for floats around each, past the largest value and non-finite;
 *  - bad scales (0, negative, NaN, infinite, a per_head other than 0/1, layers out of range, scales for
 *    a plane that is not FP8) fail and change neither a scale nor a row.
 * The pools mix FP8 with FP8 and with other formats; sizes, scales and rows are drawn from the seed. */
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

enum { LAYERS = 3, KV_HEADS = 2, GROUP = 4, Q_HEADS = KV_HEADS * GROUP, SEQS = 3, MAX_LEN = 160, FRESH = 72 };

static uint64_t g_seed;

typedef struct pool_case {
  pkv_format k, v;
  uint32_t head_dim, page_size;
  int per_head; /* the scales' shape */
} pool_case;

static const pool_case cases[] = {
    {PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E4M3, 64, 8, 0},  {PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2, 128, 16, 1},
    {PKV_FORMAT_FP8_E5M2, PKV_FORMAT_FP8_E4M3, 32, 4, 1},  {PKV_FORMAT_FP8_E5M2, PKV_FORMAT_FP8_E5M2, 256, 8, 0},
    {PKV_FORMAT_FP8_E4M3, PKV_FORMAT_F16, 128, 16, 1},     {PKV_FORMAT_BF16, PKV_FORMAT_FP8_E5M2, 64, 2, 0},
    {PKV_FORMAT_Q8_0, PKV_FORMAT_FP8_E4M3, 128, 8, 1},     {PKV_FORMAT_FP8_E5M2, PKV_FORMAT_Q4_0, 64, 16, 0},
};

/* A pool, its scales and the values its pages hold (the stored codes' values times their scales). */
typedef struct model {
  pool_case c;
  tu_rng rng;
  pkv_context *ctx;
  pkv_pool *pool;
  uint32_t row; /* kv_heads * head_dim */
  pkv_seq seq[SEQS];
  uint32_t len[SEQS];
  float scales[2][LAYERS][KV_HEADS];
  float *x[2];      /* what was written: [plane][seq][layer][position][row] */
  float *stored[2]; /* what the pages hold, as values */
} model;

static size_t at(const model *m, uint32_t s, uint32_t l, uint32_t pos) {
  return (((size_t)s * LAYERS + l) * MAX_LEN + pos) * m->row;
}

/* The value a page of format f stores for x under scale s (pagedkv.h, section 5a). */
static float stored_value(pkv_format f, float x, float s) {
  return tu_fp8(f) ? tu_fp8_to_f32(f, tu_f32_to_fp8(f, x / s)) * s : x;
}

/* The stored values of everything written, from x and the scales (quantized formats by tu_round_trip). */
static void restore(model *m) {
  float tmp[256];
  const uint32_t hd = m->c.head_dim;
  for (int p = 0; p < 2; p++) {
    const pkv_format f = p ? m->c.v : m->c.k;
    for (uint32_t s = 0; s < SEQS; s++)
      for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t pos = 0; pos < m->len[s]; pos++)
          for (uint32_t h = 0; h < KV_HEADS; h++) {
            const float *x = m->x[p] + at(m, s, l, pos) + (size_t)h * hd;
            float *out = m->stored[p] + at(m, s, l, pos) + (size_t)h * hd;
            if (tu_fp8(f)) {
              for (uint32_t d = 0; d < hd; d++) out[d] = stored_value(f, x[d], m->scales[p][l][h]);
            } else {
              tu_round_trip(f, x, hd, tmp);
              memcpy(out, tmp, hd * sizeof(float));
            }
          }
  }
}

static void model_open(model *m, const pool_case *c, uint64_t stream) {
  memset(m, 0, sizeof *m);
  m->c = *c;
  m->rng = tu_rng_stream(g_seed, stream);
  m->row = KV_HEADS * c->head_dim;
  pkv_pool_desc d = pu_desc(LAYERS, KV_HEADS, c->head_dim, c->page_size, SEQS * MAX_LEN / c->page_size + SEQS, SEQS,
                            c->k, c->v);
  pu_open(&d, &m->ctx, &m->pool);
  for (int p = 0; p < 2; p++) {
    m->x[p] = pu_malloc((size_t)SEQS * LAYERS * MAX_LEN * m->row * sizeof(float));
    m->stored[p] = pu_malloc((size_t)SEQS * LAYERS * MAX_LEN * m->row * sizeof(float));
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t h = 0; h < KV_HEADS; h++) m->scales[p][l][h] = 1.0f;
  }
}

static void model_close(model *m) {
  for (int p = 0; p < 2; p++) {
    free(m->x[p]);
    free(m->stored[p]);
  }
  pu_close(m->ctx, m->pool);
}

/* Scales of magnitudes 2^-6..2^6 (so x / s spans FP8's subnormals to past its largest value), set for
 * every layer in one call, per tensor or per head as the case says; planes of other formats keep none. */
static void set_scales(model *m) {
  float given[2][LAYERS * KV_HEADS];
  for (int p = 0; p < 2; p++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t h = 0; h < KV_HEADS; h++) {
        const pkv_format f = p ? m->c.v : m->c.k;
        if (!tu_fp8(f)) continue;
        if (h == 0 || m->c.per_head) m->scales[p][l][h] = (float)(tu_uniform(&m->rng, 1.0, 2.0) * ldexp(1.0, (int)tu_below(&m->rng, 13) - 6));
        else m->scales[p][l][h] = m->scales[p][l][0];
        given[p][m->c.per_head ? l * KV_HEADS + h : l] = m->scales[p][l][h];
      }
  pkv_scales_args a = PKV_SCALES_ARGS_INIT;
  a.per_head = (uint32_t)m->c.per_head;
  a.k_scales = tu_fp8(m->c.k) ? given[0] : NULL;
  a.v_scales = tu_fp8(m->c.v) ? given[1] : NULL;
  CHECK_OK(pkv_pool_set_scales(m->pool, &a));
}

static void check_scales(const model *m) {
  float k[LAYERS * KV_HEADS], v[LAYERS * KV_HEADS];
  memset(k, 0xff, sizeof k);
  memset(v, 0xff, sizeof v);
  CHECK_OK(pkv_pool_get_scales(m->pool, 0, 0, k, v));
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t h = 0; h < KV_HEADS; h++)
      for (int p = 0; p < 2; p++) {
        const float got = (p ? v : k)[l * KV_HEADS + h];
        if (memcmp(&got, &m->scales[p][l][h], 4) != 0)
          fail_msg("%s scale of layer %u head %u: read %a, set %a", p ? "V" : "K", l, h, (double)got,
                   (double)m->scales[p][l][h]);
      }
  /* one layer alone, K only */
  float one[KV_HEADS];
  CHECK_OK(pkv_pool_get_scales(m->pool, LAYERS - 1, 1, one, NULL));
  assert_memory_equal(one, m->scales[0][LAYERS - 1], sizeof one);
}

/* Appends and writes `n` new rows to every sequence and layer: values of both signs over 2^-8..2^8
 * times the row's scale, some past FP8's range once divided by it. */
static void grow(model *m, uint32_t n) {
  uint32_t counts[SEQS];
  for (uint32_t s = 0; s < SEQS; s++) counts[s] = tu_min_u32(n, MAX_LEN - m->len[s]);
  CHECK_OK(pkv_append(m->pool, m->seq, counts, SEQS));
  uint32_t total = 0;
  for (uint32_t s = 0; s < SEQS; s++) total += counts[s];
  float *src[2] = {pu_malloc((size_t)total * m->row * 4), pu_malloc((size_t)total * m->row * 4)};
  for (uint32_t l = 0; l < LAYERS; l++) {
    uint32_t r = 0;
    for (uint32_t s = 0; s < SEQS; s++)
      for (uint32_t i = 0; i < counts[s]; i++, r++)
        for (int p = 0; p < 2; p++)
          for (uint32_t e = 0; e < m->row; e++) {
            const double mag = ldexp(tu_uniform(&m->rng, 1.0, 2.0), (int)tu_below(&m->rng, 17) - 8);
            const float x = (float)((tu_below(&m->rng, 2) ? -mag : mag) * m->scales[p][l][e / m->c.head_dim]);
            src[p][(size_t)r * m->row + e] = x;
            m->x[p][at(m, s, l, m->len[s] + i) + e] = x;
          }
    CHECK_OK(pu_write(m->pool, l, m->seq, counts, SEQS, PKV_FORMAT_F32, src[0], src[1]));
  }
  for (uint32_t s = 0; s < SEQS; s++) m->len[s] += counts[s];
  free(src[0]);
  free(src[1]);
  restore(m);
}

/* Every row reads back as the stored values, bit for bit. */
static void check_rows(const model *m) {
  float *k = pu_malloc((size_t)MAX_LEN * m->row * 4), *v = pu_malloc((size_t)MAX_LEN * m->row * 4);
  for (uint32_t s = 0; s < SEQS; s++)
    for (uint32_t l = 0; l < LAYERS; l++) {
      memset(k, 0x7f, (size_t)MAX_LEN * m->row * 4);
      memset(v, 0x7f, (size_t)MAX_LEN * m->row * 4);
      CHECK_OK(pu_read(m->pool, l, m->seq[s], 0, m->len[s], PKV_FORMAT_F32, k, v));
      for (int p = 0; p < 2; p++) {
        const float *got = p ? v : k, *want = m->stored[p] + at(m, s, l, 0);
        for (size_t e = 0; e < (size_t)m->len[s] * m->row; e++)
          if (isnan(want[e]) ? !isnan(got[e]) : memcmp(&got[e], &want[e], 4) != 0)
            fail_msg("%s of sequence %u layer %u position %zu value %zu: read %a, want %a (written %a, scale %a)",
                     p ? "V" : "K", s, l, e / m->row, e % m->row, (double)got[e], (double)want[e],
                     (double)m->x[p][at(m, s, l, 0) + e], (double)m->scales[p][l][e % m->row / m->c.head_dim]);
      }
    }
  free(k);
  free(v);
}

/* Decode (one query token, the newest position) of layer l, or extend of each sequence's newest `fresh`
 * tokens, against the oracle over the stored values, K's times k_factor; outputs into out/lse. */
static void attend(const model *m, uint32_t l, uint32_t fresh, double k_factor, float *out, float *lse) {
  const uint32_t hd = m->c.head_dim;
  const int extend = fresh > 0;
  uint32_t offsets[SEQS + 1] = {0};
  for (uint32_t s = 0; s < SEQS; s++) offsets[s + 1] = offsets[s] + (extend ? fresh : 1);
  const uint32_t rows = offsets[SEQS];
  float *q = pu_malloc((size_t)rows * Q_HEADS * hd * 4);
  tu_rng r = tu_rng_stream(g_seed, 1000 + l);
  tu_fill_uniform(&r, q, (size_t)rows * Q_HEADS * hd, -1.0, 1.0);
  for (size_t i = 0; i < (size_t)rows * Q_HEADS * hd; i++) out[i] = NAN;
  for (size_t i = 0; i < (size_t)rows * Q_HEADS; i++) lse[i] = NAN;
  /* logits of a few units whatever the scales: the softmax scale undoes K's size (K's values are about
   * 2^6 times their scale, grow's magnitudes) */
  double k_size = 0.0;
  for (uint32_t h = 0; h < KV_HEADS; h++) k_size = fmax(k_size, m->scales[0][l][h]);
  const float scale = (float)(1.0 / (64.0 * k_size * k_factor * sqrt((double)hd)));
  if (extend) {
    pkv_extend_args a = pu_extend_args(l, m->seq, SEQS, Q_HEADS, offsets, q, out, lse);
    a.scale = scale;
    CHECK_OK(pkv_extend(m->pool, &a));
  } else {
    pkv_decode_args a = pu_decode_args(l, m->seq, SEQS, Q_HEADS, q, out, lse);
    a.scale = scale;
    CHECK_OK(pkv_decode(m->pool, &a));
  }
  CHECK_OK(pkv_context_synchronize(m->ctx));
  const oracle_tolerance tol = oracle_tolerance_for(m->c.k);
  float *k = pu_malloc((size_t)MAX_LEN * m->row * 4);
  double qd[256], ref[256], mag[256], ref_lse;
  for (uint32_t s = 0; s < SEQS; s++) {
    const float *kk = m->stored[0] + at(m, s, l, 0);
    for (size_t e = 0; e < (size_t)m->len[s] * m->row; e++) k[e] = (float)(kk[e] * k_factor);
    for (uint32_t t = 0; t < offsets[s + 1] - offsets[s]; t++) {
      const uint32_t n = m->len[s] - (offsets[s + 1] - offsets[s]) + t + 1; /* positions the query sees */
      for (uint32_t h = 0; h < Q_HEADS; h++) {
        const size_t row = (size_t)(offsets[s] + t) * Q_HEADS + h, kv = (size_t)(h / GROUP) * hd;
        for (uint32_t d = 0; d < hd; d++) qd[d] = q[row * hd + d];
        oracle_attend(qd, k + kv, m->stored[1] + at(m, s, l, 0) + kv, m->row, n, hd, scale, ref, mag, &ref_lse);
        double err2 = 0.0, ref2 = 0.0;
        for (uint32_t d = 0; d < hd; d++) {
          const double diff = (double)out[row * hd + d] - ref[d];
          err2 += diff * diff;
          ref2 += ref[d] * ref[d];
        }
        const double rel = ref2 > 0.0 ? sqrt(err2 / ref2) : sqrt(err2);
        if (!(rel <= tol.out_rel) || !(fabs(lse[row] - ref_lse) <= tol.lse_abs))
          fail_msg("%s of layer %u, sequence %u (length %u), query %u, head %u: relative error %.3g (> %.3g?), lse "
                   "%.9g, expected %.9g (K times %g)",
                   extend ? "extend" : "decode", l, s, m->len[s], t, h, rel, tol.out_rel, (double)lse[row], ref_lse,
                   k_factor);
      }
    }
  }
  free(k);
  free(q);
}

static void scales_case(void **state) {
  const pool_case *c = *state;
  model m;
  model_open(&m, c, (uint64_t)(c - cases));
  print_message("    k=%s v=%s hd=%u page=%u scales %s\n", pkv_format_name(c->k), pkv_format_name(c->v), c->head_dim,
                c->page_size, c->per_head ? "per head" : "per tensor");
  check_scales(&m); /* 1.0 until set */
  set_scales(&m);
  check_scales(&m);
  for (uint32_t s = 0; s < SEQS; s++) CHECK_OK(pkv_seq_alloc(m.pool, &m.seq[s]));
  grow(&m, FRESH + tu_below(&m.rng, 40)); /* as long as the longest extend */
  grow(&m, 1 + tu_below(&m.rng, 12)); /* into pages partly filled */
  check_rows(&m);
  const size_t cap = (size_t)SEQS * FRESH * Q_HEADS * c->head_dim;
  float *out = pu_malloc(cap * 4), *lse = pu_malloc((size_t)SEQS * FRESH * Q_HEADS * 4);
  float *doubled = pu_malloc(cap * 4), *lse2 = pu_malloc((size_t)SEQS * FRESH * Q_HEADS * 4);
  for (uint32_t l = 0; l < LAYERS; l++) {
    attend(&m, l, 0, 1.0, out, lse);
    attend(&m, l, 1 + tu_below(&m.rng, 12), 1.0, out, lse);
    attend(&m, l, 64 + tu_below(&m.rng, FRESH - 63), 1.0, out, lse);
  }

  /* Scales set after the rows: layer 1's V scales doubled double every output; K's doubled double every
   * logit. The codes stay, so the stored values double. */
  const uint32_t l = 1;
  const size_t rows = (size_t)SEQS * Q_HEADS * c->head_dim;
  if (tu_fp8(c->v)) {
    attend(&m, l, 0, 1.0, out, lse);
    float twice[KV_HEADS];
    for (uint32_t h = 0; h < KV_HEADS; h++) twice[h] = 2.0f * m.scales[1][l][h];
    pkv_scales_args a = PKV_SCALES_ARGS_INIT;
    a.first_layer = l;
    a.layer_count = 1;
    a.per_head = 1;
    a.v_scales = twice;
    CHECK_OK(pkv_pool_set_scales(m.pool, &a));
    memcpy(m.scales[1][l], twice, sizeof twice);
    for (uint32_t s = 0; s < SEQS; s++)
      for (size_t e = 0; e < (size_t)m.len[s] * m.row; e++) m.stored[1][at(&m, s, l, 0) + e] *= 2.0f;
    check_scales(&m);
    check_rows(&m);
    attend(&m, l, 0, 1.0, doubled, lse2);
    for (size_t i = 0; i < rows; i++)
      if (!(fabs(doubled[i] - 2.0 * out[i]) <= 1e-6 * fabs(2.0 * out[i]) + 1e-30))
        fail_msg("output %zu: %a with V's scale doubled, %a before", i, (double)doubled[i], (double)out[i]);
    assert_memory_equal(lse, lse2, (size_t)SEQS * Q_HEADS * 4);
  }
  if (tu_fp8(c->k)) {
    pkv_scales_args a = PKV_SCALES_ARGS_INIT;
    a.first_layer = l;
    a.layer_count = 1;
    float twice = 2.0f * m.scales[0][l][0], per_head[KV_HEADS];
    for (uint32_t h = 0; h < KV_HEADS; h++) per_head[h] = 2.0f * m.scales[0][l][h];
    a.per_head = (uint32_t)c->per_head;
    a.k_scales = c->per_head ? per_head : &twice;
    CHECK_OK(pkv_pool_set_scales(m.pool, &a));
    memcpy(m.scales[0][l], per_head, sizeof per_head);
    check_scales(&m);
    /* the oracle over the old values times 2 (attend's k_factor); its scale halves the logits back, so
     * the softmax scale passed keeps the doubled K's logits as large as before */
    attend(&m, l, 0, 2.0, out, lse);
    attend(&m, l, 1 + tu_below(&m.rng, 12), 2.0, out, lse);
    attend(&m, l, 64 + tu_below(&m.rng, FRESH - 63), 2.0, out, lse);
  }
  free(out);
  free(lse);
  free(doubled);
  free(lse2);
  model_close(&m);
}

/* The backend's own conversions (a GPU's scatter and gather kernels) against the reference, bit for
 * bit: rows holding the value of every one of the 256 codes, then floats around every code (the
 * value, the midpoints to its neighbours, one float ulp either side of each), past the largest value,
 * infinities, NaNs and random floats, written at scale 1 and read back. */
static void test_codes_through_pool(void **state) {
  (void)state;
  enum { HD = 256, ROWS = 40 };
  tu_rng r = tu_rng_stream(g_seed, 200);
  float *x = pu_malloc((size_t)ROWS * HD * 4), *back = pu_malloc((size_t)ROWS * HD * 4);
  for (int fi = 0; fi < 2; fi++) {
    const pkv_format f = fi ? PKV_FORMAT_FP8_E5M2 : PKV_FORMAT_FP8_E4M3;
    size_t n = 0;
    for (int c = 0; c < 256; c++) x[n++] = tu_fp8_to_f32(f, (uint8_t)c);
    for (int c = 0; c < 0x7f; c++) {
      const double v = tu_fp8_value(f, (uint8_t)c), next = tu_fp8_value(f, (uint8_t)(c + 1));
      if (!isfinite(v)) continue;
      const double mid = isfinite(next) ? (v + next) / 2 : 1.5 * v;
      for (int sign = 0; sign < 2; sign++)
        for (int k = 0; k < 2; k++) {
          const float at = (float)((sign ? -1 : 1) * (k ? mid : v));
          x[n++] = at;
          x[n++] = nextafterf(at, INFINITY);
          x[n++] = nextafterf(at, -INFINITY);
        }
    }
    const float special[] = {INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f, 3e38f, -0.0f};
    for (size_t i = 0; i < TU_COUNT(special); i++) x[n++] = special[i];
    assert_true(n <= (size_t)ROWS * HD);
    while (n < (size_t)ROWS * HD) {
      const double m = tu_uniform(&r, 1.0, 2.0) * ldexp(1.0, (int)tu_below(&r, 61) - 40);
      x[n++] = (float)(tu_below(&r, 2) ? -m : m);
    }
    pkv_pool_desc d = pu_desc(1, 1, HD, 16, 4, 1, f, f);
    pkv_context *ctx;
    pkv_pool *pool;
    pu_open(&d, &ctx, &pool);
    pkv_seq seq;
    const uint32_t rows = ROWS;
    CHECK_OK(pkv_seq_alloc(pool, &seq));
    CHECK_OK(pkv_append(pool, &seq, &rows, 1));
    CHECK_OK(pu_write(pool, 0, &seq, &rows, 1, PKV_FORMAT_F32, x, x));
    for (int plane = 0; plane < 2; plane++) {
      memset(back, 0x7f, (size_t)ROWS * HD * 4);
      CHECK_OK(pu_read(pool, 0, seq, 0, ROWS, PKV_FORMAT_F32, plane ? NULL : back, plane ? back : NULL));
      for (size_t i = 0; i < (size_t)ROWS * HD; i++) {
        const float want = tu_fp8_to_f32(f, tu_f32_to_fp8(f, x[i]));
        if (isnan(want) ? !isnan(back[i]) : memcmp(&back[i], &want, 4) != 0)
          fail_msg("%s %s: %a read back as %a, want %a", pkv_format_name(f), plane ? "V" : "K", (double)x[i],
                   (double)back[i], (double)want);
      }
    }
    pu_close(ctx, pool);
  }
  free(x);
  free(back);
}

/* Bad scales on a pool with FP8 K and V: a clear error, and neither a scale nor a row changes. */
static void test_bad_scales(void **state) {
  (void)state;
  model m;
  const pool_case c = {PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2, 32, 4, 1};
  model_open(&m, &c, 99);
  set_scales(&m);
  for (uint32_t s = 0; s < SEQS; s++) CHECK_OK(pkv_seq_alloc(m.pool, &m.seq[s]));
  grow(&m, 9);
  const float bad[] = {0.0f, -0.0f, -1.0f, NAN, INFINITY, -INFINITY};
  float values[LAYERS * KV_HEADS + 1]; /* V's may start one further on */
  for (size_t b = 0; b < TU_COUNT(bad); b++)
    for (int plane = 0; plane < 2; plane++)
      for (uint32_t per_head = 0; per_head < 2; per_head++) {
        for (size_t i = 0; i < TU_COUNT(values); i++) values[i] = 0.5f;
        values[tu_below(&m.rng, per_head ? LAYERS * KV_HEADS : LAYERS)] = bad[b];
        pkv_scales_args a = PKV_SCALES_ARGS_INIT;
        a.per_head = per_head;
        if (plane) a.v_scales = values;
        else a.k_scales = values, a.v_scales = tu_below(&m.rng, 2) ? values + 1 : NULL; /* the good one too */
        pu_assert_fails(pkv_pool_set_scales(m.pool, &a), PKV_ERR_INVALID_ARGUMENT);
        check_scales(&m);
      }
  for (size_t i = 0; i < TU_COUNT(values); i++) values[i] = 0.5f;
  pkv_scales_args a = PKV_SCALES_ARGS_INIT;
  a.k_scales = values;
  a.per_head = 2;
  pu_assert_fails(pkv_pool_set_scales(m.pool, &a), PKV_ERR_INVALID_ARGUMENT);
  a.per_head = 0;
  a.first_layer = LAYERS;
  pu_assert_fails(pkv_pool_set_scales(m.pool, &a), PKV_ERR_INVALID_ARGUMENT);
  a.first_layer = 1;
  a.layer_count = LAYERS;
  pu_assert_fails(pkv_pool_set_scales(m.pool, &a), PKV_ERR_INVALID_ARGUMENT);
  pu_assert_fails(pkv_pool_get_scales(m.pool, 1, LAYERS, values, values), PKV_ERR_INVALID_ARGUMENT);
  check_scales(&m);
  check_rows(&m);
  model_close(&m);

  /* A pool whose V pages are F16: V's scales are refused, K's taken. */
  const pool_case mixed = {PKV_FORMAT_FP8_E5M2, PKV_FORMAT_F16, 64, 8, 0};
  model_open(&m, &mixed, 100);
  pkv_scales_args v_only = PKV_SCALES_ARGS_INIT;
  v_only.v_scales = values;
  pu_assert_fails(pkv_pool_set_scales(m.pool, &v_only), PKV_ERR_INVALID_ARGUMENT);
  check_scales(&m);
  set_scales(&m);
  check_scales(&m);
  model_close(&m);
}

int main(void) {
  g_seed = tu_seed();
  (void)pu_run_backend();
  struct CMUnitTest tests[TU_COUNT(cases) + 2];
  char names[TU_COUNT(cases)][96];
  for (size_t i = 0; i < TU_COUNT(cases); i++) {
    snprintf(names[i], sizeof names[i], "scales k=%s v=%s %s", pkv_format_name(cases[i].k),
             pkv_format_name(cases[i].v), cases[i].per_head ? "per head" : "per tensor");
    tests[i] = (struct CMUnitTest){names[i], scales_case, NULL, NULL, (void *)&cases[i]};
  }
  tests[TU_COUNT(cases)] = (struct CMUnitTest)cmocka_unit_test(test_codes_through_pool);
  tests[TU_COUNT(cases) + 1] = (struct CMUnitTest)cmocka_unit_test(test_bad_scales);
  return tu_run_tests(tests, NULL, NULL);
}
