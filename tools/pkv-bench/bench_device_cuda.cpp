// pkv-bench's CUDA side, on the library's own driver loader (lib/cuda/cuda_driver.cpp, compiled in
// here).
#include <set>
#include <stdexcept>

#include "bench_device.hpp"
#include "cuda/cuda_driver.hpp"

namespace {

using namespace pkv::cu;

// A kernel that spins for `ns` nanoseconds of the device's global timer. Launched before the start
// event, it holds the stream while the host queues the timed call, so the events time the device's
// work rather than the host's (host time per call is measured on its own: pkv-bench's overhead rows).
const char kHoldPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64
.visible .entry pkv_bench_hold(.param .u64 ns)
{
  .reg .u64 %t0, %t1, %d, %n;
  .reg .pred %p;
  ld.param.u64 %n, [ns];
  mov.u64 %t0, %globaltimer;
spin:
  mov.u64 %t1, %globaltimer;
  sub.u64 %d, %t1, %t0;
  setp.lt.u64 %p, %d, %n;
  @%p bra spin;
  ret;
}
)";
constexpr unsigned long long kHoldNs = 200000;

class CudaBenchDevice final : public BenchDevice {
 public:
  CudaBenchDevice(const Driver &d, int ordinal) : cu_(d) {
    check(cu_.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
    check(cu_.cuDevicePrimaryCtxRetain(&ctx_, device_), "cuDevicePrimaryCtxRetain");
    // The bench's thread keeps the context current; pagedkv pushes and pops its own around each call.
    check(cu_.cuCtxPushCurrent(ctx_), "cuCtxPushCurrent");
    check(cu_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    check(cu_.cuEventCreate(&start_, 0), "cuEventCreate");
    check(cu_.cuEventCreate(&end_, 0), "cuEventCreate");
    check(cu_.cuModuleLoadData(&hold_module_, kHoldPtx), "cuModuleLoadData (hold kernel)");
    check(cu_.cuModuleGetFunction(&hold_, hold_module_, "pkv_bench_hold"), "cuModuleGetFunction");
  }

  ~CudaBenchDevice() override {
    cu_.cuStreamSynchronize(stream_);
    for (CUdeviceptr p : buffers_) cu_.cuMemFree(p);
    cu_.cuEventDestroy(start_);
    cu_.cuEventDestroy(end_);
    cu_.cuStreamDestroy(stream_);
    cu_.cuModuleUnload(hold_module_);
    CUcontext popped;
    cu_.cuCtxPopCurrent(&popped);
    cu_.cuDevicePrimaryCtxRelease(device_);
  }

  void *stream() override { return stream_; }

  void *alloc(size_t bytes) override {
    CUdeviceptr p = 0;
    check(cu_.cuMemAlloc(&p, bytes ? bytes : 1), "cuMemAlloc");
    buffers_.insert(p);
    return reinterpret_cast<void *>(p);
  }

  void release(void *ptr) override {
    const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
    if (!buffers_.erase(p)) return;
    cu_.cuStreamSynchronize(stream_);
    cu_.cuMemFree(p);
  }

  void upload(void *dst, const void *src, size_t bytes) override {
    check(cu_.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, stream_), "cuMemcpyHtoDAsync");
    check(cu_.cuStreamSynchronize(stream_), "cuStreamSynchronize");
  }

  void *alloc_pinned(size_t bytes) override {
    void *p = nullptr;
    check(cu_.cuMemHostAlloc(&p, bytes ? bytes : 1, 0), "cuMemHostAlloc");
    return p;
  }

  void release_pinned(void *ptr) override {
    cu_.cuStreamSynchronize(stream_);
    cu_.cuMemFreeHost(ptr);
  }

  void copy(void *dst, const void *src, size_t bytes, Direction d) override {
    const CUdeviceptr to = reinterpret_cast<CUdeviceptr>(dst), from = reinterpret_cast<CUdeviceptr>(src);
    if (d == kHostToDevice) check(cu_.cuMemcpyHtoDAsync(to, src, bytes, stream_), "cuMemcpyHtoDAsync");
    else if (d == kDeviceToHost) check(cu_.cuMemcpyDtoHAsync(dst, from, bytes, stream_), "cuMemcpyDtoHAsync");
    else check(cu_.cuMemcpyDtoDAsync(to, from, bytes, stream_), "cuMemcpyDtoDAsync");
  }

  void start() override {
    unsigned long long ns = kHoldNs;
    void *args[] = {&ns};
    check(cu_.cuLaunchKernel(hold_, 1, 1, 1, 1, 1, 1, 0, stream_, args, nullptr), "cuLaunchKernel (hold)");
    check(cu_.cuEventRecord(start_, stream_), "cuEventRecord");
  }

  double stop_us() override {
    check(cu_.cuEventRecord(end_, stream_), "cuEventRecord");
    check(cu_.cuEventSynchronize(end_), "cuEventSynchronize");
    float ms = 0;
    check(cu_.cuEventElapsedTime(&ms, start_, end_), "cuEventElapsedTime");
    return ms * 1e3;
  }

  std::string name() override { return "CUDA stream and buffers of the bench's own (" + cu_.library + ")"; }

 private:
  void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cu_.describe(r));
  }

  const Driver &cu_;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  CUevent start_ = nullptr, end_ = nullptr;
  CUmodule hold_module_ = nullptr;
  CUfunction hold_ = nullptr;
  std::set<CUdeviceptr> buffers_;
};

} // namespace

std::unique_ptr<BenchDevice> open_cuda_bench_device(int ordinal, std::string *why) {
  const Driver *d = pkv::cuda_driver(why);
  if (!d) return nullptr;
  int count = 0;
  if (d->cuDeviceGetCount(&count) != CUDA_SUCCESS || ordinal < 0 || ordinal >= count) {
    *why = "no CUDA device " + std::to_string(ordinal);
    return nullptr;
  }
  try {
    return std::make_unique<CudaBenchDevice>(*d, ordinal);
  } catch (const std::exception &x) {
    *why = x.what();
    return nullptr;
  }
}
