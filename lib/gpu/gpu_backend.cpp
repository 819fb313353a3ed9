#include "gpu_backend.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "../kernels/kernel_params.h"
#include "../error.hpp"
#include "../seq_image.hpp"
#include "decode_policy.hpp"
#if defined(PKV_FAULT_INJECTION) && PKV_FAULT_INJECTION
#include "fault_device.hpp"
#endif
#include "kernel_choice.hpp"
#include "plan_buffer.hpp"
#include "runtime.hpp"
#include "staging.hpp"

namespace pkv {

namespace {

using namespace gpu;

static_assert(sizeof(PkvTableEntry) == sizeof(TableEntry), "table entries cross to the device as they are");
static_assert(sizeof(PkvRowSlot) == sizeof(RowSlot), "row slots cross to the device as they are");
static_assert(sizeof(PkvPageCopy) == sizeof(PageCopy), "page copies cross to the device as they are");

constexpr unsigned kThreads = 128;
// An image's payload moves to and from host memory through a device buffer of this many bytes at a
// time (large enough that each copy runs at the link's rate); a device image moves in launches of
// at most kImageLaunchBlocks blocks.
// The most blocks of kMaxQueryTokens new tokens an extend's plan holds (8K tokens): each plan's
// launch has a block's work for every KV head of each of them, enough to fill a device, and its buffer
// stays near a MB however long the prompt (tests/api/test_extend.c's plans case crosses it).
constexpr uint32_t kExtendPlanBlocks = 1024;
// An extend's blocks of new tokens for the decode kernels, a field an array: lengths, starts, page-table
// rows, first query rows and tokens as PlanBatch takes them; tree-mask rows, mask strides (0: none)
// and the position of each one's entry's first new token for the plan's records.
struct ExtendBlocks {
  std::vector<uint32_t> lengths, starts, slots, q_rows, tokens, mask_strides, new_begins;
  std::vector<uint64_t> mask_rows;
  size_t size() const { return lengths.size(); }
  bool operator==(const ExtendBlocks &o) const {
    return lengths == o.lengths && starts == o.starts && slots == o.slots && q_rows == o.q_rows &&
           tokens == o.tokens && mask_strides == o.mask_strides && new_begins == o.new_begins && mask_rows == o.mask_rows;
  }
};
// An entry of at least this many new tokens runs on the extend kernel where it serves the call: its
// tiles of 64 query rows read each K/V stage once for all of them, but a tile attends over the whole
// context without splitting it, so a few tokens over a long context take decode's split kernels
// (and so does a call of too few tiles to fill the device: KernelChoice::extend_fills).
constexpr uint32_t kExtendKernelTokens = 64;
// The extend kernel's tiles of PKV_EXTEND_ROWS query rows an entry of n new tokens makes, per KV head.
uint32_t extend_tiles(uint32_t n, uint32_t group) {
  return uint32_t((uint64_t(n) * group + PKV_EXTEND_ROWS - 1) / PKV_EXTEND_ROWS);
}
constexpr uint64_t kImageChunkBytes = 32ull << 20;
constexpr uint64_t kImageLaunchBlocks = 1u << 20;
// Thread blocks an image copy launches at most, each taking every kImageGrid-th (layer, page) block:
// enough to fill a large GPU (132 multiprocessors, 8 blocks of 256 threads each).
constexpr uint64_t kImageGrid = 1024;

unsigned blocks_for(uint64_t n, unsigned threads) { return unsigned((n + threads - 1) / threads); }

PkvPlane plane(const PlaneLayout &l) {
  PkvPlane p{};
  p.format = uint32_t(l.format);
  p.row_data_bytes = uint32_t(l.row_data_bytes);
  p.row_scale_bytes = uint32_t(l.row_scale_bytes);
  p.scale_offset = l.scale_offset;
  return p;
}

PkvPool pool_params(const PoolGeometry &g) {
  PkvPool p{};
  p.base = g.base;
  p.table = g.table;
  p.block_bytes = g.block_bytes;
  p.k_bytes = g.k.bytes;
  p.layers = g.layers;
  p.kv_heads = g.kv_heads;
  p.head_dim = g.head_dim;
  p.page_size = g.page_size;
  p.pages = g.pages;
  p.table_stride = g.table_stride;
  p.max_sequences = g.max_sequences;
  while ((1u << p.page_shift) < g.page_size) p.page_shift++;
  p.k = plane(g.k);
  p.v = plane(g.v);
  p.scales = g.scales;
  return p;
}

// The GPU backend's own job: upload and launch. The kernel and plan come chosen (KernelChoice, through
// the pool's plan cache); transfers and scratch memory are Staging's; the plan buffer's layout is
// plan_buffer's.
class GpuBackend final : public Backend {
 public:
  GpuBackend(std::unique_ptr<Device> device, void *stream, uint32_t pack_threads)
      : dev_(std::move(device)), staging_(rt_, pack_threads) {
    rt_.dev = dev_.get();
    const DecodePolicy policy = read_decode_policy();
    try {
      Current current(rt_);
      int sms = 0, warp = 0;
      rt_.check(dev_->attribute(Attribute::multiprocessors, &sms));
      rt_.check(dev_->attribute(Attribute::warp_size, &warp));
      if (stream) {
        rt_.stream = static_cast<Stream>(stream);
      } else {
        rt_.check(dev_->stream_create(&rt_.stream));
        own_stream_ = true;
      }
      staging_.start();
      const Images &images = dev_->images();
      load_module(images.pages, &pages_module_);
      load_module(images.generic, &generic_module_);
      load_module(images.cuda_core, &cuda_core_module_);
      if (images.tensor_core) load_module(images.tensor_core, &tensor_core_module_);
      if (images.extend) load_module(images.extend, &extend_module_);
      kernels_ = std::make_unique<KernelChoice>(rt_, policy, generic_module_, cuda_core_module_, tensor_core_module_,
                                                extend_module_, uint32_t(std::max(1, sms)), unsigned(std::max(1, warp)));
      sms_ = uint32_t(std::max(1, sms));
      apply_table_ = rt_.function(pages_module_, "pkv_apply_table");
      scatter_ = rt_.function(pages_module_, "pkv_scatter");
      gather_ = rt_.function(pages_module_, "pkv_gather");
      copy_pages_ = rt_.function(pages_module_, "pkv_copy_pages");
      copy_image_ = rt_.function(pages_module_, "pkv_copy_image");
      read_bandwidth_ = rt_.function(pages_module_, "pkv_read_bandwidth");
      merge_ = rt_.function(generic_module_, "pkv_decode_merge");
    } catch (...) {
      teardown();
      throw;
    }
  }

  ~GpuBackend() override { teardown(); }

  pkv_backend kind() const override { return dev_->kind(); }

  DecodeConfig decode_config(const PoolGeometry &g, uint32_t rows) override {
    Current current(rt_);
    return kernels_->config(g, rows);
  }
  // A record per (chunk, KV head) of the tensor-core kernel's plans: as many as a balanced plan may
  // have (PlanLimits::records).
  uint64_t plan_buffer_bytes(const PoolGeometry &g) override {
    Current current(rt_);
    return plan_layout(g.max_sequences, kernels_->plan_limits(g).records).bytes;
  }

  // Zeroed on the stream (a fill of whole words: the allocation is rounded up to them), as the CPU
  // backend's calloc: a pool's memory may hold what an earlier allocation left, NaN patterns of
  // another format among it.
  DevPtr alloc(uint64_t bytes) override {
    Current current(rt_);
    DevPtr p = 0;
    const uint64_t words = std::max<uint64_t>((bytes + 3) / 4, 1);
    const Call c = dev_->alloc(&p, size_t(words * 4));
    if (c.result == kOutOfMemory)
      fail(PKV_ERR_OUT_OF_MEMORY, "%s of %llu bytes: the device has too little free memory", c.name,
           (unsigned long long)bytes);
    rt_.check(c);
    const Call zero = dev_->fill32(p, 0, size_t(words), rt_.stream);
    if (zero.result != kSuccess) {
      dev_->free(p);
      rt_.check(zero);
    }
    return p;
  }

  // A pool's pages going take its extend buffers with them.
  void release(DevPtr ptr) noexcept override {
    if (!ptr) return;
    CurrentForCleanup current(dev_.get());
    dev_->stream_synchronize(rt_.stream); // the memory may still be read by queued work
    dev_->free(ptr);
    const auto found = extends_.find(ptr);
    if (found == extends_.end()) return;
    for (const DeviceBuffer &b : found->second.buffers)
      if (b.ptr) dev_->free(b.ptr);
    extends_.erase(found);
  }

  void write_device(DevPtr dst, const void *src, uint64_t bytes) override {
    Current current(rt_);
    Upload up;
    up.add(src, bytes);
    staging_.send(up, dst);
  }

  void copy_pages(const PoolGeometry &g, const PageCopy *copies, uint32_t n) override {
    if (n == 0) return;
    Current current(rt_);
    Upload up;
    const uint64_t at = up.add(copies, uint64_t(n) * sizeof(PageCopy));
    const DevPtr dev = staging_.send(up);
    PkvCopyParams p{};
    p.pool = pool_params(g);
    p.copies = dev + at;
    p.count = n;
    rt_.launch(copy_pages_, n, g.layers, 1, &p, 256);
  }

  void scatter(const PoolGeometry &g, const ScatterArgs &a) override {
    Current current(rt_);
    const uint64_t row_bytes = uint64_t(a.rows) * g.kv_heads * g.head_dim * io_elem_bytes(a.format);
    Upload up;
    const uint64_t table_at = up.add(a.table.entries, uint64_t(a.table.count) * sizeof(TableEntry));
    const uint64_t slots_at = up.add(a.slots, uint64_t(a.rows) * sizeof(RowSlot));
    const bool host = a.memory == PKV_MEMORY_HOST;
    const uint64_t k_at = host ? up.add(a.k, row_bytes) : 0, v_at = host ? up.add(a.v, row_bytes) : 0;
    const DevPtr dev = staging_.send(up);
    apply_table(g, a.table, dev + table_at);
    PkvRowsParams p{};
    p.pool = pool_params(g);
    p.slots = dev + slots_at;
    p.k = host ? dev + k_at : DevPtr(uintptr_t(a.k));
    p.v = host ? dev + v_at : DevPtr(uintptr_t(a.v));
    p.rows = a.rows;
    p.layer = a.layer;
    p.format = uint32_t(a.format);
    rt_.launch(scatter_, blocks_for(2ull * a.rows * g.kv_heads * (g.head_dim / 32), kThreads), 1, 1, &p, kThreads);
  }

  void gather(const PoolGeometry &g, const GatherArgs &a) override {
    Current current(rt_);
    const uint64_t row_bytes = uint64_t(a.rows) * g.kv_heads * g.head_dim * io_elem_bytes(a.format);
    Upload up;
    const uint64_t table_at = up.add(a.table.entries, uint64_t(a.table.count) * sizeof(TableEntry));
    const uint64_t slots_at = up.add(a.slots, uint64_t(a.rows) * sizeof(RowSlot));
    const DevPtr dev = staging_.send(up);
    apply_table(g, a.table, dev + table_at);
    const bool host = a.memory == PKV_MEMORY_HOST;
    if (host) staging_.ensure(&rows_out_, 2 * align16(row_bytes));
    PkvRowsParams p{};
    p.pool = pool_params(g);
    p.slots = dev + slots_at;
    p.k = !a.k ? 0 : host ? rows_out_.ptr : DevPtr(uintptr_t(a.k));
    p.v = !a.v ? 0 : host ? rows_out_.ptr + align16(row_bytes) : DevPtr(uintptr_t(a.v));
    p.rows = a.rows;
    p.layer = a.layer;
    p.format = uint32_t(a.format);
    rt_.launch(gather_, blocks_for(2ull * a.rows * g.kv_heads * g.head_dim, kThreads), 1, 1, &p, kThreads);
    if (!host) {
      rt_.check(dev_->stream_synchronize(rt_.stream));
      return;
    }
    // K's rows, then V's from align16(row_bytes): the span of those asked for, in one transfer.
    const uint64_t first = a.k ? 0 : align16(row_bytes), end = a.v ? align16(row_bytes) + row_bytes : row_bytes;
    const uint8_t *rows = staging_.receive(rows_out_.ptr + first, end - first);
    if (a.k) std::memcpy(a.k, rows, size_t(row_bytes));
    if (a.v) std::memcpy(a.v, rows + align16(row_bytes) - first, size_t(row_bytes));
  }

  void prepare_decode(const PoolGeometry &g, const DecodeBatch &b) override {
    Current current(rt_);
    put_plan(g, b);
  }

  // An extend's new tokens: an entry of many on the extend kernel (extend_function) in tiles of
  // PKV_EXTEND_ROWS query rows; the rest as records of the decode's kernels, each entry's tokens in
  // blocks of up to kMaxQueryTokens, a block attending like a decode of that many query tokens over
  // the sequence up to its last token (so causally; a tree mask hides new tokens besides). The
  // blocks go in plans of up to kExtendPlanBlocks in a buffer of the pool's (extend_buffer), with the
  // call's tree masks and the extend kernel's items: in the pool's plan buffer, which holds
  // max_sequences sequences, a prefill of one sequence ran as a launch for each of its blocks, every
  // one too small to fill the device. An engine extends the same batch in every layer of a step: a
  // call whose blocks, items, masks and configuration are the pool's last call's launches what is
  // already on the device, which is also what lets a graph capture it (after pkv_extend_prepare).
  void extend(const PoolGeometry &g, const ExtendBatch &b) override {
    Current current(rt_);
    const Attention a{b.layer, b.q_heads, b.q_offsets[b.count], b.scale, b.q_format, b.out_format, b.memory,
                      b.q, b.out, b.lse, b.variants};
    ExtendWork w = plan_extend(g, b);
    int capture = 0;
    rt_.check(dev_->stream_capture_status(rt_.stream, &capture));
    if (capture != 0) check_extend_capture(g, b, w);
    put_table(g, b.table);
    if (a.rows == 0) return;
    const DevPtr at = put_extend(g, b, w);
    if (w.parts) reserve_parts(g, w.config, kMaxQueryTokens, b.q_heads);
    Staged io = stage(g, a);
    if (b.mask) io.mask = at + w.mask_at;
    ExtendPlans &x = extends_[g.base].last;
    for (uint32_t i = 0; i < w.parts; i++)
      launch(g, w.config, x.parts[i], a, io, std::min(w.most, w.count - i * w.most), kMaxQueryTokens,
             {at + i * w.part_bytes, w.most, w.place.max_records});
    if (!x.items.empty()) {
      PkvExtendParams p{};
      p.pool = pool_params(g);
      p.items = at + w.items_at;
      p.q = io.q;
      p.out = io.out;
      p.lse = io.lse;
      p.count = uint32_t(x.items.size());
      p.layer = a.layer;
      p.q_heads = a.q_heads;
      p.q_format = uint32_t(a.q_format);
      p.out_format = uint32_t(a.out_format);
      p.scale = a.scale;
      rt_.launch(w.wide, p.count, 1, 1, &p, PKV_EXTEND_ROWS / 16 * 32, 1, 1,
                 pkv_extend_shared_bytes(g.head_dim, uint32_t(g.k.format), uint32_t(g.v.format), w.q_parts));
    }
    unstage(a, io);
    x.resident = true; // once the whole call succeeded: a failed one's retry sends what a first call does
  }

  // Applies the table changes and puts the batch's plans on the device, with the decode scratch its
  // blocks need, launching nothing: an extend of the same batch that follows only launches.
  void prepare_extend(const PoolGeometry &g, const ExtendBatch &b) override {
    Current current(rt_);
    ExtendWork w = plan_extend(g, b);
    put_table(g, b.table);
    if (b.q_offsets[b.count] == 0) return;
    put_extend(g, b, w);
    if (w.parts) reserve_parts(g, w.config, kMaxQueryTokens, b.q_heads);
    extends_[g.base].last.resident = true;
  }

  // An extend's work as made on the host: the blocks for the decode kernels, the extend kernel's
  // items, the decode configuration of the blocks' plans and where everything lies in the pool's
  // extend buffer (the plans in `parts` parts of part_bytes, then the masks at mask_at, then the
  // items at items_at; `bytes` in all).
  struct ExtendWork {
    ExtendBlocks blocks;
    std::vector<PkvExtendItem> items;
    Function wide;
    uint32_t q_parts, count, most, parts;
    DecodeConfig config;
    PlanPlace place;
    uint64_t part_bytes, mask_bytes, mask_at, items_at, bytes;
  };

  ExtendWork plan_extend(const PoolGeometry &g, const ExtendBatch &b) {
    ExtendWork w{};
    w.q_parts = KernelChoice::extend_q_parts(g, b.q_format);
    w.wide = extend_function(g, b, w.q_parts);
    ExtendBlocks &blocks = w.blocks;
    const uint32_t group = b.q_heads / g.kv_heads;
    for (uint32_t e = 0; e < b.count; e++) {
      const uint32_t n = b.q_offsets[e + 1] - b.q_offsets[e], first = b.lengths[e] - n, stride = (n + 7) / 8;
      if (w.wide && n >= kExtendKernelTokens) {
        for (uint32_t h = 0; h < g.kv_heads; h++)
          for (uint32_t z = 0; z < extend_tiles(n, group); z++)
            w.items.push_back({b.seq_slots[e], b.lengths[e], n, b.q_offsets[e], h, z, {0, 0}});
        continue;
      }
      for (uint32_t i = 0; i < n; i += kMaxQueryTokens) {
        const uint32_t t = std::min(kMaxQueryTokens, n - i), start = b.variants.plan_start(first + i, g.page_size);
        blocks.lengths.push_back(first + i + t - start);
        blocks.starts.push_back(start);
        blocks.slots.push_back(b.seq_slots[e]);
        blocks.q_rows.push_back(b.q_offsets[e] + i);
        blocks.tokens.push_back(t);
        blocks.mask_rows.push_back(b.mask ? b.mask_offsets[e] + uint64_t(i) * stride : 0);
        blocks.mask_strides.push_back(b.mask ? stride : 0);
        blocks.new_begins.push_back(first);
      }
    }
    // The tiles that see the most positions first, so the last blocks to start are short ones.
    auto seen = [&](const PkvExtendItem &i) {
      return i.length - i.tokens + std::min(i.tokens * group, (i.tile + 1) * PKV_EXTEND_ROWS) / group;
    };
    std::stable_sort(w.items.begin(), w.items.end(), [&](const auto &x, const auto &y) { return seen(x) > seen(y); });
    w.config = *b.config;
    w.count = uint32_t(blocks.size());
    w.most = std::max(1u, std::min(kExtendPlanBlocks, w.count));
    w.config.plan.limits = chosen_plan_bounds(w.most, g.kv_heads, w.config.plan.workers);
    w.place = PlanPlace{0, w.most, w.config.plan.limits.records};
    w.part_bytes = align16(w.place.layout().bytes);
    w.parts = (w.count + w.most - 1) / w.most;
    w.mask_bytes = b.mask ? b.mask_bytes : 0;
    w.mask_at = w.parts * w.part_bytes;
    w.items_at = w.mask_at + align16(w.mask_bytes);
    w.bytes = w.items_at + w.items.size() * sizeof(PkvExtendItem);
    return w;
  }

  // Whether the pool's last extend plans, on the device, are the work's.
  bool extend_resident(const PoolGeometry &g, const ExtendBatch &b, const ExtendWork &w) const {
    const auto found = extends_.find(g.base);
    if (found == extends_.end()) return false;
    const ExtendPlans &x = found->second.last;
    return x.resident && x.blocks == w.blocks && x.config == w.config.plan && x.page_size == g.page_size &&
           x.kv_heads == g.kv_heads && x.mask.size() == w.mask_bytes &&
           (!b.mask || std::equal(x.mask.begin(), x.mask.end(), b.mask)) && x.items.size() == w.items.size() &&
           std::equal(x.items.begin(), x.items.end(), w.items.begin(),
                      [](const auto &u, const auto &v) { return std::memcmp(&u, &v, sizeof u) == 0; });
  }

  // An extend issued while the stream captures a graph launches only: its plans and table changes put
  // on the device by pkv_extend_prepare, q and out in device memory, the decode's blocks (if any) on
  // the tensor-core kernel with their scratch sized.
  void check_extend_capture(const PoolGeometry &g, const ExtendBatch &b, const ExtendWork &w) {
    if (b.memory == PKV_MEMORY_HOST) fail(PKV_ERR_INVALID_ARGUMENT, "an extend captured in a graph needs memory = PKV_MEMORY_DEVICE");
    if (b.table.count || (b.q_offsets[b.count] && !extend_resident(g, b, w)))
      fail(PKV_ERR_INVALID_ARGUMENT, "the stream is capturing a graph but this batch's extend plans are not on the "
           "device: call pkv_extend_prepare with the batch before capturing (and before each replay after it changed)");
    if (!w.parts) return;
    if (w.config.family != KernelFamily::tensor_core)
      refuse_capture("this extend's entries of fewer than 64 new tokens (or with a mask or variant)");
    const uint64_t parts = w.config.plan.limits.parts, part_rows = parts * kMaxQueryTokens * b.q_heads;
    if (part_rows * g.head_dim * 4 > part_out_.bytes || parts * g.kv_heads * w.config.row_tiles * 4 > counters_.bytes)
      fail(PKV_ERR_INVALID_ARGUMENT, "call pkv_extend_prepare with the batch before capturing it: its scratch buffers "
           "are sized there");
  }

  // A capture of `what`, which would run on a decode kernel other than the tensor-core one.
  [[noreturn]] void refuse_capture(const char *what) {
    const std::string none = dev_->images().tensor_core ? "" : std::string("; the ") + dev_->name() + " backend has none";
    fail(PKV_ERR_UNSUPPORTED, "%s: only the tensor-core decode kernel can be captured (pages of F16, BF16, Q8_0 or "
         "Q4_0 with head_dim 64, 128 or 256, PKV_KERNEL_FAMILY unset, and shared memory for it: not head_dim 256 on "
         "99 KB a block)%s", what, none.c_str());
  }

  // Puts the work's plans, masks and items into the pool's extend buffer for its size unless they are
  // there already; returns the buffer.
  DevPtr put_extend(const PoolGeometry &g, const ExtendBatch &b, ExtendWork &w) {
    const bool same = extend_resident(g, b, w);
    const DevPtr at = extend_buffer(g, w.bytes);
    if (same) return at;
    ExtendPlans &x = extends_[g.base].last;
    x.resident = false;
    x.parts.clear();
    for (uint32_t i = 0; i < w.parts; i++) {
      const uint32_t first = i * w.most, n = std::min(w.most, w.count - first);
      ExtendBlocks &k = w.blocks;
      PlanBatch pb{&k.lengths[first], &k.slots[first], n, g.page_size, g.kv_heads, 0, &k.starts[first], kMaxQueryTokens};
      pb.q_rows = &k.q_rows[first];
      pb.tokens = &k.tokens[first];
      x.parts.push_back(make_plan(w.config.plan, pb));
      if (b.mask)
        for (PlanRecord &r : x.parts.back().records)
          if (r.seq != kNoSeq)
            r.mask = k.mask_rows[first + r.seq], r.mask_stride = k.mask_strides[first + r.seq],
            r.new_begin = k.new_begins[first + r.seq];
    }
    for (uint32_t i = 0; i < w.parts; i++)
      upload_plan(staging_, {at + i * w.part_bytes, w.most, w.place.max_records}, x.parts[i],
                  std::min(w.most, w.count - i * w.most));
    if (w.mask_bytes || !w.items.empty()) { // one transfer: the masks, then the items
      Upload up;
      if (w.mask_bytes) up.place(0, b.mask, w.mask_bytes);
      if (!w.items.empty()) up.place(w.items_at - w.mask_at, w.items.data(), w.items.size() * sizeof(PkvExtendItem));
      staging_.send(up, at + w.mask_at);
    }
    x.blocks = std::move(w.blocks);
    x.items = std::move(w.items);
    x.config = w.config.plan;
    x.page_size = g.page_size;
    x.kv_heads = g.kv_heads;
    x.mask.assign(b.mask, b.mask + w.mask_bytes);
    return at;
  }

  // The pool's extend buffer for `bytes`: one of each power-of-two size from 4 KB, made when first
  // needed and kept for the pool's life, so a captured extend finds its batch's plans where it was
  // captured after every pkv_extend_prepare of that batch, whatever other batches came between.
  DevPtr extend_buffer(const PoolGeometry &g, uint64_t bytes) {
    unsigned size = 12;
    while ((uint64_t(1) << size) < bytes) size++;
    std::vector<DeviceBuffer> &buffers = extends_[g.base].buffers;
    if (buffers.size() <= size - 12) buffers.resize(size - 11);
    DeviceBuffer &buf = buffers[size - 12];
    if (!buf.ptr) {
      rt_.check(dev_->alloc(&buf.ptr, size_t(1) << size), " (extend plans)");
      buf.bytes = uint64_t(1) << size;
    }
    return buf.ptr;
  }

  // The extend kernel for the call, or null where it does not serve: no tree mask or attention
  // variant, the decode's tensor-core family (so PKV_KERNEL_FAMILY set to another takes the decode
  // kernels for extends too), a kernel for the pool (KernelChoice::extend), and the call's long
  // entries in enough tiles (KernelChoice::extend_fills).
  Function extend_function(const PoolGeometry &g, const ExtendBatch &b, uint32_t q_parts) {
    if (b.config->family != KernelFamily::tensor_core || b.mask || b.variants.any()) return nullptr;
    const uint32_t group = b.q_heads / g.kv_heads;
    uint64_t tiles = 0;
    for (uint32_t e = 0; e < b.count; e++) {
      const uint32_t n = b.q_offsets[e + 1] - b.q_offsets[e];
      if (n >= kExtendKernelTokens) tiles += uint64_t(g.kv_heads) * extend_tiles(n, group);
    }
    return kernels_->extend_fills(tiles) ? kernels_->extend(g, q_parts) : nullptr;
  }

  // Launches only, once the plan is on the device: nothing here waits for the device, allocates or
  // uploads, so the call can be captured in a graph (checked first, before anything changes).
  void decode(const PoolGeometry &g, const DecodeBatch &b) override {
    Current current(rt_);
    const DecodeConfig &k = *b.config;
    const Attention a{b.layer, b.q_heads, b.count * b.q_tokens, b.scale, b.q_format, b.out_format, b.memory,
                      b.q, b.out, b.lse, b.variants};
    const bool host = b.memory == PKV_MEMORY_HOST, upload = b.table.count || !b.plan_resident;
    const uint64_t parts = k.plan.limits.parts;
    const uint64_t part_rows = parts * b.q_tokens * b.q_heads;
    const uint64_t counters = parts * g.kv_heads * k.row_tiles;
    const bool tensor_core = k.family == KernelFamily::tensor_core;

    int capture = 0;
    rt_.check(dev_->stream_capture_status(rt_.stream, &capture));
    if (capture != 0) {
      if (host) fail(PKV_ERR_INVALID_ARGUMENT, "a decode captured in a graph needs memory = PKV_MEMORY_DEVICE");
      if (upload)
        fail(PKV_ERR_INVALID_ARGUMENT, "the stream is capturing a graph but this batch's plan is not on the device: call "
             "pkv_decode_prepare with the batch before capturing (and before each replay after it changed)");
      if (!tensor_core) refuse_capture("this decode");
      if (part_rows * g.head_dim * 4 > part_out_.bytes || counters * 4 > counters_.bytes)
        fail(PKV_ERR_INVALID_ARGUMENT, "decode a batch of this shape once before capturing it: its scratch buffers are "
             "sized on first use");
    }
    if (upload) put_plan(g, b);
    reserve_parts(g, k, b.q_tokens, b.q_heads);
    const Staged io = stage(g, a);
    launch(g, k, *b.plan, a, io, b.count, b.q_tokens, pool_plan(g, k));
    unstage(a, io);
  }

  // A device image: the header sent ahead of the kernels, which add the payload's checksum into it.
  // A host image: the header written now, the payload gathered a chunk at a time into the device
  // buffer and copied out of it (pinned memory directly and asynchronously; other host memory through
  // the staging buffer, waited for), the checksum copied into the header last.
  void export_image(const PoolGeometry &g, const ExportArgs &a) override {
    Current current(rt_);
    if (a.memory == PKV_MEMORY_DEVICE) {
      const DevPtr image = DevPtr(uintptr_t(a.image));
      Upload header;
      header.add(a.header, kImageHeaderBytes);
      staging_.send(header, image);
      for_image_chunks(g, a, [&](uint64_t first, uint64_t blocks) {
        copy_image(g, a, image + kImageHeaderBytes + first * g.block_bytes, first, blocks,
                   image + kImagePayloadChecksumAt, true);
      });
      return;
    }
    auto *image = static_cast<uint8_t *>(a.image);
    const bool pinned = a.memory == PKV_MEMORY_HOST_PINNED;
    std::memcpy(image, a.header, kImageHeaderBytes);
    const bool any = for_image_chunks(g, a, [&](uint64_t first, uint64_t blocks) {
      const uint64_t bytes = blocks * g.block_bytes;
      uint8_t *dst = image + kImageHeaderBytes + first * g.block_bytes;
      copy_image(g, a, image_stage_.ptr, first, blocks, image_sum_.ptr, true);
      if (pinned) rt_.check(dev_->copy_to_host(dst, image_stage_.ptr, size_t(bytes), rt_.stream));
      else std::memcpy(dst, staging_.receive(image_stage_.ptr, bytes), size_t(bytes));
    });
    if (!any) return; // no payload: the header's checksum field holds its sum, 0
    if (pinned) rt_.check(dev_->copy_to_host(image + kImagePayloadChecksumAt, image_sum_.ptr, 8, rt_.stream));
    else std::memcpy(image + kImagePayloadChecksumAt, staging_.receive(image_sum_.ptr, 8), 8);
  }

  // The payload into the pages: a device image's read in place, a host image's copied a chunk at a
  // time into the device buffer (pinned memory directly, other host memory through the staging
  // buffers, two taking turns); then its checksum, waited for.
  uint64_t import_image(const PoolGeometry &g, const ImportArgs &a) override {
    Current current(rt_);
    const auto *payload = static_cast<const uint8_t *>(a.payload);
    const bool any = for_image_chunks(g, a, [&](uint64_t first, uint64_t blocks) {
      const uint64_t bytes = blocks * g.block_bytes, at = first * g.block_bytes;
      if (a.memory == PKV_MEMORY_DEVICE) {
        copy_image(g, a, DevPtr(uintptr_t(payload + at)), first, blocks, image_sum_.ptr, false);
        return;
      }
      if (a.memory == PKV_MEMORY_HOST_PINNED) {
        rt_.check(dev_->copy_to_device(image_stage_.ptr, payload + at, size_t(bytes), rt_.stream));
      } else {
        Upload chunk;
        chunk.add(payload + at, bytes);
        staging_.send(chunk, image_stage_.ptr);
      }
      copy_image(g, a, image_stage_.ptr, first, blocks, image_sum_.ptr, false);
    });
    uint64_t sum = 0;
    if (any) std::memcpy(&sum, staging_.receive(image_sum_.ptr, 8), 8);
    return sum;
  }

  void read_caller(void *dst, const void *src, pkv_memory memory, uint64_t bytes) override {
    Current current(rt_);
    if (memory == PKV_MEMORY_DEVICE) {
      std::memcpy(dst, staging_.receive(DevPtr(uintptr_t(src)), bytes), size_t(bytes));
      return;
    }
    rt_.check(dev_->stream_synchronize(rt_.stream)); // a queued export may still be writing it
    std::memcpy(dst, src, size_t(bytes));
  }

  void synchronize() override {
    Current current(rt_);
    rt_.check(dev_->stream_synchronize(rt_.stream));
  }

  // Best of several timed passes of pkv_read_bandwidth over a buffer far larger than the L2.
  double read_bandwidth(uint64_t bytes) override {
    Current current(rt_);
    const uint64_t n = std::max<uint64_t>(bytes ? bytes : 2ull << 30, 1 << 20) & ~uint64_t(15);
    DeviceBuffer buf;
    Event start = nullptr, end = nullptr;
    double best = 0.0;
    try {
      rt_.check(dev_->alloc(&buf.ptr, size_t(n) + 16), " (bandwidth buffer)");
      rt_.check(dev_->event_create(&start, true));
      rt_.check(dev_->event_create(&end, true));
      PkvReadParams p{buf.ptr, n, buf.ptr + n};
      for (int pass = 0; pass < 12; pass++) {
        rt_.check(dev_->event_record(start, rt_.stream));
        rt_.launch(read_bandwidth_, sms_ * 8, 1, 1, &p, 512);
        rt_.check(dev_->event_record(end, rt_.stream));
        rt_.check(dev_->event_synchronize(end));
        float ms = 0.0f;
        rt_.check(dev_->event_elapsed_ms(&ms, start, end));
        if (pass > 1) best = std::max(best, double(n) / (double(ms) * 1e-3) / 1e9); // two warm-up passes
      }
    } catch (...) {
      destroy_events_and(buf, start, end);
      throw;
    }
    destroy_events_and(buf, start, end);
    return best;
  }

 private:
  void destroy_events_and(DeviceBuffer &buf, Event start, Event end) noexcept {
    if (start) dev_->event_destroy(start);
    if (end) dev_->event_destroy(end);
    if (buf.ptr) dev_->free(buf.ptr);
  }

  // A device short of memory says so; any other refusal is the image's.
  void load_module(const unsigned char *image, Module *module) {
    const Call c = dev_->module_load(module, image);
    if (c.result == kOutOfMemory) rt_.check(c, " (kernels)");
    if (c.result != kSuccess)
      fail(PKV_ERR_UNSUPPORTED, "the kernels (built for %s) do not load on this device (%s): %s", dev_->images().targets,
           dev_->identity().c_str(), dev_->describe(c.result).c_str());
  }

  // Applies a call's queued table changes.
  void put_table(const PoolGeometry &g, const TableUpdates &t) {
    if (!t.count) return;
    Upload up;
    const uint64_t at = up.add(t.entries, uint64_t(t.count) * sizeof(TableEntry));
    apply_table(g, t, staging_.send(up) + at);
  }

  // Applies the batch's queued table changes and, unless the pool's plan buffer holds it already,
  // sends the plan.
  void put_plan(const PoolGeometry &g, const DecodeBatch &b) {
    put_table(g, b.table);
    if (!b.plan_resident) upload_plan(staging_, pool_plan(g, *b.config), *b.plan, b.count);
  }

  // The pool's plan buffer, as plan_buffer_bytes sized it.
  static PlanPlace pool_plan(const PoolGeometry &g, const DecodeConfig &k) {
    return {g.plan, g.max_sequences, k.plan.limits.records};
  }

  // A call's attention as the kernels take it: `rows` query tokens of q_heads heads each in q, out and
  // lse, where `memory` says, and the rest of the call's fields.
  struct Attention {
    uint32_t layer, q_heads, rows;
    float scale;
    pkv_format q_format, out_format;
    pkv_memory memory;
    const void *q;
    void *out;
    float *lse;
    AttentionVariants variants;
  };

  // Where the kernels find q, out, lse, sinks, slopes and an extend's masks (set by extend): the
  // caller's own in device memory; from host memory q, sinks and slopes sent in one transfer, out and
  // lse (from align16(out_bytes)) in a scratch buffer, copied back by unstage.
  struct Staged {
    DevPtr q, out, lse, sinks, slopes, mask;
    uint64_t out_bytes;
  };

  Staged stage(const PoolGeometry &g, const Attention &a) {
    const uint64_t heads = uint64_t(a.rows) * a.q_heads;
    const uint64_t q_bytes = heads * g.head_dim * io_elem_bytes(a.q_format);
    const bool host = a.memory == PKV_MEMORY_HOST;
    const AttentionVariants &v = a.variants;
    Upload up;
    const uint64_t q_at = host ? up.add(a.q, q_bytes) : 0;
    const uint64_t sinks_at = host && v.sinks ? up.add(v.sinks, uint64_t(a.q_heads) * 4) : 0;
    const uint64_t slopes_at = host && v.slopes ? up.add(v.slopes, uint64_t(a.q_heads) * 4) : 0;
    const DevPtr dev = staging_.send(up);
    auto caller = [&](const void *ptr, uint64_t at) { return !ptr ? 0 : host ? dev + at : DevPtr(uintptr_t(ptr)); };
    Staged s{caller(a.q, q_at), 0, 0, caller(v.sinks, sinks_at), caller(v.slopes, slopes_at), 0,
             heads * g.head_dim * io_elem_bytes(a.out_format)};
    if (host) {
      staging_.ensure(&decode_out_, align16(s.out_bytes) + heads * 4);
      s.out = decode_out_.ptr;
      s.lse = a.lse ? decode_out_.ptr + align16(s.out_bytes) : 0;
    } else {
      s.out = DevPtr(uintptr_t(a.out));
      s.lse = DevPtr(uintptr_t(a.lse));
    }
    return s;
  }

  void unstage(const Attention &a, const Staged &s) {
    if (a.memory != PKV_MEMORY_HOST) return;
    const uint64_t lse_bytes = uint64_t(a.rows) * a.q_heads * 4;
    const uint8_t *r = staging_.receive(s.out, a.lse ? align16(s.out_bytes) + lse_bytes : s.out_bytes);
    std::memcpy(a.out, r, size_t(s.out_bytes));
    if (a.lse) std::memcpy(a.lse, r + align16(s.out_bytes), size_t(lse_bytes));
  }

  // Scratch for the partial results of split sequences under configuration k (q_tokens rows of
  // q_heads heads a part) and the tensor-core kernel's counters, zero when new.
  void reserve_parts(const PoolGeometry &g, const DecodeConfig &k, uint32_t q_tokens, uint32_t q_heads) {
    const uint64_t parts = k.plan.limits.parts, part_rows = parts * q_tokens * q_heads;
    staging_.grow_kept(&part_out_, part_rows * g.head_dim * 4);
    staging_.grow_kept(&part_lse_, part_rows * 4);
    if (staging_.grow_kept(&counters_, parts * g.kv_heads * k.row_tiles * 4)) counters_zero_ = false;
    if (!counters_zero_) { // a new buffer; the kernels leave it zero after that
      rt_.check(dev_->fill32(counters_.ptr, 0, size_t(counters_.bytes / 4), rt_.stream));
      counters_zero_ = true;
    }
  }

  // The kernels of a plan in the plan buffer `place`: `count` sequences, at most q_tokens tokens a record.
  void launch(const PoolGeometry &g, const DecodeConfig &k, const DecodePlan &plan, const Attention &a,
              const Staged &io, uint32_t count, uint32_t q_tokens, const PlanPlace &place) {
    const PlanLayout l = place.layout();
    const AttentionVariants &v = a.variants;
    PkvDecodeParams p{};
    p.pool = pool_params(g);
    p.plan = place.at;
    p.records = place.at + l.records;
    p.seq_chunks = place.at + l.seq_chunks;
    p.q = io.q;
    p.out = io.out;
    p.lse = io.lse;
    p.part_out = part_out_.ptr;
    p.part_lse = part_lse_.ptr;
    p.counters = counters_.ptr;
    p.layer = a.layer;
    p.count = count;
    p.q_heads = a.q_heads;
    p.q_tokens = q_tokens;
    p.n_chunks = plan.chunks(); // the CUDA-core and generic kernels' (the tensor-core kernel reads the plan's)
    p.row_tiles = k.row_tiles;
    p.mtiles = k.mtiles;
    p.q_aligned = p.q % 16 == 0;
    p.q_format = uint32_t(a.q_format);
    p.out_format = uint32_t(a.out_format);
    p.scale = a.scale;
    p.window = v.window;
    p.softcap = v.softcap;
    p.transform = v.softcap != 0.0f || v.slopes;
    p.sinks = io.sinks;
    p.slopes = io.slopes;
    p.mask = io.mask;

    const Function fn = static_cast<Function>(k.kernel);
    if (k.family == KernelFamily::tensor_core) {
      // Blocks loop over records, so a replay of a larger plan is still covered; a balanced plan's
      // workers are one block each (one row tile).
      const uint64_t blocks = plan.workers ? plan.workers : plan.records.size() * k.row_tiles;
      rt_.launch(fn, unsigned(blocks), 1, 1, &p, k.threads[0], k.threads[1], k.threads[2], k.shared_bytes);
    } else {
      // A block per (chunk, KV head, row tile); split sequences are left to the merge kernel.
      rt_.launch(fn, plan.chunks(), g.kv_heads, k.row_tiles, &p, k.threads[0], k.threads[1], k.threads[2],
                 k.shared_bytes);
      if (plan.parts) rt_.launch(merge_, count * q_tokens, a.q_heads, 1, &p, std::min(256u, g.head_dim));
    }
  }

  // Sends the image's page list and zeroes the checksum, then calls each(first block, blocks) over the
  // payload's blocks in chunks: the staging chunk's size for host images, launches of at most
  // kImageLaunchBlocks blocks for device ones (the staging buffer is sized for host images). Returns
  // whether there was any block.
  template <class Each> bool for_image_chunks(const PoolGeometry &g, const ImageTransfer &a, Each each) {
    const uint64_t blocks = uint64_t(a.layers) * a.count;
    if (blocks == 0) return false;
    const bool device = a.memory == PKV_MEMORY_DEVICE;
    const uint64_t per_chunk = device ? kImageLaunchBlocks : std::max<uint64_t>(1, kImageChunkBytes / g.block_bytes);
    Upload pages;
    pages.add(a.pages, uint64_t(a.count) * 4);
    staging_.ensure(&image_pages_, pages.total());
    staging_.ensure(&image_sum_, 8);
    if (!device) staging_.ensure(&image_stage_, std::min(blocks, per_chunk) * g.block_bytes);
    staging_.send(pages, image_pages_.ptr);
    rt_.check(dev_->fill32(image_sum_.ptr, 0, 2, rt_.stream));
    for (uint64_t first = 0; first < blocks; first += per_chunk) each(first, std::min(per_chunk, blocks - first));
    return true;
  }

  // Blocks [first, first + blocks) of the image between the pool and `payload`, which holds block
  // `first`; the checksum terms added to the uint64_t at `sum`.
  void copy_image(const PoolGeometry &g, const ImageTransfer &a, DevPtr payload, uint64_t first, uint64_t blocks,
                  DevPtr sum, bool to_image) {
    PkvImageParams p{};
    p.pool = pool_params(g);
    p.pages = image_pages_.ptr;
    p.payload = payload;
    p.sum = sum;
    p.first_block = first;
    p.blocks = blocks;
    p.count = a.count;
    p.first_layer = a.first_layer;
    p.to_image = to_image;
    rt_.launch(copy_image_, unsigned(std::min(blocks, kImageGrid)), 1, 1, &p, 256);
  }

  void apply_table(const PoolGeometry &g, const TableUpdates &t, DevPtr entries) {
    if (t.count == 0) return;
    PkvTableParams p{};
    p.pool = pool_params(g);
    p.entries = entries;
    p.count = t.count;
    rt_.launch(apply_table_, blocks_for(t.count, kThreads), 1, 1, &p, kThreads);
  }

  // Everything the backend made, in the device's context; the device itself is released after
  // (dev_ is destroyed last).
  void teardown() noexcept {
    CurrentForCleanup current(dev_.get());
    if (rt_.stream) dev_->stream_synchronize(rt_.stream);
    for (DeviceBuffer *b : {&part_out_, &part_lse_, &counters_, &decode_out_, &rows_out_, &image_pages_, &image_stage_,
                            &image_sum_})
      if (b->ptr) dev_->free(b->ptr);
    for (const auto &pool : extends_)
      for (const DeviceBuffer &b : pool.second.buffers)
        if (b.ptr) dev_->free(b.ptr);
    staging_.release();
    for (Module m : {pages_module_, generic_module_, cuda_core_module_, tensor_core_module_, extend_module_})
      if (m) dev_->module_unload(m);
    if (own_stream_) dev_->stream_destroy(rt_.stream);
  }

  std::unique_ptr<Device> dev_;
  Runtime rt_;
  Staging staging_;
  std::unique_ptr<KernelChoice> kernels_;
  bool own_stream_ = false;
  uint32_t sms_ = 1;
  Module pages_module_ = nullptr, generic_module_ = nullptr, cuda_core_module_ = nullptr, tensor_core_module_ = nullptr;
  Module extend_module_ = nullptr;
  Function apply_table_ = nullptr, scatter_ = nullptr, gather_ = nullptr, copy_pages_ = nullptr, merge_ = nullptr;
  Function copy_image_ = nullptr;
  Function read_bandwidth_ = nullptr;
  DeviceBuffer part_out_, part_lse_, counters_, decode_out_, rows_out_;
  // What a pool's last extend plans were made from, and the plans.
  struct ExtendPlans {
    ExtendBlocks blocks;
    std::vector<PkvExtendItem> items;
    PlanConfig config;
    uint32_t page_size = 0, kv_heads = 0;
    std::vector<uint8_t> mask;
    std::vector<DecodePlan> parts;
    bool resident = false; // the pool's extend buffer for their size holds them, and a call with them succeeded
  };
  // Each pool's extends, by the address of its pages (PoolGeometry::base): the last plans and the
  // extend buffers (extend_buffer), index i holding 4 KB << i.
  struct PoolExtends {
    ExtendPlans last;
    std::vector<DeviceBuffer> buffers;
  };
  std::map<DevPtr, PoolExtends> extends_;
  DeviceBuffer image_pages_, image_stage_, image_sum_; // an image's page list, host chunk and checksum
  bool counters_zero_ = true; // counters_ has been filled with zeros (false from its growth until then)
};

} // namespace

std::unique_ptr<Backend> make_gpu_backend(std::unique_ptr<gpu::Device> device, void *stream, uint32_t threads) {
#if defined(PKV_FAULT_INJECTION) && PKV_FAULT_INJECTION
  device = gpu::with_faults(std::move(device)); // every runtime call a gpu_call point
#endif
  if (threads == 0) threads = std::min(kDefaultPackThreads, std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<GpuBackend>(std::move(device), stream, threads);
}

} // namespace pkv
