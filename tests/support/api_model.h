/* A driver of random API call sequences checked against a reference model, shared by the libFuzzer
 * harness (tests/fuzz/fuzz_api.cpp) and test_random_calls: bytes choose a small pool and then the
 * calls (alloc, free, fork, truncate, append, write, read, decode, stats, a swap out and in through
 * export and import; valid and not). After
 * every call the pool must agree with the model: a failed call has a text and changed nothing; a
 * successful one changed what the model says (lengths, live sequences, pages in use and shared,
 * tokens, and every written row read back). */
#ifndef PKV_API_MODEL_H
#define PKV_API_MODEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Runs the calls `data` describes on a CPU context (*calls: how many ran). 0 when the pool agreed
 * with the model after every call; otherwise 1, with what disagreed in why. */
int pkv_model_run(const uint8_t *data, size_t size, uint32_t *calls, char *why, size_t why_size);

#ifdef __cplusplus
}
#endif

#endif
