/* Helpers shared by the cmocka programs: open/close a context and pool, stats, check and skip
 * helpers, pkv_write and pkv_read with host memory; args.h (included) builds the argument structs.
 * Those that check something do so with cmocka, so call them from inside a cmocka test (outside one,
 * a failed check ends the program). */
#ifndef PKV_POOLUTIL_H
#define PKV_POOLUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "args.h"
#include "pagedkv.h"

/* Fails the running test, naming the call, its status and the last error, unless it returns PKV_OK.
 * CHECK_OK_IN reaches the library through a function table (pkv_api), as the ABI tests do. */
#define CHECK_OK(call) PU_CHECK_OK_(#call, (call), pkv_status_string, pkv_last_error)
#define CHECK_OK_IN(api, call) PU_CHECK_OK_(#call, (call), (api)->status_string, (api)->last_error)
#define PU_CHECK_OK_(text, call, status_string, last_error)                                         \
  do {                                                                                               \
    const pkv_status st_ = call;                                                                     \
    if (st_ != PKV_OK) fail_msg("%s -> %s (%s)", text, status_string(st_), last_error());           \
  } while (0)

/* malloc that fails the running test when the memory is not there; 0 bytes allocates 1. */
void *pu_malloc(size_t bytes);

/* A context on PKV_BACKEND_AUTO (so PKV_BACKEND picks the backend): pkv_context_create's status, but
 * the test is skipped, saying why, when PKV_BACKEND names a backend this machine lacks. */
pkv_status pu_context(pkv_context **ctx);

/* The backend PKV_BACKEND picks for this run, asked before any test starts: a program run for a
 * backend this machine lacks exits with TU_EXIT_SKIP (cmocka's skip() works inside a test only). */
pkv_backend pu_run_backend(void);

/* pu_context and a pool on it; both must succeed (or the test skips). */
void pu_open(const pkv_pool_desc *desc, pkv_context **ctx, pkv_pool **pool);
void pu_close(pkv_context *ctx, pkv_pool *pool);

pkv_pool_stats pu_stats(pkv_pool *pool);
void pu_assert_stats_equal(const pkv_pool_stats *got, const pkv_pool_stats *want);
uint32_t pu_length(pkv_pool *pool, pkv_seq seq);

/* got == want, and a failure left a non-empty pkv_last_error(). */
void pu_assert_fails(pkv_status got, pkv_status want);

/* pkv_write / pkv_read with host memory (pu_write_args, pu_read_args). */
pkv_status pu_write(pkv_pool *pool, uint32_t layer, const pkv_seq *seqs, const uint32_t *n_tokens,
                    uint32_t count, pkv_format src_format, const void *k, const void *v);
pkv_status pu_read(pkv_pool *pool, uint32_t layer, pkv_seq seq, uint32_t start, uint32_t count,
                   pkv_format dst_format, void *k, void *v);

/* Skips the running test, saying why, in a build under AddressSanitizer, whose allocator stops the
 * program on a request it cannot serve where the test needs the request to fail. */
void pu_skip_under_asan(const char *why);

#endif
