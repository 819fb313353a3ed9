/* Transactional append, truncate, fork and free checked against a model written here: each sequence's
 * length, its list of (model) pages with reference counts, and the K/V rows it must read back.
 *
 * The header's page rules the model follows: an append of n > 0 tokens to a sequence of length len
 * needs ceil((len+n)/P) - ceil(len/P) pages, plus one when len % P != 0 and its last page is shared
 * (copy on write); fork shares every page; truncate and free release pages whose count drops to 0. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <stdio.h>
#include <string.h>

#include "poolutil.h"
#include "testutil.h"

#define LAYERS 2
#define KV_HEADS 2
#define HD 32
#define W (KV_HEADS * HD) /* floats per token row */
#define MAX_SEQS 6
#define MAX_PAGES 16
#define MAX_TOKENS (MAX_PAGES * 16)

typedef struct mseq {
  pkv_seq h;
  uint32_t len, npages;
  uint32_t pages[MAX_PAGES];              /* model page ids, not the library's */
  float rows[2][LAYERS][MAX_TOKENS * W]; /* [K/V][layer][position * W + i] */
} mseq;

static struct {
  pkv_context *ctx;
  pkv_pool *pool;
  uint32_t page_size, pages, max_seqs, max_len;
  uint32_t ref[MAX_PAGES];
  uint32_t nseq;
  mseq *seq[MAX_SEQS]; /* the live sequences */
  mseq store[MAX_SEQS];
  int store_used[MAX_SEQS];
  long op;
  char desc[160]; /* the operation under way, for failure messages */
  long n_cow, n_out_of_pages, n_out_of_seqs, n_too_long, n_ambiguous;
} M;

static tu_rng rng;

/* ---- failure reporting ---- */

static void expect_u64(uint64_t got, uint64_t want, const char *what) {
  if (got == want) return;
  print_error("op %ld (%s): %s: got %llu, want %llu\n", M.op, M.desc, what, (unsigned long long)got,
              (unsigned long long)want);
  fail();
}

static void expect_status(pkv_status got, pkv_status want) {
  if (got != want) {
    print_error("op %ld (%s): got %s (%s), want %s\n", M.op, M.desc, pkv_status_string(got), pkv_last_error(),
                pkv_status_string(want));
    fail();
  }
  if (want != PKV_OK) pu_assert_fails(got, want); /* a failure leaves a detail text */
}

/* ---- the model ---- */

/* max_len: the pool's max_sequence_length (0: pages * page_size). */
static void model_open(uint32_t page_size, uint32_t pages, uint32_t max_seqs, uint32_t max_len,
                       uint32_t page_order_seed) {
  assert_true(pages <= MAX_PAGES && max_seqs <= MAX_SEQS && pages * page_size <= MAX_TOKENS);
  memset(M.ref, 0, sizeof M.ref);
  memset(M.store_used, 0, sizeof M.store_used);
  M.nseq = 0;
  M.page_size = page_size;
  M.pages = pages;
  M.max_seqs = max_seqs;
  M.max_len = max_len ? max_len : pages * page_size;
  M.op = 0;
  M.n_cow = M.n_out_of_pages = M.n_out_of_seqs = M.n_too_long = M.n_ambiguous = 0;
  snprintf(M.desc, sizeof M.desc, "open page_size %u pages %u", page_size, pages);
  pkv_pool_desc d = pu_desc(LAYERS, KV_HEADS, HD, page_size, pages, max_seqs, PKV_FORMAT_F32, PKV_FORMAT_F32);
  d.page_order_seed = page_order_seed;
  d.max_sequence_length = max_len;
  pu_open(&d, &M.ctx, &M.pool);
}

static void model_close(void) { pu_close(M.ctx, M.pool); }

static uint32_t pages_for(uint32_t len) { return (len + M.page_size - 1) / M.page_size; }

static uint32_t free_pages(void) {
  uint32_t n = 0;
  for (uint32_t p = 0; p < M.pages; p++) n += M.ref[p] == 0;
  return n;
}

static uint32_t take_page(void) {
  for (uint32_t p = 0; p < M.pages; p++) {
    if (M.ref[p] == 0) {
      M.ref[p] = 1;
      return p;
    }
  }
  fail_msg("model: no free page (model bug)");
  return 0;
}

static void release_tail(mseq *s, uint32_t keep_pages) {
  while (s->npages > keep_pages) M.ref[s->pages[--s->npages]]--;
}

static mseq *new_mseq(pkv_seq h) {
  for (int i = 0; i < MAX_SEQS; i++) {
    if (!M.store_used[i]) {
      M.store_used[i] = 1;
      mseq *s = &M.store[i];
      s->h = h;
      s->len = s->npages = 0;
      M.seq[M.nseq++] = s;
      return s;
    }
  }
  fail_msg("model: no free slot (model bug)");
  return NULL;
}

/* Whether seq's next append must copy its last page first. */
static int needs_cow(const mseq *s, const uint32_t *ref) {
  return s->len % M.page_size != 0 && ref[s->pages[s->npages - 1]] > 1;
}

/* Pages a batch append needs. When several holders of one shared partial page append in the same batch,
 * the header's per-sequence rule counts a copy for each of them (independent), while copying in batch
 * order leaves the last holder the original (sequential); both end in the same state. */
static uint32_t pages_needed(const uint32_t *idx, const uint32_t *n, uint32_t count, int sequential) {
  uint32_t ref[MAX_PAGES], need = 0;
  memcpy(ref, M.ref, sizeof ref);
  for (uint32_t i = 0; i < count; i++) {
    const mseq *s = M.seq[idx[i]];
    if (n[i] == 0) continue;
    need += pages_for(s->len + n[i]) - pages_for(s->len);
    if (needs_cow(s, sequential ? ref : M.ref)) {
      need++;
      ref[s->pages[s->npages - 1]]--;
    }
  }
  return need;
}

/* Positions at the end of s whose pages s holds alone: only those may be written. */
static uint32_t writable_tail(const mseq *s) {
  uint32_t k = s->npages;
  while (k > 0 && M.ref[s->pages[k - 1]] == 1) k--;
  return k == s->npages ? 0 : s->len - k * M.page_size;
}

/* ---- checks against the pool ---- */

static void check_model(void) {
  const pkv_pool_stats st = pu_stats(M.pool);
  uint32_t shared = 0;
  uint64_t tokens = 0;
  for (uint32_t p = 0; p < M.pages; p++) shared += M.ref[p] > 1;
  for (uint32_t i = 0; i < M.nseq; i++) tokens += M.seq[i]->len;
  expect_u64(st.pages_total, M.pages, "pages_total");
  expect_u64(st.pages_free, free_pages(), "pages_free");
  expect_u64(st.pages_shared, shared, "pages_shared");
  expect_u64(st.sequences_live, M.nseq, "sequences_live");
  expect_u64(st.max_sequences, M.max_seqs, "max_sequences");
  expect_u64(st.tokens_live, tokens, "tokens_live");
  for (uint32_t i = 0; i < M.nseq; i++) {
    uint32_t len = 0;
    expect_status(pkv_seq_length(M.pool, M.seq[i]->h, &len), PKV_OK);
    expect_u64(len, M.seq[i]->len, "pkv_seq_length");
  }
}

/* Reads every live sequence back and compares bitwise: catches copy-on-write and aliasing bugs. */
static void check_content(void) {
  static float got[2][MAX_TOKENS * W];
  for (uint32_t i = 0; i < M.nseq; i++) {
    const mseq *s = M.seq[i];
    if (s->len == 0) continue;
    for (uint32_t l = 0; l < LAYERS; l++) {
      for (int kv = 0; kv < 2; kv++) /* NaN: an unwritten element cannot match */
        memset(got[kv], 0xff, (size_t)s->len * W * sizeof(float));
      expect_status(pu_read(M.pool, l, s->h, 0, s->len, PKV_FORMAT_F32, got[0], got[1]), PKV_OK);
      for (int kv = 0; kv < 2; kv++) {
        if (!memcmp(got[kv], s->rows[kv][l], (size_t)s->len * W * sizeof(float))) continue;
        uint32_t e = 0;
        while (!memcmp(&got[kv][e], &s->rows[kv][l][e], sizeof(float))) e++;
        print_error("op %ld (%s): seq #%u (len %u) layer %u %s: position %u elem %u: got %a want %a\n", M.op,
                    M.desc, i, s->len, l, kv ? "V" : "K", e / W, e % W, (double)got[kv][e],
                    (double)s->rows[kv][l][e]);
        fail();
      }
    }
  }
}

/* ---- operations: each calls the library, checks the status against the model, updates the model ---- */

static void model_alloc(void) {
  pkv_seq h;
  snprintf(M.desc, sizeof M.desc, "alloc with %u live", M.nseq);
  if (M.nseq == M.max_seqs) {
    expect_status(pkv_seq_alloc(M.pool, &h), PKV_ERR_OUT_OF_SEQUENCES);
    M.n_out_of_seqs++;
    return;
  }
  expect_status(pkv_seq_alloc(M.pool, &h), PKV_OK);
  new_mseq(h);
}

static void model_fork(uint32_t i) {
  pkv_seq h;
  mseq *parent = M.seq[i];
  snprintf(M.desc, sizeof M.desc, "fork seq #%u (len %u)", i, parent->len);
  if (M.nseq == M.max_seqs) {
    expect_status(pkv_seq_fork(M.pool, parent->h, &h), PKV_ERR_OUT_OF_SEQUENCES);
    M.n_out_of_seqs++;
    return;
  }
  expect_status(pkv_seq_fork(M.pool, parent->h, &h), PKV_OK);
  mseq *child = new_mseq(h);
  child->len = parent->len;
  child->npages = parent->npages;
  memcpy(child->pages, parent->pages, sizeof child->pages);
  for (uint32_t p = 0; p < child->npages; p++) M.ref[child->pages[p]]++;
  for (int kv = 0; kv < 2; kv++)
    for (int l = 0; l < LAYERS; l++)
      memcpy(child->rows[kv][l], parent->rows[kv][l], (size_t)parent->len * W * sizeof(float));
}

static void model_free(uint32_t i) {
  mseq *s = M.seq[i];
  snprintf(M.desc, sizeof M.desc, "free seq #%u (len %u)", i, s->len);
  expect_status(pkv_seq_free(M.pool, s->h), PKV_OK);
  release_tail(s, 0);
  M.store_used[s - M.store] = 0;
  M.seq[i] = M.seq[--M.nseq];
}

static void model_truncate(uint32_t i, uint32_t new_len) {
  mseq *s = M.seq[i];
  snprintf(M.desc, sizeof M.desc, "truncate seq #%u from %u to %u", i, s->len, new_len);
  if (new_len > s->len) {
    expect_status(pkv_seq_truncate(M.pool, s->h, new_len), PKV_ERR_INVALID_ARGUMENT);
    return;
  }
  expect_status(pkv_seq_truncate(M.pool, s->h, new_len), PKV_OK);
  release_tail(s, pages_for(new_len));
  s->len = new_len;
}

/* Fresh random rows for the newest m[k] positions of sequences idx[k], one layer. */
static void model_write(const uint32_t *idx, const uint32_t *m, uint32_t count, uint32_t layer) {
  static float rows[2][MAX_TOKENS * W];
  pkv_seq hs[MAX_SEQS];
  size_t r = 0;
  for (uint32_t k = 0; k < count; k++) {
    mseq *s = M.seq[idx[k]];
    hs[k] = s->h;
    assert_true(r + m[k] <= MAX_TOKENS);
    for (uint32_t pos = s->len - m[k]; pos < s->len; pos++, r++) {
      for (int kv = 0; kv < 2; kv++) {
        for (uint32_t e = 0; e < W; e++) {
          float x = (float)tu_uniform(&rng, -1.0, 1.0);
          rows[kv][r * W + e] = x;
          s->rows[kv][layer][(size_t)pos * W + e] = x;
        }
      }
    }
  }
  expect_status(pu_write(M.pool, layer, hs, m, count, PKV_FORMAT_F32, rows[0], rows[1]), PKV_OK);
}

static pkv_status model_append(const uint32_t *idx, const uint32_t *n, uint32_t count) {
  const uint32_t free = free_pages(), lo = pages_needed(idx, n, count, 1), hi = pages_needed(idx, n, count, 0);
  pkv_seq hs[MAX_SEQS];
  int len = snprintf(M.desc, sizeof M.desc, "append (free %u, need %u..%u)", free, lo, hi);
  for (uint32_t k = 0; k < count; k++) {
    hs[k] = M.seq[idx[k]]->h;
    if (len < (int)sizeof M.desc)
      len += snprintf(M.desc + len, sizeof M.desc - (size_t)len, " #%u:%u+%u", idx[k], M.seq[idx[k]]->len, n[k]);
  }
  const pkv_status st = pkv_append(M.pool, hs, n, count);
  int too_long = 0;
  for (uint32_t k = 0; k < count; k++) too_long |= (uint64_t)M.seq[idx[k]]->len + n[k] > M.max_len;
  if (too_long) { /* an invalid argument, whatever the free pages */
    expect_status(st, PKV_ERR_INVALID_ARGUMENT);
    M.n_too_long++;
    return st;
  }
  if (free >= hi) {
    expect_status(st, PKV_OK);
  } else if (free < lo) {
    expect_status(st, PKV_ERR_OUT_OF_PAGES);
  } else { /* the two readings of the rule differ here: either answer is right */
    M.n_ambiguous++;
    if (st != PKV_OK) expect_status(st, PKV_ERR_OUT_OF_PAGES);
  }
  if (st != PKV_OK) {
    M.n_out_of_pages++;
    return st;
  }
  for (uint32_t k = 0; k < count; k++) {
    mseq *s = M.seq[idx[k]];
    if (n[k] == 0) continue;
    if (needs_cow(s, M.ref)) {
      M.ref[s->pages[s->npages - 1]]--;
      s->pages[s->npages - 1] = take_page();
      M.n_cow++;
    }
    while (s->npages < pages_for(s->len + n[k])) s->pages[s->npages++] = take_page();
    s->len += n[k];
  }
  for (uint32_t l = 0; l < LAYERS; l++) model_write(idx, n, count, l);
  return st;
}

/* ---- random operations ---- */

/* count distinct random indices of live sequences. */
static void pick_distinct(uint32_t *idx, uint32_t count) {
  uint32_t all[MAX_SEQS];
  for (uint32_t i = 0; i < M.nseq; i++) all[i] = i;
  for (uint32_t i = 0; i < count; i++) {
    uint32_t j = i + tu_below(&rng, M.nseq - i), t = all[i];
    all[i] = all[j];
    all[j] = t;
    idx[i] = all[i];
  }
}

static void random_append(void) {
  uint32_t count = 1 + tu_below(&rng, M.nseq), idx[MAX_SEQS], n[MAX_SEQS];
  pick_distinct(idx, count);
  for (uint32_t k = 0; k < count; k++)
    n[k] = tu_below(&rng, 10) ? tu_below(&rng, 2 * M.page_size + 3) : tu_below(&rng, M.pages * M.page_size + 1);
  model_append(idx, n, count);
}

static void random_write(void) {
  uint32_t idx[MAX_SEQS], m[MAX_SEQS], count = 0;
  for (uint32_t i = 0; i < M.nseq; i++) {
    uint32_t tail = writable_tail(M.seq[i]);
    if (tail > 0 && tu_below(&rng, 2)) {
      idx[count] = i;
      m[count++] = 1 + tu_below(&rng, tail);
    }
  }
  if (count == 0) return;
  const uint32_t layer = tu_below(&rng, LAYERS);
  snprintf(M.desc, sizeof M.desc, "write %u sequences, layer %u", count, layer);
  model_write(idx, m, count, layer);
}

static void random_op(void) {
  const uint32_t r = M.nseq == 0 ? 0 : tu_below(&rng, 100), i = tu_below(&rng, M.nseq);
  if (r < 14) {
    model_alloc();
  } else if (r < 28) {
    model_fork(i);
  } else if (r < 40) {
    model_free(i);
  } else if (r < 55) {
    const uint32_t len = M.seq[i]->len, c = tu_below(&rng, 8);
    model_truncate(i, c == 0 ? len + 1 + tu_below(&rng, 3) : c == 1 ? len : tu_below(&rng, len + 1));
  } else if (r < 88) {
    random_append();
  } else {
    random_write();
  }
}

static void run_random(uint32_t page_size, uint32_t pages, uint32_t max_seqs, uint32_t max_len, long ops) {
  model_open(page_size, pages, max_seqs, max_len, tu_below(&rng, 2) ? (uint32_t)tu_next(&rng) | 1u : 0);
  for (M.op = 0; M.op < ops; M.op++) {
    random_op();
    check_model();
    check_content();
  }
  print_message("page_size %u: %ld copies on write, %ld out of pages, %ld out of sequences, %ld too long, "
                "%ld ambiguous\n", page_size, M.n_cow, M.n_out_of_pages, M.n_out_of_seqs, M.n_too_long,
                M.n_ambiguous);
  /* the run must have reached the paths it is meant to check */
  assert_true(M.n_out_of_pages > 0);
  assert_true(M.n_out_of_seqs > 0);
  assert_true(M.n_too_long > 0);
  if (page_size > 1) assert_true(M.n_cow > 0);
  model_close();
}

static void test_random_page_size_1(void **state) {
  (void)state;
  run_random(1, 12, 5, 0, 3000);
}

static void test_random_page_size_4(void **state) {
  (void)state;
  run_random(4, 10, 5, 24, 3000); /* shorter than the pool holds */
}

static void test_random_page_size_16(void **state) {
  (void)state;
  run_random(16, 6, 5, 0, 3000);
}

/* A batch that needs one page more than is free fails and changes nothing; one token less fits
 * exactly. The batch includes a fork whose shared partial last page must be copied. */
static void test_exhaustion(void **state) {
  (void)state;
  for (int round = 0; round < 40; round++) {
    model_open(4, 10, 5, 0, round % 2 ? (uint32_t)tu_next(&rng) | 1u : 0);
    for (int i = 0; i < 3; i++) model_alloc(); /* #0, #1, #2 */
    uint32_t first[2] = {0, 1}, first_n[2] = {1 + tu_below(&rng, 9), 1 + tu_below(&rng, 9)};
    assert_int_equal(model_append(first, first_n, 2), PKV_OK);
    model_fork(0); /* #3 shares #0's pages */
    check_model();

    uint32_t idx[3] = {1, 3, 2}, n[3] = {0, 0, 0}, k;
    do { /* one token at a time: the need grows by at most one page per token */
      k = tu_below(&rng, 3);
      n[k]++;
    } while (pages_needed(idx, n, 3, 0) <= free_pages());
    assert_int_equal(pages_needed(idx, n, 3, 0), free_pages() + 1);
    assert_int_equal(model_append(idx, n, 3), PKV_ERR_OUT_OF_PAGES);
    check_model();
    check_content();

    n[k]--;
    assert_int_equal(model_append(idx, n, 3), PKV_OK);
    check_model();
    check_content();
    assert_int_equal(free_pages(), 0);

    /* full now: anything that needs a page fails, even in a batch with an entry that needs none */
    uint32_t idx2[2] = {0, 2}, n2[2] = {0, M.page_size};
    assert_int_equal(model_append(idx2, n2, 2), PKV_ERR_OUT_OF_PAGES);
    check_model();
    check_content();
    model_close();
  }
}

/* max_sequence_length need not be a multiple of the page size: a sequence may reach it exactly and
 * not pass it, alone or in a batch, while the pool still has free pages. */
static void test_max_sequence_length(void **state) {
  (void)state;
  for (int round = 0; round < 20; round++) {
    const uint32_t page_size = 4, max_len = 5 + tu_below(&rng, 20);
    model_open(page_size, 16, 3, max_len, 0);
    model_alloc();
    model_alloc();
    uint32_t idx[2] = {0, 1}, n[2] = {tu_below(&rng, max_len + 1), tu_below(&rng, max_len + 1)};
    assert_int_equal(model_append(idx, n, 2), PKV_OK);
    check_model();
    for (uint32_t k = 0; k < 2; k++) { /* one past the limit, next to an entry that fits */
      n[k] = max_len - M.seq[k]->len + 1;
      n[1 - k] = tu_below(&rng, max_len - M.seq[1 - k]->len + 1);
      assert_int_equal(model_append(idx, n, 2), PKV_ERR_INVALID_ARGUMENT);
      check_model();
      check_content();
    }
    n[0] = max_len - M.seq[0]->len; /* exactly to the limit */
    n[1] = 0;
    assert_int_equal(model_append(idx, n, 2), PKV_OK);
    check_model();
    check_content();
    model_close();
  }
}

int main(void) {
  rng = tu_rng_make(tu_seed());
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_exhaustion),
      cmocka_unit_test(test_max_sequence_length),
      cmocka_unit_test(test_random_page_size_1),
      cmocka_unit_test(test_random_page_size_4),
      cmocka_unit_test(test_random_page_size_16),
  };
  return tu_run_tests(tests, NULL, NULL);
}
