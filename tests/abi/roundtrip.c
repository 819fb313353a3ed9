#include "roundtrip.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "oracle.h"
#include "poolutil.h" /* CHECK_OK_IN and the argument builders (args.h): nothing that calls the library */
#include "testutil.h"

enum { SEQS = 3, LAYERS = 2, MAX_KV_HEADS = 3, MAX_GROUP = 4, MAX_STEP = 24, MAX_LEN = 2 * MAX_STEP };

static const pkv_format page_formats[] = {PKV_FORMAT_F32,  PKV_FORMAT_F16,      PKV_FORMAT_BF16,    PKV_FORMAT_Q8_0,
                                          PKV_FORMAT_Q4_0, PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2};

/* Fills n values in [-1, 1) and keeps, in stored, what a page of `format` holds for them. */
static void random_rows(tu_rng *rng, pkv_format format, float *rows, float *stored, size_t n) {
  tu_fill_uniform(rng, rows, n, -1.0, 1.0);
  tu_round_trip(format, rows, n, stored);
}

void rt_round_trip(const pkv_api *api) {
  tu_rng rng = tu_rng_make(tu_seed());
  const uint32_t kv_heads = 1 + tu_below(&rng, MAX_KV_HEADS), group = 1 + tu_below(&rng, MAX_GROUP);
  const uint32_t head_dim = 32u << tu_below(&rng, 3), q_heads = kv_heads * group;
  const size_t row = (size_t)kv_heads * head_dim;
  const pkv_format kf = page_formats[tu_below(&rng, 7)], vf = page_formats[tu_below(&rng, 7)];

  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  cd.backend = PKV_BACKEND_CPU;
  pkv_context *ctx = NULL;
  CHECK_OK_IN(api, api->context_create(&cd, &ctx));

  /* Pages for every sequence at its longest, whatever the page size (2 of them: 78 pages). */
  const uint32_t page_size = 1u << (1 + tu_below(&rng, 4)), pages = SEQS * (MAX_LEN / page_size + 2);
  pkv_pool_desc pd = pu_desc(LAYERS, kv_heads, head_dim, page_size, pages, 8, kf, vf);
  pd.page_order_seed = 1 + tu_below(&rng, 1000);
  pkv_pool *pool = NULL;
  CHECK_OK_IN(api, api->pool_create(ctx, &pd, &pool));
  printf("# kv_heads %u, q_heads %u, head_dim %u, page_size %u, K %s, V %s\n", kv_heads, q_heads, head_dim,
         pd.page_size, api->format_name(kf), api->format_name(vf));

  pkv_seq seqs[SEQS];
  uint32_t len[SEQS] = {0};
  for (int s = 0; s < SEQS; s++) CHECK_OK_IN(api, api->seq_alloc(pool, &seqs[s]));

  /* stored[layer][kv][seq] holds [len][kv_heads][head_dim] as the pages store it. */
  float *stored[LAYERS][2][SEQS];
  for (int l = 0; l < LAYERS; l++)
    for (int kv = 0; kv < 2; kv++)
      for (int s = 0; s < SEQS; s++) stored[l][kv][s] = calloc(MAX_LEN * row, sizeof(float));

  for (int step = 0; step < 2; step++) {
    uint32_t n_new[SEQS], total = 0;
    for (int s = 0; s < SEQS; s++) total += n_new[s] = 1 + tu_below(&rng, MAX_STEP);
    CHECK_OK_IN(api, api->append(pool, seqs, n_new, SEQS));
    float *rows[2] = {malloc(total * row * sizeof(float)), malloc(total * row * sizeof(float))};
    for (int l = 0; l < LAYERS; l++) {
      size_t at = 0;
      for (int s = 0; s < SEQS; s++) {
        for (int kv = 0; kv < 2; kv++)
          random_rows(&rng, kv ? vf : kf, rows[kv] + at * row, stored[l][kv][s] + len[s] * row, n_new[s] * row);
        at += n_new[s];
      }
      const pkv_write_args w = pu_write_args((uint32_t)l, seqs, n_new, SEQS, PKV_FORMAT_F32, rows[0], rows[1]);
      CHECK_OK_IN(api, api->write(pool, &w));
    }
    for (int s = 0; s < SEQS; s++) len[s] += n_new[s];
    free(rows[0]);
    free(rows[1]);
  }
  for (int s = 0; s < SEQS; s++) {
    uint32_t got = 0;
    CHECK_OK_IN(api, api->seq_length(pool, seqs[s], &got));
    assert_int_equal(got, len[s]);
  }

  const uint32_t layer = tu_below(&rng, LAYERS);
  const size_t qn = (size_t)SEQS * q_heads * head_dim;
  float *q = malloc(qn * sizeof(float)), *out = malloc(qn * sizeof(float)), lse[SEQS * MAX_KV_HEADS * MAX_GROUP];
  tu_fill_uniform(&rng, q, qn, -2.0, 2.0);
  const pkv_decode_args a = pu_decode_args(layer, seqs, SEQS, q_heads, q, out, lse);
  CHECK_OK_IN(api, api->decode(pool, &a));

  /* the float64 oracle over the values the pages hold, per sequence and query head */
  const double scale = 1.0 / sqrt((double)head_dim);
  double *qd = malloc(3 * head_dim * sizeof(double)), *ref = qd + head_dim, *mag = ref + head_dim;
  for (int s = 0; s < SEQS; s++) {
    for (uint32_t h = 0; h < q_heads; h++) {
      const float *qh = q + ((size_t)s * q_heads + h) * head_dim;
      const size_t kv_off = (size_t)(h / group) * head_dim;
      for (uint32_t d = 0; d < head_dim; d++) qd[d] = qh[d];
      double lse_ref, err = 0.0, norm = 0.0;
      oracle_attend(qd, stored[layer][0][s] + kv_off, stored[layer][1][s] + kv_off, row, len[s], head_dim, scale, ref,
                    mag, &lse_ref);
      for (uint32_t d = 0; d < head_dim; d++) {
        const double diff = out[((size_t)s * q_heads + h) * head_dim + d] - ref[d];
        err += diff * diff;
        norm += ref[d] * ref[d];
      }
      if (!(sqrt(err) <= 1e-4 * sqrt(norm) + 1e-6)) /* NaN fails too */
        fail_msg("seq %d head %u: |out - ref| = %g, |ref| = %g", s, h, sqrt(err), sqrt(norm));
      const double lse_got = lse[s * q_heads + h];
      if (!(fabs(lse_got - lse_ref) <= 1e-4 * (1.0 + fabs(lse_ref))))
        fail_msg("seq %d head %u: lse %.9g, reference %.9g", s, h, lse_got, lse_ref);
    }
  }

  /* A freed handle: the failure's status and text come back through the same table. */
  CHECK_OK_IN(api, api->seq_free(pool, seqs[0]));
  assert_int_equal(api->seq_free(pool, seqs[0]), PKV_ERR_STALE_HANDLE);
  const char *detail = api->last_error();
  if (!strstr(detail, "PKV_ERR_STALE_HANDLE") || !strstr(detail, "pkv_seq_free"))
    fail_msg("last error after a double free: \"%s\"", detail);

  CHECK_OK_IN(api, api->pool_destroy(pool));
  CHECK_OK_IN(api, api->context_destroy(ctx));
  free(qd);
  free(q);
  free(out);
  for (int l = 0; l < LAYERS; l++)
    for (int kv = 0; kv < 2; kv++)
      for (int s = 0; s < SEQS; s++) free(stored[l][kv][s]);
}
