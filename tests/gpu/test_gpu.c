/* Tests for GPU backends only (skipped, visibly, when the backend in use is the CPU): pages written
 * by the GPU are identical to the CPU backend's, a batch of 512 sequences, one 128K-token sequence and
 * GQA groups of 16 decode like a float64 oracle, and a pool larger than the device fails cleanly. The rest of the suite runs on the GPU through PKV_BACKEND. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "oracle.h"
#include "poolutil.h"
#include "testutil.h"

static tu_rng rng;

static void random_values(float *dst, size_t n) { tu_fill_uniform(&rng, dst, n, -3.0, 3.0); }

/* A pool on the backend PKV_BACKEND selects; skips the test when that is the CPU. */
static void open_gpu(const pkv_pool_desc *d, pkv_context **ctx, pkv_pool **pool) {
  pu_open(d, ctx, pool);
  pkv_backend b;
  CHECK_OK(pkv_context_backend(*ctx, &b));
  if (b == PKV_BACKEND_CPU) {
    pu_close(*ctx, *pool);
    skip();
  }
}

/* Every page format pair, rows straddling pages: the GPU's scatter (quantization included) and the
 * CPU backend's must store the same bytes, seen here through their dequantized values bit for bit. */
static void pages_identical_to_cpu(void **state) {
  (void)state;
  static const pkv_format formats[] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16, PKV_FORMAT_Q8_0,
                                       PKV_FORMAT_Q4_0};
  enum { N = 5, HEADS = 3, D = 128, ROWS = 77 };
  for (int fk = 0; fk < N; fk++) {
    const pkv_pool_desc d = pu_desc(2, HEADS, D, 16, 16, 4, formats[fk], formats[(fk + 2) % N]);
    pkv_context *gctx, *cctx;
    pkv_pool *gpool, *cpool;
    open_gpu(&d, &gctx, &gpool);
    pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
    cd.backend = PKV_BACKEND_CPU;
    CHECK_OK(pkv_context_create(&cd, &cctx));
    CHECK_OK(pkv_pool_create(cctx, &d, &cpool));

    float *k = pu_malloc(sizeof(float) * ROWS * HEADS * D), *v = pu_malloc(sizeof(float) * ROWS * HEADS * D);
    float *gk = pu_malloc(sizeof(float) * ROWS * HEADS * D), *gv = pu_malloc(sizeof(float) * ROWS * HEADS * D);
    float *ck = pu_malloc(sizeof(float) * ROWS * HEADS * D), *cv = pu_malloc(sizeof(float) * ROWS * HEADS * D);
    random_values(k, (size_t)ROWS * HEADS * D);
    random_values(v, (size_t)ROWS * HEADS * D);
    k[5] = 0.0f; /* a group with a zero, and a whole zero group: d = 0 is an edge of the arithmetic */
    memset(v + D, 0, sizeof(float) * 32);
    pkv_seq gs, cs;
    const uint32_t n = ROWS;
    CHECK_OK(pkv_seq_alloc(gpool, &gs));
    CHECK_OK(pkv_seq_alloc(cpool, &cs));
    CHECK_OK(pkv_append(gpool, &gs, &n, 1));
    CHECK_OK(pkv_append(cpool, &cs, &n, 1));
    for (uint32_t layer = 0; layer < 2; layer++) {
      CHECK_OK(pu_write(gpool, layer, &gs, &n, 1, PKV_FORMAT_F32, k, v));
      CHECK_OK(pu_write(cpool, layer, &cs, &n, 1, PKV_FORMAT_F32, k, v));
      memset(gk, 0xff, sizeof(float) * ROWS * HEADS * D);
      memset(gv, 0xff, sizeof(float) * ROWS * HEADS * D);
      CHECK_OK(pu_read(gpool, layer, gs, 0, ROWS, PKV_FORMAT_F32, gk, gv));
      CHECK_OK(pu_read(cpool, layer, cs, 0, ROWS, PKV_FORMAT_F32, ck, cv));
      for (size_t i = 0; i < (size_t)ROWS * HEADS * D; i++)
        if (memcmp(&gk[i], &ck[i], 4) != 0 || memcmp(&gv[i], &cv[i], 4) != 0)
          fail_msg("K %s / V %s, layer %u, value %zu: GPU K %a V %a, CPU K %a V %a", pkv_format_name(d.k_format),
                   pkv_format_name(d.v_format), layer, i, gk[i], gv[i], ck[i], cv[i]);
    }
    free(k);
    free(v);
    free(gk);
    free(gv);
    free(ck);
    free(cv);
    CHECK_OK(pkv_pool_destroy(cpool));
    CHECK_OK(pkv_context_destroy(cctx));
    pu_close(gctx, gpool);
  }
}

/* count sequences of the given lengths, GQA q_heads / kv_heads, head_dim D, K and V pages of formats kf
 * and vf, F32 q and out. Quantized K is dotted with q rounded to int8 parts: test_decode's tolerance. */
static void decode_against_oracle(const uint32_t *len, uint32_t count, uint32_t q_heads, uint32_t kv_heads,
                                  uint32_t D, uint32_t pages, pkv_format kf, pkv_format vf) {
  const double tol = oracle_tolerance_for(kf).out_rel;
  pkv_pool_desc d = pu_desc(1, kv_heads, D, 16, pages, count, kf, vf);
  d.page_order_seed = (uint32_t)tu_next(&rng) | 1u;
  pkv_context *ctx;
  pkv_pool *pool;
  open_gpu(&d, &ctx, &pool);

  size_t total = 0;
  for (uint32_t b = 0; b < count; b++) total += len[b];
  const size_t row = (size_t)kv_heads * D;
  float *k = pu_malloc(sizeof(float) * total * row), *v = pu_malloc(sizeof(float) * total * row);
  random_values(k, total * row);
  random_values(v, total * row);
  tu_round_trip(kf, k, total * row, k); /* the values the pages hold */
  tu_round_trip(vf, v, total * row, v);
  pkv_seq *seqs = pu_malloc(sizeof(pkv_seq) * count);
  for (uint32_t b = 0; b < count; b++) CHECK_OK(pkv_seq_alloc(pool, &seqs[b]));
  CHECK_OK(pkv_append(pool, seqs, len, count));
  CHECK_OK(pu_write(pool, 0, seqs, len, count, PKV_FORMAT_F32, k, v));

  const size_t heads = (size_t)count * q_heads;
  float *q = pu_malloc(sizeof(float) * heads * D), *out = pu_malloc(sizeof(float) * heads * D);
  float *lse = pu_malloc(sizeof(float) * heads);
  random_values(q, heads * D);
  for (size_t i = 0; i < heads * D; i++) out[i] = NAN;
  for (size_t i = 0; i < heads; i++) lse[i] = NAN;
  const pkv_decode_args a = pu_decode_args(0, seqs, count, q_heads, q, out, lse);
  CHECK_OK(pkv_decode(pool, &a));

  double qd[256], ref[256], mag[256], worst = 0.0, worst_lse = 0.0;
  size_t first = 0;
  for (uint32_t b = 0; b < count; b++) {
    for (uint32_t h = 0; h < q_heads; h++) {
      const size_t i = (size_t)b * q_heads + h, kv = first * row + (size_t)(h / (q_heads / kv_heads)) * D;
      for (uint32_t x = 0; x < D; x++) qd[x] = q[i * D + x];
      double ref_lse;
      oracle_attend(qd, k + kv, v + kv, row, len[b], D, 1.0 / sqrt((double)D), ref, mag, &ref_lse);
      double err = 0.0, norm = 0.0;
      for (uint32_t x = 0; x < D; x++) {
        err += (out[i * D + x] - ref[x]) * (out[i * D + x] - ref[x]);
        norm += ref[x] * ref[x];
      }
      if (len[b] == 0) { /* empty: exactly 0 and -inf */
        if (norm != 0.0 || err != 0.0 || lse[i] != -INFINITY)
          fail_msg("empty sequence %u head %u: out not 0 or lse %g not -inf", b, h, lse[i]);
        continue;
      }
      if (!(sqrt(err) <= tol * sqrt(norm) + 1e-6)) /* NaN fails too */
        fail_msg("sequence %u (length %u) head %u: relative error %g", b, len[b], h, sqrt(err / norm));
      if (!(fabs(lse[i] - ref_lse) <= tol * fabs(ref_lse) + tol))
        fail_msg("sequence %u head %u: lse %g, oracle %g", b, h, lse[i], ref_lse);
      if (norm > 0 && sqrt(err / norm) > worst) worst = sqrt(err / norm);
      if (fabs(lse[i] - ref_lse) > worst_lse) worst_lse = fabs(lse[i] - ref_lse);
    }
    first += len[b];
  }
  print_message("%u sequences, %zu tokens, K %d V %d: worst relative error %.2e, worst lse error %.2e\n", count, total,
                (int)kf, (int)vf, worst, worst_lse);
  free(k);
  free(v);
  free(q);
  free(out);
  free(lse);
  free(seqs);
  pu_close(ctx, pool);
}

/* Also with Q4_0 V: batches that fill four blocks a multiprocessor run the four-block kernels. */
static void batch_of_512(void **state) {
  (void)state;
  enum { COUNT = 512 };
  uint32_t len[COUNT], pages = 0;
  for (uint32_t b = 0; b < COUNT; b++) {
    len[b] = b % 61 == 0 ? 0 : 1 + tu_below(&rng, 400);
    pages += (len[b] + 15) / 16;
  }
  decode_against_oracle(len, COUNT, 32, 8, 128, pages, PKV_FORMAT_F16, PKV_FORMAT_F16);
  decode_against_oracle(len, COUNT, 32, 8, 128, pages, PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0);
  decode_against_oracle(len, COUNT, 32, 8, 128, pages, PKV_FORMAT_Q4_0, PKV_FORMAT_Q4_0);
}

static void one_sequence_of_128k(void **state) {
  (void)state;
  const uint32_t len = 128 * 1024;
  decode_against_oracle(&len, 1, 8, 1, 128, len / 16, PKV_FORMAT_F16, PKV_FORMAT_F16);
}

/* A GQA group of 16 query heads per KV head: more heads than one block of some kernels serves. */
static void group_of_16(void **state) {
  (void)state;
  const uint32_t len[4] = {1 + tu_below(&rng, 40), 300 + tu_below(&rng, 700), 17, 2000 + tu_below(&rng, 2000)};
  uint32_t pages = 0;
  for (int b = 0; b < 4; b++) pages += (len[b] + 15) / 16;
  for (uint32_t D = 64; D <= 256; D *= 2) decode_against_oracle(len, 4, 32, 2, D, pages, PKV_FORMAT_F16, PKV_FORMAT_F16);
}

/* Pools the device cannot hold: PKV_ERR_OUT_OF_MEMORY with a reason, and nothing left allocated. The
 * pages of the second kind fit (52 GB) but its page table (1M sequences x 800K pages) does not, so a
 * refusal that leaked the pages would leave too little for the 52 GB pool made afterwards. */
static void pool_larger_than_device(void **state) {
  (void)state;
  const pkv_pool_desc small = pu_desc(1, 1, 64, 16, 64, 4, PKV_FORMAT_F16, PKV_FORMAT_F16);
  pkv_context *ctx;
  pkv_pool *pool, *none = NULL;
  open_gpu(&small, &ctx, &pool);
  pkv_pool_desc pages_too_big = pu_desc(80, 8, 128, 16, 65536, 4, PKV_FORMAT_F16, PKV_FORMAT_F16); /* 320 GiB */
  pu_assert_fails(pkv_pool_create(ctx, &pages_too_big, &none), PKV_ERR_OUT_OF_MEMORY);
  pkv_pool_desc table_too_big = pu_desc(1, 8, 128, 16, 800000, 1u << 20, PKV_FORMAT_F16, PKV_FORMAT_F16);
  for (int round = 0; round < 3; round++)
    pu_assert_fails(pkv_pool_create(ctx, &table_too_big, &none), PKV_ERR_OUT_OF_MEMORY);
  assert_null(none);
  pkv_pool_desc fits = table_too_big;
  fits.max_sequences = 4;
  pkv_pool *big;
  CHECK_OK(pkv_pool_create(ctx, &fits, &big));
  CHECK_OK(pkv_pool_destroy(big));
  pkv_seq s;
  CHECK_OK(pkv_seq_alloc(pool, &s)); /* the first pool is untouched */
  pu_close(ctx, pool);
}

static int setup(void **state) {
  (void)state;
  rng = tu_rng_make(tu_seed());
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(pages_identical_to_cpu),
      cmocka_unit_test(batch_of_512),
      cmocka_unit_test(one_sequence_of_128k),
      cmocka_unit_test(group_of_16),
      cmocka_unit_test(pool_larger_than_device),
  };
  return tu_run_tests(tests, setup, NULL);
}
