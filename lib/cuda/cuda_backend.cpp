#include "cuda_backend.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../error.hpp"
#include "../loader/cuda_driver.hpp"
#include "cuda_images.hpp"
#include "kernel_params.h"

namespace pkv {

namespace {

using namespace cu;

static_assert(sizeof(PkvTableEntry) == sizeof(TableEntry), "table entries cross to the device as they are");
static_assert(sizeof(PkvRowSlot) == sizeof(RowSlot), "row slots cross to the device as they are");
static_assert(sizeof(PkvPageCopy) == sizeof(PageCopy), "page copies cross to the device as they are");
static_assert(sizeof(PkvChunk) == sizeof(DecodeChunk), "chunks cross to the device as they are");
static_assert(kNoPart == UINT32_MAX, "the kernels know a sequence's only chunk by part UINT32_MAX");

constexpr unsigned kThreads = 128;
constexpr unsigned kFastSharedLimit = 48 * 1024; // what a block gets without opting in

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

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Driver &driver, int ordinal, void *stream) : cu_(driver) {
    check(cu_.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
    check(cu_.cuDevicePrimaryCtxRetain(&ctx_, device_), "cuDevicePrimaryCtxRetain");
    try {
      Current current(*this);
      int sms = 0;
      check(cu_.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_), "cuDeviceGetAttribute");
      sms_ = uint32_t(std::max(1, sms));
      if (stream) {
        stream_ = static_cast<CUstream>(stream);
      } else {
        check(cu_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        own_stream_ = true;
      }
      for (HostStage &h : stages_) check(cu_.cuEventCreate(&h.sent, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      load_module(cuda_image_pages, &pages_module_);
      load_module(cuda_image_decode, &decode_module_);
      load_module(cuda_image_decode_fast, &fast_module_);
      load_module(cuda_image_decode_mma, &mma_module_);
      kind_ = decode_kind_from_environment();
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

  ~CudaBackend() override { teardown(); }

  pkv_backend kind() const override { return PKV_BACKEND_CUDA; }
  uint32_t workers(const PoolGeometry &g, uint32_t rows) override {
    if (decode_kind(g) != DecodeKind::mma) return sms_;
    const unsigned mtiles = mma_tiles(rows);
    uint32_t &n = mma_blocks_per_sm_[g.head_dim / 128][g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16]
                                    [mtiles - 1];
    if (!n) {
      Current current(*this);
      int blocks = 0;
      check(cu_.cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, mma_function(g), mtiles * PKV_MMA_WARPS * 32,
                                                            mma_shared_bytes(g, mtiles)),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor");
      n = uint32_t(std::max(1, blocks));
    }
    return sms_ * n;
  }
  // A block streams a chunk a tile at a time: short chunks over many multiprocessors finish sooner
  // than long ones over few, and the merge of a few partials is cheap.
  uint32_t min_chunk_tokens() const override { return 64; }
  PlanLimits plan_limits(const PoolGeometry &g) override {
    return chosen_plan_bounds(g.max_sequences, g.kv_heads, workers(g, 1)); // the most blocks at once
  }
  uint64_t plan_buffer_bytes(const PoolGeometry &g) override {
    return plan_layout(g.max_sequences, plan_limits(g).chunks).bytes;
  }

  DevPtr alloc(uint64_t bytes) override {
    Current current(*this);
    CUdeviceptr p = 0;
    const CUresult r = cu_.cuMemAlloc(&p, size_t(std::max<uint64_t>(bytes, 1)));
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
      fail(PKV_ERR_OUT_OF_MEMORY, "cuMemAlloc of %llu bytes: the device has too little free memory",
           (unsigned long long)bytes);
    check(r, "cuMemAlloc");
    return p;
  }

  void release(DevPtr ptr) noexcept override {
    if (!ptr) return;
    CUcontext popped;
    if (cu_.cuCtxPushCurrent(ctx_) != CUDA_SUCCESS) return;
    cu_.cuStreamSynchronize(stream_); // the memory may still be read by queued work
    cu_.cuMemFree(ptr);
    cu_.cuCtxPopCurrent(&popped);
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
    if (host && a.k) check(cu_.cuMemcpyDtoHAsync(a.k, p.k, row_bytes, stream_), "cuMemcpyDtoHAsync");
    if (host && a.v) check(cu_.cuMemcpyDtoHAsync(a.v, p.v, row_bytes, stream_), "cuMemcpyDtoHAsync");
    check(cu_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
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

    int capture = CU_STREAM_CAPTURE_STATUS_NONE;
    check(cu_.cuStreamIsCapturing(stream_, &capture), "cuStreamIsCapturing");
    if (capture != CU_STREAM_CAPTURE_STATUS_NONE) {
      if (host) fail(PKV_ERR_INVALID_ARGUMENT, "a decode captured in a graph needs memory = PKV_MEMORY_DEVICE");
      if (upload)
        fail(PKV_ERR_INVALID_ARGUMENT, "the stream is capturing a graph but this batch's plan is not on the device: call "
             "pkv_decode_prepare with the batch before capturing (and before each replay after it changed)");
      if (k.kind != DecodeKind::mma)
        fail(PKV_ERR_UNSUPPORTED, "only the tensor-core decode kernel can be captured (pages of F16, BF16, Q8_0 or "
             "Q4_0 with head_dim 64, 128 or 256, PKV_DECODE_KERNEL unset)");
      if (part_rows * g.head_dim * 4 > part_out_.bytes || counters * 4 > counters_.bytes)
        fail(PKV_ERR_INVALID_ARGUMENT, "decode a batch of this shape once before capturing it: its scratch buffers are "
             "sized on first use");
    }
    if (upload) upload_plan(g, b);
    grow_kept(&part_out_, part_rows * g.head_dim * 4);
    grow_kept(&part_lse_, part_rows * 4);
    if (grow_kept(&counters_, counters * 4))
      check(cu_.cuMemsetD32Async(counters_.ptr, 0, size_t(counters_.bytes / 4), stream_), "cuMemsetD32Async");

    Upload up;
    const uint64_t q_at = host ? up.add(b.q, q_bytes) : 0;
    const DevPtr dev = send(up);
    if (host) ensure(&decode_out_, align16(out_bytes) + heads * 4);

    const DecodePlan &plan = *b.plan;
    const PlanLayout l = plan_layout(g.max_sequences, plan_limits(g).chunks);
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
    p.n_chunks = uint32_t(plan.chunks.size());
    p.row_tiles = k.row_tiles;
    p.mtiles = k.mtiles;
    p.q_aligned = p.q % 16 == 0;
    p.q_format = uint32_t(b.q_format);
    p.out_format = uint32_t(b.out_format);
    p.scale = b.scale;

    const unsigned n_chunks = unsigned(plan.chunks.size());
    switch (k.kind) {
    case DecodeKind::mma:
      // Blocks loop over items, so a replay of a larger plan is still covered.
      launch(k.fn, n_chunks * g.kv_heads * k.row_tiles, 1, 1, &p, k.mtiles * PKV_MMA_WARPS * 32, 1, 1, k.shared_bytes);
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
    if (host) {
      check(cu_.cuMemcpyDtoHAsync(b.out, p.out, out_bytes, stream_), "cuMemcpyDtoHAsync");
      if (b.lse) check(cu_.cuMemcpyDtoHAsync(b.lse, p.lse, heads * 4, stream_), "cuMemcpyDtoHAsync");
      check(cu_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
    }
  }

  void synchronize() override {
    Current current(*this);
    check(cu_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
  }

  // Best of several timed passes of pkv_read_bandwidth over a buffer far larger than the L2.
  double read_bandwidth(uint64_t bytes) override {
    Current current(*this);
    const uint64_t n = std::max<uint64_t>(bytes ? bytes : 2ull << 30, 1 << 20) & ~uint64_t(15);
    DeviceBuffer buf;
    CUevent start = nullptr, end = nullptr;
    double best = 0.0;
    try {
      check(cu_.cuMemAlloc(&buf.ptr, size_t(n) + 16), "cuMemAlloc (bandwidth buffer)");
      check(cu_.cuEventCreate(&start, 0), "cuEventCreate");
      check(cu_.cuEventCreate(&end, 0), "cuEventCreate");
      PkvReadParams p{buf.ptr, n, buf.ptr + n};
      for (int pass = 0; pass < 12; pass++) {
        check(cu_.cuEventRecord(start, stream_), "cuEventRecord");
        launch(read_bandwidth_, sms_ * 8, 1, 1, &p, 512);
        check(cu_.cuEventRecord(end, stream_), "cuEventRecord");
        check(cu_.cuEventSynchronize(end), "cuEventSynchronize");
        float ms = 0.0f;
        check(cu_.cuEventElapsedTime(&ms, start, end), "cuEventElapsedTime");
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
  // Makes the backend's context current on this thread for the scope.
  struct Current {
    explicit Current(CudaBackend &b) : b_(b) { b_.check(b_.cu_.cuCtxPushCurrent(b_.ctx_), "cuCtxPushCurrent"); }
    ~Current() {
      CUcontext popped;
      b_.cu_.cuCtxPopCurrent(&popped);
    }
    CudaBackend &b_;
  };

  struct DeviceBuffer {
    CUdeviceptr ptr = 0;
    uint64_t bytes = 0;
  };

  void check(CUresult r, const char *what) const {
    if (r == CUDA_SUCCESS) return;
    fail(r == CUDA_ERROR_OUT_OF_MEMORY ? PKV_ERR_OUT_OF_MEMORY : PKV_ERR_BACKEND, "%s: %s", what, cu_.describe(r).c_str());
  }

  void destroy_events_and(DeviceBuffer &buf, CUevent start, CUevent end) noexcept {
    if (start) cu_.cuEventDestroy(start);
    if (end) cu_.cuEventDestroy(end);
    if (buf.ptr) cu_.cuMemFree(buf.ptr);
  }

  void load_module(const unsigned char *image, CUmodule *module) {
    const CUresult r = cu_.cuModuleLoadData(module, image);
    if (r != CUDA_SUCCESS) {
      int major = 0, minor = 0;
      cu_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_);
      cu_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_);
      fail(PKV_ERR_UNSUPPORTED,
           "the kernels (built for %s) do not load on this device (sm_%d%d, driver %d.%d): %s", PKV_CUDA_TARGETS, major,
           minor, cu_.version / 1000, cu_.version % 1000 / 10, cu_.describe(r).c_str());
    }
  }

  CUfunction function(CUmodule module, const char *name) {
    CUfunction f = nullptr;
    check(cu_.cuModuleGetFunction(&f, module, name), name);
    return f;
  }

  template <class Params>
  void launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, Params *params, unsigned bx, unsigned by = 1,
              unsigned bz = 1, unsigned shared_bytes = 0) {
    void *args[] = {params};
    check(cu_.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared_bytes, stream_, args, nullptr), "cuLaunchKernel");
  }

  static DecodeKind decode_kind_from_environment() {
    const char *kernel = std::getenv("PKV_DECODE_KERNEL");
    if (kernel && std::strcmp(kernel, "fast") == 0) return DecodeKind::fast;
    if (kernel && std::strcmp(kernel, "generic") == 0) return DecodeKind::generic;
    return DecodeKind::mma;
  }

  // The decode kernel for this pool and batch, and its launch shape: the chosen family where it has
  // a kernel for the pool's head_dim and formats (F16/BF16/Q8_0/Q4_0 pages, head_dim 64/128/256),
  // else the generic one.
  struct DecodeKernel {
    DecodeKind kind = DecodeKind::generic;
    CUfunction fn = nullptr;
    unsigned row_tiles = 1, mtiles = 1, bdy = 0, bdz = 0, shared_bytes = 0;
  };

  DecodeKind decode_kind(const PoolGeometry &g) const {
    const uint32_t D = g.head_dim;
    auto specialised = [](pkv_format f) { return f != PKV_FORMAT_F32; };
    return (D == 64 || D == 128 || D == 256) && specialised(g.k.format) && specialised(g.v.format) ? kind_
                                                                                                  : DecodeKind::generic;
  }

  // The specialised kernel of a family for the pool's head_dim and formats, looked up once.
  CUfunction specialised_function(const PoolGeometry &g, DecodeKind kind) {
    const bool mma = kind == DecodeKind::mma;
    CUfunction &fn = (mma ? mma_functions_ : fast_functions_)[g.head_dim / 128][g.k.format - PKV_FORMAT_F16]
                                                             [g.v.format - PKV_FORMAT_F16];
    if (fn) return fn;
    const std::string name = std::string(mma ? "pkv_decode_mma_" : "pkv_decode_fast_") + std::to_string(g.head_dim) +
                             "_" + std::to_string(int(g.k.format)) + "_" + std::to_string(int(g.v.format));
    CUfunction f = function(mma ? mma_module_ : fast_module_, name.c_str());
    if (mma)
      check(cu_.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(mma_shared_bytes(g, 2))),
            name.c_str());
    fn = f;
    return fn;
  }
  CUfunction mma_function(const PoolGeometry &g) { return specialised_function(g, DecodeKind::mma); }

  DecodeKernel decode_kernel(const PoolGeometry &g, const DecodeBatch &b) {
    const uint32_t D = g.head_dim, rows = b.q_tokens * (b.q_heads / g.kv_heads); // query rows a KV head serves
    DecodeKernel k;
    k.kind = decode_kind(g);
    if (k.kind == DecodeKind::generic) {
      k.fn = partial_[D / 32 - 1];
      k.row_tiles = (rows + PKV_HEAD_TILE - 1) / PKV_HEAD_TILE;
      return k;
    }
    k.fn = specialised_function(g, k.kind);
    if (k.kind == DecodeKind::mma) {
      k.mtiles = mma_tiles(rows);
      k.row_tiles = (rows + PKV_MMA_ROWS * k.mtiles - 1) / (PKV_MMA_ROWS * k.mtiles);
      k.shared_bytes = mma_shared_bytes(g, k.mtiles);
      return k;
    }
    // Shared-memory row strides as the fast kernel lays them out: data then scales, 16-byte aligned.
    auto stride = [](const PlaneLayout &l) { return unsigned(align16(l.row_data_bytes + l.row_scale_bytes)); };
    const unsigned bdx = D / 8, row_bytes = stride(g.k) + stride(g.v), max_threads = PKV_FAST_MAX_THREADS;
    k.bdy = std::min(rows, max_threads / bdx);
    k.bdz = 1;
    while ((bdx * k.bdy * k.bdz) % 32 != 0) k.bdz *= 2; // whole warps: the row reductions shuffle
    while (bdx * k.bdy * k.bdz > max_threads) {         // an odd group too large for that: fewer heads
      k.bdy -= 1;
      k.bdz = 1;
      while ((bdx * k.bdy * k.bdz) % 32 != 0) k.bdz *= 2;
    }
    auto stages = [&](unsigned bdz) { return PKV_FAST_STAGES * PKV_FAST_TT * bdz * row_bytes; };
    while (bdx * k.bdy * k.bdz * 2 <= max_threads && stages(k.bdz * 2) <= kFastSharedLimit) k.bdz *= 2;
    k.shared_bytes = std::max(stages(k.bdz), k.bdz * k.bdy * (D + 2) * 4);
    k.row_tiles = (rows + k.bdy - 1) / k.bdy;
    return k;
  }

  // Tiles of PKV_MMA_ROWS query rows one block of the tensor-core kernel serves (PKV_MMA_WARPS warps
  // each): two when a KV head has more rows than one tile, so the stages serve them all.
  static unsigned mma_tiles(uint32_t rows) { return rows <= PKV_MMA_ROWS ? 1 : 2; }

  // The tensor-core kernel's shared memory, as decode_mma.cu's Mma<> lays it out: stages of
  // PKV_MMA_WARPS x PKV_MMA_TOKENS K and V rows, q fragments of each row tile, and the warps'
  // combine area.
  static unsigned mma_shared_bytes(const PoolGeometry &g, unsigned mtiles) {
    const unsigned D = g.head_dim, rows = PKV_MMA_ROWS, warps = PKV_MMA_WARPS;
    auto stride = [](const PlaneLayout &l) { return pkv_mma_row_stride(uint32_t(l.row_data_bytes + l.row_scale_bytes)); };
    const unsigned stage = warps * PKV_MMA_TOKENS * (stride(g.k) + stride(g.v));
    const bool quantized = g.k.format == PKV_FORMAT_Q8_0 || g.k.format == PKV_FORMAT_Q4_0;
    const unsigned q = quantized ? 2 * (D / 32 * 32 * 16) + D / 32 * rows * 4 : 2 * (D / 16) * 32 * 16;
    const unsigned combine = 2 * (warps * rows * (D + 8) + 2 * warps * rows) * 4;
    return std::max(pkv_mma_stages(D) * stage + mtiles * q, combine);
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
    const PlanLayout l = plan_layout(g.max_sequences, plan_limits(g).chunks);
    if (plan.chunks.size() > (l.bytes - l.chunks) / sizeof(PkvChunk) || b.count > g.max_sequences)
      fail(PKV_ERR_INTERNAL, "a plan of %zu chunks for %u sequences exceeds the pool's plan buffer",
           plan.chunks.size(), b.count);
    const PkvPlanHeader header{uint32_t(plan.chunks.size()), b.count, plan.parts, 0};
    Upload up;
    up.place(0, &header, sizeof header);
    up.place(l.slots, b.seq_slots, uint64_t(b.count) * 4);
    up.place(l.lengths, b.lengths, uint64_t(b.count) * 4);
    up.place(l.seq_chunks, plan.seq_chunks.data(), plan.seq_chunks.size() * 4);
    up.place(l.chunks, plan.chunks.data(), plan.chunks.size() * sizeof(DecodeChunk));
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
    check(cu_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
    const uint64_t want = std::max(bytes, 2 * buf->bytes);
    if (buf->ptr) cu_.cuMemFree(buf->ptr);
    *buf = DeviceBuffer{};
    check(cu_.cuMemAlloc(&buf->ptr, size_t(want)), "cuMemAlloc (scratch)");
    buf->bytes = want;
  }

  // Grows a buffer that captured graphs may hold the address of: the old one is kept (freed with the
  // backend), so a graph replayed with the shape it was captured with still finds memory there.
  // Returns whether it grew.
  bool grow_kept(DeviceBuffer *buf, uint64_t bytes) {
    if (bytes <= buf->bytes) return false;
    kept_.push_back(*buf);
    *buf = DeviceBuffer{};
    check(cu_.cuMemAlloc(&buf->ptr, size_t(bytes)), "cuMemAlloc (decode scratch)");
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
    if (h.pending) check(cu_.cuEventSynchronize(h.sent), "cuEventSynchronize");
    h.pending = false;
    if (up.total() > h.bytes) {
      const uint64_t want = std::max<uint64_t>(up.total(), 2 * h.bytes + (1 << 20));
      if (h.ptr) cu_.cuMemFreeHost(h.ptr);
      h.ptr = nullptr;
      h.bytes = 0;
      check(cu_.cuMemHostAlloc(&h.ptr, size_t(want), CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc (staging)");
      h.bytes = want;
    }
    if (!dst) {
      ensure(&device_stage_, up.total()); // one device buffer: uploads are ordered by the stream
      dst = device_stage_.ptr;
    }
    up.copy_into(static_cast<uint8_t *>(h.ptr));
    check(cu_.cuMemcpyHtoDAsync(dst, h.ptr, size_t(up.total()), stream_), "cuMemcpyHtoDAsync");
    check(cu_.cuEventRecord(h.sent, stream_), "cuEventRecord");
    h.pending = true;
    return dst;
  }

  void teardown() noexcept {
    CUcontext popped;
    if (!ctx_ || cu_.cuCtxPushCurrent(ctx_) != CUDA_SUCCESS) return;
    if (stream_) cu_.cuStreamSynchronize(stream_);
    for (DeviceBuffer *b : {&device_stage_, &part_out_, &part_lse_, &counters_, &decode_out_, &rows_out_})
      if (b->ptr) cu_.cuMemFree(b->ptr);
    for (DeviceBuffer &b : kept_)
      if (b.ptr) cu_.cuMemFree(b.ptr);
    for (HostStage &h : stages_) {
      if (h.ptr) cu_.cuMemFreeHost(h.ptr);
      if (h.sent) cu_.cuEventDestroy(h.sent);
    }
    if (pages_module_) cu_.cuModuleUnload(pages_module_);
    if (decode_module_) cu_.cuModuleUnload(decode_module_);
    if (fast_module_) cu_.cuModuleUnload(fast_module_);
    if (mma_module_) cu_.cuModuleUnload(mma_module_);
    if (own_stream_) cu_.cuStreamDestroy(stream_);
    cu_.cuCtxPopCurrent(&popped);
    cu_.cuDevicePrimaryCtxRelease(device_);
    ctx_ = nullptr;
  }

  const Driver &cu_;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  bool own_stream_ = false;
  uint32_t sms_ = 1;
  CUmodule pages_module_ = nullptr, decode_module_ = nullptr, fast_module_ = nullptr, mma_module_ = nullptr;
  DecodeKind kind_ = DecodeKind::mma;
  // [head_dim 64/128/256][K format][V format], looked up once
  CUfunction fast_functions_[3][4][4] = {}, mma_functions_[3][4][4] = {};
  uint32_t mma_blocks_per_sm_[3][4][4][2] = {}; // [..][row tiles a block serves: 1, 2]
  CUfunction apply_table_ = nullptr, scatter_ = nullptr, gather_ = nullptr, copy_pages_ = nullptr, merge_ = nullptr;
  CUfunction read_bandwidth_ = nullptr;
  CUfunction partial_[8] = {};
  struct HostStage {
    void *ptr = nullptr;
    uint64_t bytes = 0;
    CUevent sent = nullptr; // the transfer out of it has finished
    bool pending = false;
  };
  HostStage stages_[2];
  unsigned next_stage_ = 0;
  DeviceBuffer device_stage_, part_out_, part_lse_, counters_, decode_out_, rows_out_;
  std::vector<DeviceBuffer> kept_; // outgrown decode scratch (grow_kept)
};

const Driver &driver_or_fail() {
  std::string why;
  const Driver *d = cuda_driver(&why);
  if (!d) fail(PKV_ERR_NO_DEVICE, "%s", why.c_str());
  if (d->version < PKV_CUDA_IMAGE_VERSION)
    fail(PKV_ERR_UNSUPPORTED, "the CUDA driver (%s) supports CUDA %d.%d; the kernels were built with CUDA %d.%d: update the driver",
         d->library.c_str(), d->version / 1000, d->version % 1000 / 10, PKV_CUDA_IMAGE_VERSION / 1000,
         PKV_CUDA_IMAGE_VERSION % 1000 / 10);
  return *d;
}

} // namespace

std::unique_ptr<Backend> make_cuda_backend(int ordinal, void *stream) {
  const Driver &d = driver_or_fail();
  int count = 0;
  const CUresult r = d.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count == 0)
    fail(PKV_ERR_NO_DEVICE, "the CUDA driver (%s) found no device%s%s", d.library.c_str(), r ? ": " : "",
         r ? d.describe(r).c_str() : "");
  if (ordinal < 0 || ordinal >= count)
    fail(PKV_ERR_NO_DEVICE, "device %d does not exist: the CUDA driver found %d device%s", ordinal, count,
         count == 1 ? "" : "s");
  return std::make_unique<CudaBackend>(d, ordinal, stream);
}

int cuda_devices(std::string *detail) {
  std::string why;
  const Driver *d = cuda_driver(&why);
  if (!d) {
    *detail = why;
    return 0;
  }
  int count = 0;
  if (d->cuDeviceGetCount(&count) != CUDA_SUCCESS) count = 0;
  *detail = d->library + ", driver API " + std::to_string(d->version / 1000) + "." + std::to_string(d->version % 1000 / 10);
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    char name[128] = {0};
    int major = 0, minor = 0, sms = 0;
    size_t bytes = 0;
    d->cuDeviceGet(&dev, i);
    d->cuDeviceGetName(name, sizeof name - 1, dev);
    d->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    d->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    d->cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    d->cuDeviceTotalMem(&bytes, dev);
    *detail += "; " + std::to_string(i) + ": " + name + " (sm_" + std::to_string(major) + std::to_string(minor) + ", " +
               std::to_string(sms) + " SMs, " + std::to_string(bytes >> 30) + " GiB)";
  }
  if (count == 0) *detail += "; no device";
  return count;
}

} // namespace pkv
