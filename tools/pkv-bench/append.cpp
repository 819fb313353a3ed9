// Append throughput (measure.hpp): pkv_write of host F16 rows into their pages, per step of a
// batch and per prefill chunk, against a plain copy of the same source bytes from host memory (pinned,
// on a GPU) into device memory measured in the same run.
#include "measure.hpp"
#include "plain_copy.hpp"
#include "pools.hpp"

#include <algorithm>
#include <cstring>

namespace bench {

std::vector<AppendItem> append_items() {
  std::vector<AppendItem> items;
  for (pkv_format f : {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16, PKV_FORMAT_Q8_0, PKV_FORMAT_Q4_0,
                       PKV_FORMAT_FP8_E4M3})
    for (bool prefill : {false, true}) items.push_back({f, prefill});
  return items;
}

std::string append_id(const AppendItem &it) {
  return strf("append-%s/%s/%s", it.prefill ? "prefill4K" : "step128", kShapes[0].name, pkv_format_name(it.fmt));
}

AppendResult measure_append(Env &e, const AppendItem &it) {
  const Shape &s = kShapes[0];
  const pkv_format fmt = it.fmt;
  const bool prefill = it.prefill;
  AppendResult r;
  r.fmt = fmt;
  r.rows = prefill ? 4096 : 128;
  r.id = append_id(it);
  uint32_t nseq = prefill ? 1 : 128, steps = prefill ? std::max<uint32_t>(10, e.iters / 2) : 4 * e.iters;
  uint32_t warm = prefill ? 2 : 10;
  size_t row_vals = (size_t)s.hkv * s.d;
  measure_row(r, [&] {
    PoolGuard pool;
    uint64_t pages = prefill ? (4096 / 16 + 1) : (uint64_t)nseq * ((warm + steps) / 16 + 1);
    make_pool(e, pool, s, fmt, fmt, 16, pages, nseq, prefill ? 4096 : warm + steps, kPagedSeed);
    std::vector<pkv_seq> seqs(nseq);
    for (pkv_seq &q : seqs) check(pkv_seq_alloc(pool.p, &q), "pkv_seq_alloc");
    std::vector<uint32_t> n_new(nseq, prefill ? 4096 : 1);
    std::vector<double> t;
    // Steps walk into pages no call has written; on the CPU a page's first write faults its memory
    // in (the system zeroes it), a cost a serving pool pays once. So the steps run twice, the first
    // time untimed, the sequences emptied between (a prefill rewrites the same pages every chunk).
    for (uint32_t i = prefill ? warm + steps : 0; i < 2 * (warm + steps); i++) {
      if (i == warm + steps)
        for (pkv_seq q : seqs) check(pkv_seq_truncate(pool.p, q, 0), "pkv_seq_truncate");
      if (prefill) check(pkv_seq_truncate(pool.p, seqs[0], 0), "pkv_seq_truncate");
      check(pkv_append(pool.p, seqs.data(), n_new.data(), nseq), "pkv_append");
      size_t span = e.bank.size() - r.rows * row_vals + 1;
      pkv_write_args w = PKV_WRITE_ARGS_INIT;
      w.seqs = seqs.data();
      w.n_tokens = n_new.data();
      w.count = nseq;
      w.src_format = PKV_FORMAT_F16;
      w.memory = PKV_MEMORY_HOST;
      w.k = e.bank.data() + e.rng.next() % span;
      w.v = e.bank.data() + e.rng.next() % span;
      auto t0 = Clock::now();
      check(pkv_write(pool.p, &w), "pkv_write");
      check(pkv_context_synchronize(e.ctx), "pkv_context_synchronize");
      if (i >= 2 * warm + steps) t.push_back(us_since(t0));
    }
    pool.close();
    const size_t src_bytes = r.rows * row_vals * 2 * 2; // K and V, 2 bytes a value
    Buffer src(e, false, src_bytes), dst(e, true, src_bytes);
    std::memcpy(src.ptr, e.bank.data(), std::min(src_bytes, e.bank.size() * 2));
    r.copy_us = plain_copy_us(e, dst, src, std::max<uint32_t>(10, e.iters));
    r.us = median(t);
    r.rows_per_s = r.rows / (r.us * 1e-6);
    r.src_gbs = double(src_bytes) / r.us / 1e3;
    r.page_gbs = (double)r.rows * token_bytes(s, fmt, fmt) / r.us / 1e3;
    r.copy_gbs = double(src_bytes) / r.copy_us / 1e3;
  });
  return r;
}

} // namespace bench
