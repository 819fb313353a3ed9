#include "poolutil.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

void *pu_malloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) fail_msg("out of memory (%zu bytes)", bytes);
  return p;
}

pkv_pool_desc pu_desc(uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t page_size,
                      uint32_t pages, uint32_t max_sequences, pkv_format k_format, pkv_format v_format) {
  pkv_pool_desc d = PKV_POOL_DESC_INIT;
  d.layers = layers;
  d.kv_heads = kv_heads;
  d.head_dim = head_dim;
  d.page_size = page_size;
  d.pages = pages;
  d.max_sequences = max_sequences;
  d.k_format = k_format;
  d.v_format = v_format;
  return d;
}

pkv_status pu_context(pkv_context **ctx) {
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  const pkv_status st = pkv_context_create(&cd, ctx);
  if (st == PKV_ERR_UNSUPPORTED || st == PKV_ERR_NO_DEVICE) { /* PKV_BACKEND names one this machine lacks */
    print_message("    skipped: %s\n", pkv_last_error());
    skip();
  }
  return st;
}

void pu_open(const pkv_pool_desc *desc, pkv_context **ctx, pkv_pool **pool) {
  *ctx = NULL;
  *pool = NULL;
  assert_int_equal(pu_context(ctx), PKV_OK);
  assert_non_null(*ctx);
  assert_int_equal(pkv_pool_create(*ctx, desc, pool), PKV_OK);
  assert_non_null(*pool);
}

void pu_close(pkv_context *ctx, pkv_pool *pool) {
  assert_int_equal(pkv_pool_destroy(pool), PKV_OK);
  assert_int_equal(pkv_context_destroy(ctx), PKV_OK);
}

pkv_pool_stats pu_stats(pkv_pool *pool) {
  pkv_pool_stats s = PKV_POOL_STATS_INIT;
  assert_int_equal(pkv_pool_get_stats(pool, &s), PKV_OK);
  return s;
}

void pu_assert_stats_equal(const pkv_pool_stats *got, const pkv_pool_stats *want) {
  assert_int_equal(got->pages_total, want->pages_total);
  assert_int_equal(got->pages_free, want->pages_free);
  assert_int_equal(got->pages_shared, want->pages_shared);
  assert_int_equal(got->sequences_live, want->sequences_live);
  assert_int_equal(got->max_sequences, want->max_sequences);
  assert_int_equal(got->tokens_live, want->tokens_live);
  assert_int_equal(got->bytes_total, want->bytes_total);
  assert_int_equal(got->bytes_per_page, want->bytes_per_page);
  assert_int_equal(got->bytes_per_token, want->bytes_per_token);
}

uint32_t pu_length(pkv_pool *pool, pkv_seq seq) {
  uint32_t n = 0xdeadbeefu;
  assert_int_equal(pkv_seq_length(pool, seq, &n), PKV_OK);
  return n;
}

void pu_assert_fails(pkv_status got, pkv_status want) {
  assert_int_equal(got, want);
  const char *e = pkv_last_error();
  assert_non_null(e);
  assert_true(strlen(e) > 0);
}

pkv_status pu_write(pkv_pool *pool, uint32_t layer, const pkv_seq *seqs, const uint32_t *n_tokens,
                    uint32_t count, pkv_format src_format, const void *k, const void *v) {
  pkv_write_args a = PKV_WRITE_ARGS_INIT;
  a.layer = layer;
  a.seqs = seqs;
  a.n_tokens = n_tokens;
  a.count = count;
  a.src_format = src_format;
  a.k = k;
  a.v = v;
  return pkv_write(pool, &a);
}

pkv_status pu_read(pkv_pool *pool, uint32_t layer, pkv_seq seq, uint32_t start, uint32_t count,
                   pkv_format dst_format, void *k, void *v) {
  pkv_read_args a = PKV_READ_ARGS_INIT;
  a.layer = layer;
  a.seq = seq;
  a.start = start;
  a.count = count;
  a.dst_format = dst_format;
  a.k = k;
  a.v = v;
  return pkv_read(pool, &a);
}

pkv_decode_args pu_decode_args(uint32_t layer, const pkv_seq *seqs, uint32_t count, uint32_t q_heads, const void *q,
                               void *out, float *lse) {
  pkv_decode_args a = PKV_DECODE_ARGS_INIT;
  a.layer = layer;
  a.seqs = seqs;
  a.count = count;
  a.q_heads = q_heads;
  a.q = q;
  a.out = out;
  a.lse = lse;
  return a;
}
