/* Helpers shared by the pool tests: open/close a context and pool, stats, and thin wrappers around
 * the argument structs. They assert with cmocka, so call them from inside a cmocka test. */
#ifndef PKV_POOLUTIL_H
#define PKV_POOLUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "pagedkv.h"

/* A pool description; page_order_seed 0. */
pkv_pool_desc pu_desc(uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t page_size,
                      uint32_t pages, uint32_t max_sequences, pkv_format k_format, pkv_format v_format);

/* A context on PKV_BACKEND_AUTO (so PKV_BACKEND picks the backend) and a pool on it; skips the test
 * when PKV_BACKEND names a backend this machine lacks. */
void pu_open(const pkv_pool_desc *desc, pkv_context **ctx, pkv_pool **pool);
void pu_close(pkv_context *ctx, pkv_pool *pool);

pkv_pool_stats pu_stats(pkv_pool *pool);
void pu_assert_stats_equal(const pkv_pool_stats *got, const pkv_pool_stats *want);
uint32_t pu_length(pkv_pool *pool, pkv_seq seq);

/* got == want, and a failure left a non-empty pkv_last_error(). */
void pu_assert_fails(pkv_status got, pkv_status want);

/* pkv_write / pkv_read with host memory. */
pkv_status pu_write(pkv_pool *pool, uint32_t layer, const pkv_seq *seqs, const uint32_t *n_tokens,
                    uint32_t count, pkv_format src_format, const void *k, const void *v);
pkv_status pu_read(pkv_pool *pool, uint32_t layer, pkv_seq seq, uint32_t start, uint32_t count,
                   pkv_format dst_format, void *k, void *v);

#endif
