// Extend (measure.hpp): pkv_extend of an engine step's new tokens over their sequences' cached ones,
// pages of 16: time per call and the causal FLOPs it did per second.
#include "bench_device.hpp"
#include "measure.hpp"
#include "pools.hpp"

#include <algorithm>

namespace bench {

// name, sequences, cached tokens each, new tokens each, from one forked prefix, tree masks.
const ExtendItem kExtends[4] = {
    {"prefill-1x1K", 1, 0, 1024, false, false},
    {"chunk-4x256-over-4K", 4, 4096, 256, false, false},
    {"prefix-8x128-over-2K", 8, 2048, 128, true, false},
    {"tree-4x32-over-4K", 4, 4096, 32, false, true},
};
// chunk-1x64-over-128K: a chunk the GPU extend kernel takes as 4 tiles a KV head, each reading the whole
// context (it splits no context), where decode's blocks split it.
const ExtendItem kExtendsFull[6] = {
    {"prefill-1x4K", 1, 0, 4096, false, false},
    {"prefill-8x2K", 8, 0, 2048, false, false},
    {"chunk-8x512-over-32K", 8, 32768, 512, false, false},
    {"chunk-1x64-over-128K", 1, 131072, 64, false, false},
    {"prefix-32x256-over-4K", 32, 4096, 256, true, false},
    {"tree-8x64-over-32K", 8, 32768, 64, false, true},
};

namespace {

constexpr uint32_t kPage = 16;

// A random tree over n new tokens (each sees its parent's ancestors and itself), rows of
// ceil(n / 8) bytes; adds the positions each row sees among the new tokens to *seen.
std::vector<uint8_t> tree_mask(Env &e, uint32_t n, uint64_t *seen) {
  const uint32_t rb = (n + 7) / 8;
  std::vector<uint8_t> m(size_t(n) * rb, 0);
  for (uint32_t i = 0; i < n; i++) {
    uint8_t *row = &m[size_t(i) * rb];
    if (i > 0) std::copy_n(&m[size_t(e.rng.next() % i) * rb], rb, row);
    row[i / 8] |= uint8_t(1u << (i % 8));
    for (uint32_t b = 0; b < rb; b++) *seen += uint64_t(__builtin_popcount(row[b]));
  }
  return m;
}

} // namespace

ExtendResult measure_extend(Env &e, const ExtendItem &it, const Shape &s, const Formats &f) {
  ExtendResult r;
  r.item = &it;
  r.id = strf("extend-%s/%s/%s", it.name, s.name, f.name);
  measure_row(r, [&] {
    PoolGuard pool;
    const uint32_t length = it.cached + it.fresh;
    const uint64_t seq_pages = (length + kPage - 1) / kPage;
    make_pool(e, pool, s, f.k, f.v, kPage, uint64_t(it.count + 1) * seq_pages, it.count + 1, length, kPagedSeed);
    std::vector<pkv_seq> seqs(it.count);
    const size_t row_vals = size_t(s.hkv) * s.d;
    pkv_seq prefix{};
    if (it.prefix) {
      check(pkv_seq_alloc(pool.p, &prefix), "pkv_seq_alloc");
      fill_seq(e, pool.p, prefix, it.cached, row_vals);
    }
    for (pkv_seq &x : seqs) {
      if (it.prefix) check(pkv_seq_fork(pool.p, prefix, &x), "pkv_seq_fork");
      else {
        check(pkv_seq_alloc(pool.p, &x), "pkv_seq_alloc");
        fill_seq(e, pool.p, x, it.cached, row_vals);
      }
      fill_seq(e, pool.p, x, it.fresh, row_vals);
    }

    // Causal: query i of a sequence sees cached + i + 1 positions; a tree row its own count.
    std::vector<uint32_t> offsets(it.count + 1);
    std::vector<uint64_t> mask_offsets(it.count);
    std::vector<uint8_t> mask;
    uint64_t seen = 0;
    for (uint32_t b = 0; b < it.count; b++) {
      offsets[b + 1] = offsets[b] + it.fresh;
      seen += uint64_t(it.fresh) * it.cached;
      if (!it.tree) {
        seen += uint64_t(it.fresh) * (it.fresh + 1) / 2;
        continue;
      }
      mask_offsets[b] = mask.size();
      const std::vector<uint8_t> m = tree_mask(e, it.fresh, &seen);
      mask.insert(mask.end(), m.begin(), m.end());
    }
    r.flops = 4.0 * s.hq * s.d * double(seen);

    const pkv_format io = io_format(f);
    const size_t values = size_t(offsets[it.count]) * s.hq * s.d;
    std::vector<uint16_t> q = random_values(e, io, values), out(values);
    pkv_extend_args a = PKV_EXTEND_ARGS_INIT;
    a.seqs = seqs.data();
    a.count = it.count;
    a.q_heads = s.hq;
    a.q_offsets = offsets.data();
    a.q_format = io;
    a.out_format = io;
    a.q = q.data();
    a.out = out.data();
    if (it.tree) {
      a.mask = mask.data();
      a.mask_offsets = mask_offsets.data();
      a.mask_bytes = mask.size();
    }
    // On a GPU q and out live on the device, as an engine's do, and events on the bench's stream time
    // the call: host copies of a long prompt's q and out would weigh as much as its attention.
    BenchDevice *dev = e.dev.get();
    void *dev_q = nullptr, *dev_out = nullptr;
    if (dev) {
      dev_q = dev->copy_of(q.data(), q.size() * 2);
      dev_out = dev->alloc(out.size() * 2);
      a.memory = PKV_MEMORY_DEVICE;
      a.q = dev_q;
      a.out = dev_out;
    }
    std::vector<double> t;
    const uint32_t iters = std::max<uint32_t>(3, e.iters / 5);
    for (uint32_t i = 0; i <= iters; i++) { // the first call warms the workers' buffers (not counted)
      double us;
      if (dev) {
        dev->start();
        check(pkv_extend(pool.p, &a), "pkv_extend");
        us = dev->stop_us();
      } else {
        auto t0 = Clock::now();
        check(pkv_extend(pool.p, &a), "pkv_extend");
        check(pkv_context_synchronize(e.ctx), "pkv_context_synchronize");
        us = us_since(t0);
      }
      if (i > 0) t.push_back(us);
    }
    pool.close();
    if (dev) dev->release(dev_q), dev->release(dev_out);
    r.us = median(t);
    r.tflops = r.flops / r.us / 1e6;
  });
  return r;
}

} // namespace bench
