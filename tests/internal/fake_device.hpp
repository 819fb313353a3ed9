// A stand-in GPU for the GPU backend's host code (lib/gpu/): an H200-like gpu::Device whose memory
// is host memory, where copies land at once and launches do nothing. Every copy must stay inside
// the allocation it touches, as a real device would insist, and a copy from pinned memory must not
// read bytes that an earlier transfer, for all the host has waited for, may still be reading
// (the host has rewritten them): a real device copies asynchronously. A decode kernel must find its
// chunk counters zero, as the kernels leave them (lib/kernels/kernel_params.h). The image copy kernel
// is the one launch it carries out, so that exported images and imported pages are whole. Its ledger, which may outlive it, counts
// what is alive (no leak leaves a count above 0) and can record what the backend asked of it.
//
// The device's own memory comes from malloc, not operator new: in the fault injection build
// (test_faults) only the library's allocations are points, and a failing one must not hit the stand-in.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "error.hpp"
#include "gpu/gpu_device.hpp"

template <class T> struct MallocAllocator {
  using value_type = T;
  MallocAllocator() = default;
  template <class U> MallocAllocator(const MallocAllocator<U> &) {}
  T *allocate(size_t n) {
    if (void *p = std::malloc(n * sizeof(T))) return static_cast<T *>(p);
    throw std::bad_alloc();
  }
  void deallocate(T *p, size_t) { std::free(p); }
  template <class U> bool operator==(const MallocAllocator<U> &) const { return true; }
  template <class U> bool operator!=(const MallocAllocator<U> &) const { return false; }
};
template <class T> using FakeVector = std::vector<T, MallocAllocator<T>>;
using FakeString = std::basic_string<char, std::char_traits<char>, MallocAllocator<char>>;
template <class K, class V> using FakeMap = std::map<K, V, std::less<K>, MallocAllocator<std::pair<const K, V>>>;

struct FakeLedger {
  enum Thing { device_memory, pinned_memory, stream, event, module, kThings };
  int64_t live[kThings] = {};
  // While `recording`: every copy to the device (where in its allocation, bytes, a hash of them) and
  // launch (kernel name and shape), in order.
  bool recording = false;
  FakeVector<FakeString> writes;

  // "2 device allocations, 1 stream" for those alive, or empty.
  std::string alive() const;
};

class FakeDevice final : public pkv::gpu::Device, public pkv::gpu::TensorCores {
 public:
  // `ledger` null: the device keeps its own.
  explicit FakeDevice(FakeLedger *ledger = nullptr) : ledger_(ledger ? ledger : &own_) {}
  static void *operator new(size_t bytes) { return MallocAllocator<char>().allocate(bytes); }
  static void operator delete(void *p) { std::free(p); }

  // The allocation holding [p, p + bytes), or null.
  uint8_t *at(pkv::DevPtr p, uint64_t bytes);

  pkv_backend kind() const override { return PKV_BACKEND_CUDA; }
  const char *name() const override { return "fake"; }
  const pkv::gpu::Images &images() const override { return images_; }
  pkv::gpu::TensorCores *tensor_cores() override { return this; }
  std::string describe(int result) const override { return "fake error " + std::to_string(result); }
  std::string identity() const override { return "a stand-in device"; }

  pkv::gpu::Call enter(int *token) override;
  void leave(int) noexcept override {}
  pkv::gpu::Call attribute(pkv::gpu::Attribute a, int *value) override;

  pkv::gpu::Call stream_create(pkv::gpu::Stream *s) override;
  pkv::gpu::Call stream_destroy(pkv::gpu::Stream s) override;
  pkv::gpu::Call stream_synchronize(pkv::gpu::Stream) override;
  pkv::gpu::Call stream_capture_status(pkv::gpu::Stream, int *status) override;
  pkv::gpu::Call event_create(pkv::gpu::Event *e, bool) override;
  pkv::gpu::Call event_destroy(pkv::gpu::Event e) override;
  pkv::gpu::Call event_record(pkv::gpu::Event e, pkv::gpu::Stream) override;
  pkv::gpu::Call event_synchronize(pkv::gpu::Event e) override;
  pkv::gpu::Call event_elapsed_ms(float *ms, pkv::gpu::Event, pkv::gpu::Event) override;

  pkv::gpu::Call alloc(pkv::DevPtr *ptr, size_t bytes) override;
  pkv::gpu::Call free(pkv::DevPtr ptr) override;
  pkv::gpu::Call host_alloc(void **ptr, size_t bytes) override;
  pkv::gpu::Call host_free(void *ptr) override;
  pkv::gpu::Call copy_to_device(pkv::DevPtr dst, const void *src, size_t bytes, pkv::gpu::Stream) override;
  pkv::gpu::Call copy_to_host(void *dst, pkv::DevPtr src, size_t bytes, pkv::gpu::Stream) override;
  pkv::gpu::Call fill32(pkv::DevPtr dst, uint32_t value, size_t count, pkv::gpu::Stream) override;

  pkv::gpu::Call module_load(pkv::gpu::Module *m, const void *) override;
  pkv::gpu::Call module_unload(pkv::gpu::Module m) override;
  pkv::gpu::Call function(pkv::gpu::Function *f, pkv::gpu::Module, const char *name) override;
  pkv::gpu::Call launch(pkv::gpu::Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared_bytes, pkv::gpu::Stream, void **) override;

  // sm_90's: 227 KB a block, 228 KB and 2048 threads a multiprocessor.
  pkv::gpu::Call set_shared_limit(pkv::gpu::Function, int) override { return ok("set_shared_limit"); }
  pkv::gpu::Call shared_per_block(int *bytes) override;
  pkv::gpu::Call static_shared(pkv::gpu::Function, int *bytes) override;
  pkv::gpu::Call occupancy(int *blocks, pkv::gpu::Function, int threads, size_t shared_bytes) override;

 private:
  static pkv::gpu::Call ok(const char *what) { return {pkv::gpu::kSuccess, what}; }
  template <class H> H handle(FakeLedger::Thing thing) {
    ledger_->live[thing]++;
    things_[++handles_] = thing;
    return reinterpret_cast<H>(handles_);
  }
  // Ends a handle of `thing`: a call on one that is not alive fails, as the runtime's would.
  pkv::gpu::Call end(const void *h, FakeLedger::Thing thing, const char *what);
  void record(const char *format, ...) PKV_PRINTF_LIKE(2, 3);
  bool copy_image(const struct PkvImageParams &p);

  static constexpr unsigned char image_[1] = {0};
  pkv::gpu::Images images_{image_, image_, image_, image_, image_, "fake"};
  FakeLedger own_, *ledger_;
  FakeMap<pkv::DevPtr, FakeVector<uint8_t>> memory_;
  // Bytes [begin, end) of a pinned buffer read by transfer `by`.
  struct Read {
    uint64_t begin, end, by;
  };
  struct Pinned {
    FakeVector<uint8_t> bytes;
    FakeVector<Read> reads; // transfers out of it not known finished
  };
  // The pinned buffer holding p, or null.
  Pinned *pinned(const void *p);

  FakeMap<const uint8_t *, Pinned> pinned_;
  FakeMap<uintptr_t, FakeLedger::Thing> things_; // live streams, events and modules
  // Transfers are numbered as queued; those up to `done_` are known finished: by a stream
  // synchronize, or an event recorded after them waited for.
  uint64_t queued_ = 0, done_ = 0;
  FakeMap<pkv::gpu::Event, uint64_t> recorded_;
  FakeMap<pkv::gpu::Function, FakeString> functions_;
  pkv::DevPtr next_ = 0x10000000;
  uintptr_t handles_ = 0x1000;
};
