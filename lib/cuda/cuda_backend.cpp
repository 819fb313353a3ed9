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

constexpr unsigned kThreads = 128;
constexpr unsigned kFastSharedLimit = 48 * 1024; // what a block gets without opting in

uint64_t align16(uint64_t n) { return (n + 15) & ~uint64_t(15); }
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
    total_ = align16(total_);
    pieces_.push_back({src, bytes, total_});
    total_ += bytes;
    return pieces_.back().offset;
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
      const char *kernel = std::getenv("PKV_DECODE_KERNEL");
      use_fast_ = !(kernel && std::strcmp(kernel, "generic") == 0);
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
  uint32_t workers() const override { return sms_; }
  // A block streams a chunk a tile at a time: short chunks over many multiprocessors finish sooner
  // than long ones over few, and the merge of a few partials is cheap.
  uint32_t min_chunk_tokens() const override { return 64; }

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

  void decode(const PoolGeometry &g, const DecodeBatch &b) override {
    Current current(*this);
    const DecodePlan &plan = *b.plan;
    const uint64_t n_chunks = plan.chunks.size();
    const uint64_t heads = uint64_t(b.count) * b.q_tokens * b.q_heads; // query rows
    const uint64_t q_bytes = heads * g.head_dim * io_elem_bytes(b.q_format);
    const uint64_t out_bytes = heads * g.head_dim * io_elem_bytes(b.out_format);
    const bool host = b.memory == PKV_MEMORY_HOST;

    Upload up;
    const uint64_t table_at = up.add(b.table.entries, uint64_t(b.table.count) * sizeof(TableEntry));
    const uint64_t slots_at = up.add(b.seq_slots, uint64_t(b.count) * 4);
    const uint64_t lengths_at = up.add(b.lengths, uint64_t(b.count) * 4);
    const uint64_t chunks_at = up.add(plan.chunks.data(), n_chunks * sizeof(DecodeChunk));
    const uint64_t seq_chunks_at = up.add(plan.seq_chunks.data(), plan.seq_chunks.size() * 4);
    const uint64_t q_at = host ? up.add(b.q, q_bytes) : 0;
    const DevPtr dev = send(up);
    apply_table(g, b.table, dev + table_at);

    const uint64_t part_rows = n_chunks * b.q_tokens * b.q_heads;
    ensure(&part_out_, std::max<uint64_t>(1, part_rows * g.head_dim * 4));
    ensure(&part_lse_, std::max<uint64_t>(1, part_rows * 4));
    if (host) ensure(&decode_out_, align16(out_bytes) + heads * 4);

    PkvDecodeParams p{};
    p.pool = pool_params(g);
    p.seq_slots = dev + slots_at;
    p.lengths = dev + lengths_at;
    p.chunks = dev + chunks_at;
    p.seq_chunks = dev + seq_chunks_at;
    p.q = host ? dev + q_at : DevPtr(uintptr_t(b.q));
    p.out = host ? decode_out_.ptr : DevPtr(uintptr_t(b.out));
    p.lse = !b.lse ? 0 : host ? decode_out_.ptr + align16(out_bytes) : DevPtr(uintptr_t(b.lse));
    p.part_out = part_out_.ptr;
    p.part_lse = part_lse_.ptr;
    p.layer = b.layer;
    p.count = b.count;
    p.q_heads = b.q_heads;
    p.q_tokens = b.q_tokens;
    p.n_chunks = uint32_t(n_chunks);
    p.q_format = uint32_t(b.q_format);
    p.out_format = uint32_t(b.out_format);
    p.scale = b.scale;

    const uint32_t rows = b.q_tokens * (b.q_heads / g.kv_heads); // query rows one KV head serves
    if (n_chunks) {
      const FastKernel fast = fast_kernel(g, rows);
      if (fast.fn)
        launch(fast.fn, unsigned(n_chunks), g.kv_heads, (rows + fast.bdy - 1) / fast.bdy, &p, g.head_dim / 8, fast.bdy,
               fast.bdz, fast.shared_bytes);
      else
        launch(partial_[g.head_dim / 32 - 1], unsigned(n_chunks), g.kv_heads,
               (rows + PKV_HEAD_TILE - 1) / PKV_HEAD_TILE, &p, PKV_DECODE_WARPS * 32);
    }
    // Sequences with one chunk were written by the partial kernel; the rest (split or empty) merge.
    bool merge = false;
    for (uint32_t s = 0; s < b.count && !merge; s++) merge = plan.seq_chunks[s + 1] - plan.seq_chunks[s] != 1;
    if (merge) launch(merge_, b.count * b.q_tokens, b.q_heads, 1, &p, std::min(256u, g.head_dim));
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

  // The specialised decode kernel for this pool and its block shape, or no function when the pool's
  // head_dim or formats have none (or PKV_DECODE_KERNEL=generic asks for the generic one).
  struct FastKernel {
    CUfunction fn = nullptr;
    unsigned bdy = 0, bdz = 0, shared_bytes = 0;
  };

  FastKernel fast_kernel(const PoolGeometry &g, uint32_t rows) {
    auto fast_format = [](pkv_format f) { return f != PKV_FORMAT_F32; };
    const uint32_t D = g.head_dim;
    if (!use_fast_ || (D != 64 && D != 128 && D != 256) || !fast_format(g.k.format) || !fast_format(g.v.format))
      return {};
    CUfunction &fn = fast_functions_[D / 128][g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16];
    if (!fn) {
      const std::string name = "pkv_decode_fast_" + std::to_string(D) + "_" + std::to_string(int(g.k.format)) + "_" +
                               std::to_string(int(g.v.format));
      fn = function(fast_module_, name.c_str());
    }
    // Shared-memory row strides as the kernel lays them out: data then scales, 16-byte aligned.
    auto stride = [](const PlaneLayout &l) { return unsigned(align16(l.row_data_bytes + l.row_scale_bytes)); };
    const unsigned bdx = D / 8, row_bytes = stride(g.k) + stride(g.v), max_threads = PKV_FAST_MAX_THREADS;
    FastKernel k;
    k.fn = fn;
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
    return k;
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

  // One packed host-to-device transfer through a pinned staging buffer; returns where it lands. Two
  // pinned buffers take turns, so the host waits only when the transfer before last is still going.
  DevPtr send(const Upload &up) {
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
    ensure(&device_stage_, up.total()); // one device buffer: uploads are ordered by the stream
    up.copy_into(static_cast<uint8_t *>(h.ptr));
    check(cu_.cuMemcpyHtoDAsync(device_stage_.ptr, h.ptr, size_t(up.total()), stream_), "cuMemcpyHtoDAsync");
    check(cu_.cuEventRecord(h.sent, stream_), "cuEventRecord");
    h.pending = true;
    return device_stage_.ptr;
  }

  void teardown() noexcept {
    CUcontext popped;
    if (!ctx_ || cu_.cuCtxPushCurrent(ctx_) != CUDA_SUCCESS) return;
    if (stream_) cu_.cuStreamSynchronize(stream_);
    for (DeviceBuffer *b : {&device_stage_, &part_out_, &part_lse_, &decode_out_, &rows_out_})
      if (b->ptr) cu_.cuMemFree(b->ptr);
    for (HostStage &h : stages_) {
      if (h.ptr) cu_.cuMemFreeHost(h.ptr);
      if (h.sent) cu_.cuEventDestroy(h.sent);
    }
    if (pages_module_) cu_.cuModuleUnload(pages_module_);
    if (decode_module_) cu_.cuModuleUnload(decode_module_);
    if (fast_module_) cu_.cuModuleUnload(fast_module_);
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
  CUmodule pages_module_ = nullptr, decode_module_ = nullptr, fast_module_ = nullptr;
  bool use_fast_ = true;
  CUfunction fast_functions_[3][4][4] = {}; // [head_dim 64/128/256][K format][V format], looked up once
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
  DeviceBuffer device_stage_, part_out_, part_lse_, decode_out_, rows_out_;
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
