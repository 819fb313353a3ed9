// The HIP runtime as pagedkv uses it: our own declarations of the few types, values and entry points
// (no ROCm header is needed to build), resolved at run time from libamdhip64.so.N / amdhip64_N.dll.
// HIP's module API mirrors the CUDA driver API call for call (lib/cuda/cuda_driver.hpp); where HIP
// differs, the comments say so.
#pragma once

#include <cstddef>
#include <string>

namespace pkv {
namespace hip {

using hipError_t = int;
using hipDevice_t = int; // a device ordinal
using hipDeviceptr_t = void *;
using hipModule_t = struct ihipModule_t *;
using hipFunction_t = struct ihipModuleSymbol_t *;
using hipStream_t = struct ihipStream_t *;
using hipEvent_t = struct ihipEvent_t *;

// hipError_t values; ROCm numbers them as CUDA numbers its driver results.
constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorOutOfMemory = 2;
constexpr hipError_t hipErrorNoDevice = 100;
constexpr hipError_t hipErrorInvalidImage = 200;
constexpr hipError_t hipErrorNoBinaryForGpu = 209;
constexpr hipError_t hipErrorNotFound = 500;
constexpr hipError_t hipErrorNotReady = 600;

// hipDeviceAttribute_t values as ROCm 5 numbers them (CUDA-compatible attributes in alphabetical
// order from 0, AMD-specific ones from 10000; not CUDA's numbers). Checked against ROCm 5.2's and
// 7.x's headers: 7.x retired some attributes but kept their places, so these stay put.
constexpr int hipDeviceAttributeComputeCapabilityMajor = 23;
constexpr int hipDeviceAttributeComputeCapabilityMinor = 61;
constexpr int hipDeviceAttributeMultiprocessorCount = 63;
constexpr int hipDeviceAttributeMaxSharedMemoryPerBlock = 74;
constexpr int hipDeviceAttributeWarpSize = 87;

constexpr unsigned hipStreamNonBlocking = 1;
constexpr unsigned hipEventDisableTiming = 2;
constexpr unsigned hipHostMallocPortable = 1;
constexpr int hipStreamCaptureStatusNone = 0; // hipStreamCaptureStatus

// return type, name, parameters. HIP exports unversioned names, so dlsym finds each directly.
// Unlike CUDA there are no contexts to push: the calling thread's current device (hipGetDevice /
// hipSetDevice) is what memory, streams and modules belong to.
#define PKV_HIP_RUNTIME_FUNCTIONS(X)                                                                       \
  X(hipError_t, hipInit, (unsigned int flags))                                                             \
  X(hipError_t, hipRuntimeGetVersion, (int *version))                                                      \
  X(const char *, hipGetErrorName, (hipError_t error))                                                     \
  X(const char *, hipGetErrorString, (hipError_t error))                                                   \
  X(hipError_t, hipGetDeviceCount, (int *count))                                                           \
  X(hipError_t, hipDeviceGet, (hipDevice_t * device, int ordinal))                                         \
  X(hipError_t, hipDeviceGetName, (char *name, int length, hipDevice_t device))                            \
  X(hipError_t, hipDeviceGetAttribute, (int *value, int attribute, hipDevice_t device))                    \
  X(hipError_t, hipDeviceTotalMem, (size_t * bytes, hipDevice_t device))                                   \
  X(hipError_t, hipGetDevice, (int *ordinal))                                                              \
  X(hipError_t, hipSetDevice, (int ordinal))                                                               \
  X(hipError_t, hipStreamCreateWithFlags, (hipStream_t * stream, unsigned int flags))                      \
  X(hipError_t, hipStreamDestroy, (hipStream_t stream))                                                    \
  X(hipError_t, hipStreamSynchronize, (hipStream_t stream))                                                \
  X(hipError_t, hipStreamIsCapturing, (hipStream_t stream, int *status))                                   \
  X(hipError_t, hipMalloc, (void **ptr, size_t bytes))                                                     \
  X(hipError_t, hipFree, (void *ptr))                                                                      \
  X(hipError_t, hipHostMalloc, (void **ptr, size_t bytes, unsigned int flags))                             \
  X(hipError_t, hipHostFree, (void *ptr))                                                                  \
  X(hipError_t, hipMemcpyHtoDAsync, (hipDeviceptr_t dst, const void *src, size_t bytes, hipStream_t s))    \
  X(hipError_t, hipMemcpyDtoHAsync, (void *dst, hipDeviceptr_t src, size_t bytes, hipStream_t s))          \
  X(hipError_t, hipMemsetD32Async, (hipDeviceptr_t dst, int value, size_t count, hipStream_t s))           \
  X(hipError_t, hipModuleLoadData, (hipModule_t * module, const void *image))                              \
  X(hipError_t, hipModuleUnload, (hipModule_t module))                                                     \
  X(hipError_t, hipModuleGetFunction, (hipFunction_t * fn, hipModule_t module, const char *name))          \
  X(hipError_t, hipModuleLaunchKernel,                                                                     \
    (hipFunction_t fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,        \
     unsigned shared_bytes, hipStream_t stream, void **params, void **extra))                              \
  X(hipError_t, hipEventCreateWithFlags, (hipEvent_t * event, unsigned int flags))                         \
  X(hipError_t, hipEventDestroy, (hipEvent_t event))                                                       \
  X(hipError_t, hipEventRecord, (hipEvent_t event, hipStream_t stream))                                    \
  X(hipError_t, hipEventSynchronize, (hipEvent_t event))                                                   \
  X(hipError_t, hipEventElapsedTime, (float *ms, hipEvent_t start, hipEvent_t end))

struct Runtime {
#define PKV_HIP_DECLARE(ret, name, params) ret(*name) params = nullptr;
  PKV_HIP_RUNTIME_FUNCTIONS(PKV_HIP_DECLARE)
#undef PKV_HIP_DECLARE
  int version = 0;     // hipRuntimeGetVersion: major * 10^7 + minor * 10^5 + patch
  std::string library; // what was opened

  // "hipErrorOutOfMemory (out of memory)" for an error code.
  std::string describe(hipError_t e) const;
};

} // namespace hip

// The process's HIP runtime, opened and initialised once (hipInit included). nullptr when there is
// none; *why then says which libraries were tried and what each answered. PKV_HIP_RUNTIME may name
// the library to open instead of the platform's defaults.
const hip::Runtime *hip_runtime(std::string *why);

} // namespace pkv
