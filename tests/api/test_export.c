/* Sequence images: pkv_seq_export and pkv_seq_import, and the pool's memory for transfer engines.
 *
 * - round trip: for every page format pair of a table, a pool of ragged, shuffled sequences (a fork
 *   sharing its parent's pages, a truncated one, an empty one) is exported sequence by sequence into
 *   host memory and imported into a second pool with another page order. Every layer and position
 *   reads back the same bits, decode gives the same bits, and the imported sequence exported again
 *   gives the same image byte for byte (so the stored quants and scales are the same, not only their
 *   values). Layer ranges: a random range is exported and imported, and must match in its layers.
 * - swap: an engine that swaps sequences out (export + free) and in (import) between steps of a
 *   generation (append, write every layer, decode every layer) decodes the same bits at every step as
 *   one that never swaps.
 * - bad images: a corrupted header byte, payload byte or payload checksum, a truncated image, a bad
 *   magic, a version from the future, every geometry field wrong, a length past the pool's longest
 *   sequence, a pool short of pages or sequence slots: each a clear status naming what is wrong, and
 *   the pool's statistics, lengths and rows unchanged. (NULL pointers, stale handles and layer ranges
 *   out of bounds are rows of test_bad_input.)
 * - regions and spans: one region covering the pool; the spans of a sequence, copied one by one into a
 *   sequence of the same length in another pool as a transfer engine would, give the same decode;
 *   on the CPU backend the bytes at the spans are the image's payload, in its order.
 * Random inputs come from tu_seed() (printed; PKV_TEST_SEED replays). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

#define LAYERS 3
#define KV_HEADS 2
#define HEAD_DIM 64
#define ROW (KV_HEADS * HEAD_DIM)
#define Q_HEADS 4
#define NSEQ 6

static uint64_t g_seed;

/* ---- helpers ---- */

static pkv_pool_desc desc_of(pkv_format k, pkv_format v, uint32_t page_size, uint32_t pages, uint32_t seed) {
  pkv_pool_desc d = pu_desc(LAYERS, KV_HEADS, HEAD_DIM, page_size, pages, 16, k, v);
  d.page_order_seed = seed;
  return d;
}

/* Appends n tokens to s and writes random rows for them in every layer. */
static void grow(pkv_pool *pool, pkv_seq s, uint32_t n, tu_rng *r) {
  if (n == 0) return;
  CHECK_OK(pkv_append(pool, &s, &n, 1));
  float *k = pu_malloc((size_t)n * ROW * sizeof(float)), *v = pu_malloc((size_t)n * ROW * sizeof(float));
  for (uint32_t l = 0; l < LAYERS; l++) {
    tu_fill_uniform(r, k, (size_t)n * ROW, -2.0, 2.0);
    tu_fill_uniform(r, v, (size_t)n * ROW, -2.0, 2.0);
    CHECK_OK(pu_write(pool, l, &s, &n, 1, PKV_FORMAT_F32, k, v));
  }
  free(k);
  free(v);
}

/* The image of layers [first, first + count) of s, in host memory (*bytes: its size). */
static uint8_t *export_host(pkv_pool *pool, pkv_seq s, uint32_t first, uint32_t count, uint64_t *bytes) {
  pkv_export_args a = PKV_EXPORT_ARGS_INIT;
  a.seq = s;
  a.first_layer = first;
  a.layer_count = count;
  CHECK_OK(pkv_seq_export_size(pool, &a, bytes));
  a.image = pu_malloc((size_t)*bytes);
  a.image_bytes = *bytes;
  CHECK_OK(pkv_seq_export(pool, &a));
  return a.image;
}

static pkv_status import_host(pkv_pool *pool, const void *image, uint64_t bytes, pkv_seq *out) {
  pkv_import_args a = PKV_IMPORT_ARGS_INIT;
  a.image = image;
  a.image_bytes = bytes;
  return pkv_seq_import(pool, &a, out);
}

/* Layers [first, first + count) of a and b read back as the same bits, K and V. */
static void assert_same_rows(pkv_pool *pa, pkv_seq a, pkv_pool *pb, pkv_seq b, uint32_t first, uint32_t count,
                             const char *what) {
  const uint32_t n = pu_length(pa, a);
  if (pu_length(pb, b) != n) fail_msg("%s: lengths %u and %u", what, n, pu_length(pb, b));
  if (n == 0) return;
  const size_t floats = (size_t)n * ROW;
  float *buf = pu_malloc(4 * floats * sizeof(float));
  for (uint32_t l = first; l < first + count; l++) {
    CHECK_OK(pu_read(pa, l, a, 0, n, PKV_FORMAT_F32, buf, buf + floats));
    CHECK_OK(pu_read(pb, l, b, 0, n, PKV_FORMAT_F32, buf + 2 * floats, buf + 3 * floats));
    if (memcmp(buf, buf + 2 * floats, 2 * floats * sizeof(float)) != 0) fail_msg("%s: layer %u reads differently", what, l);
  }
  free(buf);
}

/* Decode of layer `layer` over seqs a[] of pa and b[] of pb: the same bits. */
static void assert_same_decode(pkv_pool *pa, const pkv_seq *a, pkv_pool *pb, const pkv_seq *b, uint32_t count,
                               uint32_t layer, tu_rng *r, const char *what) {
  const size_t n = (size_t)count * Q_HEADS * HEAD_DIM;
  float *q = pu_malloc(n * sizeof(float)), *oa = pu_malloc(n * sizeof(float)), *ob = pu_malloc(n * sizeof(float));
  float *la = pu_malloc((size_t)count * Q_HEADS * sizeof(float)), *lb = pu_malloc((size_t)count * Q_HEADS * sizeof(float));
  tu_fill_uniform(r, q, n, -1.0, 1.0);
  pkv_decode_args d = pu_decode_args(layer, a, count, Q_HEADS, q, oa, la);
  CHECK_OK(pkv_decode(pa, &d));
  d = pu_decode_args(layer, b, count, Q_HEADS, q, ob, lb);
  CHECK_OK(pkv_decode(pb, &d));
  if (memcmp(oa, ob, n * sizeof(float)) != 0 || memcmp(la, lb, (size_t)count * Q_HEADS * sizeof(float)) != 0)
    fail_msg("%s: layer %u decodes differently", what, layer);
  free(q), free(oa), free(ob), free(la), free(lb);
}

/* The live sequences' statistics, lengths and rows of a pool: what a failed call must not change. */
typedef struct pool_state {
  pkv_pool_stats stats;
  uint32_t len[NSEQ];
  uint8_t *image[NSEQ];
  uint64_t bytes[NSEQ];
} pool_state;

static void take_state(pkv_pool *pool, const pkv_seq *seqs, uint32_t n, pool_state *s) {
  s->stats = pu_stats(pool);
  for (uint32_t i = 0; i < n; i++) {
    s->len[i] = pu_length(pool, seqs[i]);
    s->image[i] = export_host(pool, seqs[i], 0, 0, &s->bytes[i]);
  }
}

static void assert_state(pkv_pool *pool, const pkv_seq *seqs, uint32_t n, pool_state *before, const char *what) {
  pool_state after;
  take_state(pool, seqs, n, &after);
  pu_assert_stats_equal(&after.stats, &before->stats);
  for (uint32_t i = 0; i < n; i++) {
    if (after.len[i] != before->len[i]) fail_msg("%s: a length changed", what);
    if (after.bytes[i] != before->bytes[i] || memcmp(after.image[i], before->image[i], (size_t)after.bytes[i]) != 0)
      fail_msg("%s: a sequence's pages changed", what);
    free(after.image[i]);
  }
}

static void free_state(pool_state *s, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) free(s->image[i]);
}

/* ---- round trip ---- */

typedef struct formats {
  pkv_format k, v;
} formats;

static const formats kPairs[] = {
    {PKV_FORMAT_F32, PKV_FORMAT_F32},   {PKV_FORMAT_F16, PKV_FORMAT_F16},   {PKV_FORMAT_BF16, PKV_FORMAT_BF16},
    {PKV_FORMAT_Q8_0, PKV_FORMAT_Q8_0}, {PKV_FORMAT_Q4_0, PKV_FORMAT_Q4_0}, {PKV_FORMAT_F16, PKV_FORMAT_Q4_0},
    {PKV_FORMAT_Q8_0, PKV_FORMAT_BF16}, {PKV_FORMAT_Q4_0, PKV_FORMAT_F32},  {PKV_FORMAT_FP8_E4M3, PKV_FORMAT_FP8_E5M2},
    {PKV_FORMAT_FP8_E5M2, PKV_FORMAT_Q8_0},
};

static void round_trip(void **state) {
  const formats *f = *state;
  tu_rng r = tu_rng_stream(g_seed, (uint64_t)(f - kPairs));
  const uint32_t page_size = 1u << tu_below(&r, 5); /* 1..16 */
  pkv_context *ctx;
  pkv_pool *a, *b;
  const pkv_pool_desc da = desc_of(f->k, f->v, page_size, 400, 1 + tu_below(&r, 1000));
  pu_open(&da, &ctx, &a);
  const pkv_pool_desc db = desc_of(f->k, f->v, page_size, 400, 1001 + tu_below(&r, 1000));
  CHECK_OK(pkv_pool_create(ctx, &db, &b));

  /* ragged sequences grown interleaved; a fork sharing pages; one truncated; one empty */
  pkv_seq s[NSEQ], in[NSEQ];
  for (int i = 0; i < 4; i++) CHECK_OK(pkv_seq_alloc(a, &s[i]));
  for (int step = 0; step < 6; step++)
    for (int i = 0; i < 3; i++) grow(a, s[i], tu_below(&r, 3 * page_size + 2), &r);
  CHECK_OK(pkv_seq_fork(a, s[0], &s[4]));
  CHECK_OK(pkv_seq_fork(a, s[1], &s[5]));
  grow(a, s[5], 1 + tu_below(&r, page_size), &r); /* diverges: copy on write of a shared last page */
  CHECK_OK(pkv_seq_truncate(a, s[2], pu_length(a, s[2]) / 2));
  print_message("    k=%s v=%s page_size %u lengths", pkv_format_name(f->k), pkv_format_name(f->v), page_size);
  for (int i = 0; i < NSEQ; i++) print_message(" %u", pu_length(a, s[i]));
  print_message("\n");

  for (int i = 0; i < NSEQ; i++) {
    uint64_t bytes, again_bytes;
    uint8_t *image = export_host(a, s[i], 0, 0, &bytes);
    CHECK_OK(import_host(b, image, bytes, &in[i]));
    assert_same_rows(a, s[i], b, in[i], 0, LAYERS, "imported sequence");
    uint8_t *again = export_host(b, in[i], 0, 0, &again_bytes);
    if (again_bytes != bytes || memcmp(again, image, (size_t)bytes) != 0)
      fail_msg("sequence %d: the imported sequence's image differs from the one it was imported from", i);
    free(image);
    free(again);
  }
  for (uint32_t l = 0; l < LAYERS; l++) assert_same_decode(a, s, b, in, NSEQ, l, &r, "imported batch");

  /* a layer range, into a third sequence */
  const uint32_t first = tu_below(&r, LAYERS), count = 1 + tu_below(&r, LAYERS - first);
  uint64_t bytes, whole;
  uint8_t *image = export_host(a, s[1], first, count, &bytes);
  free(export_host(a, s[1], 0, 0, &whole));
  assert_int_equal(bytes - PKV_SEQ_IMAGE_HEADER_BYTES, (whole - PKV_SEQ_IMAGE_HEADER_BYTES) / LAYERS * count);
  pkv_seq part;
  CHECK_OK(import_host(b, image, bytes, &part));
  assert_same_rows(a, s[1], b, part, first, count, "layer range");
  free(image);

  CHECK_OK(pkv_pool_destroy(b));
  pu_close(ctx, a);
}

/* ---- swap ---- */

/* Six sequences generate 40 steps; the swapping pool keeps a random part of them exported to host
 * memory (freed from the pool) between steps and brings each back before it takes part in a step. */
static void swap_keeps_generation(void **state) {
  (void)state;
  tu_rng r = tu_rng_stream(g_seed, 100);
  pkv_context *ctx;
  pkv_pool *ref, *swp;
  const pkv_pool_desc d = desc_of(PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0, 4, 600, 7);
  pu_open(&d, &ctx, &ref);
  const pkv_pool_desc d2 = desc_of(PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0, 4, 600, 99);
  CHECK_OK(pkv_pool_create(ctx, &d2, &swp));
  pkv_seq a[NSEQ], b[NSEQ];
  uint8_t *out[NSEQ] = {0}; /* a swapped-out sequence's image */
  uint64_t out_bytes[NSEQ];
  for (int i = 0; i < NSEQ; i++) {
    CHECK_OK(pkv_seq_alloc(ref, &a[i]));
    CHECK_OK(pkv_seq_alloc(swp, &b[i]));
  }
  float k[NSEQ * 3 * ROW], v[NSEQ * 3 * ROW];
  uint32_t swaps = 0;
  for (int step = 0; step < 40; step++) {
    /* swap out some, in the others */
    for (int i = 0; i < NSEQ; i++) {
      if (!out[i] && tu_below(&r, 3) == 0) {
        out[i] = export_host(swp, b[i], 0, 0, &out_bytes[i]);
        CHECK_OK(pkv_seq_free(swp, b[i]));
        swaps++;
      } else if (out[i] && tu_below(&r, 2) == 0) {
        CHECK_OK(import_host(swp, out[i], out_bytes[i], &b[i]));
        free(out[i]);
        out[i] = NULL;
      }
    }
    /* the resident ones step: 1-3 tokens each, written in every layer, then decoded in every layer */
    pkv_seq ra[NSEQ], rb[NSEQ];
    uint32_t n[NSEQ], count = 0, rows = 0;
    for (int i = 0; i < NSEQ; i++)
      if (!out[i]) ra[count] = a[i], rb[count] = b[i], n[count] = 1 + tu_below(&r, 3), rows += n[count++];
    if (count == 0) continue;
    CHECK_OK(pkv_append(ref, ra, n, count));
    CHECK_OK(pkv_append(swp, rb, n, count));
    for (uint32_t l = 0; l < LAYERS; l++) {
      tu_fill_uniform(&r, k, (size_t)rows * ROW, -1.5, 1.5);
      tu_fill_uniform(&r, v, (size_t)rows * ROW, -1.5, 1.5);
      CHECK_OK(pu_write(ref, l, ra, n, count, PKV_FORMAT_F32, k, v));
      CHECK_OK(pu_write(swp, l, rb, n, count, PKV_FORMAT_F32, k, v));
      assert_same_decode(ref, ra, swp, rb, count, l, &r, "a step after swaps");
    }
  }
  print_message("    %u swaps over 40 steps\n", swaps);
  assert_true(swaps > 0);
  for (int i = 0; i < NSEQ; i++) free(out[i]);
  CHECK_OK(pkv_pool_destroy(swp));
  pu_close(ctx, ref);
}

/* ---- bad images ---- */

enum edit_kind { EDIT_BYTE, EDIT_TRUNCATE, EDIT_POOL };

typedef struct bad_image {
  const char *name;
  enum edit_kind kind;
  uint32_t at;          /* EDIT_BYTE: the byte flipped (past the header: into the payload) */
  pkv_status expect;
  const char *says;     /* a part of the last error's text */
  pkv_pool_desc (*pool)(void); /* EDIT_POOL: the pool imported into */
} bad_image;

#define BAD_PAGE 4
static pkv_pool_desc good_desc(void) { return desc_of(PKV_FORMAT_Q4_0, PKV_FORMAT_F16, BAD_PAGE, 16, 3); }
#define POOL_WITH(fn, field, value)                                                                   \
  static pkv_pool_desc fn(void) {                                                                    \
    pkv_pool_desc d = good_desc();                                                                   \
    d.field = value;                                                                                 \
    return d;                                                                                        \
  }
POOL_WITH(pool_layers, layers, LAYERS + 1)
POOL_WITH(pool_kv_heads, kv_heads, KV_HEADS * 2)
POOL_WITH(pool_head_dim, head_dim, HEAD_DIM * 2)
POOL_WITH(pool_page_size, page_size, BAD_PAGE * 2)
POOL_WITH(pool_k_format, k_format, PKV_FORMAT_Q8_0)
POOL_WITH(pool_v_format, v_format, PKV_FORMAT_BF16)
POOL_WITH(pool_short_length, max_sequence_length, 9)
POOL_WITH(pool_few_pages, pages, 4)       /* the held 6 tokens take 2, the image needs 3 */
POOL_WITH(pool_one_slot, max_sequences, 1) /* the held sequence takes it */

static const bad_image kBad[] = {
    {"header_byte", EDIT_BYTE, 30, PKV_ERR_INVALID_ARGUMENT, "header's checksum", NULL},
    {"header_checksum", EDIT_BYTE, 121, PKV_ERR_INVALID_ARGUMENT, "header's checksum", NULL},
    {"payload_checksum", EDIT_BYTE, 113, PKV_ERR_INVALID_ARGUMENT, "payload is corrupted", NULL},
    {"payload_byte", EDIT_BYTE, PKV_SEQ_IMAGE_HEADER_BYTES + 1000, PKV_ERR_INVALID_ARGUMENT, "payload is corrupted", NULL},
    {"last_payload_byte", EDIT_BYTE, UINT32_MAX, PKV_ERR_INVALID_ARGUMENT, "payload is corrupted", NULL},
    {"magic", EDIT_BYTE, 0, PKV_ERR_INVALID_ARGUMENT, "magic", NULL},
    {"version_from_the_future", EDIT_BYTE, 8, PKV_ERR_VERSION, "version 3", NULL},
    {"truncated", EDIT_TRUNCATE, 1, PKV_ERR_INVALID_ARGUMENT, "truncated", NULL},
    {"header_only", EDIT_TRUNCATE, 0, PKV_ERR_INVALID_ARGUMENT, "truncated", NULL},
    {"layers", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "layers is 3, the pool's 4", pool_layers},
    {"kv_heads", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "kv_heads is 2, the pool's 4", pool_kv_heads},
    {"head_dim", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "head_dim is 64, the pool's 128", pool_head_dim},
    {"page_size", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "page_size is 4, the pool's 8", pool_page_size},
    {"k_format", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "k_format is q4_0 (5), the pool's q8_0", pool_k_format},
    {"v_format", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "v_format is f16 (2), the pool's bf16", pool_v_format},
    {"too_long", EDIT_POOL, 0, PKV_ERR_INVALID_ARGUMENT, "longest sequence", pool_short_length},
    {"out_of_pages", EDIT_POOL, 0, PKV_ERR_OUT_OF_PAGES, "needs 3 pages", pool_few_pages},
    {"out_of_sequences", EDIT_POOL, 0, PKV_ERR_OUT_OF_SEQUENCES, "sequence slots", pool_one_slot},
};

/* An image of a sequence of 10 tokens (3 pages of 4); the pool imported into holds a sequence of 6
 * tokens (and its rows), which must stay as it was. */
static void bad_image_refused(void **state) {
  const bad_image *c = *state;
  tu_rng r = tu_rng_stream(g_seed, 200 + (uint64_t)(c - kBad));
  pkv_context *ctx;
  pkv_pool *src, *dst;
  const pkv_pool_desc ds = good_desc();
  pu_open(&ds, &ctx, &src);
  const pkv_pool_desc dd = c->pool ? c->pool() : good_desc();
  CHECK_OK(pkv_pool_create(ctx, &dd, &dst));
  pkv_seq s, held;
  CHECK_OK(pkv_seq_alloc(src, &s));
  grow(src, s, 10, &r);
  CHECK_OK(pkv_seq_alloc(dst, &held));
  if (dd.layers == LAYERS && dd.kv_heads == KV_HEADS && dd.head_dim == HEAD_DIM) grow(dst, held, 6, &r);
  uint64_t bytes;
  uint8_t *image = export_host(src, s, 0, 0, &bytes);
  CHECK_OK(import_host(src, image, bytes, &s)); /* the untouched image imports */
  switch (c->kind) {
  case EDIT_BYTE: image[c->at == UINT32_MAX ? bytes - 1 : c->at] ^= c->at == 8 ? 2 : 0x10; break;
  case EDIT_TRUNCATE: bytes = c->at ? bytes - c->at : PKV_SEQ_IMAGE_HEADER_BYTES; break;
  case EDIT_POOL: break;
  }
  pool_state before;
  take_state(dst, &held, 1, &before);
  pkv_seq out = {0};
  const pkv_status st = import_host(dst, image, bytes, &out);
  char err[512];
  snprintf(err, sizeof err, "%s", pkv_last_error());
  print_message("    -> %s: \"%s\"\n", pkv_status_string(st), err);
  if (st != c->expect) fail_msg("%s: got %s, expected %s", c->name, pkv_status_string(st), pkv_status_string(c->expect));
  if (!strstr(err, c->says)) fail_msg("%s: the last error \"%s\" does not say \"%s\"", c->name, err, c->says);
  if (strncmp(err + strcspn(err, ":") + 2, "pkv_seq_import", 14) != 0) fail_msg("%s: \"%s\" names no function", c->name, err);
  assert_int_equal(out.id, 0);
  assert_state(dst, &held, 1, &before, c->name);
  free_state(&before, 1);
  free(image);
  CHECK_OK(pkv_pool_destroy(dst));
  pu_close(ctx, src);
}

/* ---- regions and spans ---- */

static void spans_move_a_sequence(void **state) {
  (void)state;
  tu_rng r = tu_rng_stream(g_seed, 300);
  pkv_context *ctx;
  pkv_pool *a, *b;
  const pkv_pool_desc d = desc_of(PKV_FORMAT_F16, PKV_FORMAT_Q8_0, 8, 64, 5);
  pu_open(&d, &ctx, &a);
  const pkv_pool_desc d2 = desc_of(PKV_FORMAT_F16, PKV_FORMAT_Q8_0, 8, 64, 77);
  CHECK_OK(pkv_pool_create(ctx, &d2, &b));
  pkv_backend backend;
  CHECK_OK(pkv_context_backend(ctx, &backend));

  pkv_memory_region ra, rb;
  uint32_t n_regions = 0;
  CHECK_OK(pkv_pool_regions(a, NULL, 0, &n_regions));
  assert_int_equal(n_regions, 1);
  CHECK_OK(pkv_pool_regions(a, &ra, 1, &n_regions));
  CHECK_OK(pkv_pool_regions(b, &rb, 1, &n_regions));
  assert_int_equal(ra.bytes, pu_stats(a).bytes_total);

  /* the prefill side: a sequence written, its writes finished */
  pkv_seq s, t;
  CHECK_OK(pkv_seq_alloc(a, &s));
  const uint32_t len = 20 + tu_below(&r, 30);
  grow(a, s, len, &r);
  CHECK_OK(pkv_context_synchronize(ctx));
  /* the decode side: a sequence of the same length, appended, not written */
  CHECK_OK(pkv_seq_alloc(b, &t));
  CHECK_OK(pkv_append(b, &t, &len, 1));

  uint64_t n = 0, m = 0;
  CHECK_OK(pkv_seq_page_spans(a, s, 0, 0, NULL, 0, &n));
  assert_int_equal(n, 2ull * LAYERS * ((len + 7) / 8));
  pkv_page_span *sa = pu_malloc(n * sizeof *sa), *sb = pu_malloc(n * sizeof *sb);
  pu_assert_fails(pkv_seq_page_spans(a, s, 0, 0, sa, n - 1, &m), PKV_ERR_INVALID_ARGUMENT);
  CHECK_OK(pkv_seq_page_spans(a, s, 0, 0, sa, n, &m));
  CHECK_OK(pkv_seq_page_spans(b, t, 0, 0, sb, n, &m));
  assert_int_equal(m, n);
  uint64_t bytes;
  uint8_t *image = export_host(a, s, 0, 0, &bytes);
  uint64_t at = PKV_SEQ_IMAGE_HEADER_BYTES;
  for (uint64_t i = 0; i < n; i++) {
    assert_int_equal(sa[i].region, 0);
    assert_int_equal(sa[i].part, i % 2);
    assert_int_equal(sa[i].layer, i / (n / LAYERS));
    assert_int_equal(sa[i].bytes, sb[i].bytes);
    assert_true(sa[i].offset + sa[i].bytes <= ra.bytes);
    if (i % 2) assert_int_equal(sa[i].offset, sa[i - 1].offset + sa[i - 1].bytes); /* V follows K */
    /* the CPU backend's regions are host memory: the engine's transfer is a memcpy */
    if (backend == PKV_BACKEND_CPU) {
      const uint8_t *from = (const uint8_t *)(uintptr_t)(ra.address + sa[i].offset);
      if (memcmp(from, image + at, (size_t)sa[i].bytes) != 0) fail_msg("span %llu is not the image's payload there", (unsigned long long)i);
      memcpy((uint8_t *)(uintptr_t)(rb.address + sb[i].offset), from, (size_t)sa[i].bytes);
    }
    at += sa[i].bytes;
  }
  assert_int_equal(at, bytes);
  if (backend == PKV_BACKEND_CPU) {
    /* decode on the decode side applies its queued page-table changes first */
    for (uint32_t l = 0; l < LAYERS; l++) assert_same_decode(a, &s, b, &t, 1, l, &r, "after the span copies");
    assert_same_rows(a, s, b, t, 0, LAYERS, "after the span copies");
  }
  free(image);
  free(sa);
  free(sb);
  CHECK_OK(pkv_pool_destroy(b));
  pu_close(ctx, a);
}

int main(void) {
  g_seed = tu_seed();
  struct CMUnitTest t[TU_COUNT(kPairs) + TU_COUNT(kBad) + 2];
  char names[TU_COUNT(kPairs) + TU_COUNT(kBad)][64];
  size_t n = 0;
  for (size_t i = 0; i < TU_COUNT(kPairs); i++, n++) {
    snprintf(names[n], sizeof names[n], "round trip k=%s v=%s", pkv_format_name(kPairs[i].k), pkv_format_name(kPairs[i].v));
    t[n] = (struct CMUnitTest){names[n], round_trip, NULL, NULL, (void *)&kPairs[i]};
  }
  for (size_t i = 0; i < TU_COUNT(kBad); i++, n++) {
    snprintf(names[n], sizeof names[n], "bad image %s", kBad[i].name);
    t[n] = (struct CMUnitTest){names[n], bad_image_refused, NULL, NULL, (void *)&kBad[i]};
  }
  t[n++] = (struct CMUnitTest){"swap keeps a generation bit-identical", swap_keeps_generation, NULL, NULL, NULL};
  t[n++] = (struct CMUnitTest){"spans move a sequence", spans_move_a_sequence, NULL, NULL, NULL};
  return tu_run_group("export", t, n, NULL, NULL);
}
