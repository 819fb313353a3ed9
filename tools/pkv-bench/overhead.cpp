// Host overhead (measure.hpp): the host time of one call of each kind, timed in blocks of many calls.
#include "measure.hpp"
#include "pools.hpp"

#include <algorithm>

namespace bench {

const OverheadItem kOverhead[7] = {
    {"overhead/alloc+free", "pkv_seq_alloc + pkv_seq_free pair", "ns"},
    {"overhead/append1", "pkv_append of 1 token to a warm sequence", "ns"},
    {"overhead/truncate1", "pkv_seq_truncate by 1 token", "ns"},
    {"overhead/decode-tiny", "pkv_decode, 1 sequence of 16 tokens, same batch each call", "us"},
    {"overhead/decode-tiny-alternating", "pkv_decode, 1 sequence of 16 tokens, alternating 2 batches", "us"},
    {"overhead/decode-async", "pkv_decode alone (no synchronize), 8 sequences of 16 tokens, same batch each call",
     "us"},
    {"overhead/decode-async-alternating",
     "pkv_decode alone (no synchronize), 8 sequences of 16 tokens, alternating 2 batches (a new plan each call)", "us"},
};

namespace {

// Microseconds per op: the median over `blocks` blocks of `ops` calls, each block after setup().
template <class Setup, class Op>
double per_op(uint32_t blocks, uint32_t ops, Setup setup, Op op) {
  std::vector<double> t;
  for (uint32_t b = 0; b < blocks; b++) {
    setup();
    auto t0 = Clock::now();
    for (uint32_t i = 0; i < ops; i++) op(i);
    t.push_back(us_since(t0) / ops);
  }
  return median(t);
}

} // namespace

std::vector<OverheadResult> measure_overhead(Env &e, const std::string &filter) {
  const Shape &s = kShapes[0];
  std::vector<OverheadResult> out;
  const uint32_t ops = 1000, blocks = std::max<uint32_t>(20, e.iters);
  const uint32_t warm_len = 256;
  for (const OverheadItem &it : kOverhead) {
    OverheadResult r;
    r.id = it.id;
    r.what = it.what;
    r.unit = it.unit;
    if (!filter.empty() && r.id.find(filter) == std::string::npos) continue;
    measure_row(r, [&] {
      PoolGuard pool;
      make_pool(e, pool, s, PKV_FORMAT_F16, PKV_FORMAT_F16, 16, (warm_len + 2 * ops) / 16 + 4, 64, warm_len + 2 * ops,
                kPagedSeed);
      pkv_seq seq{0};
      check(pkv_seq_alloc(pool.p, &seq), "pkv_seq_alloc");
      uint32_t one = 1;
      if (r.id == "overhead/alloc+free") {
        r.value = 1e3 * per_op(blocks, ops, [] {}, [&](uint32_t) {
          pkv_seq x;
          check(pkv_seq_alloc(pool.p, &x), "pkv_seq_alloc");
          check(pkv_seq_free(pool.p, x), "pkv_seq_free");
        });
      } else if (r.id == "overhead/append1") {
        check(pkv_append(pool.p, &seq, &warm_len, 1), "pkv_append");
        r.value = 1e3 * per_op(blocks, ops, [&] { check(pkv_seq_truncate(pool.p, seq, warm_len), "pkv_seq_truncate"); },
                               [&](uint32_t) { check(pkv_append(pool.p, &seq, &one, 1), "pkv_append"); });
      } else if (r.id == "overhead/truncate1") {
        uint32_t top = warm_len + ops;
        check(pkv_append(pool.p, &seq, &top, 1), "pkv_append");
        r.value = 1e3 * per_op(blocks, ops, [&] {
          uint32_t len = 0;
          check(pkv_seq_length(pool.p, seq, &len), "pkv_seq_length");
          uint32_t add = top - len;
          if (add) check(pkv_append(pool.p, &seq, &add, 1), "pkv_append");
        }, [&](uint32_t i) { check(pkv_seq_truncate(pool.p, seq, top - 1 - i), "pkv_seq_truncate"); });
      } else {
        // decode-tiny: a call and its wait, q and out in host memory. decode-async: the host time of
        // the call alone, as an engine without graphs pays it each layer, q and out in device memory
        // on a GPU (the stream runs behind; each block of calls starts on an idle one). On the CPU
        // backend a decode is done when the call returns, so both time the same.
        const bool alternate = r.id.find("alternating") != std::string::npos;
        const bool async = r.id.find("async") != std::string::npos;
        const uint32_t count = async ? 8 : 1;
        std::vector<pkv_seq> batches[2];
        for (std::vector<pkv_seq> &b : batches)
          for (uint32_t k = 0; k < count; k++) {
            pkv_seq x;
            check(pkv_seq_alloc(pool.p, &x), "pkv_seq_alloc");
            fill_seq(e, pool.p, x, 16, (size_t)s.hkv * s.d);
            b.push_back(x);
          }
        const size_t qn = (size_t)count * s.hq * s.d;
        std::vector<uint16_t> q = random_values(e, PKV_FORMAT_F16, qn), o(qn);
        pkv_decode_args a = PKV_DECODE_ARGS_INIT;
        a.count = count;
        a.q_heads = s.hq;
        a.q_format = a.out_format = PKV_FORMAT_F16;
        a.q = q.data();
        a.out = o.data();
        void *dev_q = nullptr, *dev_out = nullptr;
        if (async && e.dev) {
          dev_q = e.dev->copy_of(q.data(), qn * 2);
          dev_out = e.dev->alloc(qn * 2);
          a.memory = PKV_MEMORY_DEVICE;
          a.q = dev_q;
          a.out = dev_out;
        }
        auto wait = [&] { check(pkv_context_synchronize(e.ctx), "pkv_context_synchronize"); };
        auto call = [&](uint32_t i) {
          a.seqs = batches[alternate ? i & 1 : 0].data();
          check(pkv_decode(pool.p, &a), "pkv_decode");
          if (!async) wait();
        };
        for (uint32_t i = 0; i < 10; i++) call(i);
        wait();
        r.value = per_op(blocks, 100, wait, call);
        wait();
        if (dev_q) e.dev->release(dev_q), e.dev->release(dev_out);
      }
      pool.close();
    });
    out.push_back(r);
  }
  return out;
}

} // namespace bench
