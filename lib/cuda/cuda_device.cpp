// The CUDA backend: the CUDA driver as the GPU backend's gpu::Device (lib/gpu/gpu_device.hpp). The
// device's primary context is retained and made current around each call, so the engine's own use
// of the primary context is shared, not disturbed.
#include "cuda_backend.hpp"

#include "../error.hpp"
#include "../gpu/gpu_backend.hpp"
#include "cuda_driver.hpp"
#include "cuda_images.hpp"

namespace pkv {

namespace {

using namespace cu;
using gpu::Call;

static_assert(CUDA_SUCCESS == gpu::kSuccess && CUDA_ERROR_OUT_OF_MEMORY == gpu::kOutOfMemory &&
                  CUDA_ERROR_NOT_FOUND == gpu::kNotFound,
              "the GPU backend reads CUDA's results by these numbers");
static_assert(CU_STREAM_CAPTURE_STATUS_NONE == 0, "the GPU backend reads 0 as not capturing");

class CudaDevice final : public gpu::Device, public gpu::TensorCores {
 public:
  CudaDevice(const Driver &driver, int ordinal) : cu_(driver) {
    check({cu_.cuDeviceGet(&device_, ordinal), "cuDeviceGet"});
    check({cu_.cuDevicePrimaryCtxRetain(&ctx_, device_), "cuDevicePrimaryCtxRetain"});
  }
  ~CudaDevice() override { cu_.cuDevicePrimaryCtxRelease(device_); }

  pkv_backend kind() const override { return PKV_BACKEND_CUDA; }
  const char *name() const override { return "CUDA"; }
  const gpu::Images &images() const override {
    static const gpu::Images images{cuda_image_pages,           cuda_image_decode_generic,
                                    cuda_image_decode_cuda_core, cuda_image_decode_tensor_core,
                                    cuda_image_extend_tensor_core, PKV_CUDA_TARGETS};
    return images;
  }
  gpu::TensorCores *tensor_cores() override { return this; }
  std::string describe(int result) const override { return cu_.describe(result); }
  std::string identity() const override {
    int major = 0, minor = 0;
    cu_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_);
    cu_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_);
    return "sm_" + std::to_string(major) + std::to_string(minor) + ", driver " + std::to_string(cu_.version / 1000) +
           "." + std::to_string(cu_.version % 1000 / 10);
  }

  Call enter(int *) override { return {cu_.cuCtxPushCurrent(ctx_), "cuCtxPushCurrent"}; }
  void leave(int) noexcept override {
    CUcontext popped;
    cu_.cuCtxPopCurrent(&popped);
  }
  Call attribute(gpu::Attribute a, int *value) override {
    const int id =
        a == gpu::Attribute::multiprocessors ? CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT : CU_DEVICE_ATTRIBUTE_WARP_SIZE;
    return {cu_.cuDeviceGetAttribute(value, id, device_), "cuDeviceGetAttribute"};
  }

  Call stream_create(gpu::Stream *s) override {
    CUstream raw = nullptr;
    const Call c{cu_.cuStreamCreate(&raw, CU_STREAM_NON_BLOCKING), "cuStreamCreate"};
    *s = reinterpret_cast<gpu::Stream>(raw);
    return c;
  }
  Call stream_destroy(gpu::Stream s) override { return {cu_.cuStreamDestroy(stream(s)), "cuStreamDestroy"}; }
  Call stream_synchronize(gpu::Stream s) override {
    return {cu_.cuStreamSynchronize(stream(s)), "cuStreamSynchronize"};
  }
  Call stream_capture_status(gpu::Stream s, int *status) override {
    return {cu_.cuStreamIsCapturing(stream(s), status), "cuStreamIsCapturing"};
  }
  Call event_create(gpu::Event *e, bool timing) override {
    CUevent raw = nullptr;
    const Call c{cu_.cuEventCreate(&raw, timing ? 0 : CU_EVENT_DISABLE_TIMING), "cuEventCreate"};
    *e = reinterpret_cast<gpu::Event>(raw);
    return c;
  }
  Call event_destroy(gpu::Event e) override { return {cu_.cuEventDestroy(event(e)), "cuEventDestroy"}; }
  Call event_record(gpu::Event e, gpu::Stream s) override {
    return {cu_.cuEventRecord(event(e), stream(s)), "cuEventRecord"};
  }
  Call event_synchronize(gpu::Event e) override { return {cu_.cuEventSynchronize(event(e)), "cuEventSynchronize"}; }
  Call event_elapsed_ms(float *ms, gpu::Event start, gpu::Event end) override {
    return {cu_.cuEventElapsedTime(ms, event(start), event(end)), "cuEventElapsedTime"};
  }

  Call alloc(DevPtr *ptr, size_t bytes) override {
    CUdeviceptr raw = 0;
    const Call c{cu_.cuMemAlloc(&raw, bytes), "cuMemAlloc"};
    *ptr = raw;
    return c;
  }
  Call free(DevPtr ptr) override { return {cu_.cuMemFree(ptr), "cuMemFree"}; }
  Call host_alloc(void **ptr, size_t bytes) override {
    return {cu_.cuMemHostAlloc(ptr, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"};
  }
  Call host_free(void *ptr) override { return {cu_.cuMemFreeHost(ptr), "cuMemFreeHost"}; }
  Call copy_to_device(DevPtr dst, const void *src, size_t bytes, gpu::Stream s) override {
    return {cu_.cuMemcpyHtoDAsync(dst, src, bytes, stream(s)), "cuMemcpyHtoDAsync"};
  }
  Call copy_to_host(void *dst, DevPtr src, size_t bytes, gpu::Stream s) override {
    return {cu_.cuMemcpyDtoHAsync(dst, src, bytes, stream(s)), "cuMemcpyDtoHAsync"};
  }
  Call fill32(DevPtr dst, uint32_t value, size_t count, gpu::Stream s) override {
    return {cu_.cuMemsetD32Async(dst, value, count, stream(s)), "cuMemsetD32Async"};
  }

  Call module_load(gpu::Module *m, const void *image) override {
    CUmodule raw = nullptr;
    const Call c{cu_.cuModuleLoadData(&raw, image), "cuModuleLoadData"};
    *m = reinterpret_cast<gpu::Module>(raw);
    return c;
  }
  Call module_unload(gpu::Module m) override {
    return {cu_.cuModuleUnload(reinterpret_cast<CUmodule>(m)), "cuModuleUnload"};
  }
  Call function(gpu::Function *f, gpu::Module m, const char *name) override {
    CUfunction raw = nullptr;
    const Call c{cu_.cuModuleGetFunction(&raw, reinterpret_cast<CUmodule>(m), name), "cuModuleGetFunction"};
    *f = reinterpret_cast<gpu::Function>(raw);
    return c;
  }
  Call launch(gpu::Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
              unsigned shared_bytes, gpu::Stream s, void **params) override {
    return {cu_.cuLaunchKernel(kernel(f), gx, gy, gz, bx, by, bz, shared_bytes, stream(s), params, nullptr),
            "cuLaunchKernel"};
  }

  Call set_shared_limit(gpu::Function f, int bytes) override {
    return {cu_.cuFuncSetAttribute(kernel(f), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
            "cuFuncSetAttribute"};
  }
  Call shared_per_block(int *bytes) override {
    return {cu_.cuDeviceGetAttribute(bytes, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device_),
            "cuDeviceGetAttribute"};
  }
  Call static_shared(gpu::Function f, int *bytes) override {
    return {cu_.cuFuncGetAttribute(bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel(f)), "cuFuncGetAttribute"};
  }
  Call occupancy(int *blocks, gpu::Function f, int threads, size_t shared_bytes) override {
    return {cu_.cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel(f), threads, shared_bytes),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor"};
  }

 private:
  void check(Call c) const {
    if (c.result != CUDA_SUCCESS) fail(PKV_ERR_BACKEND, "%s: %s", c.name, cu_.describe(c.result).c_str());
  }
  static CUstream stream(gpu::Stream s) { return reinterpret_cast<CUstream>(s); }
  static CUevent event(gpu::Event e) { return reinterpret_cast<CUevent>(e); }
  static CUfunction kernel(gpu::Function f) { return reinterpret_cast<CUfunction>(f); }

  const Driver &cu_;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
};

const Driver &driver_or_fail() {
  std::string why;
  const Driver *d = cuda_driver(&why);
  if (!d) fail(PKV_ERR_NO_DEVICE, "%s", why.c_str());
  if (d->version < PKV_CUDA_IMAGE_VERSION)
    fail(PKV_ERR_UNSUPPORTED,
         "the CUDA driver (%s) supports CUDA %d.%d; the kernels were built with CUDA %d.%d: update the driver",
         d->library.c_str(), d->version / 1000, d->version % 1000 / 10, PKV_CUDA_IMAGE_VERSION / 1000,
         PKV_CUDA_IMAGE_VERSION % 1000 / 10);
  return *d;
}

} // namespace

std::unique_ptr<Backend> make_cuda_backend(int ordinal, void *stream, uint32_t threads) {
  const Driver &d = driver_or_fail();
  int count = 0;
  const CUresult r = d.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count == 0)
    fail(PKV_ERR_NO_DEVICE, "the CUDA driver (%s) found no device%s%s", d.library.c_str(), r ? ": " : "",
         r ? d.describe(r).c_str() : "");
  if (ordinal < 0 || ordinal >= count)
    fail(PKV_ERR_NO_DEVICE, "device %d does not exist: the CUDA driver found %d device%s", ordinal, count,
         count == 1 ? "" : "s");
  return make_gpu_backend(std::make_unique<CudaDevice>(d, ordinal), stream, threads);
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
  *detail =
      d->library + ", driver API " + std::to_string(d->version / 1000) + "." + std::to_string(d->version % 1000 / 10);
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
