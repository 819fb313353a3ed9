// Decode measurement: the paged pool against a contiguous, padded baseline of the same batch.
#include "measure.hpp"
#include "pools.hpp"

#include <algorithm>
#include <cmath>
#include <new>

namespace bench {

namespace {

// Layers of a batch of `bytes` (per layer) that make up at least --rotate-mb (at most 64).
uint32_t copies_for(const Env &e, uint64_t bytes) {
  return (uint32_t)std::min<uint64_t>(64, std::max<uint64_t>(1, (e.rotate_bytes + bytes - 1) / bytes));
}

// A pool of `copies` layers holding one batch (sequences filled one at a time), and one decode call
// (pkv_decode + pkv_context_synchronize) of a layer. Calls rotate over the layers, as an engine's
// step does, so caches do not flatter the result and the plan is made once per batch.
struct DecodePool {
  PoolGuard pool;
  std::vector<pkv_seq> seqs;
  std::vector<uint16_t> q, out;
  std::vector<float> sinks, slopes; // Variant::scores
  BenchDevice *dev = nullptr; // q, out, sinks and slopes live on it when set, as an engine's would
  void *dev_q = nullptr, *dev_out = nullptr, *dev_sinks = nullptr, *dev_slopes = nullptr;

  DecodePool() = default;
  DecodePool(const DecodePool &) = delete;
  DecodePool &operator=(const DecodePool &) = delete;
  ~DecodePool() {
    if (!dev) return;
    dev->release(dev_q);
    dev->release(dev_out);
    dev->release(dev_sinks);
    dev->release(dev_slopes);
  }
  pkv_decode_args args = PKV_DECODE_ARGS_INIT;
  uint32_t b = 0, copies = 0;
  uint64_t bytes = 0; // the pool's size

  void build(Env &e, const Workload &w, const std::vector<uint32_t> &lens, uint32_t n_copies, uint32_t seed,
             uint64_t reserved, uint32_t chunk_pages, Variant variant) {
    const Shape &s = *w.shape;
    b = (uint32_t)lens.size();
    copies = n_copies;
    uint64_t pages = 0;
    for (uint32_t l : lens) pages += (l + w.page - 1) / w.page;
    bytes = pool_bytes(e, s, *w.fmt, w.page, pages * copies, reserved);
    uint32_t longest = *std::max_element(lens.begin(), lens.end());
    make_pool(e, pool, s, w.fmt->k, w.fmt->v, w.page, pages, b, longest, seed, copies);
    seqs.resize(b);
    for (pkv_seq &x : seqs) check(pkv_seq_alloc(pool.p, &x), "pkv_seq_alloc");

    pkv_format io = io_format(*w.fmt);
    size_t qn = (size_t)b * w.qtok * s.hq * s.d;
    q = random_values(e, io, qn);
    out.assign(qn, 0);
    args.count = b;
    args.q_heads = s.hq;
    args.q_tokens = w.qtok;
    args.q_format = io;
    args.out_format = io;
    args.chunk_pages = chunk_pages;
    args.memory = PKV_MEMORY_HOST;
    args.q = q.data();
    args.out = out.data();
    if (variant == Variant::scores) {
      // Gemma 2's cap; ALiBi's geometric slopes 2^(-8 h / H); sinks as a model's learned logits.
      args.softcap = 50.0f;
      for (uint32_t h = 0; h < s.hq; h++) {
        slopes.push_back(std::exp2(-8.0f * float(h + 1) / float(s.hq)));
        sinks.push_back(float(h % 5) - 2.0f);
      }
      args.sinks = sinks.data();
      args.alibi_slopes = slopes.data();
    }
    if (variant == Variant::window4K) args.window = kBenchWindow;
    if (e.dev) {
      dev = e.dev.get();
      dev_q = dev->copy_of(q.data(), q.size() * 2);
      dev_out = dev->alloc(out.size() * 2);
      args.memory = PKV_MEMORY_DEVICE;
      args.q = dev_q;
      args.out = dev_out;
      if (!sinks.empty()) {
        dev_sinks = dev->copy_of(sinks.data(), sinks.size() * 4);
        dev_slopes = dev->copy_of(slopes.data(), slopes.size() * 4);
        args.sinks = static_cast<const float *>(dev_sinks);
        args.alibi_slopes = static_cast<const float *>(dev_slopes);
      }
    }
    call(e, 0); // on the empty sequences: an unsupported call is reported before the fill
    for (size_t i = 0; i < seqs.size(); i++) fill_seq(e, pool.p, seqs[i], lens[i], (size_t)s.hkv * s.d, copies);
  }

  double call(Env &e, uint32_t i) { // microseconds
    args.seqs = seqs.data();
    args.layer = i % copies;
    if (dev) { // device time on the bench's stream: the call's upload, kernels and any gap between them
      dev->start();
      check(pkv_decode(pool.p, &args), "pkv_decode");
      return dev->stop_us();
    }
    auto t0 = Clock::now();
    check(pkv_decode(pool.p, &args), "pkv_decode");
    check(pkv_context_synchronize(e.ctx), "pkv_context_synchronize");
    return us_since(t0);
  }
};

} // namespace

// The paged pool and the baseline pool are built side by side and their calls interleaved, so a
// disturbance during the run (another process, clock changes) touches both alike. A row with
// attention variants has the plain decode of the same paged batch for its baseline; a window's
// bytes are those its queries see.
DecodeResult measure_decode(Env &e, const Workload &w) {
  DecodeResult r;
  r.w = &w;
  uint64_t per_token = token_bytes(*w.shape, w.fmt->k, w.fmt->v);
  uint32_t longest = *std::max_element(w.lens.begin(), w.lens.end());
  const bool variant = w.variant != Variant::none;
  r.bytes = r.base_bytes = sum_of(w.lens) * per_token;
  if (w.variant == Variant::window4K) {
    r.bytes = 0;
    for (uint32_t l : w.lens) r.bytes += std::min(l, kBenchWindow) * per_token;
  }
  if (!variant) r.base_bytes = (uint64_t)w.lens.size() * longest * per_token;
  measure_row(r, [&] {
    const uint64_t pool_bytes = sum_of(w.lens) * per_token; // a window's pool holds every position
    if (pool_bytes > 40000000000ull) throw Skipped("over 40 GB of K/V");
    r.copies = copies_for(e, pool_bytes);
    DecodePool paged, base;
    paged.build(e, w, w.lens, r.copies, kPagedSeed, 0, e.chunk_pages, w.variant);
    try { // baseline: every sequence padded to the longest, identity page order, contiguous
      r.base_copies = copies_for(e, r.base_bytes);
      // The planner's split: a forced one (--chunk-pages) is compared against the reference.
      if (variant) base.build(e, w, w.lens, r.base_copies, kPagedSeed, paged.bytes, e.chunk_pages, Variant::none);
      else base.build(e, w, std::vector<uint32_t>(w.lens.size(), longest), r.base_copies, 0, paged.bytes, 0, Variant::none);
    } catch (const Skipped &x) {
      r.base_reason = x.what();
      base.pool.close();
    }
    bool with_base = r.base_reason.empty();
    uint32_t warm = std::max<uint32_t>(std::max(r.copies, r.base_copies), 5);
    for (uint32_t i = 0; i < warm; i++) {
      paged.call(e, i);
      if (with_base) base.call(e, i);
    }
    std::vector<double> tp, tbase;
    for (uint32_t i = warm; i < warm + e.iters; i++) {
      tp.push_back(paged.call(e, i));
      if (with_base) tbase.push_back(base.call(e, i));
    }
    paged.pool.close();
    if (with_base) base.pool.close();
    r.us = median(tp);
    r.min_us = *std::min_element(tp.begin(), tp.end());
    r.gbs = (double)r.bytes / r.us / 1e3;
    r.pct = e.bw_gbs > 0 ? 100.0 * r.gbs / e.bw_gbs : 0;
    if (with_base) {
      r.base_us = median(tbase);
      r.ratio = r.base_us / r.us;
    }
  });
  return r;
}

} // namespace bench
