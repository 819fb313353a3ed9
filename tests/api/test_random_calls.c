/* Random calls, valid and not, on small pools of random shapes and formats: every call returns (no
 * crash, and under the sanitizer build no report); a failed call says why and leaves the pool's
 * statistics and every sequence's length as they were. Arguments are drawn to be wrong now and then:
 * stale, zero or foreign handles, null arrays, layers and formats out of range, lengths past the
 * pool, q_tokens past 8, q_heads not a multiple of kv_heads, extends (and their prepare) of more new
 * tokens than a sequence holds or offsets not from 0; rows and q hold random bits in their
 * source format now and then (NaNs and infinities among them). test_bad_input names each bad input
 * once; this mixes them with valid calls in random orders. A second test runs the fuzzer's driver
 * (tests/support/api_model.cpp) on random bytes, which checks successful calls against a reference
 * model too. PKV_TEST_SEED replays a run. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <string.h>

#include "api_model.h"
#include "poolutil.h"
#include "testutil.h"

enum { SEQS = 10, ROUNDS = 30, CALLS = 600, FLOATS = 1 << 18 };

static tu_rng rng;
static pkv_pool *pool;
static pkv_seq seqs[SEQS]; /* zero where none: the zero handle is never valid */
static float data[FLOATS], out[FLOATS]; /* static: a skipped test (no such backend) leaks nothing */

static uint32_t below(uint32_t n) { return tu_below(&rng, n); }
static int now_and_then(void) { return below(12) == 0; }

/* A handle of the test's, or now and then one damaged, zero or freed. */
static pkv_seq some_seq(void) {
  pkv_seq s = seqs[below(SEQS)];
  if (now_and_then()) s.id ^= 1ull << below(64);
  return s;
}
static pkv_format some_format(void) { return now_and_then() ? (pkv_format)below(9) : (pkv_format)(1 + below(3)); }

/* n values for a row or q buffer: small floats, or now and then random bits (NaN, inf, anything). */
static const void *values(size_t n) {
  if (n > FLOATS) n = FLOATS;
  const int bits = now_and_then();
  for (size_t i = 0; i < n; i++) {
    if (bits) {
      const uint32_t u = (uint32_t)tu_next(&rng);
      memcpy(&data[i], &u, 4);
    } else {
      data[i] = (float)tu_uniform(&rng, -2.0, 2.0);
    }
  }
  return data;
}

typedef struct state {
  pkv_pool_stats stats;
  uint32_t len[SEQS];
} state;

static state take(void) {
  state s;
  s.stats = pu_stats(pool);
  for (int i = 0; i < SEQS; i++)
    if (pkv_seq_length(pool, seqs[i], &s.len[i]) != PKV_OK) s.len[i] = UINT32_MAX;
  return s;
}

/* One random call; its status. */
static pkv_status random_call(const pkv_pool_desc *d) {
  const uint32_t i = below(SEQS), row = d->kv_heads * d->head_dim;
  pkv_seq b[4];
  uint32_t n[4], count = below(5), total = 0;
  for (uint32_t k = 0; k < 4; k++) {
    b[k] = some_seq();
    n[k] = below(now_and_then() ? 5000 : 6);
    total += k < count ? n[k] : 0;
  }
  switch (below(9)) {
  case 0: {
    pkv_seq s;
    const pkv_status st = pkv_seq_alloc(pool, &s);
    if (st == PKV_OK) {
      pkv_seq_free(pool, seqs[i]); /* the slot's old handle: zero or already freed fails, harmlessly */
      seqs[i] = s;
    }
    return st;
  }
  case 1: return pkv_seq_free(pool, some_seq());
  case 2: {
    pkv_seq s;
    const pkv_status st = pkv_seq_fork(pool, some_seq(), &s);
    if (st == PKV_OK) {
      pkv_seq_free(pool, seqs[i]);
      seqs[i] = s;
    }
    return st;
  }
  case 3: return pkv_seq_truncate(pool, some_seq(), below(60));
  case 4: return pkv_append(pool, now_and_then() ? NULL : b, now_and_then() ? NULL : n, count);
  case 5: {
    pkv_write_args a = PKV_WRITE_ARGS_INIT;
    a.layer = below(d->layers + 1);
    a.seqs = b;
    a.n_tokens = n;
    a.count = count;
    a.src_format = some_format();
    if ((size_t)total * row > FLOATS / 2) return PKV_OK; /* larger than the buffer: not drawn */
    a.k = now_and_then() ? NULL : values((size_t)total * row);
    a.v = a.k ? a.k : data;
    return pkv_write(pool, &a);
  }
  case 6: {
    pkv_read_args a = PKV_READ_ARGS_INIT;
    a.layer = below(d->layers + 1);
    a.seq = some_seq();
    a.start = below(40);
    a.count = below(40);
    a.dst_format = some_format();
    a.k = below(4) ? out : NULL;
    a.v = below(4) ? out + FLOATS / 2 : NULL;
    return pkv_read(pool, &a);
  }
  case 7: {
    /* New tokens of each entry: mostly a few (past a sequence's length now and then), now and then
     * its n; the offsets NULL or decreasing at times. */
    uint32_t offsets[5] = {0};
    for (uint32_t k = 0; k < count; k++) offsets[k + 1] = offsets[k] + (now_and_then() ? n[k] : below(4));
    if (count && now_and_then()) offsets[1] = offsets[0] + 1, offsets[0] = 1;
    pkv_extend_args a = PKV_EXTEND_ARGS_INIT;
    a.layer = below(d->layers + 1);
    a.seqs = now_and_then() ? NULL : b;
    a.count = count;
    a.q_heads = d->kv_heads * below(5) + (now_and_then() ? 1 : 0);
    a.q_offsets = now_and_then() ? NULL : offsets;
    a.q_format = some_format();
    a.out_format = some_format();
    a.scale = now_and_then() ? NAN : 0.0f;
    const size_t q = (size_t)offsets[count] * a.q_heads * d->head_dim;
    if (2 * q + (size_t)offsets[count] * a.q_heads > FLOATS) return PKV_OK; /* not drawn */
    a.q = now_and_then() ? NULL : values(q);
    a.out = now_and_then() ? NULL : out;
    a.lse = below(2) ? out + q : NULL;
    return below(4) ? pkv_extend(pool, &a) : pkv_extend_prepare(pool, &a);
  }
  default: {
    pkv_decode_args a = PKV_DECODE_ARGS_INIT;
    a.layer = below(d->layers + 1);
    a.seqs = now_and_then() ? NULL : b;
    a.count = count;
    a.q_heads = d->kv_heads * below(5) + (now_and_then() ? 1 : 0);
    a.q_tokens = now_and_then() ? below(12) : 1 + below(3);
    a.q_format = some_format();
    a.out_format = some_format();
    a.chunk_pages = below(3) ? 0 : below(4);
    a.scale = now_and_then() ? NAN : 0.0f;
    const size_t q = (size_t)count * a.q_tokens * a.q_heads * d->head_dim;
    if (2 * q + (size_t)count * a.q_tokens * a.q_heads > FLOATS) return PKV_OK; /* not drawn */
    a.q = now_and_then() ? NULL : values(q);
    a.out = now_and_then() ? NULL : out;
    a.lse = below(2) ? out + q : NULL;
    return below(4) ? pkv_decode(pool, &a) : pkv_decode_prepare(pool, &a);
  }
  }
}

static void random_calls(void **s) {
  (void)s;
  rng = tu_rng_make(tu_seed() ^ 0x5eed5eedull);
  for (int round = 0; round < ROUNDS; round++) {
    const pkv_format formats[7] = {PKV_FORMAT_F32,  PKV_FORMAT_F16,      PKV_FORMAT_BF16,    PKV_FORMAT_Q8_0,
                                   PKV_FORMAT_Q4_0, PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2};
    pkv_pool_desc d = pu_desc(1 + below(3), 1 + below(3), 32 * (1 + below(4)), 1u << below(6), 1 + below(40),
                              1 + below(SEQS), formats[below(7)], formats[below(7)]);
    d.max_sequence_length = below(3) ? 0 : below(300);
    d.page_order_seed = below(2);
    pkv_context *ctx;
    pu_open(&d, &ctx, &pool);
    memset(seqs, 0, sizeof seqs);
    for (int call = 0; call < CALLS; call++) {
      const state before = take();
      const pkv_status st = random_call(&d);
      if (st == PKV_OK) continue;
      if (!pkv_last_error()[0]) fail_msg("round %d call %d: %s with no error text", round, call, pkv_status_string(st));
      const state after = take();
      pu_assert_stats_equal(&after.stats, &before.stats);
      for (int i = 0; i < SEQS; i++)
        if (after.len[i] != before.len[i])
          fail_msg("round %d call %d failed (%s) but sequence %d's length went from %u to %u", round, call,
                   pkv_last_error(), i, before.len[i], after.len[i]);
    }
    pu_close(ctx, pool);
  }
}

/* Random call sequences (tests/support/api_model.cpp, the fuzzer's driver) from the seed's bytes:
 * every call, successful ones included, checked against the reference model. */
static void random_calls_against_model(void **s) {
  (void)s;
  enum { RUNS = 100, BYTES = 3000 };
  static uint8_t bytes[BYTES];
  tu_rng r = tu_rng_make(tu_seed() ^ 0x40de1ull);
  uint64_t total = 0;
  for (int run = 0; run < RUNS; run++) {
    for (int i = 0; i < BYTES; i++) bytes[i] = (uint8_t)tu_next(&r);
    uint32_t calls = 0;
    char why[512];
    if (pkv_model_run(bytes, BYTES, &calls, why, sizeof why) != 0) fail_msg("run %d: %s", run, why);
    total += calls;
  }
  print_message("    %d runs, %llu calls checked against the model\n", RUNS, (unsigned long long)total);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(random_calls), cmocka_unit_test(random_calls_against_model)};
  return tu_run_tests(tests, NULL, NULL);
}
