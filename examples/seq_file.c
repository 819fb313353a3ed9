/* Saving a sequence's K/V to a file and restoring it, as an engine does to keep a conversation:
 * the file holds the sequence's image, the bytes pkv_seq_export writes (header, checksums, pages as
 * stored), and pkv_seq_import reads them back into any pool of the same geometry.
 *
 * usage: seq_file FILE   (run by the test suite: it saves, restores into a new pool of another
 * context, and checks that every row reads back and decodes the same; exit 0 on success) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagedkv.h"

#define CHECK(call)                                                                                   \
  do {                                                                                               \
    pkv_status st_ = (call);                                                                         \
    if (st_ != PKV_OK) {                                                                             \
      fprintf(stderr, "%s failed: %s\n", #call, pkv_last_error());                                   \
      exit(1);                                                                                       \
    }                                                                                                \
  } while (0)

enum { LAYERS = 4, KV_HEADS = 2, HEAD_DIM = 64, TOKENS = 37, Q_HEADS = 8 };

static pkv_pool *open_pool(pkv_context **ctx, uint32_t seed) {
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
  CHECK(pkv_context_create(&cd, ctx));
  pkv_pool_desc d = PKV_POOL_DESC_INIT;
  d.layers = LAYERS;
  d.kv_heads = KV_HEADS;
  d.head_dim = HEAD_DIM;
  d.pages = 32;
  d.k_format = PKV_FORMAT_Q8_0;
  d.v_format = PKV_FORMAT_Q4_0;
  d.page_order_seed = seed;
  pkv_pool *pool;
  CHECK(pkv_pool_create(*ctx, &d, &pool));
  return pool;
}

/* Saves seq's image to path. */
static void save(pkv_context *ctx, pkv_pool *pool, pkv_seq seq, const char *path) {
  pkv_export_args a = PKV_EXPORT_ARGS_INIT;
  a.seq = seq;
  uint64_t bytes;
  CHECK(pkv_seq_export_size(pool, &a, &bytes));
  a.image = malloc(bytes);
  a.image_bytes = bytes;
  CHECK(pkv_seq_export(pool, &a));
  CHECK(pkv_context_synchronize(ctx)); /* host memory: already complete; the call an engine keeps */
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(a.image, 1, bytes, f) != bytes || fclose(f) != 0) {
    perror(path);
    exit(1);
  }
  free(a.image);
}

/* A new sequence of pool restored from the file at path. */
static pkv_seq restore(pkv_pool *pool, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f || fseek(f, 0, SEEK_END) != 0) {
    perror(path);
    exit(1);
  }
  const long bytes = ftell(f);
  rewind(f);
  void *image = malloc(bytes > 0 ? (size_t)bytes : 1);
  if (bytes <= 0 || fread(image, 1, (size_t)bytes, f) != (size_t)bytes) {
    fprintf(stderr, "%s: cannot read\n", path);
    exit(1);
  }
  fclose(f);
  pkv_import_args a = PKV_IMPORT_ARGS_INIT;
  a.image = image;
  a.image_bytes = (uint64_t)bytes;
  pkv_seq seq;
  CHECK(pkv_seq_import(pool, &a, &seq));
  free(image);
  return seq;
}

static void decode(pkv_pool *pool, pkv_seq seq, uint32_t layer, const float *q, float *out) {
  pkv_decode_args a = PKV_DECODE_ARGS_INIT;
  a.layer = layer;
  a.seqs = &seq;
  a.count = 1;
  a.q_heads = Q_HEADS;
  a.q = q;
  a.out = out;
  CHECK(pkv_decode(pool, &a));
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seq_file FILE\n");
    return 2;
  }
  static float k[TOKENS * KV_HEADS * HEAD_DIM], v[TOKENS * KV_HEADS * HEAD_DIM], q[Q_HEADS * HEAD_DIM];
  static float out_a[Q_HEADS * HEAD_DIM], out_b[Q_HEADS * HEAD_DIM];
  static float rows_a[2][TOKENS * KV_HEADS * HEAD_DIM], rows_b[2][TOKENS * KV_HEADS * HEAD_DIM];
  uint32_t x = 12345;
  for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)((x = x * 1103515245u + 12345u) >> 16) / 32768.0f - 1.0f;

  /* a conversation of TOKENS tokens in every layer, saved */
  pkv_context *ctx_a, *ctx_b;
  pkv_pool *a = open_pool(&ctx_a, 11);
  pkv_seq s;
  const uint32_t n = TOKENS;
  CHECK(pkv_seq_alloc(a, &s));
  CHECK(pkv_append(a, &s, &n, 1));
  for (uint32_t l = 0; l < LAYERS; l++) {
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
      k[i] = (float)((x = x * 1103515245u + 12345u) >> 16) / 32768.0f - 1.0f;
      v[i] = (float)((x = x * 1103515245u + 12345u) >> 16) / 16384.0f - 2.0f;
    }
    pkv_write_args w = PKV_WRITE_ARGS_INIT;
    w.layer = l;
    w.seqs = &s;
    w.n_tokens = &n;
    w.count = 1;
    w.k = k;
    w.v = v;
    CHECK(pkv_write(a, &w));
  }
  save(ctx_a, a, s, argv[1]);

  /* restored into a pool of another context, its pages in another order */
  pkv_pool *b = open_pool(&ctx_b, 99);
  const pkv_seq t = restore(b, argv[1]);
  uint32_t len = 0;
  CHECK(pkv_seq_length(b, t, &len));
  if (len != TOKENS) {
    fprintf(stderr, "restored %u tokens, saved %u\n", len, (unsigned)TOKENS);
    return 1;
  }
  for (uint32_t l = 0; l < LAYERS; l++) {
    pkv_read_args r = PKV_READ_ARGS_INIT;
    r.layer = l;
    r.count = TOKENS;
    r.seq = s;
    r.k = rows_a[0];
    r.v = rows_a[1];
    CHECK(pkv_read(a, &r));
    r.seq = t;
    r.k = rows_b[0];
    r.v = rows_b[1];
    CHECK(pkv_read(b, &r));
    decode(a, s, l, q, out_a);
    decode(b, t, l, q, out_b);
    if (memcmp(rows_a, rows_b, sizeof rows_a) != 0 || memcmp(out_a, out_b, sizeof out_a) != 0) {
      fprintf(stderr, "layer %u differs after the restore\n", l);
      return 1;
    }
  }
  printf("saved %u tokens of %u layers to %s and restored them: every row and decode the same\n", (unsigned)TOKENS,
         (unsigned)LAYERS, argv[1]);
  CHECK(pkv_pool_destroy(a));
  CHECK(pkv_pool_destroy(b));
  CHECK(pkv_context_destroy(ctx_a));
  CHECK(pkv_context_destroy(ctx_b));
  return 0;
}
