#include "gpu_backend.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../kernels/kernel_params.h"
#include "../error.hpp"

namespace pkv {

namespace {

using namespace gpu;

static_assert(sizeof(PkvTableEntry) == sizeof(TableEntry), "table entries cross to the device as they are");
static_assert(sizeof(PkvRowSlot) == sizeof(RowSlot), "row slots cross to the device as they are");
static_assert(sizeof(PkvPageCopy) == sizeof(PageCopy), "page copies cross to the device as they are");
static_assert(kNoPart == UINT32_MAX, "the kernels know a sequence's only chunk by part UINT32_MAX");

constexpr unsigned kThreads = 128;
constexpr unsigned kFastSharedLimit = 48 * 1024; // what a block gets without opting in
constexpr uint64_t kMmaBytesInFlight = 64 * 1024; // per multiprocessor, to keep pace with its share of the bandwidth

uint64_t align16(uint64_t n) { return (n + 15) & ~uint64_t(15); }

// Where a pool's plan buffer keeps each array: offsets fixed by the pool's capacity.
struct PlanLayout {
  uint64_t slots, lengths, seq_chunks, chunks, bytes;
};

PlanLayout plan_layout(uint32_t max_sequences, uint32_t max_chunks) {
  PlanLayout l;
  l.slots = align16(sizeof(PkvPlanHeader));
  l.lengths = l.slots + align16(4ull * max_sequences);
  l.seq_chunks = l.lengths + align16(4ull * max_sequences);
  l.chunks = l.seq_chunks + align16(4ull * (max_sequences + 1));
  l.bytes = l.chunks + uint64_t(max_chunks) * sizeof(PkvChunk);
  return l;
}

// The decode kernel families, newest first; PKV_DECODE_KERNEL names an older one for A/B runs.
enum class DecodeKind { mma, fast, generic };
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
  return p;
}

// Pieces of host memory gathered into one upload: each gets a 16-byte aligned offset.
class Upload {
 public:
  uint64_t add(const void *src, uint64_t bytes) {
    place(align16(total_), src, bytes);
    return pieces_.back().offset;
  }
  // At a given offset (16-byte aligned; the bytes between pieces are left as they are).
  void place(uint64_t offset, const void *src, uint64_t bytes) {
    pieces_.push_back({src, bytes, offset});
    total_ = std::max(total_, offset + bytes);
  }
  uint64_t total() const { return total_; }
  void copy_into(uint8_t *dst) const {
    for (const Piece &p : pieces_)
      if (p.bytes) std::memcpy(dst + p.offset, p.src, p.bytes);
  }

 private:
  struct Piece {
    const void *src;
    uint64_t bytes, offset;
  };
  std::vector<Piece> pieces_;
  uint64_t total_ = 0;
};

static_assert(kGpuChunkTokens == PKV_MMA_WARPS * PKV_MMA_TOKENS, "a block's stage");

class GpuBackend final : public Backend {
 public:
  GpuBackend(std::unique_ptr<Device> device, void *stream) : dev_(std::move(device)) {
    const char *kernel = std::getenv("PKV_DECODE_KERNEL");
    kind_ = decode_kind_from_environment(kernel);
    narrow_ = !(kernel && std::strcmp(kernel, "mma16") == 0);
    narrow_ntiles_ = narrow_ && !(kernel && std::strcmp(kernel, "mma8") == 0);
    four_block_kernels_ = !(kernel && std::strcmp(kernel, "mma3") == 0);
    group_tiles_ = !(kernel && std::strcmp(kernel, "mma8x4") == 0);
    balance_ = balance_from_environment(std::getenv("PKV_PLAN"));
    try {
      Current current(*this);
      int sms = 0, warp = 0;
      check(dev_->attribute(Attribute::multiprocessors, &sms));
      check(dev_->attribute(Attribute::warp_size, &warp));
      sms_ = uint32_t(std::max(1, sms));
      warp_ = unsigned(std::max(1, warp));
      if (stream) {
        stream_ = static_cast<Stream>(stream);
      } else {
        check(dev_->stream_create(&stream_));
        own_stream_ = true;
      }
      for (HostStage &h : stages_) check(dev_->event_create(&h.sent, false));
      const Images &images = dev_->images();
      load_module(images.pages, &pages_module_);
      load_module(images.decode, &decode_module_);
      load_module(images.fast, &fast_module_);
      if (images.mma) load_module(images.mma, &mma_module_);
      // Only an sm_90a image has the group tile's kernels (all or none).
      Function group = nullptr;
      group_tiles_ = group_tiles_ && mma_module_ &&
                     dev_->function(&group, mma_module_, "pkv_decode_mmag_128_5_5_3").result == kSuccess;
      apply_table_ = function(pages_module_, "pkv_apply_table");
      scatter_ = function(pages_module_, "pkv_scatter");
      gather_ = function(pages_module_, "pkv_gather");
      copy_pages_ = function(pages_module_, "pkv_copy_pages");
      read_bandwidth_ = function(pages_module_, "pkv_read_bandwidth");
      for (int nv = 1; nv <= 8; nv++)
        partial_[nv - 1] = function(decode_module_, ("pkv_decode_partial_" + std::to_string(nv)).c_str());
      merge_ = function(decode_module_, "pkv_decode_merge");
    } catch (...) {
      teardown();
      throw;
    }
  }

  ~GpuBackend() override { teardown(); }

  pkv_backend kind() const override { return dev_->kind(); }
  uint32_t workers(const PoolGeometry &g, uint32_t rows) override {
    if (decode_kind(g) != DecodeKind::mma) return sms_;
    return sms_ * mma_blocks_per_sm(g, mma_shape(g, rows));
  }
  // Float pages in the narrow tile: the kernel waits on memory, and a multiprocessor's share of the
  // bandwidth needs about 64 KB in flight (a block has all its stages but the computing one loading):
  // blocks beyond that only split the share. Quantized pages are bound by instruction issue, and the
  // wide tile does twice the tensor-core work a byte (one block a multiprocessor measured 7% slower on
  // speculative verify of 4 tokens): every block counts.
  uint32_t full_rate_workers(const PoolGeometry &g, uint32_t rows) override {
    if (decode_kind(g) != DecodeKind::mma || !float_pages(g)) return workers(g, rows);
    const MmaShape shape = mma_shape(g, rows);
    if (!shape.narrow()) return workers(g, rows);
    const uint64_t in_flight = uint64_t(mma_stages(g, shape.tile) - 1) * mma_stage_bytes(g);
    const uint64_t blocks = (kMmaBytesInFlight + in_flight - 1) / in_flight;
    return sms_ * uint32_t(std::min<uint64_t>(mma_blocks_per_sm(g, shape), blocks));
  }
  // A block streams a chunk a tile at a time: short chunks over many multiprocessors finish sooner
  // than long ones over few, and the merge of a few partials is cheap.
  uint32_t min_chunk_tokens() const override { return kGpuChunkTokens; }
  uint32_t chunk_granule_tokens() const override { return kGpuChunkTokens; }
  PlanLimits plan_limits(const PoolGeometry &g) override {
    return chosen_plan_bounds(g.max_sequences, g.kv_heads, workers(g, 1)); // the most blocks at once
  }
  // The plan buffer holds a record per (chunk, KV head) of the tensor-core kernel's plans: as many as
  // a balanced plan may have (PlanLimits::pieces).
  uint64_t plan_buffer_bytes(const PoolGeometry &g) override {
    return plan_layout(g.max_sequences, plan_limits(g).pieces).bytes;
  }
  // Balanced plans where the tensor-core kernel's blocks each serve all of a KV head's query rows:
  // the launch is then one block for each full-rate worker, which takes its pieces in turn.
  Balance plan_balance(const PoolGeometry &g, uint32_t rows) override {
    if (decode_kind(g) != DecodeKind::mma) return Balance::never;
    return rows <= mma_shape(g, rows).rows() ? balance_ : Balance::never;
  }

  DevPtr alloc(uint64_t bytes) override {
    Current current(*this);
    DevPtr p = 0;
    const Call c = dev_->alloc(&p, size_t(std::max<uint64_t>(bytes, 1)));
    if (c.result == kOutOfMemory)
      fail(PKV_ERR_OUT_OF_MEMORY, "%s of %llu bytes: the device has too little free memory", c.name,
           (unsigned long long)bytes);
    check(c);
    return p;
  }

  void release(DevPtr ptr) noexcept override {
    if (!ptr) return;
    int token = 0;
    if (dev_->enter(&token).result != kSuccess) return;
    dev_->stream_synchronize(stream_); // the memory may still be read by queued work
    dev_->free(ptr);
    dev_->leave(token);
  }

  void copy_pages(const PoolGeometry &g, const PageCopy *copies, uint32_t n) override {
    if (n == 0) return;
    Current current(*this);
    Upload up;
    const uint64_t at = up.add(copies, uint64_t(n) * sizeof(PageCopy));
    const DevPtr dev = send(up);
    PkvCopyParams p{};
    p.pool = pool_params(g);
    p.copies = dev + at;
    p.count = n;
    launch(copy_pages_, n, g.layers, 1, &p, 256);
  }

  void scatter(const PoolGeometry &g, const ScatterArgs &a) override {
    Current current(*this);
    const uint64_t row_bytes = uint64_t(a.rows) * g.kv_heads * g.head_dim * io_elem_bytes(a.format);
    Upload up;
    const uint64_t table_at = up.add(a.table.entries, uint64_t(a.table.count) * sizeof(TableEntry));
    const uint64_t slots_at = up.add(a.slots, uint64_t(a.rows) * sizeof(RowSlot));
    const bool host = a.memory == PKV_MEMORY_HOST;
    const uint64_t k_at = host ? up.add(a.k, row_bytes) : 0, v_at = host ? up.add(a.v, row_bytes) : 0;
    const DevPtr dev = send(up);
    apply_table(g, a.table, dev + table_at);
    PkvRowsParams p{};
    p.pool = pool_params(g);
    p.slots = dev + slots_at;
    p.k = host ? dev + k_at : DevPtr(uintptr_t(a.k));
    p.v = host ? dev + v_at : DevPtr(uintptr_t(a.v));
    p.rows = a.rows;
    p.layer = a.layer;
    p.format = uint32_t(a.format);
    launch(scatter_, blocks_for(2ull * a.rows * g.kv_heads * (g.head_dim / 32), kThreads), 1, 1, &p, kThreads);
  }

  void gather(const PoolGeometry &g, const GatherArgs &a) override {
    Current current(*this);
    const uint64_t row_bytes = uint64_t(a.rows) * g.kv_heads * g.head_dim * io_elem_bytes(a.format);
    Upload up;
    const uint64_t table_at = up.add(a.table.entries, uint64_t(a.table.count) * sizeof(TableEntry));
    const uint64_t slots_at = up.add(a.slots, uint64_t(a.rows) * sizeof(RowSlot));
    const DevPtr dev = send(up);
    apply_table(g, a.table, dev + table_at);
    const bool host = a.memory == PKV_MEMORY_HOST;
    if (host) ensure(&rows_out_, 2 * align16(row_bytes));
    PkvRowsParams p{};
    p.pool = pool_params(g);
    p.slots = dev + slots_at;
    p.k = !a.k ? 0 : host ? rows_out_.ptr : DevPtr(uintptr_t(a.k));
    p.v = !a.v ? 0 : host ? rows_out_.ptr + align16(row_bytes) : DevPtr(uintptr_t(a.v));
    p.rows = a.rows;
    p.layer = a.layer;
    p.format = uint32_t(a.format);
    launch(gather_, blocks_for(2ull * a.rows * g.kv_heads * g.head_dim, kThreads), 1, 1, &p, kThreads);
    if (!host) {
      check(dev_->stream_synchronize(stream_));
      return;
    }
    // K's rows, then V's from align16(row_bytes): the span of those asked for, in one transfer.
    const uint64_t first = a.k ? 0 : align16(row_bytes), end = a.v ? align16(row_bytes) + row_bytes : row_bytes;
    const uint8_t *rows = receive(rows_out_.ptr + first, end - first);
    if (a.k) std::memcpy(a.k, rows, size_t(row_bytes));
    if (a.v) std::memcpy(a.v, rows + align16(row_bytes) - first, size_t(row_bytes));
  }

  void prepare_decode(const PoolGeometry &g, const DecodeBatch &b) override {
    Current current(*this);
    upload_plan(g, b);
  }

  // Launches only, once the plan is on the device: nothing here waits for the device, allocates or
  // uploads, so the call can be captured in a graph (checked first, before anything changes).
  void decode(const PoolGeometry &g, const DecodeBatch &b) override {
    Current current(*this);
    const uint64_t heads = uint64_t(b.count) * b.q_tokens * b.q_heads; // query rows
    const uint64_t q_bytes = heads * g.head_dim * io_elem_bytes(b.q_format);
    const uint64_t out_bytes = heads * g.head_dim * io_elem_bytes(b.out_format);
    const bool host = b.memory == PKV_MEMORY_HOST, upload = b.table.count || !b.plan_resident;
    const DecodeKernel k = decode_kernel(g, b);
    const uint64_t parts = plan_limits(g).parts;
    const uint64_t part_rows = parts * b.q_tokens * b.q_heads;
    const uint64_t counters = parts * g.kv_heads * k.row_tiles;

    int capture = 0;
    check(dev_->stream_capture_status(stream_, &capture));
    if (capture != 0) {
      if (host) fail(PKV_ERR_INVALID_ARGUMENT, "a decode captured in a graph needs memory = PKV_MEMORY_DEVICE");
      if (upload)
        fail(PKV_ERR_INVALID_ARGUMENT, "the stream is capturing a graph but this batch's plan is not on the device: call "
             "pkv_decode_prepare with the batch before capturing (and before each replay after it changed)");
      if (k.kind != DecodeKind::mma) {
        const std::string none = dev_->images().mma ? "" : std::string("; the ") + dev_->name() + " backend has none";
        fail(PKV_ERR_UNSUPPORTED, "only the tensor-core decode kernel can be captured (pages of F16, BF16, Q8_0 or "
             "Q4_0 with head_dim 64, 128 or 256, PKV_DECODE_KERNEL unset, and shared memory for it: not head_dim 256 on "
             "99 KB a block)%s", none.c_str());
      }
      if (part_rows * g.head_dim * 4 > part_out_.bytes || counters * 4 > counters_.bytes)
        fail(PKV_ERR_INVALID_ARGUMENT, "decode a batch of this shape once before capturing it: its scratch buffers are "
             "sized on first use");
    }
    if (upload) upload_plan(g, b);
    grow_kept(&part_out_, part_rows * g.head_dim * 4);
    grow_kept(&part_lse_, part_rows * 4);
    if (grow_kept(&counters_, counters * 4))
      check(dev_->fill32(counters_.ptr, 0, size_t(counters_.bytes / 4), stream_));

    Upload up;
    const uint64_t q_at = host ? up.add(b.q, q_bytes) : 0;
    const DevPtr dev = send(up);
    if (host) ensure(&decode_out_, align16(out_bytes) + heads * 4);

    const DecodePlan &plan = *b.plan;
    const PlanLayout l = plan_layout(g.max_sequences, plan_limits(g).pieces);
    PkvDecodeParams p{};
    p.pool = pool_params(g);
    p.plan = g.plan;
    p.seq_slots = g.plan + l.slots;
    p.lengths = g.plan + l.lengths;
    p.chunks = g.plan + l.chunks;
    p.seq_chunks = g.plan + l.seq_chunks;
    p.q = host ? dev + q_at : DevPtr(uintptr_t(b.q));
    p.out = host ? decode_out_.ptr : DevPtr(uintptr_t(b.out));
    p.lse = !b.lse ? 0 : host ? decode_out_.ptr + align16(out_bytes) : DevPtr(uintptr_t(b.lse));
    p.part_out = part_out_.ptr;
    p.part_lse = part_lse_.ptr;
    p.counters = counters_.ptr;
    p.layer = b.layer;
    p.count = b.count;
    p.q_heads = b.q_heads;
    p.q_tokens = b.q_tokens;
    p.n_chunks = uint32_t(plan.chunks.size()); // the older kernels' (the tensor-core kernel reads the plan's)
    p.row_tiles = k.row_tiles;
    p.mtiles = k.mtiles;
    p.q_aligned = p.q % 16 == 0;
    p.q_format = uint32_t(b.q_format);
    p.out_format = uint32_t(b.out_format);
    p.scale = b.scale;

    const unsigned n_chunks = unsigned(plan.chunks.size());
    switch (k.kind) {
    case DecodeKind::mma:
      // Blocks loop over items, so a replay of a larger plan is still covered; a balanced plan's
      // workers are one block each (one row tile: plan_balance).
      launch(k.fn, plan.workers ? plan.workers : n_chunks * g.kv_heads * k.row_tiles, 1, 1, &p,
             k.mtiles * PKV_MMA_WARPS * 32, 1, 1, k.shared_bytes);
      break;
    case DecodeKind::fast:
      launch(k.fn, n_chunks, g.kv_heads, k.row_tiles, &p, g.head_dim / 8, k.bdy, k.bdz, k.shared_bytes);
      break;
    case DecodeKind::generic:
      launch(k.fn, n_chunks, g.kv_heads, k.row_tiles, &p, PKV_DECODE_WARPS * 32);
      break;
    }
    // The older kernels leave split sequences to the merge kernel.
    if (k.kind != DecodeKind::mma && plan.parts) launch(merge_, b.count * b.q_tokens, b.q_heads, 1, &p, std::min(256u, g.head_dim));
    if (host) { // out, then lse from align16(out_bytes): one transfer
      const uint8_t *r = receive(decode_out_.ptr, b.lse ? align16(out_bytes) + heads * 4 : out_bytes);
      std::memcpy(b.out, r, size_t(out_bytes));
      if (b.lse) std::memcpy(b.lse, r + align16(out_bytes), size_t(heads * 4));
    }
  }

  void synchronize() override {
    Current current(*this);
    check(dev_->stream_synchronize(stream_));
  }

  // Best of several timed passes of pkv_read_bandwidth over a buffer far larger than the L2.
  double read_bandwidth(uint64_t bytes) override {
    Current current(*this);
    const uint64_t n = std::max<uint64_t>(bytes ? bytes : 2ull << 30, 1 << 20) & ~uint64_t(15);
    DeviceBuffer buf;
    Event start = nullptr, end = nullptr;
    double best = 0.0;
    try {
      check(dev_->alloc(&buf.ptr, size_t(n) + 16), " (bandwidth buffer)");
      check(dev_->event_create(&start, true));
      check(dev_->event_create(&end, true));
      PkvReadParams p{buf.ptr, n, buf.ptr + n};
      for (int pass = 0; pass < 12; pass++) {
        check(dev_->event_record(start, stream_));
        launch(read_bandwidth_, sms_ * 8, 1, 1, &p, 512);
        check(dev_->event_record(end, stream_));
        check(dev_->event_synchronize(end));
        float ms = 0.0f;
        check(dev_->event_elapsed_ms(&ms, start, end));
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
  // Makes the backend's device current on this thread for the scope.
  struct Current {
    explicit Current(GpuBackend &b) : b_(b) { b_.check(b_.dev_->enter(&token_)); }
    ~Current() { b_.dev_->leave(token_); }
    GpuBackend &b_;
    int token_ = 0;
  };

  struct DeviceBuffer {
    DevPtr ptr = 0;
    uint64_t bytes = 0;
  };
  struct PinnedBuffer {
    void *ptr = nullptr;
    uint64_t bytes = 0;
  };

  // `what` follows the call's name in the message: "cuMemAlloc (scratch)".
  void check(Call c, const char *what = "") const {
    if (c.result == kSuccess) return;
    fail(c.result == kOutOfMemory ? PKV_ERR_OUT_OF_MEMORY : PKV_ERR_BACKEND, "%s%s: %s", c.name, what,
         dev_->describe(c.result).c_str());
  }

  void destroy_events_and(DeviceBuffer &buf, Event start, Event end) noexcept {
    if (start) dev_->event_destroy(start);
    if (end) dev_->event_destroy(end);
    if (buf.ptr) dev_->free(buf.ptr);
  }

  void load_module(const unsigned char *image, Module *module) {
    const Call c = dev_->module_load(module, image);
    if (c.result != kSuccess)
      fail(PKV_ERR_UNSUPPORTED, "the kernels (built for %s) do not load on this device (%s): %s", dev_->images().targets,
           dev_->identity().c_str(), dev_->describe(c.result).c_str());
  }

  Function function(Module module, const char *name) {
    Function f = nullptr;
    check(dev_->function(&f, module, name), (" " + std::string(name)).c_str());
    return f;
  }

  template <class Params>
  void launch(Function f, unsigned gx, unsigned gy, unsigned gz, Params *params, unsigned bx, unsigned by = 1,
              unsigned bz = 1, unsigned shared_bytes = 0) {
    void *args[] = {params};
    check(dev_->launch(f, gx, gy, gz, bx, by, bz, shared_bytes, stream_, args));
  }

  // PKV_DECODE_KERNEL=mma|fast|generic picks a family for A/B runs; by default the newest the runtime
  // has (the tensor-core kernels are CUDA-only). mma16: the tensor-core kernel with wide tiles only;
  // mma8: narrow tiles of one n-tile only (wide tiles for more rows); mma3: without the four-block
  // variants.
  DecodeKind decode_kind_from_environment(const char *kernel) const {
    const bool mma = dev_->images().mma != nullptr;
    if (kernel && std::strcmp(kernel, "fast") == 0) return DecodeKind::fast;
    if (kernel && std::strcmp(kernel, "generic") == 0) return DecodeKind::generic;
    const bool mma_named = kernel && (std::strcmp(kernel, "mma") == 0 || std::strcmp(kernel, "mma16") == 0 ||
                                      std::strcmp(kernel, "mma8") == 0 || std::strcmp(kernel, "mma3") == 0 ||
                                      std::strcmp(kernel, "mma8x4") == 0);
    if (mma_named && !mma)
      fail(PKV_ERR_UNSUPPORTED, "PKV_DECODE_KERNEL=%s: the tensor-core decode kernels are CUDA-only; the %s backend "
           "has fast and generic", kernel, dev_->name());
    return mma ? DecodeKind::mma : DecodeKind::fast;
  }

  // PKV_PLAN=balanced|cheaper: balanced plans wherever the tensor-core kernel may take them, or where
  // the planner finds them cheaper; unset or uniform: sequence-wide chunks only. Balanced plans are
  // not the default: on the H200 they measured no faster but on one row (docs/cuda.md, "Balanced plans").
  static Balance balance_from_environment(const char *plan) {
    if (!plan || !*plan) return Balance::never;
    if (std::strcmp(plan, "cheaper") == 0) return Balance::cheaper;
    if (std::strcmp(plan, "uniform") == 0) return Balance::never;
    if (std::strcmp(plan, "balanced") == 0) return Balance::always;
    fail(PKV_ERR_INVALID_ARGUMENT, "PKV_PLAN=%s: expected uniform, balanced or cheaper (or unset)", plan);
  }

  // The tensor-core kernel's tiles of query rows (MmaShape): wide, narrow of 1, 2 or 4 n-tiles, or
  // the group tile (the warpgroup MMA of sm_90a) of 4.
  enum MmaTile : unsigned { kWide, kNarrow1, kNarrow2, kNarrow4, kGroup4, kMmaTiles };

  // The decode kernel for this pool and batch, and its launch shape: the chosen family where it has
  // a kernel for the pool's head_dim and formats (F16/BF16/Q8_0/Q4_0 pages, head_dim 64/128/256),
  // else the generic one.
  struct DecodeKernel {
    DecodeKind kind = DecodeKind::generic;
    Function fn = nullptr;
    unsigned row_tiles = 1, mtiles = 1, bdy = 0, bdz = 0, shared_bytes = 0;
  };

  // The tensor-core kernel serves where the device's shared memory per block holds it for the pool
  // (not head_dim 256 on sm_86/sm_89's 99 KB); the CUDA-core kernel serves there instead.
  DecodeKind decode_kind(const PoolGeometry &g) {
    const uint32_t D = g.head_dim;
    auto specialised = [](pkv_format f) { return f != PKV_FORMAT_F32; };
    if (!((D == 64 || D == 128 || D == 256) && specialised(g.k.format) && specialised(g.v.format)))
      return DecodeKind::generic;
    return kind_ == DecodeKind::mma && !mma_fits(g) ? DecodeKind::fast : kind_;
  }

  // The specialised kernel of a family for the pool's head_dim and formats, looked up once (for the
  // tensor-core kernel, of the tile kind).
  Function specialised_function(const PoolGeometry &g, DecodeKind kind, MmaTile tile = kWide) {
    const bool mma = kind == DecodeKind::mma, narrow = tile != kWide;
    const unsigned d = g.head_dim / 128, kf = g.k.format - PKV_FORMAT_F16, vf = g.v.format - PKV_FORMAT_F16;
    Function &fn = mma ? mma_functions_[tile][d][kf][vf] : fast_functions_[d][kf][vf];
    if (fn) return fn;
    Current current(*this);
    const std::string formats = std::to_string(g.head_dim) + "_" + std::to_string(int(g.k.format)) + "_" +
                                std::to_string(int(g.v.format));
    if (!mma) return fn = function(fast_module_, ("pkv_decode_fast_" + formats).c_str());
    // The most stages whose largest block (two wide row tiles, one narrow) fits the device's shared
    // memory: pkv_mma_stages, else pkv_mma_fewer_stages; none when neither fits.
    const MmaShape largest{tile, narrow ? 1u : 2u};
    static const char *const prefix[kMmaTiles] = {"pkv_decode_mma16_", "pkv_decode_mma8_", "pkv_decode_mma8x2_",
                                                  "pkv_decode_mma8x4_", "pkv_decode_mmag_"};
    for (uint32_t stages : {pkv_mma_stages(g.head_dim), pkv_mma_fewer_stages(g.head_dim, float_pages(g))}) {
      if (!stages) break;
      const std::string name = prefix[tile] + formats + "_" + std::to_string(stages);
      fn = function(mma_module_, name.c_str());
      const unsigned bytes = mma_shared_bytes(g, largest, stages);
      if (fits_shared_memory(fn, bytes, name)) {
        check(dev_->tensor_cores()->set_shared_limit(fn, int(bytes)), (" " + name).c_str());
        mma_stages_[tile][d][kf][vf] = uint8_t(stages);
        if (tile == kNarrow1 && stages == 3 && four_block_variant(g))
          if (Function four = four_block_function(name + "_4blocks", bytes)) fn = four;
        break;
      }
    }
    return fn;
  }
  // The narrow head_dim 128 kernels with quantized K and Q4_0 V come in a four-block variant too (128
  // registers): bound by instruction issue, they gain from the fourth block's warps, and the planner
  // fills them (H200: 32x4K Q4_0 16% faster, 8x32K 4%; docs/perf/decisions.md).
  bool four_block_variant(const PoolGeometry &g) const {
    return four_block_kernels_ && g.head_dim == 128 && is_quantized(g.k.format) && g.v.format == PKV_FORMAT_Q4_0;
  }
  // The variant, where four of its blocks fit a multiprocessor (else null: the three-block kernel
  // keeps its registers).
  Function four_block_function(const std::string &name, unsigned bytes) {
    Function fn = function(mma_module_, name.c_str());
    check(dev_->tensor_cores()->set_shared_limit(fn, int(bytes)), (" " + name).c_str());
    int blocks = 0;
    check(dev_->tensor_cores()->occupancy(&blocks, fn, PKV_MMA_WARPS * 32, bytes));
    return blocks >= 4 ? fn : nullptr;
  }
  Function mma_function(const PoolGeometry &g, MmaTile tile) { return specialised_function(g, DecodeKind::mma, tile); }
  // The tensor-core kernel's stage count for the pool, 0 when no block of it fits the device.
  unsigned mma_stages(const PoolGeometry &g, MmaTile tile) {
    mma_function(g, tile);
    return mma_stages_[tile][g.head_dim / 128][g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16];
  }
  // The wide tile and the narrow one of one n-tile serve every batch; the others where they fit.
  bool mma_fits(const PoolGeometry &g) { return mma_stages(g, kWide) != 0 && mma_stages(g, kNarrow1) != 0; }

  // Whether `dynamic` bytes of shared memory and f's own arrays fit what a block may opt in to on
  // this device. PKV_TEST_SHARED_LIMIT (bytes) lowers the device's figure, so that a large GPU runs
  // a small one's choices.
  bool fits_shared_memory(Function f, unsigned dynamic, const std::string &name) {
    int per_block = 0, own = 0;
    check(dev_->tensor_cores()->shared_per_block(&per_block));
    check(dev_->tensor_cores()->static_shared(f, &own), (" " + name).c_str());
    if (const char *cap = std::getenv("PKV_TEST_SHARED_LIMIT")) per_block = std::min(per_block, std::atoi(cap));
    return int64_t(dynamic) + own <= per_block;
  }

  DecodeKernel decode_kernel(const PoolGeometry &g, const DecodeBatch &b) {
    const uint32_t D = g.head_dim, rows = b.q_tokens * (b.q_heads / g.kv_heads); // query rows a KV head serves
    DecodeKernel k;
    k.kind = decode_kind(g);
    if (k.kind == DecodeKind::generic) {
      k.fn = partial_[D / 32 - 1];
      k.row_tiles = (rows + PKV_HEAD_TILE - 1) / PKV_HEAD_TILE;
      return k;
    }
    if (k.kind == DecodeKind::mma) {
      const MmaShape shape = mma_shape(g, rows);
      k.fn = mma_function(g, shape.tile);
      k.mtiles = shape.mtiles;
      k.row_tiles = (rows + shape.rows() - 1) / shape.rows();
      k.shared_bytes = mma_shared_bytes(g, shape, mma_stages(g, shape.tile));
      return k;
    }
    k.fn = specialised_function(g, k.kind);
    // Shared-memory row strides as the fast kernel lays them out: data then scales, 16-byte aligned.
    auto stride = [](const PlaneLayout &l) { return unsigned(align16(l.row_data_bytes + l.row_scale_bytes)); };
    const unsigned bdx = D / 8, row_bytes = stride(g.k) + stride(g.v), max_threads = PKV_FAST_MAX_THREADS;
    // Whole warps (wavefronts on AMD: 32 or 64 lanes, as the runtime says): the row reductions shuffle.
    k.bdy = std::min(rows, max_threads / bdx);
    k.bdz = 1;
    while ((bdx * k.bdy * k.bdz) % warp_ != 0) k.bdz *= 2;
    while (bdx * k.bdy * k.bdz > max_threads) { // an odd group too large for that: fewer heads
      k.bdy -= 1;
      k.bdz = 1;
      while ((bdx * k.bdy * k.bdz) % warp_ != 0) k.bdz *= 2;
    }
    auto stages = [&](unsigned bdz) { return PKV_FAST_STAGES * PKV_FAST_TT * bdz * row_bytes; };
    while (bdx * k.bdy * k.bdz * 2 <= max_threads && stages(k.bdz * 2) <= kFastSharedLimit) k.bdz *= 2;
    k.shared_bytes = std::max(stages(k.bdz), k.bdz * k.bdy * (D + 2) * 4);
    k.row_tiles = (rows + k.bdy - 1) / k.bdy;
    return k;
  }

  // The query rows one block of the tensor-core kernel serves: a narrow tile (PKV_MMA_NARROW_ROWS)
  // when a KV head's rows fit one; where K and V are quantized (head_dim 64 and 128), a narrow tile of
  // 2 or 4 n-tiles (16 or 32 rows), which converts each K and V fragment once for all of them; else
  // one or two wide tiles (PKV_MMA_ROWS each, PKV_MMA_WARPS warps each): two when a KV head has more
  // rows than one, so the stages serve them all.
  struct MmaShape {
    MmaTile tile;
    unsigned mtiles; // wide row tiles a block; 1 for narrow tiles
    bool narrow() const { return tile != kWide; }
    unsigned rows() const {
      if (tile == kGroup4) return 4 * PKV_MMA_NARROW_ROWS;
      return narrow() ? PKV_MMA_NARROW_ROWS << (tile - kNarrow1) : PKV_MMA_ROWS * mtiles;
    }
  };
  MmaShape mma_shape(const PoolGeometry &g, uint32_t rows) {
    if (narrow_ && rows <= PKV_MMA_NARROW_ROWS) return {kNarrow1, 1};
    if (narrow_ntiles_ && is_quantized(g.k.format) && is_quantized(g.v.format) && g.head_dim <= 128) {
      const MmaTile tile = rows <= 2 * PKV_MMA_NARROW_ROWS ? kNarrow2 : kNarrow4;
      if (tile == kNarrow4 && group_tile(g)) return {kGroup4, 1};
      if (mma_stages(g, tile)) return {tile, 1};
    }
    return {kWide, rows <= PKV_MMA_ROWS ? 1u : 2u};
  }

  // The group tile serves Q4_0 K and V at head_dim 128 where the image has it (sm_90a): speculative
  // verify of 8 tokens at 8x32K 5% faster than Narrow<4>; with Q8_0 pages it was no faster (-0.4%
  // to +2%; docs/perf/decisions.md).
  bool group_tile(const PoolGeometry &g) {
    return group_tiles_ && g.head_dim == 128 && g.k.format == PKV_FORMAT_Q4_0 && g.v.format == PKV_FORMAT_Q4_0 &&
           mma_stages(g, kGroup4);
  }

  // Blocks of the tensor-core kernel a multiprocessor holds at once, for the pool and row tiles.
  uint32_t mma_blocks_per_sm(const PoolGeometry &g, MmaShape shape) {
    uint32_t &n = mma_blocks_per_sm_[shape.tile + kMmaTiles * (shape.mtiles - 1)][g.head_dim / 128]
                                    [g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16];
    if (!n) {
      Current current(*this);
      int blocks = 0;
      check(dev_->tensor_cores()->occupancy(&blocks, mma_function(g, shape.tile), shape.mtiles * PKV_MMA_WARPS * 32,
                                            mma_shared_bytes(g, shape, mma_stages(g, shape.tile))));
      n = uint32_t(std::max(1, blocks));
    }
    return n;
  }
  static int float_pages(const PoolGeometry &g) { return !is_quantized(g.k.format) && !is_quantized(g.v.format); }

  // The tensor-core kernel's shared memory, as decode_mma.cu's Mma<> lays it out (it checks the
  // kernel_params.h sizes at compile time): `stages` stages of PKV_MMA_WARPS x PKV_MMA_TOKENS K and V
  // rows, q fragments of each row tile, and the warps' combine area of each row tile (which reuses
  // the others once a chunk is done).
  static unsigned mma_stage_bytes(const PoolGeometry &g) {
    auto part = [&](const PlaneLayout &l) {
      return pkv_mma_part_bytes(uint32_t(l.row_data_bytes + l.row_scale_bytes), is_quantized(l.format));
    };
    return part(g.k) + part(g.v);
  }
  static unsigned mma_shared_bytes(const PoolGeometry &g, MmaShape shape, unsigned stages) {
    const unsigned D = g.head_dim, rows = shape.rows() / shape.mtiles, mtiles = shape.mtiles;
    const unsigned q = pkv_mma_q_bytes(D, rows, is_quantized(g.k.format), shape.tile > kNarrow1);
    const unsigned outputs = shape.tile == kGroup4 ? 1 : PKV_MMA_WARPS;
    return std::max(stages * mma_stage_bytes(g) + mtiles * q, mtiles * pkv_mma_combine_bytes(D, rows, outputs));
  }

  // Sends the batch's queued table changes and, unless the pool's plan buffer holds it already, the
  // plan: header and arrays at the buffer's fixed offsets, in one transfer.
  void upload_plan(const PoolGeometry &g, const DecodeBatch &b) {
    if (b.table.count) {
      Upload t;
      const uint64_t at = t.add(b.table.entries, uint64_t(b.table.count) * sizeof(TableEntry));
      apply_table(g, b.table, send(t) + at);
    }
    if (b.plan_resident) return;
    const DecodePlan &plan = *b.plan;
    const PlanLayout l = plan_layout(g.max_sequences, plan_limits(g).pieces);
    // The tensor-core kernel takes a record per item's (chunk, KV head): a uniform plan's chunk
    // becomes one for each KV head, a balanced plan's pieces (fillers too) are one already. The older
    // kernels take one per chunk, with the KV head from the grid.
    const bool per_head = decode_kind(g) == DecodeKind::mma && !plan.workers;
    const uint64_t records = per_head ? plan.chunks.size() * g.kv_heads : plan.chunks.size();
    if (records > (l.bytes - l.chunks) / sizeof(PkvChunk) || b.count > g.max_sequences)
      fail(PKV_ERR_INTERNAL, "a plan of %zu chunks for %u sequences exceeds the pool's plan buffer",
           plan.chunks.size(), b.count);
    const PkvPlanHeader header{uint32_t(records), b.count, plan.parts, 0};
    Upload up;
    up.place(0, &header, sizeof header);
    up.place(l.slots, b.seq_slots, uint64_t(b.count) * 4);
    up.place(l.lengths, b.lengths, uint64_t(b.count) * 4);
    up.place(l.seq_chunks, plan.seq_chunks.data(), plan.seq_chunks.size() * 4);
    device_chunks_.clear();
    for (const DecodeChunk &c : plan.chunks) {
      const bool filler = c.seq == kNoSeq;
      PkvChunk d{c.seq, c.token_begin, c.token_end, c.part, filler ? 0 : b.seq_slots[c.seq],
                 filler ? 0 : b.lengths[c.seq], c.first_part, c.siblings, c.head, {}};
      if (!per_head) {
        device_chunks_.push_back(d);
        continue;
      }
      for (d.head = 0; d.head < g.kv_heads; d.head++) device_chunks_.push_back(d);
    }
    up.place(l.chunks, device_chunks_.data(), device_chunks_.size() * sizeof(PkvChunk));
    send(up, g.plan);
  }

  void apply_table(const PoolGeometry &g, const TableUpdates &t, DevPtr entries) {
    if (t.count == 0) return;
    PkvTableParams p{};
    p.pool = pool_params(g);
    p.entries = entries;
    p.count = t.count;
    launch(apply_table_, blocks_for(t.count, kThreads), 1, 1, &p, kThreads);
  }

  // Grows a scratch buffer; the old one may still be in use by queued work, so wait for it first.
  void ensure(DeviceBuffer *buf, uint64_t bytes) {
    if (bytes <= buf->bytes) return;
    check(dev_->stream_synchronize(stream_));
    const uint64_t want = std::max(bytes, 2 * buf->bytes);
    if (buf->ptr) dev_->free(buf->ptr);
    *buf = DeviceBuffer{};
    check(dev_->alloc(&buf->ptr, size_t(want)), " (scratch)");
    buf->bytes = want;
  }

  // Grows send's or receive's pinned host memory (to twice its size and 1 MB more, at least); no
  // transfer through it is in flight: send waits for its own first, receive's are waited for.
  void ensure_pinned(PinnedBuffer *buf, uint64_t bytes) {
    if (bytes <= buf->bytes) return;
    const uint64_t want = std::max<uint64_t>(bytes, 2 * buf->bytes + (1 << 20));
    if (buf->ptr) dev_->host_free(buf->ptr);
    *buf = PinnedBuffer{};
    check(dev_->host_alloc(&buf->ptr, size_t(want)), " (staging)");
    buf->bytes = want;
  }

  // Grows a buffer that captured graphs may hold the address of: the old one is kept (freed with the
  // backend), so a graph replayed with the shape it was captured with still finds memory there.
  // Returns whether it grew.
  bool grow_kept(DeviceBuffer *buf, uint64_t bytes) {
    if (bytes <= buf->bytes) return false;
    kept_.push_back(*buf);
    *buf = DeviceBuffer{};
    check(dev_->alloc(&buf->ptr, size_t(bytes)), " (decode scratch)");
    buf->bytes = bytes;
    return true;
  }

  // One packed host-to-device transfer through a pinned staging buffer into `dst` (0: the device
  // staging buffer); returns where it lands. Two pinned buffers take turns, so the host waits only
  // when the transfer before last is still going.
  DevPtr send(const Upload &up, DevPtr dst = 0) {
    if (up.total() == 0) return 0;
    HostStage &h = stages_[next_stage_];
    next_stage_ = 1 - next_stage_;
    if (h.pending) check(dev_->event_synchronize(h.sent));
    h.pending = false;
    ensure_pinned(&h.buffer, up.total());
    if (!dst) {
      ensure(&device_stage_, up.total()); // one device buffer: uploads are ordered by the stream
      dst = device_stage_.ptr;
    }
    up.copy_into(static_cast<uint8_t *>(h.buffer.ptr));
    check(dev_->copy_to_device(dst, h.buffer.ptr, size_t(up.total()), stream_));
    check(dev_->event_record(h.sent, stream_));
    h.pending = true;
    return dst;
  }

  // `bytes` from the device, in one transfer into a pinned buffer, waited for (with the work queued
  // before it). Into the caller's pageable memory the runtime would stage each copy itself: a decode
  // with host-memory results took two such copies.
  const uint8_t *receive(DevPtr src, uint64_t bytes) {
    ensure_pinned(&download_, bytes);
    check(dev_->copy_to_host(download_.ptr, src, size_t(bytes), stream_));
    check(dev_->stream_synchronize(stream_));
    return static_cast<const uint8_t *>(download_.ptr);
  }

  // Everything the backend made, in the device's context; the device itself is released after
  // (dev_ is destroyed last).
  void teardown() noexcept {
    int token = 0;
    if (dev_->enter(&token).result != kSuccess) return;
    if (stream_) dev_->stream_synchronize(stream_);
    for (DeviceBuffer *b : {&device_stage_, &part_out_, &part_lse_, &counters_, &decode_out_, &rows_out_})
      if (b->ptr) dev_->free(b->ptr);
    for (DeviceBuffer &b : kept_)
      if (b.ptr) dev_->free(b.ptr);
    if (download_.ptr) dev_->host_free(download_.ptr);
    for (HostStage &h : stages_) {
      if (h.buffer.ptr) dev_->host_free(h.buffer.ptr);
      if (h.sent) dev_->event_destroy(h.sent);
    }
    for (Module m : {pages_module_, decode_module_, fast_module_, mma_module_})
      if (m) dev_->module_unload(m);
    if (own_stream_) dev_->stream_destroy(stream_);
    dev_->leave(token);
  }

  std::unique_ptr<Device> dev_;
  Stream stream_ = nullptr;
  bool own_stream_ = false;
  uint32_t sms_ = 1;
  unsigned warp_ = 32; // lanes a warp (wavefront) has
  Module pages_module_ = nullptr, decode_module_ = nullptr, fast_module_ = nullptr, mma_module_ = nullptr;
  DecodeKind kind_ = DecodeKind::mma;
  bool narrow_ = true; // the tensor-core kernel's narrow tile serves where it can
  bool narrow_ntiles_ = true; // and its kinds of several n-tiles
  bool group_tiles_ = true;   // and the group tile where the image has it
  bool four_block_kernels_ = true; // the four-block variants serve where they exist and hold four blocks
  Balance balance_ = Balance::never; // what plan_balance offers the planner (PKV_PLAN)
  // Looked up once, by [head_dim / 128][K format][V format] (from F16); the tensor-core kernel's first
  // by [MmaTile].
  Function fast_functions_[3][4][4] = {}, mma_functions_[kMmaTiles][3][4][4] = {};
  std::vector<PkvChunk> device_chunks_; // the plan's chunks as uploaded (kept: its capacity is reused)
  uint8_t mma_stages_[kMmaTiles][3][4][4] = {}; // 0 until looked up, and where no block fits
  uint32_t mma_blocks_per_sm_[2 * kMmaTiles][3][4][4] = {}; // first by shape: tile + kMmaTiles (mtiles - 1)
  Function apply_table_ = nullptr, scatter_ = nullptr, gather_ = nullptr, copy_pages_ = nullptr, merge_ = nullptr;
  Function read_bandwidth_ = nullptr;
  Function partial_[8] = {};
  struct HostStage {
    PinnedBuffer buffer;
    Event sent = nullptr; // the transfer out of it has finished
    bool pending = false;
  };
  HostStage stages_[2];
  unsigned next_stage_ = 0;
  PinnedBuffer download_; // receive's
  DeviceBuffer device_stage_, part_out_, part_lse_, counters_, decode_out_, rows_out_;
  std::vector<DeviceBuffer> kept_; // outgrown decode scratch (grow_kept)
};

} // namespace

std::unique_ptr<Backend> make_gpu_backend(std::unique_ptr<gpu::Device> device, void *stream) {
  return std::make_unique<GpuBackend>(std::move(device), stream);
}

} // namespace pkv
