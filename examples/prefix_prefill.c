/* Chunked prefill and a prefix-cache hit with pkv_extend, every status checked. A prompt is prefilled
 * in chunks: each chunk's tokens are appended, their K/V rows written, and the chunk's queries
 * attended over the cache grown so far. Then the cached prompt is forked into two requests that
 * share its pages, each appends its own new prompt tokens, and one pkv_extend attends both (ragged:
 * 7 and 12 new tokens). The check: the last chunk's outputs equal those of one extend of the whole
 * prompt, and each request's last query equals a decode of its newest token. The CPU backend runs
 * extend (the GPU backends refuse it for now), so this example asks for it.
 * Build: cc prefix_prefill.c $(pkg-config --cflags --libs pagedkv) -lm */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <pagedkv.h>

#define CHECK(call)                                                                                 \
  do {                                                                                              \
    pkv_status st_ = (call);                                                                        \
    if (st_ != PKV_OK) {                                                                            \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, pkv_last_error());        \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)

enum { KV_HEADS = 2, Q_HEADS = 8, HEAD_DIM = 64, ROW = KV_HEADS * HEAD_DIM, QROW = Q_HEADS * HEAD_DIM };
enum { PROMPT = 100, CHUNK = 32 };

static unsigned state = 2024;
static float random_value(void) {
  state = state * 1664525u + 1013904223u;
  return (float)((state >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* Appends n tokens to seq and writes random K/V rows for them (one layer). */
static void grow(pkv_pool *pool, pkv_seq seq, uint32_t n) {
  float *k = malloc(sizeof *k * n * ROW), *v = malloc(sizeof *v * n * ROW);
  pkv_write_args w = PKV_WRITE_ARGS_INIT;
  size_t i;
  if (!k || !v) exit(1);
  for (i = 0; i < (size_t)n * ROW; i++) k[i] = random_value(), v[i] = random_value();
  CHECK(pkv_append(pool, &seq, &n, 1));
  w.seqs = &seq;
  w.n_tokens = &n;
  w.count = 1;
  w.k = k;
  w.v = v;
  CHECK(pkv_write(pool, &w));
  free(k), free(v);
}

/* One extend of count entries: q and out [sum tokens][q_heads][head_dim] as F32 host memory. */
static void extend(pkv_pool *pool, const pkv_seq *seqs, const uint32_t *offsets, uint32_t count, const float *q,
                   float *out) {
  pkv_extend_args a = PKV_EXTEND_ARGS_INIT;
  a.seqs = seqs;
  a.count = count;
  a.q_heads = Q_HEADS;
  a.q_offsets = offsets;
  a.q = q;
  a.out = out;
  CHECK(pkv_extend(pool, &a));
}

static double max_diff(const float *x, const float *y, size_t n) {
  double worst = 0;
  size_t i;
  for (i = 0; i < n; i++) {
    /* A comparison, not fmax: GCC 12 for aarch64 fails with an internal error vectorising fmax here. */
    const double d = fabs((double)x[i] - y[i]);
    if (d != d) return INFINITY; /* a NaN on either side is the worst difference */
    if (d > worst) worst = d;
  }
  return worst;
}

int main(void) {
  pkv_context *ctx;
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  pkv_pool *pool;
  pkv_pool_desc pd = PKV_POOL_DESC_INIT;
  pkv_seq prompt, req[2];
  const uint32_t fresh[2] = {7, 12}, req_offsets[3] = {0, 7, 19};
  float *q = malloc(sizeof *q * PROMPT * QROW), *out = malloc(sizeof *out * PROMPT * QROW);
  float *whole = malloc(sizeof *whole * PROMPT * QROW), *dec = malloc(sizeof *dec * 2 * QROW);
  double chunk_err, decode_err = 0;
  uint32_t done, i;
  size_t j;
  if (!q || !out || !whole || !dec) return 1;
  for (j = 0; j < (size_t)PROMPT * QROW; j++) q[j] = random_value();

  cd.backend = PKV_BACKEND_CPU;
  CHECK(pkv_context_create(&cd, &ctx));
  pd.layers = 1;
  pd.kv_heads = KV_HEADS;
  pd.head_dim = HEAD_DIM;
  pd.pages = 64;
  pd.k_format = PKV_FORMAT_Q8_0;
  CHECK(pkv_pool_create(ctx, &pd, &pool));

  /* 1. Chunked prefill: chunk c attends over the prompt's first (c + 1) chunks. */
  CHECK(pkv_seq_alloc(pool, &prompt));
  for (done = 0; done < PROMPT; done += CHUNK) {
    const uint32_t n = PROMPT - done < CHUNK ? PROMPT - done : CHUNK, offsets[2] = {0, n};
    grow(pool, prompt, n);
    extend(pool, &prompt, offsets, 1, q + (size_t)done * QROW, out + (size_t)done * QROW);
  }
  {
    const uint32_t offsets[2] = {0, PROMPT};
    extend(pool, &prompt, offsets, 1, q, whole);
  }
  chunk_err = max_diff(out, whole, (size_t)PROMPT * QROW);

  /* 2. Prefix hit: two requests fork the cached prompt (its pages shared), append their own tokens
   *    (the first append into the shared partial page copies it) and are extended together. */
  for (i = 0; i < 2; i++) {
    CHECK(pkv_seq_fork(pool, prompt, &req[i]));
    grow(pool, req[i], fresh[i]);
  }
  extend(pool, req, req_offsets, 2, q, out);

  /* Each request's last query is its newest token: what pkv_decode computes for it. */
  for (i = 0; i < 2; i++) {
    pkv_decode_args d = PKV_DECODE_ARGS_INIT;
    d.seqs = &req[i];
    d.count = 1;
    d.q_heads = Q_HEADS;
    d.q = q + (size_t)(req_offsets[i + 1] - 1) * QROW;
    d.out = dec + (size_t)i * QROW;
    CHECK(pkv_decode(pool, &d));
    decode_err = fmax(decode_err, max_diff(dec + (size_t)i * QROW, out + (size_t)(req_offsets[i + 1] - 1) * QROW, QROW));
  }

  for (i = 0; i < 2; i++) CHECK(pkv_seq_free(pool, req[i]));
  CHECK(pkv_seq_free(pool, prompt));
  CHECK(pkv_pool_destroy(pool));
  CHECK(pkv_context_destroy(ctx));
  free(q), free(out), free(whole), free(dec);
  printf("chunked prefill vs whole prompt: max difference %.2e; prefix hit's last queries vs decode: %.2e\n",
         chunk_err, decode_err);
  return chunk_err < 1e-5 && decode_err < 1e-5 ? 0 : 1;
}
