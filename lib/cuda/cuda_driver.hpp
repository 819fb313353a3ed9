// The CUDA driver API as pagedkv uses it: our own declarations of the few types and entry points
// (no SDK header is needed to build), resolved at run time from libcuda.so.1 / nvcuda.dll.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pkv {
namespace cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st *;
using CUmodule = struct CUmod_st *;
using CUfunction = struct CUfunc_st *;
using CUstream = struct CUstream_st *;
using CUevent = struct CUevent_st *;
using CUgraph = struct CUgraph_st *;
using CUgraphExec = struct CUgraphExec_st *;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8;
constexpr int CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 1;
constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
constexpr int CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;

// The driver API version whose entry-point semantics we ask cuGetProcAddress for (CUDA 12.0).
constexpr int kApiVersion = 12000;

// name, symbol to look up directly when cuGetProcAddress is unavailable, return, parameters.
#define PKV_CUDA_DRIVER_FUNCTIONS(X)                                                                       \
  X(cuInit, "cuInit", (unsigned int flags))                                                                \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int *version))                                              \
  X(cuGetErrorName, "cuGetErrorName", (CUresult error, const char **name))                                 \
  X(cuGetErrorString, "cuGetErrorString", (CUresult error, const char **text))                             \
  X(cuDeviceGetCount, "cuDeviceGetCount", (int *count))                                                    \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice * device, int ordinal))                                          \
  X(cuDeviceGetName, "cuDeviceGetName", (char *name, int length, CUdevice device))                         \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int *value, int attribute, CUdevice device))            \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t * bytes, CUdevice device))                            \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext * ctx, CUdevice device))              \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice device))                         \
  X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", (CUcontext ctx))                                              \
  X(cuCtxPopCurrent, "cuCtxPopCurrent_v2", (CUcontext * ctx))                                              \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext ctx))                                                   \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext * ctx))                                                 \
  X(cuCtxGetDevice, "cuCtxGetDevice", (CUdevice * device))                                                 \
  X(cuStreamCreate, "cuStreamCreate", (CUstream * stream, unsigned int flags))                             \
  X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream stream))                                              \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream stream))                                         \
  X(cuStreamIsCapturing, "cuStreamIsCapturing", (CUstream stream, int *status))                            \
  X(cuStreamBeginCapture, "cuStreamBeginCapture_v2", (CUstream stream, int mode))                          \
  X(cuStreamEndCapture, "cuStreamEndCapture", (CUstream stream, CUgraph * graph))                          \
  X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags",                                            \
    (CUgraphExec * exec, CUgraph graph, unsigned long long flags))                                         \
  X(cuGraphLaunch, "cuGraphLaunch", (CUgraphExec exec, CUstream stream))                                   \
  X(cuGraphExecDestroy, "cuGraphExecDestroy", (CUgraphExec exec))                                          \
  X(cuGraphDestroy, "cuGraphDestroy", (CUgraph graph))                                                     \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr * ptr, size_t bytes))                                        \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr ptr))                                                          \
  X(cuMemHostAlloc, "cuMemHostAlloc", (void **ptr, size_t bytes, unsigned int flags))                      \
  X(cuMemFreeHost, "cuMemFreeHost", (void *ptr))                                                           \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", (CUdeviceptr dst, const void *src, size_t bytes, CUstream s)) \
  X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", (void *dst, CUdeviceptr src, size_t bytes, CUstream s))     \
  X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s)) \
  X(cuMemsetD32Async, "cuMemsetD32Async", (CUdeviceptr dst, unsigned int value, size_t count, CUstream s))   \
  X(cuModuleLoadData, "cuModuleLoadData", (CUmodule * module, const void *image))                          \
  X(cuModuleUnload, "cuModuleUnload", (CUmodule module))                                                   \
  X(cuModuleGetFunction, "cuModuleGetFunction", (CUfunction * fn, CUmodule module, const char *name))      \
  X(cuFuncSetAttribute, "cuFuncSetAttribute", (CUfunction fn, int attribute, int value))                   \
  X(cuFuncGetAttribute, "cuFuncGetAttribute", (int *value, int attribute, CUfunction fn))                  \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor",              \
    (int *blocks, CUfunction fn, int block_size, size_t shared_bytes))                                     \
  X(cuLaunchKernel, "cuLaunchKernel",                                                                      \
    (CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,           \
     unsigned shared_bytes, CUstream stream, void **params, void **extra))                                 \
  X(cuEventCreate, "cuEventCreate", (CUevent * event, unsigned int flags))                                 \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent event))                                                  \
  X(cuEventRecord, "cuEventRecord", (CUevent event, CUstream stream))                                      \
  X(cuEventSynchronize, "cuEventSynchronize", (CUevent event))                                            \
  X(cuEventElapsedTime, "cuEventElapsedTime", (float *ms, CUevent start, CUevent end))

struct Driver {
#define PKV_CUDA_DECLARE(name, symbol, params) CUresult (*name) params = nullptr;
  PKV_CUDA_DRIVER_FUNCTIONS(PKV_CUDA_DECLARE)
#undef PKV_CUDA_DECLARE
  int version = 0;     // cuDriverGetVersion, e.g. 13000
  std::string library; // what was opened

  // "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for a result code.
  std::string describe(CUresult r) const;
};

} // namespace cu

// The process's CUDA driver, opened and initialised once (cuInit included). nullptr when there is
// none; *why then says which libraries were tried and what each answered. PKV_CUDA_DRIVER may name
// the library to open instead of the platform's default.
const cu::Driver *cuda_driver(std::string *why);

} // namespace pkv
