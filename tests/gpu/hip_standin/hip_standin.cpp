// A stand-in for the HIP runtime, for tests only (docs/hip.md): the HIP calls pagedkv's HIP backend
// makes (lib/hip/hip_runtime.hpp), carried out by the CUDA driver (lib/cuda/cuda_driver.hpp).
// Its module loader takes the code-object bundle the backend passes, checks that it is one of the
// library's HIP images, and loads the CUDA build of the same kernel file instead; so on an NVIDIA GPU
// the HIP backend's host code runs the GPU test suite for real. It is no HIP implementation: only
// what pagedkv calls, with HIP's meaning where it differs from CUDA's.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_driver.hpp"
#include "cuda/cuda_images.hpp"
#include "hip/hip_images.hpp"
#include "hip/hip_runtime.hpp"

using namespace pkv::hip;
using namespace pkv::cu;

// The runtime's entry points, exported under HIP's names with exactly the table's signatures (a
// definition below that differed would not compile).
#define PKV_STANDIN_DECLARE(ret, name, params) __attribute__((visibility("default"))) ret name params;
extern "C" {
PKV_HIP_RUNTIME_FUNCTIONS(PKV_STANDIN_DECLARE)
}
#undef PKV_STANDIN_DECLARE

namespace {

constexpr hipError_t kInvalidValue = 1, kNotInitialized = 3;

const Driver *cu = nullptr; // set by a successful hipInit
std::string init_failure;   // why hipInit failed

// HIP has a current device per thread, device 0 until one is set; CUDA has a current context. A
// device's context here is its primary context, retained once and kept, as HIP keeps its devices.
std::mutex primaries_mutex;
std::vector<CUcontext> primaries;

CUresult primary(int ordinal, CUcontext *ctx) {
  std::lock_guard<std::mutex> lock(primaries_mutex);
  int count = 0;
  if (const CUresult r = cu->cuDeviceGetCount(&count)) return r;
  if (ordinal < 0 || ordinal >= count) return CUresult(101); // CUDA_ERROR_INVALID_DEVICE
  primaries.resize(size_t(count), nullptr);
  if (!primaries[ordinal]) {
    CUdevice dev;
    if (const CUresult r = cu->cuDeviceGet(&dev, ordinal)) return r;
    if (const CUresult r = cu->cuDevicePrimaryCtxRetain(&primaries[ordinal], dev)) return r;
  }
  *ctx = primaries[ordinal];
  return CUDA_SUCCESS;
}

// Calls that create something on "the current device" get device 0 when none is current, as in HIP.
CUresult bind() {
  CUcontext ctx = nullptr;
  if (const CUresult r = cu->cuCtxGetCurrent(&ctx)) return r;
  if (ctx) return CUDA_SUCCESS;
  if (const CUresult r = primary(0, &ctx)) return r;
  return cu->cuCtxSetCurrent(ctx);
}

// Runs a driver call once hipInit has succeeded. CUDA driver results pass through as HIP errors:
// ROCm numbers hipError_t as CUDA numbers its results, and the names and texts come from the driver.
template <class Call> hipError_t run(Call call) { return cu ? hipError_t(call()) : kNotInitialized; }

// The same for calls that create something on the current device.
template <class Call> hipError_t run_on_device(Call call) {
  if (!cu) return kNotInitialized;
  if (const CUresult r = bind()) return r;
  return call();
}

// A clang offload bundle: the magic, the number of entries, then per entry its offset, size, id
// length and id. `size` is 0 when the image is none; `amd` says whether it holds a code object for
// an AMD GPU, as every image of the HIP backend does.
struct Bundle {
  uint64_t size = 0;
  bool amd = false;
};

Bundle read_bundle(const unsigned char *image) {
  static const char kMagic[] = "__CLANG_OFFLOAD_BUNDLE__";
  Bundle b;
  if (std::memcmp(image, kMagic, sizeof kMagic - 1) != 0) return b;
  auto u64 = [](const unsigned char *p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  };
  const unsigned char *p = image + sizeof kMagic - 1;
  const uint64_t entries = u64(p);
  p += 8;
  for (uint64_t i = 0; i < entries; i++) {
    const uint64_t offset = u64(p), size = u64(p + 8), id_bytes = u64(p + 16);
    const std::string id(reinterpret_cast<const char *>(p + 24), size_t(id_bytes));
    b.amd = b.amd || (size > 0 && id.rfind("hipv4-amdgcn-amd-amdhsa--gfx", 0) == 0);
    b.size = std::max(b.size, offset + size);
    p += 24 + id_bytes;
  }
  return b;
}

// The CUDA image of the kernel file whose HIP image this is, or nullptr.
const unsigned char *cuda_twin(const void *image) {
  static const struct {
    const unsigned char *hip, *cuda;
  } files[] = {{pkv::hip_image_pages, pkv::cuda_image_pages},
               {pkv::hip_image_decode_generic, pkv::cuda_image_decode_generic},
               {pkv::hip_image_decode_cuda_core, pkv::cuda_image_decode_cuda_core}};
  const Bundle b = read_bundle(static_cast<const unsigned char *>(image));
  if (!b.amd) return nullptr;
  for (const auto &f : files)
    if (read_bundle(f.hip).size == b.size && std::memcmp(f.hip, image, size_t(b.size)) == 0) return f.cuda;
  return nullptr;
}

} // namespace

hipError_t hipInit(unsigned int) {
  static std::once_flag once;
  std::call_once(once, [] {
    std::string why;
    cu = pkv::cuda_driver(&why);
    if (!cu) init_failure = "the HIP stand-in has no CUDA driver: " + why;
  });
  return cu ? hipSuccess : hipErrorNoDevice;
}

hipError_t hipRuntimeGetVersion(int *version) {
  *version = PKV_STANDIN_HIP_VERSION; // the HIP that built the kernels, whose calls it stands in for
  return hipSuccess;
}

const char *hipGetErrorName(hipError_t e) {
  const char *name = nullptr;
  if (!cu) return e == hipErrorNoDevice ? "hipErrorNoDevice" : "hipErrorNotInitialized";
  return cu->cuGetErrorName(e, &name) == CUDA_SUCCESS && name ? name : "unknown error";
}

const char *hipGetErrorString(hipError_t e) {
  const char *text = nullptr;
  if (!cu) return init_failure.c_str();
  return cu->cuGetErrorString(e, &text) == CUDA_SUCCESS && text ? text : "unknown error";
}

hipError_t hipGetDeviceCount(int *count) {
  *count = 0;
  return run([&] { return cu->cuDeviceGetCount(count); });
}

hipError_t hipDeviceGet(hipDevice_t *device, int ordinal) {
  return run([&] { return cu->cuDeviceGet(device, ordinal); });
}

hipError_t hipDeviceGetName(char *name, int length, hipDevice_t device) {
  return run([&] { return cu->cuDeviceGetName(name, length, device); });
}

hipError_t hipDeviceGetAttribute(int *value, int attribute, hipDevice_t device) {
  static const int map[][2] = {
      {hipDeviceAttributeComputeCapabilityMajor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR},
      {hipDeviceAttributeComputeCapabilityMinor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR},
      {hipDeviceAttributeMultiprocessorCount, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT},
      {hipDeviceAttributeMaxSharedMemoryPerBlock, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK},
      {hipDeviceAttributeWarpSize, CU_DEVICE_ATTRIBUTE_WARP_SIZE}};
  for (const auto &m : map)
    if (m[0] == attribute) return run([&] { return cu->cuDeviceGetAttribute(value, m[1], device); });
  return kInvalidValue; // an attribute the backend was not expected to ask for
}

hipError_t hipDeviceTotalMem(size_t *bytes, hipDevice_t device) {
  return run([&] { return cu->cuDeviceTotalMem(bytes, device); });
}

hipError_t hipGetDevice(int *ordinal) {
  if (!cu) return kNotInitialized;
  CUcontext ctx = nullptr;
  if (const CUresult r = cu->cuCtxGetCurrent(&ctx)) return r;
  if (!ctx) {
    *ordinal = 0;
    return hipSuccess;
  }
  return cu->cuCtxGetDevice(ordinal);
}

hipError_t hipSetDevice(int ordinal) {
  if (!cu) return kNotInitialized;
  CUcontext ctx = nullptr;
  if (const CUresult r = primary(ordinal, &ctx)) return r;
  return cu->cuCtxSetCurrent(ctx);
}

hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags) {
  return run_on_device([&] { return cu->cuStreamCreate(reinterpret_cast<CUstream *>(stream), flags); });
}

hipError_t hipStreamDestroy(hipStream_t stream) {
  return run([&] { return cu->cuStreamDestroy(CUstream(stream)); });
}

hipError_t hipStreamSynchronize(hipStream_t stream) {
  return run([&] { return cu->cuStreamSynchronize(CUstream(stream)); });
}

hipError_t hipStreamIsCapturing(hipStream_t stream, int *status) {
  return run([&] { return cu->cuStreamIsCapturing(CUstream(stream), status); });
}

hipError_t hipMalloc(void **ptr, size_t bytes) {
  CUdeviceptr p = 0;
  const hipError_t e = run_on_device([&] { return cu->cuMemAlloc(&p, bytes); });
  *ptr = reinterpret_cast<void *>(p);
  return e;
}

hipError_t hipFree(void *ptr) {
  return ptr ? run([&] { return cu->cuMemFree(CUdeviceptr(ptr)); }) : hipSuccess;
}

hipError_t hipHostMalloc(void **ptr, size_t bytes, unsigned int flags) {
  if (flags & ~hipHostMallocPortable) return kInvalidValue; // AMD-only placement flags mean nothing here
  return run_on_device([&] { return cu->cuMemHostAlloc(ptr, bytes, flags); }); // portable: the same bit
}

hipError_t hipHostFree(void *ptr) {
  return ptr ? run([&] { return cu->cuMemFreeHost(ptr); }) : hipSuccess;
}

hipError_t hipMemcpyHtoDAsync(hipDeviceptr_t dst, const void *src, size_t bytes, hipStream_t s) {
  return run([&] { return cu->cuMemcpyHtoDAsync(CUdeviceptr(dst), src, bytes, CUstream(s)); });
}

hipError_t hipMemcpyDtoHAsync(void *dst, hipDeviceptr_t src, size_t bytes, hipStream_t s) {
  return run([&] { return cu->cuMemcpyDtoHAsync(dst, CUdeviceptr(src), bytes, CUstream(s)); });
}

hipError_t hipMemsetD32Async(hipDeviceptr_t dst, int value, size_t count, hipStream_t s) {
  return run([&] { return cu->cuMemsetD32Async(CUdeviceptr(dst), unsigned(value), count, CUstream(s)); });
}

hipError_t hipModuleLoadData(hipModule_t *module, const void *image) {
  const unsigned char *twin = cuda_twin(image);
  if (!twin) return hipErrorInvalidImage; // not a HIP image of this library's kernels
  return run_on_device([&] { return cu->cuModuleLoadData(reinterpret_cast<CUmodule *>(module), twin); });
}

hipError_t hipModuleUnload(hipModule_t module) {
  return run([&] { return cu->cuModuleUnload(CUmodule(module)); });
}

hipError_t hipModuleGetFunction(hipFunction_t *fn, hipModule_t module, const char *name) {
  return run([&] { return cu->cuModuleGetFunction(reinterpret_cast<CUfunction *>(fn), CUmodule(module), name); });
}

hipError_t hipModuleLaunchKernel(hipFunction_t fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shared_bytes, hipStream_t stream, void **params, void **extra) {
  if (extra) return kInvalidValue; // HIP's and CUDA's `extra` markers differ; the backend passes params
  return run([&] {
    return cu->cuLaunchKernel(CUfunction(fn), gx, gy, gz, bx, by, bz, shared_bytes, CUstream(stream), params, nullptr);
  });
}

hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned int flags) {
  return run_on_device([&] { return cu->cuEventCreate(reinterpret_cast<CUevent *>(event), flags); });
}

hipError_t hipEventDestroy(hipEvent_t event) {
  return run([&] { return cu->cuEventDestroy(CUevent(event)); });
}

hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) {
  return run([&] { return cu->cuEventRecord(CUevent(event), CUstream(stream)); });
}

hipError_t hipEventSynchronize(hipEvent_t event) {
  return run([&] { return cu->cuEventSynchronize(CUevent(event)); });
}

hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t end) {
  return run([&] { return cu->cuEventElapsedTime(ms, CUevent(start), CUevent(end)); });
}
