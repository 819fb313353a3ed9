#include "poolutil.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "testutil.h"

void *pu_malloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) fail_msg("out of memory (%zu bytes)", bytes);
  return p;
}

pkv_status pu_context(pkv_context **ctx) {
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  const pkv_status st = pkv_context_create(&cd, ctx);
  if (tu_backend_missing(st)) {
    print_message("    skipped: %s\n", pkv_last_error());
    skip();
  }
  return st;
}

pkv_backend pu_run_backend(void) {
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  pkv_context *ctx = NULL;
  pkv_backend backend = PKV_BACKEND_AUTO;
  const pkv_status st = pkv_context_create(&cd, &ctx);
  if (tu_backend_missing(st)) {
    printf("SKIP: no backend for this run: %s\n", pkv_last_error());
    exit(TU_EXIT_SKIP);
  }
  if (st != PKV_OK || pkv_context_backend(ctx, &backend) != PKV_OK) {
    fprintf(stderr, "no context: %s\n", pkv_last_error());
    exit(1);
  }
  pkv_context_destroy(ctx);
  return backend;
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
  const pkv_write_args a = pu_write_args(layer, seqs, n_tokens, count, src_format, k, v);
  return pkv_write(pool, &a);
}

pkv_status pu_read(pkv_pool *pool, uint32_t layer, pkv_seq seq, uint32_t start, uint32_t count,
                   pkv_format dst_format, void *k, void *v) {
  const pkv_read_args a = pu_read_args(layer, seq, start, count, dst_format, k, v);
  return pkv_read(pool, &a);
}

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

void pu_skip_under_asan(const char *why) {
#if defined(UNDER_ASAN)
  print_message("    skipped under AddressSanitizer: %s\n", why);
  skip();
#else
  (void)why;
#endif
}
