// The HIP backend: the HIP runtime as the GPU backend's gpu::Device (lib/gpu/gpu_device.hpp). HIP has
// no context to push: around each call the device is made the calling thread's current one, and the
// one current before is restored, so the engine's own choice of device is left as it was.
#include "hip_backend.hpp"

#include "../error.hpp"
#include "../gpu/gpu_backend.hpp"
#include "hip_images.hpp"
#include "hip_runtime.hpp"

namespace pkv {

namespace {

using namespace hip;
using gpu::Call;

static_assert(hipSuccess == gpu::kSuccess && hipErrorOutOfMemory == gpu::kOutOfMemory &&
                  hipErrorNotFound == gpu::kNotFound,
              "the GPU backend reads HIP's results by these numbers");
static_assert(hipStreamCaptureStatusNone == 0, "the GPU backend reads 0 as not capturing");

std::string version_text(int v) { return std::to_string(v / 10000000) + "." + std::to_string(v / 100000 % 100); }

class HipDevice final : public gpu::Device {
 public:
  HipDevice(const Runtime &runtime, int ordinal) : hip_(runtime), ordinal_(ordinal) {
    const hipError_t e = hip_.hipDeviceGet(&device_, ordinal);
    if (e != hipSuccess) fail(PKV_ERR_BACKEND, "hipDeviceGet: %s", hip_.describe(e).c_str());
  }

  pkv_backend kind() const override { return PKV_BACKEND_HIP; }
  const char *name() const override { return "HIP"; }
  const gpu::Images &images() const override {
    static const gpu::Images images{hip_image_pages, hip_image_decode_generic, hip_image_decode_cuda_core, nullptr, nullptr,
                                    PKV_HIP_TARGETS};
    return images;
  }
  std::string describe(int result) const override { return hip_.describe(result); }
  std::string identity() const override {
    char name[128] = {0};
    int major = 0, minor = 0;
    hip_.hipDeviceGetName(name, sizeof name - 1, device_);
    hip_.hipDeviceGetAttribute(&major, hipDeviceAttributeComputeCapabilityMajor, device_);
    hip_.hipDeviceGetAttribute(&minor, hipDeviceAttributeComputeCapabilityMinor, device_);
    return std::string(name) + ", arch " + std::to_string(major) + "." + std::to_string(minor) + ", HIP " +
           version_text(hip_.version) + " (" + hip_.library + ")";
  }

  Call enter(int *token) override {
    const hipError_t e = hip_.hipGetDevice(token);
    if (e != hipSuccess) return {e, "hipGetDevice"};
    return {hip_.hipSetDevice(ordinal_), "hipSetDevice"};
  }
  void leave(int token) noexcept override { hip_.hipSetDevice(token); }
  Call attribute(gpu::Attribute a, int *value) override {
    const int id =
        a == gpu::Attribute::multiprocessors ? hipDeviceAttributeMultiprocessorCount : hipDeviceAttributeWarpSize;
    return {hip_.hipDeviceGetAttribute(value, id, device_), "hipDeviceGetAttribute"};
  }

  Call stream_create(gpu::Stream *s) override {
    hipStream_t raw = nullptr;
    const Call c{hip_.hipStreamCreateWithFlags(&raw, hipStreamNonBlocking), "hipStreamCreateWithFlags"};
    *s = reinterpret_cast<gpu::Stream>(raw);
    return c;
  }
  Call stream_destroy(gpu::Stream s) override { return {hip_.hipStreamDestroy(stream(s)), "hipStreamDestroy"}; }
  Call stream_synchronize(gpu::Stream s) override {
    return {hip_.hipStreamSynchronize(stream(s)), "hipStreamSynchronize"};
  }
  Call stream_capture_status(gpu::Stream s, int *status) override {
    return {hip_.hipStreamIsCapturing(stream(s), status), "hipStreamIsCapturing"};
  }
  Call event_create(gpu::Event *e, bool timing) override {
    hipEvent_t raw = nullptr;
    const Call c{hip_.hipEventCreateWithFlags(&raw, timing ? 0 : hipEventDisableTiming), "hipEventCreateWithFlags"};
    *e = reinterpret_cast<gpu::Event>(raw);
    return c;
  }
  Call event_destroy(gpu::Event e) override { return {hip_.hipEventDestroy(event(e)), "hipEventDestroy"}; }
  Call event_record(gpu::Event e, gpu::Stream s) override {
    return {hip_.hipEventRecord(event(e), stream(s)), "hipEventRecord"};
  }
  Call event_synchronize(gpu::Event e) override { return {hip_.hipEventSynchronize(event(e)), "hipEventSynchronize"}; }
  Call event_elapsed_ms(float *ms, gpu::Event start, gpu::Event end) override {
    return {hip_.hipEventElapsedTime(ms, event(start), event(end)), "hipEventElapsedTime"};
  }

  Call alloc(DevPtr *ptr, size_t bytes) override {
    void *raw = nullptr;
    const Call c{hip_.hipMalloc(&raw, bytes), "hipMalloc"};
    *ptr = DevPtr(uintptr_t(raw));
    return c;
  }
  Call free(DevPtr ptr) override { return {hip_.hipFree(address(ptr)), "hipFree"}; }
  Call host_alloc(void **ptr, size_t bytes) override {
    return {hip_.hipHostMalloc(ptr, bytes, hipHostMallocPortable), "hipHostMalloc"};
  }
  Call host_free(void *ptr) override { return {hip_.hipHostFree(ptr), "hipHostFree"}; }
  Call copy_to_device(DevPtr dst, const void *src, size_t bytes, gpu::Stream s) override {
    return {hip_.hipMemcpyHtoDAsync(address(dst), src, bytes, stream(s)), "hipMemcpyHtoDAsync"};
  }
  Call copy_to_host(void *dst, DevPtr src, size_t bytes, gpu::Stream s) override {
    return {hip_.hipMemcpyDtoHAsync(dst, address(src), bytes, stream(s)), "hipMemcpyDtoHAsync"};
  }
  Call fill32(DevPtr dst, uint32_t value, size_t count, gpu::Stream s) override {
    return {hip_.hipMemsetD32Async(address(dst), int(value), count, stream(s)), "hipMemsetD32Async"};
  }

  Call module_load(gpu::Module *m, const void *image) override {
    hipModule_t raw = nullptr;
    const Call c{hip_.hipModuleLoadData(&raw, image), "hipModuleLoadData"};
    *m = reinterpret_cast<gpu::Module>(raw);
    return c;
  }
  Call module_unload(gpu::Module m) override {
    return {hip_.hipModuleUnload(reinterpret_cast<hipModule_t>(m)), "hipModuleUnload"};
  }
  Call function(gpu::Function *f, gpu::Module m, const char *name) override {
    hipFunction_t raw = nullptr;
    const Call c{hip_.hipModuleGetFunction(&raw, reinterpret_cast<hipModule_t>(m), name), "hipModuleGetFunction"};
    *f = reinterpret_cast<gpu::Function>(raw);
    return c;
  }
  Call launch(gpu::Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
              unsigned shared_bytes, gpu::Stream s, void **params) override {
    return {hip_.hipModuleLaunchKernel(reinterpret_cast<hipFunction_t>(f), gx, gy, gz, bx, by, bz, shared_bytes,
                                       stream(s), params, nullptr),
            "hipModuleLaunchKernel"};
  }

 private:
  static hipStream_t stream(gpu::Stream s) { return reinterpret_cast<hipStream_t>(s); }
  static hipEvent_t event(gpu::Event e) { return reinterpret_cast<hipEvent_t>(e); }
  static void *address(DevPtr p) { return reinterpret_cast<void *>(uintptr_t(p)); }

  const Runtime &hip_;
  int ordinal_;
  hipDevice_t device_ = 0;
};

const Runtime &runtime_or_fail() {
  std::string why;
  const Runtime *r = hip_runtime(&why);
  if (!r) fail(PKV_ERR_NO_DEVICE, "%s", why.c_str());
  return *r;
}

} // namespace

std::unique_ptr<Backend> make_hip_backend(int ordinal, void *stream, uint32_t threads) {
  const Runtime &r = runtime_or_fail();
  int count = 0;
  const hipError_t e = r.hipGetDeviceCount(&count);
  if (e != hipSuccess || count == 0)
    fail(PKV_ERR_NO_DEVICE, "the HIP runtime (%s) found no device%s%s", r.library.c_str(), e ? ": " : "",
         e ? r.describe(e).c_str() : "");
  if (ordinal < 0 || ordinal >= count)
    fail(PKV_ERR_NO_DEVICE, "device %d does not exist: the HIP runtime found %d device%s", ordinal, count,
         count == 1 ? "" : "s");
  return make_gpu_backend(std::make_unique<HipDevice>(r, ordinal), stream, threads);
}

int hip_devices(std::string *detail) {
  std::string why;
  const Runtime *r = hip_runtime(&why);
  if (!r) {
    *detail = why;
    return 0;
  }
  int count = 0;
  if (r->hipGetDeviceCount(&count) != hipSuccess) count = 0;
  *detail = r->library + ", HIP " + version_text(r->version);
  for (int i = 0; i < count; i++) {
    hipDevice_t dev;
    char name[128] = {0};
    int major = 0, minor = 0, cus = 0, wave = 0;
    size_t bytes = 0;
    r->hipDeviceGet(&dev, i);
    r->hipDeviceGetName(name, sizeof name - 1, dev);
    r->hipDeviceGetAttribute(&major, hipDeviceAttributeComputeCapabilityMajor, dev);
    r->hipDeviceGetAttribute(&minor, hipDeviceAttributeComputeCapabilityMinor, dev);
    r->hipDeviceGetAttribute(&cus, hipDeviceAttributeMultiprocessorCount, dev);
    r->hipDeviceGetAttribute(&wave, hipDeviceAttributeWarpSize, dev);
    r->hipDeviceTotalMem(&bytes, dev);
    *detail += "; " + std::to_string(i) + ": " + name + " (arch " + std::to_string(major) + "." +
               std::to_string(minor) + ", " + std::to_string(cus) + " CUs, wave" + std::to_string(wave) + ", " +
               std::to_string(bytes >> 30) + " GiB)";
  }
  if (count == 0) *detail += "; no device";
  return count;
}

} // namespace pkv
