// pkv-bench's CUDA side, on the library's own driver loader (lib/loader, compiled in here).
#include <set>
#include <stdexcept>

#include "bench_device.hpp"
#include "loader/cuda_driver.hpp"

namespace {

using namespace pkv::cu;

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
  }

  ~CudaBenchDevice() override {
    cu_.cuStreamSynchronize(stream_);
    for (CUdeviceptr p : buffers_) cu_.cuMemFree(p);
    cu_.cuEventDestroy(start_);
    cu_.cuEventDestroy(end_);
    cu_.cuStreamDestroy(stream_);
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

  void start() override { check(cu_.cuEventRecord(start_, stream_), "cuEventRecord"); }

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
