/* Builders of the API's description and argument structs. They call nothing of the library and need
 * no cmocka, so every program may use them: the ABI tests, whose loader test reaches the library
 * through a function table and links no pagedkv, the fuzz harness and test_faults, which check with
 * exceptions of their own (failure.hpp), as well as the cmocka programs (poolutil.h includes this). */
#ifndef PKV_ARGS_H
#define PKV_ARGS_H

#include <stdint.h>

#include "pagedkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A pool description; page_order_seed 0, max_sequence_length 0 (the pages' cap). */
pkv_pool_desc pu_desc(uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t page_size, uint32_t pages,
                      uint32_t max_sequences, pkv_format k_format, pkv_format v_format);

/* pkv_write_args for host memory. */
pkv_write_args pu_write_args(uint32_t layer, const pkv_seq *seqs, const uint32_t *n_tokens, uint32_t count,
                             pkv_format src_format, const void *k, const void *v);

/* pkv_read_args for host memory. */
pkv_read_args pu_read_args(uint32_t layer, pkv_seq seq, uint32_t start, uint32_t count, pkv_format dst_format,
                           void *k, void *v);

/* pkv_decode_args for `count` sequences of `layer` with q_heads query heads each, one query token,
 * F32 q and out in host memory, and lse (NULL: none); the other fields as PKV_DECODE_ARGS_INIT sets
 * them. */
pkv_decode_args pu_decode_args(uint32_t layer, const pkv_seq *seqs, uint32_t count, uint32_t q_heads, const void *q,
                               void *out, float *lse);

/* pkv_extend_args for `count` entries of `layer` whose new tokens q_offsets gives, q_heads query heads
 * each, causal, F32 q and out in host memory, and lse (NULL: none); the other fields as
 * PKV_EXTEND_ARGS_INIT sets them. */
pkv_extend_args pu_extend_args(uint32_t layer, const pkv_seq *seqs, uint32_t count, uint32_t q_heads,
                               const uint32_t *q_offsets, const void *q, void *out, float *lse);

#ifdef __cplusplus
}
#endif

#endif
