#include "cpu_backend.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../error.hpp"
#include "../fault.hpp"
#include "../seq_image.hpp"
#include "cpu_attention.hpp"
#include "cpu_extend.hpp"
#include "../worker_pool.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pkv {

namespace {

constexpr uint32_t kRowsPerItem = 64; // rows one scatter/gather work item converts
constexpr uint32_t kScatterAhead = 4;  // a scatter asks for the lines of the row this far ahead
constexpr uint64_t kImageBytesPerItem = 1 << 20; // payload one export/import work item copies
constexpr uint32_t kPlanWorkers = 32;             // the threads a decode plan is cut for

// Asks for the lines a row of `head` at `slot` will be written to: a step's rows go to as many
// pages, mostly out of the caches, and each row's stores would otherwise wait for its lines in turn
// (docs/perf/decisions.md).
void prefetch_for_write(const PlaneLayout &l, uint8_t *part, uint32_t head, uint32_t slot) {
  const uint8_t *row = part + l.data_at(head, slot);
  for (uint32_t o = 0; o < l.row_data_bytes; o += 64) __builtin_prefetch(row + o, 1, 3);
  if (l.row_scale_bytes) __builtin_prefetch(part + l.scale_at(head, slot), 1, 3);
}

// Asks Linux for 2 MB pages over the whole 2 MB spans of a fresh allocation (where transparent huge
// pages are on only for memory that asks): a decode reads a pool's pages in table order, a few KB a
// page, and with 4 KB pages each of those costs a TLB miss.
void ask_huge_pages(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (uintptr_t(p) + kHuge - 1) & ~(kHuge - 1), end = (uintptr_t(p) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void *>(begin), end - begin, MADV_HUGEPAGE); // advice: failure is harmless
#else
  (void)p, (void)bytes;
#endif
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(uint32_t threads, AttendKernel attend)
      : attend_(attend), workers_(threads), scratch_(workers_.threads()), row_(workers_.threads()) {}

  pkv_backend kind() const override { return PKV_BACKEND_CPU; }
  // Plans for kPlanWorkers threads whatever the context has, so that a decode's chunks, and with them
  // its result's bits, are the same for any thread count; every thread at the full rate; an item
  // costs a thread hand-off: worth it for a few hundred tokens.
  DecodeConfig decode_config(const PoolGeometry &, uint32_t) override {
    DecodeConfig c;
    c.plan.workers = c.plan.full_rate_workers = kPlanWorkers;
    c.plan.fixed_cost_tokens = 256;
    return c;
  }

  // calloc keeps never-written slots at zero (and cheap: the OS zeroes pages lazily); the block is
  // over-allocated so the pool can start 64-byte aligned like a device allocation.
  DevPtr alloc(uint64_t bytes) override {
    if (bytes > std::numeric_limits<size_t>::max() - 64) fail(PKV_ERR_OUT_OF_MEMORY, "%llu bytes", (unsigned long long)bytes);
    void *raw = fault::fails(fault::Kind::host_alloc) ? nullptr : std::calloc(size_t(bytes) + 64, 1);
    if (!raw) fail(PKV_ERR_OUT_OF_MEMORY, "could not allocate %llu bytes of host memory", (unsigned long long)bytes);
    const DevPtr aligned = (DevPtr(uintptr_t(raw)) + 63) & ~DevPtr(63);
    ask_huge_pages(raw, size_t(bytes) + 64);
    try {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_[aligned] = raw;
    } catch (...) { // the block's bookkeeping failed: the block goes back rather than leak
      std::free(raw);
      throw;
    }
    return aligned;
  }

  void release(DevPtr ptr) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) return;
    std::free(it->second);
    blocks_.erase(it);
  }

  void write_device(DevPtr dst, const void *src, uint64_t bytes) override {
    std::memcpy(host(dst), src, size_t(bytes));
  }

  void copy_pages(const PoolGeometry &g, const PageCopy *copies, uint32_t n) override {
    for (uint32_t i = 0; i < n; i++)
      for (uint32_t layer = 0; layer < g.layers; layer++)
        std::memcpy(host(g.k_part(layer, copies[i].dst)), host(g.k_part(layer, copies[i].src)), g.block_bytes);
  }

  void scatter(const PoolGeometry &g, const ScatterArgs &a) override {
    apply(g, a.table);
    for_rows(g, a, [&](uint32_t r, float *row, size_t stride) {
      if (r + kScatterAhead < a.rows) {
        const RowSlot ahead = a.slots[r + kScatterAhead];
        for (uint32_t h = 0; h < g.kv_heads; h++) {
          prefetch_for_write(g.k, host(g.k_part(a.layer, ahead.page)), h, ahead.slot);
          prefetch_for_write(g.v, host(g.v_part(a.layer, ahead.page)), h, ahead.slot);
        }
      }
      for (uint32_t h = 0; h < g.kv_heads; h++) {
        const RowSlot at = a.slots[r];
        load_io(a.format, static_cast<const uint8_t *>(a.k) + stride * (size_t(r) * g.kv_heads + h), g.head_dim, row);
        encode_row(g.k, host(g.k_part(a.layer, at.page)), h, at.slot, plane_scale(g, false, a.layer, h), row);
        load_io(a.format, static_cast<const uint8_t *>(a.v) + stride * (size_t(r) * g.kv_heads + h), g.head_dim, row);
        encode_row(g.v, host(g.v_part(a.layer, at.page)), h, at.slot, plane_scale(g, true, a.layer, h), row);
      }
    });
  }

  void gather(const PoolGeometry &g, const GatherArgs &a) override {
    apply(g, a.table);
    for_rows(g, a, [&](uint32_t r, float *row, size_t stride) {
      for (uint32_t h = 0; h < g.kv_heads; h++) {
        const RowSlot at = a.slots[r];
        const size_t offset = stride * (size_t(r) * g.kv_heads + h);
        if (a.k) {
          decode_row(g.k, host(g.k_part(a.layer, at.page)), h, at.slot, plane_scale(g, false, a.layer, h), row);
          store_io(a.format, row, g.head_dim, static_cast<uint8_t *>(a.k) + offset);
        }
        if (a.v) {
          decode_row(g.v, host(g.v_part(a.layer, at.page)), h, at.slot, plane_scale(g, true, a.layer, h), row);
          store_io(a.format, row, g.head_dim, static_cast<uint8_t *>(a.v) + offset);
        }
      }
    });
  }

  void prepare_decode(const PoolGeometry &g, const DecodeBatch &b) override { apply(g, b.table); }
  void prepare_extend(const PoolGeometry &g, const ExtendBatch &b) override { apply(g, b.table); }

  void decode(const PoolGeometry &g, const DecodeBatch &b) override {
    apply(g, b.table);
    const DecodePlan &plan = *b.plan;
    const uint32_t D = g.head_dim, rows = b.q_tokens * (b.q_heads / g.kv_heads);
    const size_t items = size_t(plan.chunks()) * g.kv_heads;
    part_out_.resize(items * rows * D);
    part_lse_.resize(items * rows);
    const uint32_t group = b.q_heads / g.kv_heads;
    workers_.run(uint32_t(items), [&](uint32_t item, uint32_t worker) {
      const PlanRecord &c = plan.chunk(item / g.kv_heads);
      const uint32_t h = item % g.kv_heads;
      AttendScratch &sc = scratch_[worker];
      load_queries(g, b.q_format, b.q, uint64_t(c.seq) * b.q_tokens, b.q_tokens, b.q_heads, h, sc.q);
      // Query token t, at position length - q_tokens + t, sees its window up to itself.
      sc.views.resize(b.q_tokens);
      for (uint32_t t = 0; t < b.q_tokens; t++) {
        const uint64_t at = uint64_t(b.lengths[c.seq]) - b.q_tokens + t;
        sc.views[t] = {b.variants.first_seen(at), at + 1, nullptr, 0};
      }
      const uint64_t start = c.start; // the chunk's range counts from the window's first page
      attend_.run({&g, b.layer, h, page_row(g, b.seq_slots[c.seq]), start + c.token_begin, start + c.token_end,
                   b.q_tokens, group, sc.q.data(), sc.views.data(), b.scale, b.variants.softcap,
                   b.variants.slopes ? b.variants.slopes + size_t(h) * group : nullptr,
                   &part_out_[size_t(item) * rows * D], &part_lse_[size_t(item) * rows], &sc});
    });
    workers_.run(b.count, [&](uint32_t s, uint32_t worker) { merge(g, b, part_out_, part_lse_, s, row_[worker]); });
  }

  // Items (block of new tokens, KV head), the costliest blocks first; no split along the positions:
  // each item attends over all its rows see, and writes its rows of out and lse itself.
  void extend(const PoolGeometry &g, const ExtendBatch &b) override {
    apply(g, b.table);
    make_extend_blocks(g, b, &extend_blocks_);
    const uint64_t items = uint64_t(extend_blocks_.size()) * g.kv_heads; // at most the call's query rows
    workers_.run(uint32_t(items), [&](uint32_t item, uint32_t worker) {
      extend_block(g, b, extend_blocks_[item / g.kv_heads], item % g.kv_heads, attend_, scratch_[worker]);
    });
  }

  void export_image(const PoolGeometry &g, const ExportArgs &a) override {
    auto *image = static_cast<uint8_t *>(a.image);
    std::memcpy(image, a.header, kImageHeaderBytes);
    const uint64_t sum = for_blocks(g, a, image + kImageHeaderBytes, [](uint8_t *pool, uint8_t *payload, uint64_t n) {
      std::memcpy(payload, pool, n);
    });
    set_payload_checksum(image, sum);
  }

  uint64_t import_image(const PoolGeometry &g, const ImportArgs &a) override {
    return for_blocks(g, a, static_cast<const uint8_t *>(a.payload),
                      [](uint8_t *pool, const uint8_t *payload, uint64_t n) { std::memcpy(pool, payload, n); });
  }

  void read_caller(void *dst, const void *src, pkv_memory, uint64_t bytes) override {
    std::memcpy(dst, src, size_t(bytes));
  }

  void synchronize() override {}

  // Each worker sums its share of a buffer of non-zero words; the sums are kept so the reads stay.
  double read_bandwidth(uint64_t bytes) override {
    if (bytes / 8 > std::vector<uint64_t>().max_size())
      fail(PKV_ERR_OUT_OF_MEMORY, "a buffer of %llu bytes cannot be allocated on this host", (unsigned long long)bytes);
    const size_t words = size_t(std::max<uint64_t>(bytes ? bytes : kDefaultBandwidthBytes, 1 << 20) / 8);
    std::vector<uint64_t> buffer(words);
    for (size_t i = 0; i < words; i++) buffer[i] = i * 0x9E3779B97F4A7C15ull + 1;
    const uint32_t parts = workers_.threads();
    std::vector<uint64_t> sums(parts);
    double best = 0.0;
    for (int pass = 0; pass < 5; pass++) {
      const auto t0 = std::chrono::steady_clock::now();
      workers_.run(parts, [&](uint32_t part, uint32_t) {
        const size_t begin = words * part / parts, end = words * (part + 1) / parts;
        uint64_t s[4] = {0, 0, 0, 0};
        for (size_t i = begin; i + 4 <= end; i += 4)
          for (int j = 0; j < 4; j++) s[j] += buffer[i + j];
        sums[part] += s[0] ^ s[1] ^ s[2] ^ s[3];
      });
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, double(words) * 8 / seconds / 1e9);
    }
    if (std::find(sums.begin(), sums.end(), 0) != sums.end()) bandwidth_sink_ = sums[0];
    return best;
  }

 private:
  static void apply(const PoolGeometry &g, const TableUpdates &t) {
    auto *table = reinterpret_cast<uint32_t *>(host(g.table));
    for (uint32_t i = 0; i < t.count; i++)
      table[size_t(t.entries[i].seq_slot) * g.table_stride + t.entries[i].index] = t.entries[i].page;
  }

  // Calls fn(row, scratch, bytes per row of one head) for every row, spread over the workers.
  template <class Fn> void for_rows(const PoolGeometry &g, const RowTransfer &a, Fn fn) {
    const size_t stride = size_t(g.head_dim) * io_elem_bytes(a.format);
    const uint32_t items = uint32_t((uint64_t(a.rows) + kRowsPerItem - 1) / kRowsPerItem); // rows near 2^32 too
    // Sized here, so that no worker allocates: a scatter whose rows are half written cannot fail.
    for (std::vector<float> &row : row_) row.resize(g.head_dim);
    workers_.run(items, [&](uint32_t item, uint32_t worker) {
      std::vector<float> &row = row_[worker];
      const uint32_t end = uint32_t(std::min<uint64_t>(a.rows, (uint64_t(item) + 1) * kRowsPerItem));
      for (uint32_t r = item * kRowsPerItem; r < end; r++) fn(r, row.data(), stride);
    });
  }

  // Calls copy(pool block, payload block, block_bytes) for every block of an image's payload and
  // returns the payload's checksum, the blocks spread over the workers.
  template <class Byte, class Copy>
  uint64_t for_blocks(const PoolGeometry &g, const ImageTransfer &a, Byte *payload, Copy copy) {
    const uint64_t blocks = uint64_t(a.layers) * a.count;
    const uint64_t per_item = std::max<uint64_t>(1, kImageBytesPerItem / g.block_bytes);
    const uint64_t items = (blocks + per_item - 1) / per_item;
    if (items > UINT32_MAX) fail(PKV_ERR_INVALID_ARGUMENT, "an image of %llu blocks", (unsigned long long)blocks);
    std::vector<uint64_t> sums(size_t(items), 0); // before any copy: nothing below allocates
    workers_.run(uint32_t(items), [&](uint32_t item, uint32_t) {
      const uint64_t end = std::min(blocks, (item + 1) * per_item);
      for (uint64_t b = item * per_item; b < end; b++) {
        const uint32_t layer = a.first_layer + uint32_t(b / a.count), page = a.pages[b % a.count];
        Byte *block = payload + b * g.block_bytes;
        copy(host(g.k_part(layer, page)), block, g.block_bytes);
        sums[item] += image_checksum(block, g.block_bytes, b * g.block_bytes / 8);
      }
    });
    uint64_t sum = 0;
    for (uint64_t s : sums) sum += s;
    return sum;
  }

  // Combines sequence s's chunk partials through their log-sum-exp, joins the sink once, and writes
  // out and lse. A chunk a row sees nothing of has lse -inf and weighs nothing.
  static void merge(const PoolGeometry &g, const DecodeBatch &b, const std::vector<float> &part_out,
                    const std::vector<float> &part_lse, uint32_t s, std::vector<float> &row) {
    const uint32_t D = g.head_dim, group = b.q_heads / g.kv_heads, rows = b.q_tokens * group;
    const uint32_t c0 = b.plan->seq_chunks[s], c1 = b.plan->seq_chunks[s + 1];
    const size_t out_elem = io_elem_bytes(b.out_format);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    row.resize(D);
    for (uint32_t tok = 0; tok < b.q_tokens; tok++) {
      for (uint32_t qh = 0; qh < b.q_heads; qh++) {
        const uint32_t h = qh / group, r = tok * group + qh % group;
        auto part = [&](uint32_t c) { return (size_t(c) * g.kv_heads + h) * rows + r; };
        float top = neg_inf;
        for (uint32_t c = c0; c < c1; c++) top = std::max(top, part_lse[part(c)]);
        float sum = 0.0f;
        std::fill(row.begin(), row.end(), 0.0f);
        for (uint32_t c = c0; c < c1 && top != neg_inf; c++) {
          const float w = std::exp(part_lse[part(c)] - top);
          const float *o = &part_out[part(c) * D];
          for (uint32_t d = 0; d < D; d++) row[d] += w * o[d];
          sum += w;
        }
        if (sum > 0.0f)
          for (uint32_t d = 0; d < D; d++) row[d] /= sum;
        float lse = sum > 0.0f ? top + std::log(sum) : neg_inf;
        if (b.variants.sinks) add_sink(row.data(), D, &lse, b.variants.sinks[qh]);
        const size_t at = (size_t(s) * b.q_tokens + tok) * b.q_heads + qh;
        store_io(b.out_format, row.data(), D, static_cast<uint8_t *>(b.out) + at * D * out_elem);
        if (b.lse) b.lse[at] = lse;
      }
    }
  }

  static constexpr uint64_t kDefaultBandwidthBytes = 512ull << 20;

  AttendKernel attend_;
  WorkerPool workers_;
  // Kept between calls, so that once warm a decode, a scatter or a gather allocates nothing (each
  // call's backend work holds the context's lock: docs/api.md, Threads).
  std::vector<AttendScratch> scratch_;    // one a worker thread
  std::vector<std::vector<float>> row_;   // one a worker thread: a row of head_dim floats
  std::vector<float> part_out_, part_lse_; // the chunks' partial results
  std::vector<ExtendBlock> extend_blocks_;
  uint64_t bandwidth_sink_ = 0;
  std::mutex mu_;
  std::unordered_map<DevPtr, void *> blocks_;
};

} // namespace

std::unique_ptr<Backend> make_cpu_backend(uint32_t threads) {
  const char *want = std::getenv("PKV_CPU_KERNEL");
  const AttendKernel attend = attend_kernel(want);
  if (!attend.run && attend.name)
    fail(PKV_ERR_UNSUPPORTED, "PKV_CPU_KERNEL=%s: this processor does not run the %s decode", want, attend.name);
  if (!attend.run) fail(PKV_ERR_INVALID_ARGUMENT, "PKV_CPU_KERNEL=%s: expected %s (or unset)", want, attend_kernel_names());
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return std::make_unique<CpuBackend>(threads, attend);
}

std::string cpu_description() {
  std::string model = "unknown processor";
  std::ifstream cpuinfo("/proc/cpuinfo");
  cpuinfo.exceptions(std::ios::badbit); // a line that cannot be read (no memory) throws, not ends the loop
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  const char *want = std::getenv("PKV_CPU_KERNEL");
  const AttendKernel attend = attend_kernel(want);
  return model + ", " + std::to_string(std::max(1u, std::thread::hardware_concurrency())) + " hardware threads, " +
         (attend.run ? std::string(attend.name) + " decode" : "PKV_CPU_KERNEL=" + std::string(want) + " not run here");
}

int32_t cpu_devices(std::string *detail) {
  const char *want = std::getenv("PKV_CPU_KERNEL");
  if (attend_kernel(want).run) {
    *detail = cpu_description();
    return 1;
  }
  *detail = "PKV_CPU_KERNEL=" + std::string(want) + ": expected " + attend_kernel_names() +
            " that this processor runs (or unset); no CPU context can be created";
  return 0;
}

} // namespace pkv
