// Sequence images (measure.hpp): pkv_seq_export and pkv_seq_import of one long sequence of every
// layer, into and out of host memory (pinned, on a GPU) and device memory, each against a plain copy
// of the same bytes in the same direction measured in the same run.
#include "measure.hpp"
#include "plain_copy.hpp"
#include "pools.hpp"

#include <algorithm>

namespace bench {

const TransferItem kTransfers[4] = {
    {"export", "host", false, true}, {"import", "host", false, false},
    {"export", "device", true, true}, {"import", "device", true, false},
};

namespace {

constexpr uint32_t kLayers = 32, kPage = 16;

} // namespace

TransferResult measure_transfer(Env &e, const TransferItem &it, const Formats &f, uint32_t tokens) {
  const Shape &s = kShapes[0];
  TransferResult r;
  r.item = &it;
  r.id = strf("%s-%s/%s/%s/%uK", it.op, it.where, s.name, f.name, tokens / 1024);
  measure_row(r, [&] {
    PoolGuard pool;
    const uint64_t payload = uint64_t(tokens) * kLayers * token_bytes(s, f.k, f.v);
    if (e.mem_avail && 3 * payload > e.mem_avail)
      throw Skipped(strf("needs %.1f GB, %.1f GB available", 3 * payload / 1e9, e.mem_avail / 1e9));
    make_pool(e, pool, s, f.k, f.v, kPage, tokens / kPage, 1, tokens, kPagedSeed, kLayers);
    pkv_seq seq;
    check(pkv_seq_alloc(pool.p, &seq), "pkv_seq_alloc");
    fill_seq(e, pool.p, seq, tokens, (size_t)s.hkv * s.d, kLayers);
    pkv_export_args a = PKV_EXPORT_ARGS_INIT;
    a.seq = seq;
    check(pkv_seq_export_size(pool.p, &a, &r.bytes), "pkv_seq_export_size");
    Buffer image(e, it.device, r.bytes), plain(e, true, r.bytes);
    a.memory = image.memory();
    a.image = image.ptr;
    a.image_bytes = r.bytes;
    const uint32_t iters = std::max<uint32_t>(3, e.iters / 10);
    check(pkv_seq_export(pool.p, &a), "pkv_seq_export");
    check(pkv_context_synchronize(e.ctx), "pkv_context_synchronize");
    if (it.to_image) {
      r.us = time_us(e, iters, [&] { check(pkv_seq_export(pool.p, &a), "pkv_seq_export"); });
    } else {
      pkv_import_args in = PKV_IMPORT_ARGS_INIT;
      in.memory = a.memory;
      in.image = a.image;
      in.image_bytes = r.bytes;
      // Each import takes the pages the sequence before it gave back (not timed).
      r.us = time_us(e, iters, [&] {
        check(pkv_seq_free(pool.p, seq), "pkv_seq_free");
        check(pkv_seq_import(pool.p, &in, &seq), "pkv_seq_import");
      });
    }
    pool.close();
    // The plain copy: the same bytes between device memory and the image's memory, in the same
    // direction (on the CPU, one host buffer into another).
    r.copy_us = it.to_image ? plain_copy_us(e, image, plain, iters) : plain_copy_us(e, plain, image, iters);
    r.gbs = r.bytes / r.us / 1e3;
    r.copy_gbs = r.bytes / r.copy_us / 1e3;
    r.pct = 100.0 * r.gbs / r.copy_gbs;
  });
  return r;
}

} // namespace bench
