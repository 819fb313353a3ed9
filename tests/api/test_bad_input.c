/* Bad input at every public entry point: each call must return the documented status, say why in
 * pkv_last_error(), and change nothing. Every row of the table below is one bad call made on a fresh
 * fixture (a context, two pools with written sequences, a forked one, a freed handle); the pools'
 * statistics, their sequences' lengths and the K/V rows read back are compared before and after it.
 * A few rows are calls that must succeed (count 0 with NULL arrays, NULL to the destroy functions, a
 * struct_size larger than this header's); for those pkv_last_error() must be empty.
 *
 * One file past 500 lines: the table of bad calls is one table, read entry point by entry point;
 * splitting it would split the fixture every row shares. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

#define LAYERS 2
#define KV_HEADS 2
#define HEAD_DIM 32
#define ROW (KV_HEADS * HEAD_DIM)
#define PAGE_SIZE 4
#define PAGES 12
#define Q_HEADS 4
#define SRC_ROWS 16 /* rows in the write source buffers: more than any call here asks for */
#define N_TRACKED 5

#define INVALID PKV_ERR_INVALID_ARGUMENT
#define STALE PKV_ERR_STALE_HANDLE

static uint64_t g_seed;

/* What the pools hold, as seen through the API. */
typedef struct snapshot {
  pkv_pool_stats stats[2];
  uint32_t len[N_TRACKED];
  float *rows[N_TRACKED]; /* [layer][k, v][len][ROW] */
} snapshot;

struct bad_case;

typedef struct fixture {
  const struct bad_case *c;
  pkv_context *ctx;
  pkv_pool *pool, *pool2;
  /* pool: a (6 tokens, its pages shared with fork), b (3), empty (0), fork (of a), freed (stale);
   * pool2: other (2 tokens) */
  pkv_seq a, b, empty, fork, freed, other;
  pkv_seq batch[3]; /* a, b, empty: the decode batch */
  pkv_pool *tracked_pool[N_TRACKED];
  pkv_seq tracked[N_TRACKED];
  uint32_t tracked_layers[N_TRACKED];
  float k[SRC_ROWS * ROW], v[SRC_ROWS * ROW];                    /* write sources */
  float rk[SRC_ROWS * ROW], rv[SRC_ROWS * ROW];                  /* read destinations */
  float q[3 * Q_HEADS * HEAD_DIM], out[3 * Q_HEADS * HEAD_DIM], lse[3 * Q_HEADS];
  uint64_t image[1024]; /* an image of b (export, import); 8-byte words keep it 16-byte aligned or not on purpose */
  pkv_page_span spans[64];
  pkv_memory_region regions[2];
  pkv_seq imported;
  snapshot before, after;
} fixture;

typedef struct bad_case {
  const char *name;
  pkv_status (*call)(fixture *f, int variant);
  int variant;
  pkv_status expect;
  pkv_status also; /* a second acceptable status; PKV_OK: none */
  int mutates;     /* an accepted call that rightly changes the pool: no before/after comparison */
} bad_case;

/* ---------------------------------------------------------------------------------------------------
 * Fixture
 * ------------------------------------------------------------------------------------------------- */

static pkv_pool_desc desc_of(uint32_t layers, uint32_t pages, pkv_format k, pkv_format v, uint32_t seed) {
  pkv_pool_desc d = pu_desc(layers, KV_HEADS, HEAD_DIM, PAGE_SIZE, pages, 8, k, v);
  d.page_order_seed = seed;
  return d;
}

/* Appends n[i] tokens to s[i] and writes random rows for them in every layer. */
static void fill(fixture *f, pkv_pool *pool, uint32_t layers, const pkv_seq *s, const uint32_t *n,
                 uint32_t count, tu_rng *r) {
  CHECK_OK(pkv_append(pool, s, n, count));
  for (uint32_t l = 0; l < layers; l++) {
    tu_fill_uniform(r, f->k, SRC_ROWS * ROW, -1.0, 1.0);
    tu_fill_uniform(r, f->v, SRC_ROWS * ROW, -1.0, 1.0);
    CHECK_OK(pu_write(pool, l, s, n, count, PKV_FORMAT_F32, f->k, f->v));
  }
}

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  if (!f) return -1;
  f->c = *state;
  *state = f;
  return 0;
}

/* Called by the test itself rather than the setup, so that it may skip. */
static void open_fixture(fixture *f) {
  tu_rng r = tu_rng_make(g_seed);

  CHECK_OK(pu_context(&f->ctx));
  /* Quantized K and BF16 V so the read-back compares what the pages really hold. */
  pkv_pool_desc d = desc_of(LAYERS, PAGES, PKV_FORMAT_Q8_0, PKV_FORMAT_BF16, 1 + tu_below(&r, 1000000));
  CHECK_OK(pkv_pool_create(f->ctx, &d, &f->pool));
  pkv_pool_desc d2 = desc_of(1, 4, PKV_FORMAT_F16, PKV_FORMAT_F16, 0);
  CHECK_OK(pkv_pool_create(f->ctx, &d2, &f->pool2));

  /* freed first, so the slot it leaves is likely reused by a live sequence of a newer generation */
  CHECK_OK(pkv_seq_alloc(f->pool, &f->freed));
  CHECK_OK(pkv_seq_free(f->pool, f->freed));
  CHECK_OK(pkv_seq_alloc(f->pool, &f->a));
  CHECK_OK(pkv_seq_alloc(f->pool, &f->b));
  CHECK_OK(pkv_seq_alloc(f->pool, &f->empty));
  const pkv_seq ab[2] = {f->a, f->b};
  const uint32_t n_ab[2] = {6, 3};
  fill(f, f->pool, LAYERS, ab, n_ab, 2, &r);
  CHECK_OK(pkv_seq_fork(f->pool, f->a, &f->fork));
  CHECK_OK(pkv_seq_alloc(f->pool2, &f->other));
  const uint32_t two = 2;
  fill(f, f->pool2, 1, &f->other, &two, 1, &r);

  f->batch[0] = f->a;
  f->batch[1] = f->b;
  f->batch[2] = f->empty;
  const pkv_seq tracked[N_TRACKED] = {f->a, f->b, f->empty, f->fork, f->other};
  for (int i = 0; i < N_TRACKED; i++) {
    f->tracked[i] = tracked[i];
    f->tracked_pool[i] = i < 4 ? f->pool : f->pool2;
    f->tracked_layers[i] = i < 4 ? LAYERS : 1;
  }
  tu_fill_uniform(&r, f->k, SRC_ROWS * ROW, -1.0, 1.0);
  tu_fill_uniform(&r, f->v, SRC_ROWS * ROW, -1.0, 1.0);
  tu_fill_uniform(&r, f->q, 3 * Q_HEADS * HEAD_DIM, -1.0, 1.0);
}

static void free_snapshot(snapshot *s) {
  for (int i = 0; i < N_TRACKED; i++) free(s->rows[i]), s->rows[i] = NULL;
}

static int teardown(void **state) {
  fixture *f = *state;
  free_snapshot(&f->before);
  free_snapshot(&f->after);
  /* Also checks that a context whose destruction was refused is still whole. */
  CHECK_OK(pkv_pool_destroy(f->pool));
  CHECK_OK(pkv_pool_destroy(f->pool2));
  CHECK_OK(pkv_context_destroy(f->ctx)); /* NULL when skipped */
  free(f);
  return 0;
}

static void take(fixture *f, snapshot *s) {
  pkv_pool *pools[2] = {f->pool, f->pool2};
  for (int p = 0; p < 2; p++) {
    pkv_pool_stats st = PKV_POOL_STATS_INIT;
    CHECK_OK(pkv_pool_get_stats(pools[p], &st));
    s->stats[p] = st;
  }
  for (int i = 0; i < N_TRACKED; i++) {
    uint32_t len = 0, layers = f->tracked_layers[i];
    CHECK_OK(pkv_seq_length(f->tracked_pool[i], f->tracked[i], &len));
    s->len[i] = len;
    s->rows[i] = calloc((size_t)layers * 2 * len * ROW + 1, sizeof(float));
    for (uint32_t l = 0; l < layers && len; l++)
      CHECK_OK(pu_read(f->tracked_pool[i], l, f->tracked[i], 0, len, PKV_FORMAT_F32,
                       s->rows[i] + (size_t)l * 2 * len * ROW, s->rows[i] + ((size_t)l * 2 + 1) * len * ROW));
  }
}

static void assert_same(const fixture *f, const snapshot *x, const snapshot *y) {
  const char *name = f->c->name;
  for (int p = 0; p < 2; p++) {
    const pkv_pool_stats *a = &x->stats[p], *b = &y->stats[p];
#define SAME(field)                                                                                  \
  if (a->field != b->field)                                                                          \
  fail_msg("%s: pool %d stats." #field " changed from %llu to %llu", name, p + 1,                   \
           (unsigned long long)a->field, (unsigned long long)b->field)
    SAME(pages_total);
    SAME(pages_free);
    SAME(pages_shared);
    SAME(sequences_live);
    SAME(max_sequences);
    SAME(tokens_live);
    SAME(bytes_total);
    SAME(bytes_per_page);
    SAME(bytes_per_token);
#undef SAME
  }
  static const char *names[N_TRACKED] = {"a", "b", "empty", "fork", "other"};
  for (int i = 0; i < N_TRACKED; i++) {
    if (x->len[i] != y->len[i])
      fail_msg("%s: length of %s changed from %u to %u", name, names[i], x->len[i], y->len[i]);
    if (memcmp(x->rows[i], y->rows[i], (size_t)f->tracked_layers[i] * 2 * x->len[i] * ROW * sizeof(float)))
      fail_msg("%s: the K/V rows of %s changed", name, names[i]);
  }
}

/* ---------------------------------------------------------------------------------------------------
 * Valid calls; each bad call below changes one thing in one of them.
 * ------------------------------------------------------------------------------------------------- */
static const uint32_t one = 1, two = 2;

static pkv_context_desc good_ctx_desc(void) {
  pkv_context_desc d = PKV_CONTEXT_DESC_INIT;
  return d;
}
static pkv_pool_desc good_pool_desc(void) { return desc_of(1, 2, PKV_FORMAT_F16, PKV_FORMAT_Q4_0, 0); }
static pkv_backend_info good_info(void) {
  pkv_backend_info i = PKV_BACKEND_INFO_INIT;
  return i;
}
static pkv_pool_stats good_stats(void) {
  pkv_pool_stats s = PKV_POOL_STATS_INIT;
  return s;
}
/* the newest 2 of b's 3 tokens, layer 1 */
static pkv_write_args good_write(fixture *f) { return pu_write_args(1, &f->b, &two, 1, PKV_FORMAT_F32, f->k, f->v); }
/* tokens 1..5 of a, layer 1 */
static pkv_read_args good_read(fixture *f) { return pu_read_args(1, f->a, 1, 5, PKV_FORMAT_F32, f->rk, f->rv); }
/* a, b and empty, layer 1 */
static pkv_decode_args good_decode(fixture *f) {
  return pu_decode_args(1, f->batch, 3, Q_HEADS, f->q, f->out, f->lse);
}

/* b's whole image into f->image */
/* a: its last token, b: its 3 tokens, empty: none (3 query rows, as decode's q holds); the mask's rows
 * are the causal ones: entry 0 at byte 0, entry 1 at bytes 1 and 2. */
static const uint32_t extend_offsets[4] = {0, 1, 3, 3};
static const uint8_t causal_mask[3] = {1, 1, 3};
static const uint64_t mask_offsets[3] = {0, 1, 3};
static pkv_extend_args good_extend(fixture *f) {
  return pu_extend_args(1, f->batch, 3, Q_HEADS, extend_offsets, f->q, f->out, f->lse);
}
static pkv_extend_args good_masked_extend(fixture *f) {
  pkv_extend_args a = good_extend(f);
  a.mask = causal_mask;
  a.mask_offsets = mask_offsets;
  a.mask_bytes = sizeof causal_mask;
  return a;
}

static pkv_export_args good_export(fixture *f) {
  pkv_export_args a = PKV_EXPORT_ARGS_INIT;
  a.seq = f->b;
  a.image = f->image;
  a.image_bytes = sizeof f->image;
  return a;
}
/* f->image, exported first (the import of it takes a slot and a page) */
static pkv_import_args good_import(fixture *f) {
  const pkv_export_args e = good_export(f);
  CHECK_OK(pkv_seq_export(f->pool, &e));
  pkv_import_args a = PKV_IMPORT_ARGS_INIT;
  a.image = f->image;
  a.image_bytes = sizeof f->image;
  return a;
}
static pkv_status spans_of(fixture *f, pkv_seq s, uint32_t first, uint32_t count, uint64_t capacity) {
  uint64_t n = 0;
  return pkv_seq_page_spans(f->pool, s, first, count, f->spans, capacity, &n);
}

/* Creation calls clean up after themselves when they (wrongly or rightly) succeed. */
static pkv_status try_ctx(const pkv_context_desc *d) {
  pkv_context *c = NULL;
  pkv_status st = pkv_context_create(d, &c);
  if (st == PKV_OK) CHECK_OK(pkv_context_destroy(c));
  return st;
}
static pkv_status try_pool(fixture *f, const pkv_pool_desc *d) {
  pkv_pool *p = NULL;
  pkv_status st = pkv_pool_create(f->ctx, d, &p);
  if (st == PKV_OK) CHECK_OK(pkv_pool_destroy(p));
  return st;
}

/* ---------------------------------------------------------------------------------------------------
 * The bad calls
 * ------------------------------------------------------------------------------------------------- */

/* A call on a copy of a valid struct with one edit. Variadic so edits may contain commas. */
#define EDIT(fn, T, make, call, ...)                                                                \
  static pkv_status fn(fixture *f, int variant) {                                                    \
    (void)f, (void)variant;                                                                          \
    T a = make;                                                                                      \
    __VA_ARGS__;                                                                                     \
    return call;                                                                                     \
  }
#define CALL(fn, ...)                                                                                \
  static pkv_status fn(fixture *f, int variant) {                                                    \
    (void)f, (void)variant;                                                                          \
    __VA_ARGS__;                                                                                     \
  }
#define CTX(fn, ...) EDIT(fn, pkv_context_desc, good_ctx_desc(), try_ctx(&a), __VA_ARGS__)
#define POOL(fn, ...) EDIT(fn, pkv_pool_desc, good_pool_desc(), try_pool(f, &a), __VA_ARGS__)
#define WRITE(fn, ...) EDIT(fn, pkv_write_args, good_write(f), pkv_write(f->pool, &a), __VA_ARGS__)
#define READ(fn, ...) EDIT(fn, pkv_read_args, good_read(f), pkv_read(f->pool, &a), __VA_ARGS__)
#define DECODE(fn, ...) EDIT(fn, pkv_decode_args, good_decode(f), pkv_decode(f->pool, &a), __VA_ARGS__)
#define PREPARE(fn, ...) EDIT(fn, pkv_decode_args, good_decode(f), pkv_decode_prepare(f->pool, &a), __VA_ARGS__)
#define EXTEND(fn, ...) EDIT(fn, pkv_extend_args, good_extend(f), pkv_extend(f->pool, &a), __VA_ARGS__)
#define MASKED(fn, ...) EDIT(fn, pkv_extend_args, good_masked_extend(f), pkv_extend(f->pool, &a), __VA_ARGS__)
#define EXTEND_PREPARE(fn, ...) EDIT(fn, pkv_extend_args, good_extend(f), pkv_extend_prepare(f->pool, &a), __VA_ARGS__)
#define MASKED_PREPARE(fn, ...)                                                                     \
  EDIT(fn, pkv_extend_args, good_masked_extend(f), pkv_extend_prepare(f->pool, &a), __VA_ARGS__)
#define EXPORT_SIZE(fn, ...) EDIT(fn, pkv_export_args, good_export(f), pkv_seq_export_size(f->pool, &a, &f->image[0]), __VA_ARGS__)
#define EXPORT(fn, ...) EDIT(fn, pkv_export_args, good_export(f), pkv_seq_export(f->pool, &a), __VA_ARGS__)
#define IMPORT(fn, ...) EDIT(fn, pkv_import_args, good_import(f), pkv_seq_import(f->pool, &a, &f->imported), __VA_ARGS__)

/* struct_size: 0, just the size field, all but the last field, one byte short of it, or larger than this
 * header's struct with the extra bytes zero (a newer caller's fields at their defaults). */
enum { SZ_ZERO, SZ_FOUR, SZ_NO_LAST, SZ_SHORT, SZ_LARGER };
#define SIZED(fn, T, last, make, call)                                                              \
  static pkv_status fn(fixture *f, int variant) {                                                    \
    struct {                                                                                         \
      T a;                                                                                           \
      unsigned char more[32];                                                                        \
    } big;                                                                                           \
    (void)f;                                                                                         \
    memset(&big, 0, sizeof big);                                                                     \
    big.a = make;                                                                                    \
    const uint32_t sizes[] = {0, 4, (uint32_t)offsetof(T, last), (uint32_t)(offsetof(T, last) + sizeof(((T *)0)->last) - 1), \
                              (uint32_t)sizeof big};                                                 \
    big.a.struct_size = sizes[variant];                                                              \
    T *a = &big.a;                                                                                   \
    return call;                                                                                     \
  }

/* Contexts */
CALL(ctx_create_desc_null, pkv_context *c = NULL; pkv_status st = pkv_context_create(NULL, &c);
     if (st == PKV_OK) pkv_context_destroy(c); return st)
CALL(ctx_create_out_null, pkv_context_desc d = good_ctx_desc(); return pkv_context_create(&d, NULL))
CTX(ctx_create_backend_unknown, a.backend = (pkv_backend)7)
/* Enums are 32-bit: a C caller may pass any value, negative ones included. */
CTX(ctx_create_backend_negative, a.backend = (pkv_backend)-1)
SIZED(ctx_create_sized, pkv_context_desc, stream, good_ctx_desc(), try_ctx(a))

/* A GPU backend that this build or machine does not offer: skipped where it is usable. */
static pkv_status gpu_absent(pkv_backend backend) {
  pkv_backend_info info = PKV_BACKEND_INFO_INIT;
  if (pkv_backend_query(backend, &info) == PKV_OK && info.compiled && info.device_count > 0) skip();
  pkv_context_desc d = good_ctx_desc();
  d.backend = backend;
  return try_ctx(&d);
}
CALL(ctx_create_cuda_absent, return gpu_absent(PKV_BACKEND_CUDA))
CALL(ctx_create_hip_absent, return gpu_absent(PKV_BACKEND_HIP))

CALL(ctx_destroy_null, return pkv_context_destroy(NULL))
CALL(ctx_destroy_live_pool, return pkv_context_destroy(f->ctx))
CALL(ctx_backend_ctx_null, pkv_backend b; return pkv_context_backend(NULL, &b))
CALL(ctx_backend_out_null, return pkv_context_backend(f->ctx, NULL))
CALL(ctx_synchronize_null, return pkv_context_synchronize(NULL))

CALL(query_auto, pkv_backend_info i = good_info(); return pkv_backend_query(PKV_BACKEND_AUTO, &i))
CALL(query_unknown, pkv_backend_info i = good_info(); return pkv_backend_query((pkv_backend)9, &i))
CALL(query_negative, pkv_backend_info i = good_info(); return pkv_backend_query((pkv_backend)-1, &i))
CALL(query_info_null, return pkv_backend_query(PKV_BACKEND_CPU, NULL))
SIZED(query_sized, pkv_backend_info, detail, good_info(), pkv_backend_query(PKV_BACKEND_CPU, a))

/* Pools */
CALL(pool_create_ctx_null, pkv_pool_desc d = good_pool_desc(); pkv_pool *p = NULL;
     pkv_status st = pkv_pool_create(NULL, &d, &p); if (st == PKV_OK) pkv_pool_destroy(p); return st)
CALL(pool_create_desc_null, pkv_pool *p = NULL; pkv_status st = pkv_pool_create(f->ctx, NULL, &p);
     if (st == PKV_OK) pkv_pool_destroy(p); return st)
CALL(pool_create_out_null, pkv_pool_desc d = good_pool_desc(); return pkv_pool_create(f->ctx, &d, NULL))
SIZED(pool_create_sized, pkv_pool_desc, page_order_seed, good_pool_desc(), try_pool(f, a))
POOL(pool_layers_0, a.layers = 0)
POOL(pool_kv_heads_0, a.kv_heads = 0)
POOL(pool_head_dim_0, a.head_dim = 0)
POOL(pool_head_dim_16, a.head_dim = 16)
POOL(pool_head_dim_48, a.head_dim = 48)
POOL(pool_head_dim_288, a.head_dim = 288)
POOL(pool_page_size_0, a.page_size = 0)
POOL(pool_page_size_3, a.page_size = 3)
POOL(pool_page_size_24, a.page_size = 24)
POOL(pool_page_size_2048, a.page_size = 2048)
POOL(pool_pages_0, a.pages = 0)
POOL(pool_max_sequences_0, a.max_sequences = 0)
POOL(pool_max_sequences_too_many, a.max_sequences = 1048577)
POOL(pool_k_format_invalid, a.k_format = PKV_FORMAT_INVALID)
POOL(pool_k_format_unknown, a.k_format = (pkv_format)8)
POOL(pool_k_format_negative, a.k_format = (pkv_format)-1)
POOL(pool_v_format_invalid, a.v_format = PKV_FORMAT_INVALID)
POOL(pool_v_format_unknown, a.v_format = (pkv_format)99)
CALL(pool_destroy_null, return pkv_pool_destroy(NULL))
CALL(stats_pool_null, pkv_pool_stats s = good_stats(); return pkv_pool_get_stats(NULL, &s))
CALL(stats_out_null, return pkv_pool_get_stats(f->pool, NULL))
SIZED(stats_sized, pkv_pool_stats, bytes_per_token, good_stats(), pkv_pool_get_stats(f->pool, a))

/* Sequences */
static const pkv_seq zero = {0}, garbage = {~(uint64_t)0};
CALL(seq_alloc_pool_null, pkv_seq s; return pkv_seq_alloc(NULL, &s))
CALL(seq_alloc_out_null, return pkv_seq_alloc(f->pool, NULL))
CALL(seq_free_pool_null, return pkv_seq_free(NULL, f->b))
CALL(seq_free_zero, return pkv_seq_free(f->pool, zero))
CALL(seq_free_freed, return pkv_seq_free(f->pool, f->freed))
CALL(seq_free_other_pool, return pkv_seq_free(f->pool, f->other))
CALL(seq_free_in_other_pool, return pkv_seq_free(f->pool2, f->b))
CALL(seq_free_garbage, return pkv_seq_free(f->pool, garbage))
CALL(seq_fork_pool_null, pkv_seq s; return pkv_seq_fork(NULL, f->b, &s))
CALL(seq_fork_child_null, return pkv_seq_fork(f->pool, f->b, NULL))
CALL(seq_fork_zero, pkv_seq s; return pkv_seq_fork(f->pool, zero, &s))
CALL(seq_fork_freed, pkv_seq s; return pkv_seq_fork(f->pool, f->freed, &s))
CALL(seq_fork_other_pool, pkv_seq s; return pkv_seq_fork(f->pool, f->other, &s))
CALL(seq_truncate_pool_null, return pkv_seq_truncate(NULL, f->b, 1))
CALL(seq_truncate_zero, return pkv_seq_truncate(f->pool, zero, 0))
CALL(seq_truncate_freed, return pkv_seq_truncate(f->pool, f->freed, 0))
CALL(seq_truncate_other_pool, return pkv_seq_truncate(f->pool, f->other, 0))
CALL(seq_truncate_past_length, return pkv_seq_truncate(f->pool, f->b, 4))
CALL(seq_truncate_empty_to_1, return pkv_seq_truncate(f->pool, f->empty, 1))
CALL(seq_truncate_uint32_max, return pkv_seq_truncate(f->pool, f->a, UINT32_MAX))
CALL(seq_length_pool_null, uint32_t n; return pkv_seq_length(NULL, f->b, &n))
CALL(seq_length_out_null, return pkv_seq_length(f->pool, f->b, NULL))
CALL(seq_length_zero, uint32_t n; return pkv_seq_length(f->pool, zero, &n))
CALL(seq_length_freed, uint32_t n; return pkv_seq_length(f->pool, f->freed, &n))
CALL(seq_length_other_pool, uint32_t n; return pkv_seq_length(f->pool, f->other, &n))
CALL(seq_length_garbage, uint32_t n; return pkv_seq_length(f->pool, garbage, &n))

/* Append. Several-sequence calls put the bad one last, after valid ones that must not change. */
CALL(append_pool_null, return pkv_append(NULL, &f->b, &one, 1))
CALL(append_seqs_null, return pkv_append(f->pool, NULL, &one, 1))
CALL(append_n_new_null, return pkv_append(f->pool, &f->b, NULL, 1))
CALL(append_zero, pkv_seq s[2] = {f->b, zero}; uint32_t n[2] = {1, 1}; return pkv_append(f->pool, s, n, 2))
CALL(append_freed, pkv_seq s[2] = {f->b, f->freed}; uint32_t n[2] = {1, 1}; return pkv_append(f->pool, s, n, 2))
CALL(append_other_pool, pkv_seq s[2] = {f->empty, f->other}; uint32_t n[2] = {5, 1};
     return pkv_append(f->pool, s, n, 2))
CALL(append_repeated, pkv_seq s[3] = {f->b, f->empty, f->b}; uint32_t n[3] = {1, 2, 1};
     return pkv_append(f->pool, s, n, 3))
/* a has 6 tokens: 6 + (2^32 - 6) does not fit 32 bits */
CALL(append_overflow, pkv_seq s[2] = {f->b, f->a}; uint32_t n[2] = {1, UINT32_MAX - 5};
     return pkv_append(f->pool, s, n, 2))
/* 9 of the 12 pages (48 tokens) are free: b's 43 tokens would fit the pool, but not beside a */
CALL(append_out_of_pages, pkv_seq s[2] = {f->empty, f->b}; uint32_t n[2] = {4, 40};
     return pkv_append(f->pool, s, n, 2))
/* more tokens than the whole pool holds: the pool is short (header), and no free page would help */
CALL(append_past_pool_capacity, pkv_seq s[2] = {f->empty, f->b}; uint32_t n[2] = {4, 46};
     return pkv_append(f->pool, s, n, 2))
CALL(append_count_0_null, return pkv_append(f->pool, NULL, NULL, 0))

/* Write */
CALL(write_pool_null, pkv_write_args a = good_write(f); return pkv_write(NULL, &a))
CALL(write_args_null, return pkv_write(f->pool, NULL))
SIZED(write_sized, pkv_write_args, v, good_write(f), pkv_write(f->pool, a))
WRITE(write_layer_past_end, a.layer = LAYERS)
WRITE(write_layer_uint32_max, a.layer = UINT32_MAX)
WRITE(write_seqs_null, a.seqs = NULL)
WRITE(write_n_tokens_null, a.n_tokens = NULL)
WRITE(write_k_null, a.k = NULL)
WRITE(write_v_null, a.v = NULL)
WRITE(write_zero, pkv_seq s[2] = {f->b, zero}; uint32_t n[2] = {1, 1}; a.seqs = s; a.n_tokens = n; a.count = 2)
WRITE(write_freed, pkv_seq s[2] = {f->b, f->freed}; uint32_t n[2] = {1, 1}; a.seqs = s; a.n_tokens = n;
      a.count = 2)
WRITE(write_other_pool, pkv_seq s[2] = {f->b, f->other}; uint32_t n[2] = {1, 1}; a.seqs = s; a.n_tokens = n;
      a.count = 2)
WRITE(write_more_than_length, uint32_t n = 4; a.n_tokens = &n)
WRITE(write_uint32_max_tokens, uint32_t n = UINT32_MAX; a.n_tokens = &n)
WRITE(write_empty_sequence, pkv_seq s[2] = {f->b, f->empty}; uint32_t n[2] = {1, 1}; a.seqs = s;
      a.n_tokens = n; a.count = 2)
WRITE(write_repeated, pkv_seq s[2] = {f->b, f->b}; uint32_t n[2] = {1, 1}; a.seqs = s; a.n_tokens = n;
      a.count = 2)
WRITE(write_src_q8_0, a.src_format = PKV_FORMAT_Q8_0)
WRITE(write_src_q4_0, a.src_format = PKV_FORMAT_Q4_0)
WRITE(write_src_invalid, a.src_format = PKV_FORMAT_INVALID)
WRITE(write_src_unknown, a.src_format = (pkv_format)42)
WRITE(write_src_negative, a.src_format = (pkv_format)-2)
WRITE(write_memory_unknown, a.memory = (pkv_memory)5)
WRITE(write_memory_negative, a.memory = (pkv_memory)-1)
/* a's last page is shared with fork (header: write targets must not lie in a shared page) */
WRITE(write_shared_page, a.seqs = &f->a; a.n_tokens = &one)
WRITE(write_count_0_null, a.seqs = NULL; a.n_tokens = NULL; a.k = NULL; a.v = NULL; a.count = 0)

/* Read */
CALL(read_pool_null, pkv_read_args a = good_read(f); return pkv_read(NULL, &a))
CALL(read_args_null, return pkv_read(f->pool, NULL))
SIZED(read_sized, pkv_read_args, v, good_read(f), pkv_read(f->pool, a))
READ(read_layer_past_end, a.layer = LAYERS)
READ(read_zero, a.seq = zero)
READ(read_freed, a.seq = f->freed)
READ(read_other_pool, a.seq = f->other)
READ(read_past_length, a.start = 5; a.count = 2)
READ(read_at_length, a.start = 6; a.count = 1)
READ(read_start_past_length, a.start = 7; a.count = 0)
READ(read_wrapping_range, a.start = 1; a.count = UINT32_MAX)
READ(read_empty_sequence, a.seq = f->empty; a.start = 0; a.count = 1)
READ(read_no_destination, a.k = NULL; a.v = NULL)
READ(read_dst_q8_0, a.dst_format = PKV_FORMAT_Q8_0)
READ(read_dst_q4_0, a.dst_format = PKV_FORMAT_Q4_0)
READ(read_dst_invalid, a.dst_format = PKV_FORMAT_INVALID)
READ(read_dst_negative, a.dst_format = (pkv_format)-1)
READ(read_memory_unknown, a.memory = (pkv_memory)5)

/* Decode */
CALL(decode_pool_null, pkv_decode_args a = good_decode(f); return pkv_decode(NULL, &a))
CALL(decode_args_null, return pkv_decode(f->pool, NULL))
SIZED(decode_sized, pkv_decode_args, chunk_pages, good_decode(f), pkv_decode(f->pool, a))
DECODE(decode_layer_past_end, a.layer = LAYERS)
DECODE(decode_seqs_null, a.seqs = NULL)
DECODE(decode_q_null, a.q = NULL)
DECODE(decode_out_null, a.out = NULL)
DECODE(decode_zero, pkv_seq s[3] = {f->a, f->b, zero}; a.seqs = s)
DECODE(decode_freed, pkv_seq s[3] = {f->a, f->b, f->freed}; a.seqs = s)
DECODE(decode_other_pool, pkv_seq s[3] = {f->a, f->b, f->other}; a.seqs = s)
DECODE(decode_q_heads_0, a.q_heads = 0)
DECODE(decode_q_heads_1, a.q_heads = 1) /* fewer than kv_heads (2) */
DECODE(decode_q_heads_3, a.q_heads = 3)
DECODE(decode_q_tokens_9, a.q_tokens = 9)
DECODE(decode_q_tokens_past_length, a.q_tokens = 4) /* b holds 3 tokens */
DECODE(decode_q_tokens_0, a.q_tokens = 0)
DECODE(decode_scale_negative, a.scale = -0.125f)
DECODE(decode_scale_nan, a.scale = NAN)
DECODE(decode_scale_inf, a.scale = INFINITY)
DECODE(decode_scale_minus_inf, a.scale = -INFINITY)

/* Decode prepare: the decode's checks except q and out, which it does not read */
CALL(prepare_pool_null, pkv_decode_args a = good_decode(f); return pkv_decode_prepare(NULL, &a))
CALL(prepare_args_null, return pkv_decode_prepare(f->pool, NULL))
SIZED(prepare_sized, pkv_decode_args, chunk_pages, good_decode(f), pkv_decode_prepare(f->pool, a))
PREPARE(prepare_layer_past_end, a.layer = LAYERS)
PREPARE(prepare_seqs_null, a.seqs = NULL)
PREPARE(prepare_freed, pkv_seq s[3] = {f->a, f->b, f->freed}; a.seqs = s)
PREPARE(prepare_other_pool, pkv_seq s[3] = {f->a, f->b, f->other}; a.seqs = s)
PREPARE(prepare_q_heads_3, a.q_heads = 3)
PREPARE(prepare_q_tokens_past_length, a.q_tokens = 4)
PREPARE(prepare_scale_nan, a.scale = NAN)
PREPARE(prepare_memory_unknown, a.memory = (pkv_memory)5)
/* Export, import, regions and spans */
CALL(export_size_pool_null, pkv_export_args a = good_export(f); uint64_t n; return pkv_seq_export_size(NULL, &a, &n))
CALL(export_size_args_null, uint64_t n; return pkv_seq_export_size(f->pool, NULL, &n))
CALL(export_size_bytes_null, pkv_export_args a = good_export(f); return pkv_seq_export_size(f->pool, &a, NULL))
SIZED(export_size_sized, pkv_export_args, image_bytes, good_export(f), pkv_seq_export_size(f->pool, a, &f->image[0]))
EXPORT_SIZE(export_size_zero, a.seq.id = 0)
EXPORT_SIZE(export_size_freed, a.seq = f->freed)
EXPORT_SIZE(export_size_other_pool, a.seq = f->other)
EXPORT_SIZE(export_size_first_layer_past_end, a.first_layer = LAYERS)
EXPORT_SIZE(export_size_range_past_end, a.first_layer = 1; a.layer_count = LAYERS)
CALL(export_pool_null, pkv_export_args a = good_export(f); return pkv_seq_export(NULL, &a))
CALL(export_args_null, return pkv_seq_export(f->pool, NULL))
SIZED(export_sized, pkv_export_args, image_bytes, good_export(f), pkv_seq_export(f->pool, a))
EXPORT(export_image_null, a.image = NULL)
EXPORT(export_image_bytes_short, a.image_bytes = PKV_SEQ_IMAGE_HEADER_BYTES)
EXPORT(export_zero, a.seq.id = 0)
EXPORT(export_freed, a.seq = f->freed)
EXPORT(export_other_pool, a.seq = f->other)
EXPORT(export_layer_past_end, a.first_layer = LAYERS)
EXPORT(export_layer_count_past_end, a.layer_count = LAYERS + 1)
EXPORT(export_layer_range_wrapping, a.first_layer = 1; a.layer_count = UINT32_MAX)
EXPORT(export_memory_unknown, a.memory = (pkv_memory)3)
EXPORT(export_memory_negative, a.memory = (pkv_memory)-1)
EXPORT(export_device_unaligned, a.memory = PKV_MEMORY_DEVICE; a.image = (uint8_t *)f->image + 8)
CALL(import_pool_null, pkv_import_args a = good_import(f); pkv_seq s; return pkv_seq_import(NULL, &a, &s))
CALL(import_args_null, pkv_seq s; return pkv_seq_import(f->pool, NULL, &s))
CALL(import_out_null, pkv_import_args a = good_import(f); return pkv_seq_import(f->pool, &a, NULL))
SIZED(import_sized, pkv_import_args, image_bytes, good_import(f), pkv_seq_import(f->pool, a, &f->imported))
IMPORT(import_image_null, a.image = NULL)
IMPORT(import_image_bytes_0, a.image_bytes = 0)
IMPORT(import_image_bytes_short_of_header, a.image_bytes = PKV_SEQ_IMAGE_HEADER_BYTES - 1)
IMPORT(import_truncated, a.image_bytes = PKV_SEQ_IMAGE_HEADER_BYTES + 8)
IMPORT(import_not_an_image, a.image = f->k)
IMPORT(import_memory_unknown, a.memory = (pkv_memory)3)
IMPORT(import_device_unaligned, a.memory = PKV_MEMORY_DEVICE; a.image = (uint8_t *)f->image + 8)
CALL(regions_pool_null, uint32_t n; return pkv_pool_regions(NULL, f->regions, 2, &n))
CALL(regions_count_null, return pkv_pool_regions(f->pool, f->regions, 2, NULL))
CALL(regions_null_with_capacity, uint32_t n; return pkv_pool_regions(f->pool, NULL, 2, &n))
CALL(spans_pool_null, uint64_t n; return pkv_seq_page_spans(NULL, f->a, 0, 0, f->spans, 64, &n))
CALL(spans_count_null, return pkv_seq_page_spans(f->pool, f->a, 0, 0, f->spans, 64, NULL))
CALL(spans_null_with_capacity, uint64_t n; return pkv_seq_page_spans(f->pool, f->a, 0, 0, NULL, 64, &n))
CALL(spans_zero, pkv_seq z = {0}; return spans_of(f, z, 0, 0, 64))
CALL(spans_freed, return spans_of(f, f->freed, 0, 0, 64))
CALL(spans_other_pool, return spans_of(f, f->other, 0, 0, 64))
CALL(spans_layer_past_end, return spans_of(f, f->a, LAYERS, 0, 64))
CALL(spans_layer_count_past_end, return spans_of(f, f->a, 0, LAYERS + 1, 64))
CALL(spans_capacity_short, return spans_of(f, f->a, 0, 0, 2 * LAYERS * 2 - 1)) /* a: 6 tokens, 2 pages */

DECODE(decode_q_q8_0, a.q_format = PKV_FORMAT_Q8_0)
DECODE(decode_q_invalid, a.q_format = PKV_FORMAT_INVALID)
DECODE(decode_out_q4_0, a.out_format = PKV_FORMAT_Q4_0)
DECODE(decode_out_unknown, a.out_format = (pkv_format)17)
DECODE(decode_out_negative, a.out_format = (pkv_format)-1)
DECODE(decode_memory_unknown, a.memory = (pkv_memory)5)
DECODE(decode_memory_negative, a.memory = (pkv_memory)-1)
DECODE(decode_count_0_null, a.seqs = NULL; a.q = NULL; a.out = NULL; a.lse = NULL; a.count = 0)

/* The attention variants (pagedkv.h, section 7a), decode's and extend's alike */
static const float nan_at_1[Q_HEADS] = {0.5f, NAN}, inf_at_1[Q_HEADS] = {0.5f, INFINITY};
static const float negative_at_1[Q_HEADS] = {0.5f, -0.25f}, sinks_ok[Q_HEADS] = {-2.0f, 0.0f, 3.0f, 1e30f};
static const float slopes_ok[Q_HEADS] = {0.0f, 0.125f, 0.5f, 1.0f};
DECODE(decode_softcap_negative, a.softcap = -1.0f)
DECODE(decode_softcap_nan, a.softcap = NAN)
DECODE(decode_softcap_inf, a.softcap = INFINITY)
DECODE(decode_sinks_nan, a.sinks = nan_at_1)
DECODE(decode_sinks_inf, a.sinks = inf_at_1)
DECODE(decode_slopes_negative, a.alibi_slopes = negative_at_1)
DECODE(decode_slopes_nan, a.alibi_slopes = nan_at_1)
DECODE(decode_slopes_inf, a.alibi_slopes = inf_at_1)
/* Accepted: any window, negative sinks, every variant at once. */
DECODE(decode_variants_all, a.window = 1; a.softcap = 30.0f; a.sinks = sinks_ok; a.alibi_slopes = slopes_ok)
DECODE(decode_window_max, a.window = UINT32_MAX)
PREPARE(prepare_softcap_nan, a.softcap = NAN)
EXTEND(extend_softcap_negative, a.softcap = -0.5f)
EXTEND(extend_sinks_nan, a.sinks = nan_at_1)
EXTEND(extend_slopes_negative, a.alibi_slopes = negative_at_1)
EXTEND(extend_variants_all, a.window = 2; a.softcap = 5.0f; a.sinks = sinks_ok; a.alibi_slopes = slopes_ok)

/* Releasing the positions before a point */
CALL(release_pool_null, return pkv_seq_release_before(NULL, f->a, 1))
CALL(release_zero, pkv_seq z = {0}; return pkv_seq_release_before(f->pool, z, 1))
CALL(release_freed, return pkv_seq_release_before(f->pool, f->freed, 1))
CALL(release_other_pool, return pkv_seq_release_before(f->pool, f->other, 1))
CALL(release_past_length, return pkv_seq_release_before(f->pool, f->a, 7)) /* a holds 6 */
CALL(release_at_0, return pkv_seq_release_before(f->pool, f->a, 0))        /* releases nothing */

/* FP8 scales: the fixture's pages are F16 (K) and Q4_0 (V), which have none; an FP8 pool's bad
 * scales are test_fp8's. Setting nothing and reading 1.0s back are accepted. */
static const float ones[LAYERS * KV_HEADS] = {1.0f, 1.0f, 1.0f, 1.0f};
static float scales_out[LAYERS * KV_HEADS];
static pkv_scales_args good_scales(void) {
  pkv_scales_args a = PKV_SCALES_ARGS_INIT;
  return a;
}
#define SCALES(fn, ...) EDIT(fn, pkv_scales_args, good_scales(), pkv_pool_set_scales(f->pool, &a), __VA_ARGS__)
CALL(scales_pool_null, pkv_scales_args a = good_scales(); return pkv_pool_set_scales(NULL, &a))
CALL(scales_args_null, return pkv_pool_set_scales(f->pool, NULL))
SIZED(scales_sized, pkv_scales_args, v_scales, good_scales(), pkv_pool_set_scales(f->pool, a))
SCALES(scales_k_on_f16, a.k_scales = ones)
SCALES(scales_v_on_q4_0, a.v_scales = ones; a.per_head = 1)
SCALES(scales_first_layer_past_end, a.first_layer = LAYERS)
SCALES(scales_layers_past_end, a.first_layer = 1; a.layer_count = LAYERS)
SCALES(scales_per_head_2, a.per_head = 2)
SCALES(scales_nothing, a.first_layer = 1)
CALL(get_scales_pool_null, return pkv_pool_get_scales(NULL, 0, 0, scales_out, scales_out))
CALL(get_scales_first_past_end, return pkv_pool_get_scales(f->pool, LAYERS, 0, scales_out, scales_out))
CALL(get_scales_count_past_end, return pkv_pool_get_scales(f->pool, 1, LAYERS, scales_out, scales_out))
CALL(get_scales_all, return pkv_pool_get_scales(f->pool, 0, 0, scales_out, NULL))
/* FP8 is a page format only */
WRITE(write_src_fp8, a.src_format = PKV_FORMAT_FP8_E4M3)
READ(read_dst_fp8, a.dst_format = PKV_FORMAT_FP8_E5M2)
DECODE(decode_q_fp8, a.q_format = PKV_FORMAT_FP8_E4M3)
EXTEND(extend_out_fp8, a.out_format = PKV_FORMAT_FP8_E5M2)

/* Extend: the attention checks decode makes, then the offsets, the rows' total and the mask */
CALL(extend_pool_null, pkv_extend_args a = good_extend(f); return pkv_extend(NULL, &a))
CALL(extend_args_null, return pkv_extend(f->pool, NULL))
SIZED(extend_sized, pkv_extend_args, mask_bytes, good_extend(f), pkv_extend(f->pool, a))
EXTEND(extend_layer_past_end, a.layer = LAYERS)
EXTEND(extend_seqs_null, a.seqs = NULL)
EXTEND(extend_offsets_null, a.q_offsets = NULL)
EXTEND(extend_q_null, a.q = NULL)
EXTEND(extend_out_null, a.out = NULL)
EXTEND(extend_zero, pkv_seq s[3] = {f->a, f->b, zero}; a.seqs = s)
EXTEND(extend_freed, pkv_seq s[3] = {f->a, f->b, f->freed}; a.seqs = s)
EXTEND(extend_other_pool, pkv_seq s[3] = {f->a, f->b, f->other}; a.seqs = s)
EXTEND(extend_q_heads_0, a.q_heads = 0)
EXTEND(extend_q_heads_3, a.q_heads = 3) /* not a multiple of kv_heads (2) */
EXTEND(extend_q_heads_past_max, a.q_heads = PKV_MAX_Q_HEADS + KV_HEADS)
EXTEND(extend_scale_nan, a.scale = NAN)
EXTEND(extend_scale_negative, a.scale = -1.0f)
EXTEND(extend_q_q8_0, a.q_format = PKV_FORMAT_Q8_0)
EXTEND(extend_out_invalid, a.out_format = PKV_FORMAT_INVALID)
EXTEND(extend_memory_unknown, a.memory = (pkv_memory)5)
EXTEND(extend_offsets_not_from_0, static const uint32_t o[4] = {1, 2, 3, 3}; a.q_offsets = o)
EXTEND(extend_offsets_decreasing, static const uint32_t o[4] = {0, 2, 1, 3}; a.q_offsets = o)
EXTEND(extend_tokens_past_length, static const uint32_t o[4] = {0, 1, 5, 5}; a.q_offsets = o) /* b holds 3 */
EXTEND(extend_empty_with_tokens, static const uint32_t o[4] = {0, 1, 3, 4}; a.q_offsets = o)
/* 2^22 + 1 queries of 1024 heads: more rows than 32 bits count (checked before any length). */
EXTEND(extend_rows_overflow, static const uint32_t o[4] = {0, 0, 0, (1u << 22) + 1}; a.q_offsets = o;
       a.q_heads = PKV_MAX_Q_HEADS)
MASKED(extend_mask_offsets_null, a.mask_offsets = NULL)
MASKED(extend_mask_too_small, a.mask_bytes = 2)
MASKED(extend_mask_offset_past_end, static const uint64_t o[3] = {0, 2, 3}; a.mask_offsets = o)
MASKED(extend_mask_offset_huge, static const uint64_t o[3] = {0, UINT64_MAX, 3}; a.mask_offsets = o)
MASKED(extend_mask_without_self, static const uint8_t m[3] = {1, 1, 1}; a.mask = m)
MASKED(extend_mask_sees_later, static const uint8_t m[3] = {1, 3, 3}; a.mask = m)
/* Accepted: bits past T_b in a row's last byte are ignored; a sequence named twice; no rows at all
 * with q and out NULL; count 0. */
MASKED(extend_mask_bits_past_tokens, static const uint8_t m[3] = {0xff, 0xf9, 0xfb}; a.mask = m)
EXTEND(extend_twice, pkv_seq s[3] = {f->b, f->b, f->a}; a.seqs = s)
EXTEND(extend_no_rows_null, static const uint32_t o[4] = {0, 0, 0, 0}; a.q_offsets = o; a.q = NULL; a.out = NULL;
       a.lse = NULL)
EXTEND(extend_count_0_null, a.seqs = NULL; a.q_offsets = NULL; a.q = NULL; a.out = NULL; a.count = 0)

/* Extend prepare: the extend's checks except q and out, which it does not read */
CALL(extend_prepare_pool_null, pkv_extend_args a = good_extend(f); return pkv_extend_prepare(NULL, &a))
CALL(extend_prepare_args_null, return pkv_extend_prepare(f->pool, NULL))
SIZED(extend_prepare_sized, pkv_extend_args, mask_bytes, good_extend(f), pkv_extend_prepare(f->pool, a))
EXTEND_PREPARE(extend_prepare_layer_past_end, a.layer = LAYERS)
EXTEND_PREPARE(extend_prepare_seqs_null, a.seqs = NULL)
EXTEND_PREPARE(extend_prepare_offsets_null, a.q_offsets = NULL)
EXTEND_PREPARE(extend_prepare_freed, pkv_seq s[3] = {f->a, f->b, f->freed}; a.seqs = s)
EXTEND_PREPARE(extend_prepare_q_heads_3, a.q_heads = 3)
EXTEND_PREPARE(extend_prepare_scale_nan, a.scale = NAN)
EXTEND_PREPARE(extend_prepare_offsets_decreasing, static const uint32_t o[4] = {0, 2, 1, 3}; a.q_offsets = o)
EXTEND_PREPARE(extend_prepare_tokens_past_length, static const uint32_t o[4] = {0, 1, 5, 5}; a.q_offsets = o)
MASKED_PREPARE(extend_prepare_mask_too_small, a.mask_bytes = 2)
MASKED_PREPARE(extend_prepare_mask_sees_later, static const uint8_t m[3] = {1, 3, 3}; a.mask = m)
EXTEND_PREPARE(extend_prepare_q_out_null, a.q = NULL; a.out = NULL; a.lse = NULL)
MASKED_PREPARE(extend_prepare_masked_q_out_null, a.q = NULL; a.out = NULL)

/* Format conversion */
static float conv_src[64];
static unsigned char conv_dst[256];
CALL(from_f32_invalid, return pkv_convert_from_f32(PKV_FORMAT_INVALID, conv_src, 32, conv_dst))
CALL(from_f32_unknown, return pkv_convert_from_f32((pkv_format)8, conv_src, 32, conv_dst))
CALL(from_f32_negative, return pkv_convert_from_f32((pkv_format)-1, conv_src, 32, conv_dst))
CALL(from_f32_q8_0_33, return pkv_convert_from_f32(PKV_FORMAT_Q8_0, conv_src, 33, conv_dst))
CALL(from_f32_q4_0_16, return pkv_convert_from_f32(PKV_FORMAT_Q4_0, conv_src, 16, conv_dst))
CALL(from_f32_src_null, return pkv_convert_from_f32(PKV_FORMAT_F16, NULL, 32, conv_dst))
CALL(from_f32_dst_null, return pkv_convert_from_f32(PKV_FORMAT_F16, conv_src, 32, NULL))
CALL(to_f32_invalid, return pkv_convert_to_f32(PKV_FORMAT_INVALID, conv_dst, 32, conv_src))
CALL(to_f32_unknown, return pkv_convert_to_f32((pkv_format)8, conv_dst, 32, conv_src))
CALL(to_f32_negative, return pkv_convert_to_f32((pkv_format)-1, conv_dst, 32, conv_src))
CALL(to_f32_q8_0_33, return pkv_convert_to_f32(PKV_FORMAT_Q8_0, conv_dst, 33, conv_src))
CALL(to_f32_q4_0_16, return pkv_convert_to_f32(PKV_FORMAT_Q4_0, conv_dst, 16, conv_src))
CALL(to_f32_src_null, return pkv_convert_to_f32(PKV_FORMAT_BF16, NULL, 32, conv_src))
CALL(to_f32_dst_null, return pkv_convert_to_f32(PKV_FORMAT_BF16, conv_dst, 32, NULL))

/* The loaders' function table */
CALL(get_api_version_0, const pkv_api *t = NULL; return pkv_get_api(0, &t))
CALL(get_api_version_newer, const pkv_api *t = NULL; return pkv_get_api(PKV_API_VERSION + 1, &t))
CALL(get_api_version_uint32_max, const pkv_api *t = NULL; return pkv_get_api(UINT32_MAX, &t))
CALL(get_api_out_null, return pkv_get_api(PKV_API_VERSION, NULL))

/* ---------------------------------------------------------------------------------------------------
 * The table
 * ------------------------------------------------------------------------------------------------- */
#define BAD(fn, expect) {#fn, fn, 0, expect, PKV_OK, 0}
#define BAD2(fn, expect, also) {#fn, fn, 0, expect, also, 0}
#define OK(fn) {#fn, fn, 0, PKV_OK, PKV_OK, 0}
/* larger_also: a status the larger struct's call may get instead of success, past the size check. */
#define SIZES_OR(fn, larger_mutates, larger_also)                                                     \
  {#fn " 0", fn, SZ_ZERO, PKV_ERR_STRUCT_SIZE, PKV_OK, 0},                                           \
      {#fn " 4", fn, SZ_FOUR, PKV_ERR_STRUCT_SIZE, PKV_OK, 0},                                       \
      {#fn " without the last field", fn, SZ_NO_LAST, PKV_ERR_STRUCT_SIZE, PKV_OK, 0},               \
      {#fn " one byte short", fn, SZ_SHORT, PKV_ERR_STRUCT_SIZE, PKV_OK, 0},                         \
      {#fn " larger", fn, SZ_LARGER, PKV_OK, larger_also, larger_mutates}
#define SIZES(fn, larger_mutates) SIZES_OR(fn, larger_mutates, PKV_OK)

static const bad_case cases[] = {
    BAD(ctx_create_desc_null, INVALID),
    BAD(ctx_create_out_null, INVALID),
    BAD(ctx_create_backend_unknown, INVALID),
    BAD(ctx_create_backend_negative, INVALID),
    SIZES(ctx_create_sized, 0),
    BAD2(ctx_create_cuda_absent, PKV_ERR_UNSUPPORTED, PKV_ERR_NO_DEVICE),
    BAD2(ctx_create_hip_absent, PKV_ERR_UNSUPPORTED, PKV_ERR_NO_DEVICE),
    OK(ctx_destroy_null),
    BAD(ctx_destroy_live_pool, INVALID),
    BAD(ctx_backend_ctx_null, INVALID),
    BAD(ctx_backend_out_null, INVALID),
    BAD(ctx_synchronize_null, INVALID),
    BAD(query_auto, INVALID),
    BAD(query_unknown, INVALID),
    BAD(query_negative, INVALID),
    BAD(query_info_null, INVALID),
    SIZES(query_sized, 0),

    BAD(pool_create_ctx_null, INVALID),
    BAD(pool_create_desc_null, INVALID),
    BAD(pool_create_out_null, INVALID),
    SIZES(pool_create_sized, 0),
    BAD(pool_layers_0, INVALID),
    BAD(pool_kv_heads_0, INVALID),
    BAD(pool_head_dim_0, INVALID),
    BAD(pool_head_dim_16, INVALID),
    BAD(pool_head_dim_48, INVALID),
    BAD(pool_head_dim_288, INVALID),
    BAD(pool_page_size_0, INVALID),
    BAD(pool_page_size_3, INVALID),
    BAD(pool_page_size_24, INVALID),
    BAD(pool_page_size_2048, INVALID),
    BAD(pool_pages_0, INVALID),
    BAD(pool_max_sequences_0, INVALID),
    BAD(pool_max_sequences_too_many, INVALID),
    BAD(pool_k_format_invalid, INVALID),
    BAD(pool_k_format_unknown, INVALID),
    BAD(pool_k_format_negative, INVALID),
    BAD(pool_v_format_invalid, INVALID),
    BAD(pool_v_format_unknown, INVALID),
    OK(pool_destroy_null),
    BAD(stats_pool_null, INVALID),
    BAD(stats_out_null, INVALID),
    SIZES(stats_sized, 0),

    BAD(seq_alloc_pool_null, INVALID),
    BAD(seq_alloc_out_null, INVALID),
    BAD(seq_free_pool_null, INVALID),
    BAD(seq_free_zero, STALE),
    BAD(seq_free_freed, STALE),
    BAD(seq_free_other_pool, STALE),
    BAD(seq_free_in_other_pool, STALE),
    BAD(seq_free_garbage, STALE),
    BAD(seq_fork_pool_null, INVALID),
    BAD(seq_fork_child_null, INVALID),
    BAD(seq_fork_zero, STALE),
    BAD(seq_fork_freed, STALE),
    BAD(seq_fork_other_pool, STALE),
    BAD(seq_truncate_pool_null, INVALID),
    BAD(seq_truncate_zero, STALE),
    BAD(seq_truncate_freed, STALE),
    BAD(seq_truncate_other_pool, STALE),
    BAD(seq_truncate_past_length, INVALID),
    BAD(seq_truncate_empty_to_1, INVALID),
    BAD(seq_truncate_uint32_max, INVALID),
    BAD(seq_length_pool_null, INVALID),
    BAD(seq_length_out_null, INVALID),
    BAD(seq_length_zero, STALE),
    BAD(seq_length_freed, STALE),
    BAD(seq_length_other_pool, STALE),
    BAD(seq_length_garbage, STALE),

    BAD(append_pool_null, INVALID),
    BAD(append_seqs_null, INVALID),
    BAD(append_n_new_null, INVALID),
    BAD(append_zero, STALE),
    BAD(append_freed, STALE),
    BAD(append_other_pool, STALE),
    BAD(append_repeated, INVALID),
    BAD(append_overflow, INVALID),
    BAD(append_out_of_pages, PKV_ERR_OUT_OF_PAGES),
    BAD2(append_past_pool_capacity, PKV_ERR_OUT_OF_PAGES, INVALID),
    OK(append_count_0_null),

    BAD(write_pool_null, INVALID),
    BAD(write_args_null, INVALID),
    SIZES(write_sized, 1),
    BAD(write_layer_past_end, INVALID),
    BAD(write_layer_uint32_max, INVALID),
    BAD(write_seqs_null, INVALID),
    BAD(write_n_tokens_null, INVALID),
    BAD(write_k_null, INVALID),
    BAD(write_v_null, INVALID),
    BAD(write_zero, STALE),
    BAD(write_freed, STALE),
    BAD(write_other_pool, STALE),
    BAD(write_more_than_length, INVALID),
    BAD(write_uint32_max_tokens, INVALID),
    BAD(write_empty_sequence, INVALID),
    BAD(write_repeated, INVALID),
    BAD(write_src_q8_0, INVALID),
    BAD(write_src_q4_0, INVALID),
    BAD(write_src_invalid, INVALID),
    BAD(write_src_unknown, INVALID),
    BAD(write_src_negative, INVALID),
    BAD(write_memory_unknown, INVALID),
    BAD(write_memory_negative, INVALID),
    BAD(write_shared_page, INVALID),
    OK(write_count_0_null),

    BAD(read_pool_null, INVALID),
    BAD(read_args_null, INVALID),
    SIZES(read_sized, 0),
    BAD(read_layer_past_end, INVALID),
    BAD(read_zero, STALE),
    BAD(read_freed, STALE),
    BAD(read_other_pool, STALE),
    BAD(read_past_length, INVALID),
    BAD(read_at_length, INVALID),
    BAD(read_start_past_length, INVALID),
    BAD(read_wrapping_range, INVALID),
    BAD(read_empty_sequence, INVALID),
    BAD(read_no_destination, INVALID),
    BAD(read_dst_q8_0, INVALID),
    BAD(read_dst_q4_0, INVALID),
    BAD(read_dst_invalid, INVALID),
    BAD(read_dst_negative, INVALID),
    BAD(read_memory_unknown, INVALID),

    BAD(decode_pool_null, INVALID),
    BAD(decode_args_null, INVALID),
    SIZES(decode_sized, 0),
    BAD(decode_layer_past_end, INVALID),
    BAD(decode_seqs_null, INVALID),
    BAD(decode_q_null, INVALID),
    BAD(decode_out_null, INVALID),
    BAD(decode_zero, STALE),
    BAD(decode_freed, STALE),
    BAD(decode_other_pool, STALE),
    BAD(decode_q_heads_0, INVALID),
    BAD(decode_q_heads_1, INVALID),
    BAD(decode_q_heads_3, INVALID),
    BAD(decode_q_tokens_9, INVALID),
    BAD(decode_q_tokens_past_length, INVALID),
    BAD(decode_q_tokens_0, INVALID),
    BAD(decode_scale_negative, INVALID),
    BAD(decode_scale_nan, INVALID),
    BAD(decode_scale_inf, INVALID),
    BAD(decode_scale_minus_inf, INVALID),
    BAD(decode_q_q8_0, INVALID),
    BAD(decode_q_invalid, INVALID),
    BAD(decode_out_q4_0, INVALID),
    BAD(decode_out_unknown, INVALID),
    BAD(decode_out_negative, INVALID),
    BAD(decode_memory_unknown, INVALID),
    BAD(decode_memory_negative, INVALID),
    OK(decode_count_0_null),
    BAD(decode_softcap_negative, INVALID),
    BAD(decode_softcap_nan, INVALID),
    BAD(decode_softcap_inf, INVALID),
    BAD(decode_sinks_nan, INVALID),
    BAD(decode_sinks_inf, INVALID),
    BAD(decode_slopes_negative, INVALID),
    BAD(decode_slopes_nan, INVALID),
    BAD(decode_slopes_inf, INVALID),
    OK(decode_variants_all),
    OK(decode_window_max),
    BAD(prepare_softcap_nan, INVALID),
    BAD(extend_softcap_negative, INVALID),
    BAD(extend_sinks_nan, INVALID),
    BAD(extend_slopes_negative, INVALID),
    OK(extend_variants_all),
    BAD(release_pool_null, INVALID),
    BAD(release_zero, STALE),
    BAD(release_freed, STALE),
    BAD(release_other_pool, STALE),
    BAD(release_past_length, INVALID),
    OK(release_at_0),
    BAD(scales_pool_null, INVALID),
    BAD(scales_args_null, INVALID),
    SIZES(scales_sized, 0),
    BAD(scales_k_on_f16, INVALID),
    BAD(scales_v_on_q4_0, INVALID),
    BAD(scales_first_layer_past_end, INVALID),
    BAD(scales_layers_past_end, INVALID),
    BAD(scales_per_head_2, INVALID),
    OK(scales_nothing),
    BAD(get_scales_pool_null, INVALID),
    BAD(get_scales_first_past_end, INVALID),
    BAD(get_scales_count_past_end, INVALID),
    OK(get_scales_all),
    BAD(write_src_fp8, INVALID),
    BAD(read_dst_fp8, INVALID),
    BAD(decode_q_fp8, INVALID),
    BAD(extend_out_fp8, INVALID),

    BAD(extend_pool_null, INVALID),
    BAD(extend_args_null, INVALID),
    SIZES(extend_sized, 0),
    BAD(extend_layer_past_end, INVALID),
    BAD(extend_seqs_null, INVALID),
    BAD(extend_offsets_null, INVALID),
    BAD(extend_q_null, INVALID),
    BAD(extend_out_null, INVALID),
    BAD(extend_zero, STALE),
    BAD(extend_freed, STALE),
    BAD(extend_other_pool, STALE),
    BAD(extend_q_heads_0, INVALID),
    BAD(extend_q_heads_3, INVALID),
    BAD(extend_q_heads_past_max, INVALID),
    BAD(extend_scale_nan, INVALID),
    BAD(extend_scale_negative, INVALID),
    BAD(extend_q_q8_0, INVALID),
    BAD(extend_out_invalid, INVALID),
    BAD(extend_memory_unknown, INVALID),
    BAD(extend_offsets_not_from_0, INVALID),
    BAD(extend_offsets_decreasing, INVALID),
    BAD(extend_tokens_past_length, INVALID),
    BAD(extend_empty_with_tokens, INVALID),
    BAD(extend_rows_overflow, INVALID),
    BAD(extend_mask_offsets_null, INVALID),
    BAD(extend_mask_too_small, INVALID),
    BAD(extend_mask_offset_past_end, INVALID),
    BAD(extend_mask_offset_huge, INVALID),
    BAD(extend_mask_without_self, INVALID),
    BAD(extend_mask_sees_later, INVALID),
    OK(extend_mask_bits_past_tokens),
    OK(extend_twice),
    OK(extend_no_rows_null),
    OK(extend_count_0_null),

    BAD(extend_prepare_pool_null, INVALID),
    BAD(extend_prepare_args_null, INVALID),
    SIZES(extend_prepare_sized, 0),
    BAD(extend_prepare_layer_past_end, INVALID),
    BAD(extend_prepare_seqs_null, INVALID),
    BAD(extend_prepare_offsets_null, INVALID),
    BAD(extend_prepare_freed, STALE),
    BAD(extend_prepare_q_heads_3, INVALID),
    BAD(extend_prepare_scale_nan, INVALID),
    BAD(extend_prepare_offsets_decreasing, INVALID),
    BAD(extend_prepare_tokens_past_length, INVALID),
    BAD(extend_prepare_mask_too_small, INVALID),
    BAD(extend_prepare_mask_sees_later, INVALID),
    OK(extend_prepare_q_out_null),
    OK(extend_prepare_masked_q_out_null),

    BAD(prepare_pool_null, INVALID),
    BAD(prepare_args_null, INVALID),
    SIZES(prepare_sized, 0),
    BAD(prepare_layer_past_end, INVALID),
    BAD(prepare_seqs_null, INVALID),
    BAD(prepare_freed, STALE),
    BAD(prepare_other_pool, STALE),
    BAD(prepare_q_heads_3, INVALID),
    BAD(prepare_q_tokens_past_length, INVALID),
    BAD(prepare_scale_nan, INVALID),
    BAD(prepare_memory_unknown, INVALID),

    BAD(export_size_pool_null, INVALID),
    BAD(export_size_args_null, INVALID),
    BAD(export_size_bytes_null, INVALID),
    SIZES(export_size_sized, 0),
    BAD(export_size_zero, STALE),
    BAD(export_size_freed, STALE),
    BAD(export_size_other_pool, STALE),
    BAD(export_size_first_layer_past_end, INVALID),
    BAD(export_size_range_past_end, INVALID),
    BAD(export_pool_null, INVALID),
    BAD(export_args_null, INVALID),
    SIZES(export_sized, 0),
    BAD(export_image_null, INVALID),
    BAD(export_image_bytes_short, INVALID),
    BAD(export_zero, STALE),
    BAD(export_freed, STALE),
    BAD(export_other_pool, STALE),
    BAD(export_layer_past_end, INVALID),
    BAD(export_layer_count_past_end, INVALID),
    BAD(export_layer_range_wrapping, INVALID),
    BAD(export_memory_unknown, INVALID),
    BAD(export_memory_negative, INVALID),
    BAD(export_device_unaligned, INVALID),
    BAD(import_pool_null, INVALID),
    BAD(import_args_null, INVALID),
    BAD(import_out_null, INVALID),
    SIZES(import_sized, 1),
    BAD(import_image_null, INVALID),
    BAD(import_image_bytes_0, INVALID),
    BAD(import_image_bytes_short_of_header, INVALID),
    BAD(import_truncated, INVALID),
    BAD(import_not_an_image, INVALID),
    BAD(import_memory_unknown, INVALID),
    BAD(import_device_unaligned, INVALID),
    BAD(regions_pool_null, INVALID),
    BAD(regions_count_null, INVALID),
    BAD(regions_null_with_capacity, INVALID),
    BAD(spans_pool_null, INVALID),
    BAD(spans_count_null, INVALID),
    BAD(spans_null_with_capacity, INVALID),
    BAD(spans_zero, STALE),
    BAD(spans_freed, STALE),
    BAD(spans_other_pool, STALE),
    BAD(spans_layer_past_end, INVALID),
    BAD(spans_layer_count_past_end, INVALID),
    BAD(spans_capacity_short, INVALID),

    BAD(from_f32_invalid, INVALID),
    BAD(from_f32_unknown, INVALID),
    BAD(from_f32_negative, INVALID),
    BAD(from_f32_q8_0_33, INVALID),
    BAD(from_f32_q4_0_16, INVALID),
    BAD(from_f32_src_null, INVALID),
    BAD(from_f32_dst_null, INVALID),
    BAD(to_f32_invalid, INVALID),
    BAD(to_f32_unknown, INVALID),
    BAD(to_f32_negative, INVALID),
    BAD(to_f32_q8_0_33, INVALID),
    BAD(to_f32_q4_0_16, INVALID),
    BAD(to_f32_src_null, INVALID),
    BAD(to_f32_dst_null, INVALID),

    BAD(get_api_version_0, PKV_ERR_VERSION),
    BAD(get_api_version_newer, PKV_ERR_VERSION),
    BAD(get_api_version_uint32_max, PKV_ERR_VERSION),
    BAD(get_api_out_null, INVALID),
};

static void run_case(void **state) {
  fixture *f = *state;
  const bad_case *c = f->c;
  open_fixture(f);
  take(f, &f->before);
  pkv_status st = c->call(f, c->variant);
  char err[1024];
  snprintf(err, sizeof err, "%s", pkv_last_error());
  print_message("    -> %s: \"%s\"\n", pkv_status_string(st), err);
  if (st != c->expect && !(c->also != PKV_OK && st == c->also))
    fail_msg("%s: got %s, expected %s%s%s (last error: \"%s\")", c->name, pkv_status_string(st),
             pkv_status_string(c->expect), c->also != PKV_OK ? " or " : "",
             c->also != PKV_OK ? pkv_status_string(c->also) : "", err);
  if (st != PKV_OK && err[0] == '\0') fail_msg("%s: failed with an empty pkv_last_error()", c->name);
  if (st == PKV_OK && err[0] != '\0') fail_msg("%s: succeeded, but pkv_last_error() is \"%s\"", c->name, err);
  if (!c->mutates) {
    take(f, &f->after);
    assert_same(f, &f->before, &f->after);
  }
}

/* Each valid call the bad ones are made from succeeds, so a bad call fails for the edit alone. */
static void valid_calls_succeed(void **state) {
  fixture *f = *state;
  open_fixture(f);
  pkv_context_desc cd = good_ctx_desc();
  pkv_pool_desc pd = good_pool_desc();
  pkv_backend_info info = good_info();
  pkv_pool_stats stats = good_stats();
  pkv_read_args r = good_read(f);
  pkv_decode_args d = good_decode(f);
  pkv_write_args w = good_write(f);
  CHECK_OK(try_ctx(&cd));
  CHECK_OK(try_pool(f, &pd));
  CHECK_OK(pkv_backend_query(PKV_BACKEND_CPU, &info));
  CHECK_OK(pkv_pool_get_stats(f->pool, &stats));
  CHECK_OK(pkv_read(f->pool, &r));
  CHECK_OK(pkv_decode(f->pool, &d));
  d.q = NULL; /* prepare reads neither q nor out */
  d.out = NULL;
  CHECK_OK(pkv_decode_prepare(f->pool, &d));
  CHECK_OK(pkv_write(f->pool, &w));
  pkv_backend backend = PKV_BACKEND_AUTO;
  CHECK_OK(pkv_context_backend(f->ctx, &backend));
  pkv_extend_args x = good_extend(f), xm = good_masked_extend(f);
  CHECK_OK(pkv_extend(f->pool, &x));
  CHECK_OK(pkv_extend(f->pool, &xm));
  CHECK_OK(pkv_convert_from_f32(PKV_FORMAT_Q4_0, conv_src, 64, conv_dst));
  CHECK_OK(pkv_convert_to_f32(PKV_FORMAT_Q8_0, conv_dst, 32, conv_src));
  const pkv_api *api = NULL;
  CHECK_OK(pkv_get_api(PKV_API_VERSION, &api));
  pkv_export_args e = good_export(f);
  uint64_t bytes = 0;
  CHECK_OK(pkv_seq_export_size(f->pool, &e, &bytes));
  CHECK_OK(pkv_seq_export(f->pool, &e));
  pkv_import_args i = good_import(f);
  CHECK_OK(pkv_seq_import(f->pool, &i, &f->imported));
  uint32_t n_regions = 0;
  CHECK_OK(pkv_pool_regions(f->pool, f->regions, 2, &n_regions));
  CHECK_OK(spans_of(f, f->a, 0, 0, 2 * LAYERS * 2));
  const pkv_seq s[2] = {f->empty, f->b};
  const uint32_t n[2] = {4, 1};
  CHECK_OK(pkv_append(f->pool, s, n, 2));
  assert_string_equal(pkv_last_error(), "");
}

/* The calls that return no status: unknown values get names, invalid sizes 0. */
static void helpers_on_unknown_values(void **state) {
  (void)state;
  const pkv_status unknown[2] = {(pkv_status)12345, (pkv_status)-1};
  for (int i = 0; i < 2; i++) {
    const char *s = pkv_status_string(unknown[i]);
    assert_non_null(s);
    assert_true(strlen(s) > 0);
  }
  assert_non_null(pkv_last_error());
  assert_string_equal(pkv_backend_name((pkv_backend)99), "unknown");
  assert_string_equal(pkv_backend_name((pkv_backend)-1), "unknown");
  assert_string_equal(pkv_format_name((pkv_format)99), "unknown");
  assert_string_equal(pkv_format_name((pkv_format)-1), "unknown");
  assert_int_equal(pkv_format_row_bytes((pkv_format)-1, 32), 0);
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_Q8_0, 33), 0);
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_Q4_0, 16), 0);
  assert_int_equal(pkv_format_row_bytes(PKV_FORMAT_INVALID, 32), 0);
  assert_int_equal(pkv_format_row_bytes((pkv_format)99, 32), 0);
}

int main(void) {
  g_seed = tu_seed();
  tu_rng r = tu_rng_make(g_seed);
  tu_fill_uniform(&r, conv_src, 64, -1.0, 1.0);
  const size_t n = sizeof cases / sizeof cases[0];
  struct CMUnitTest *t = calloc(n + 2, sizeof *t);
  assert_non_null(t);
  t[0].name = "valid calls succeed";
  t[0].test_func = valid_calls_succeed;
  t[0].setup_func = setup;
  t[0].teardown_func = teardown;
  t[1].name = "helpers on unknown values";
  t[1].test_func = helpers_on_unknown_values;
  for (size_t i = 0; i < n; i++) {
    t[i + 2].name = cases[i].name;
    t[i + 2].test_func = run_case;
    t[i + 2].setup_func = setup;
    t[i + 2].teardown_func = teardown;
    t[i + 2].initial_state = (void *)&cases[i];
  }
  int failed = tu_run_group("bad_input", t, n + 2, NULL, NULL);
  free(t);
  return failed;
}
