// Building and filling pools (pools.hpp).
#include "pools.hpp"

#include <algorithm>
#include <cstdio>

namespace bench {

void make_pool(Env &e, PoolGuard &g, const Shape &s, pkv_format k, pkv_format v, uint32_t page,
               uint64_t pages, uint64_t max_seqs, uint32_t max_len, uint32_t seed, uint32_t layers) {
  if (pages > UINT32_MAX) throw Skipped(strf("needs %llu pages, more than a pool holds", (unsigned long long)pages));
  if (max_seqs > 1048576) throw Skipped("needs more than 1048576 sequences");
  pkv_pool_desc d = PKV_POOL_DESC_INIT;
  d.layers = layers;
  d.kv_heads = s.hkv;
  d.head_dim = s.d;
  d.page_size = page;
  d.pages = (uint32_t)std::max<uint64_t>(pages, 1);
  d.max_sequences = (uint32_t)std::max<uint64_t>(max_seqs, 1);
  d.k_format = k;
  d.v_format = v;
  d.page_order_seed = seed;
  d.max_sequence_length = max_len; // keeps the page table small: pools here are sized exactly
  check(pkv_pool_create(e.ctx, &d, &g.p), "pkv_pool_create");
}

uint64_t pool_bytes(Env &e, const Shape &s, const Formats &f, uint32_t page, uint64_t pages, uint64_t reserved) {
  PoolGuard g;
  make_pool(e, g, s, f.k, f.v, page, 1, 1, page, 0);
  pkv_pool_stats st = PKV_POOL_STATS_INIT;
  check(pkv_pool_get_stats(g.p, &st), "pkv_pool_get_stats");
  g.close();
  if (st.bytes_per_token != token_bytes(s, f.k, f.v))
    std::fprintf(stderr, "warning: %s %s: library stores %llu bytes per token, the format says %llu\n",
                 s.name, f.name, (unsigned long long)st.bytes_per_token,
                 (unsigned long long)token_bytes(s, f.k, f.v));
  uint64_t need = pages * st.bytes_per_page;
  if (e.mem_avail && need + reserved > e.mem_avail)
    throw Skipped(strf("pool needs %.1f GB, %.1f GB available", need / 1e9,
                       (e.mem_avail - std::min(reserved, e.mem_avail)) / 1e9));
  return need;
}

namespace {
const uint32_t kChunk = 4096; // tokens per pkv_write while filling
} // namespace

void fill_seq(Env &e, pkv_pool *pool, pkv_seq seq, uint32_t len, size_t row_vals, uint32_t layers) {
  uint32_t chunk = (uint32_t)std::min<size_t>(kChunk, e.bank.size() / 2 / row_vals);
  for (uint32_t done = 0; done < len;) {
    uint32_t c = std::min(len - done, chunk);
    check(pkv_append(pool, &seq, &c, 1), "pkv_append");
    size_t need = (size_t)c * row_vals, span = e.bank.size() - need + 1;
    for (uint32_t layer = 0; layer < layers; layer++) {
      pkv_write_args w = PKV_WRITE_ARGS_INIT;
      w.layer = layer;
      w.seqs = &seq;
      w.n_tokens = &c;
      w.count = 1;
      w.src_format = PKV_FORMAT_F16;
      w.memory = PKV_MEMORY_HOST;
      w.k = e.bank.data() + e.rng.next() % span;
      w.v = e.bank.data() + e.rng.next() % span;
      check(pkv_write(pool, &w), "pkv_write");
    }
    done += c;
  }
}

} // namespace bench
