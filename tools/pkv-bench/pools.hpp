// The pools the measurements build: sized from the library's own statistics, checked against the
// memory available, and filled with random K/V.
#pragma once

#include "common.hpp"
#include "workloads.hpp"

namespace bench {

const uint32_t kPagedSeed = 0x9A6ED; // any non-zero seed: shuffled physical pages

struct PoolGuard {
  pkv_pool *p = nullptr;
  PoolGuard() = default;
  PoolGuard(const PoolGuard &) = delete;
  PoolGuard &operator=(const PoolGuard &) = delete;
  ~PoolGuard() {
    if (p) pkv_pool_destroy(p); // only on an error path; close() checks the status
  }
  void close() {
    pkv_pool *q = p;
    p = nullptr;
    check(pkv_pool_destroy(q), "pkv_pool_destroy");
  }
};

void make_pool(Env &e, PoolGuard &g, const Shape &s, pkv_format k, pkv_format v, uint32_t page,
               uint64_t pages, uint64_t max_seqs, uint32_t max_len, uint32_t seed, uint32_t layers = 1);

// The bytes a pool of `pages` takes (from a one-page pool's statistics); skips when it would not fit
// beside `reserved` bytes already in use.
uint64_t pool_bytes(Env &e, const Shape &s, const Formats &f, uint32_t page, uint64_t pages, uint64_t reserved);

// Appends len tokens to seq and writes random K/V rows (F16 source) into every layer, in chunks.
void fill_seq(Env &e, pkv_pool *pool, pkv_seq seq, uint32_t len, size_t row_vals, uint32_t layers = 1);

} // namespace bench
