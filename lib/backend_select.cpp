#include "backend_select.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/cpu_backend.hpp"
#include "error.hpp"
#if PKV_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif
#if PKV_WITH_HIP
#include "hip/hip_backend.hpp"
#endif

namespace pkv {

namespace {

const char *missing_reason(pkv_backend b) {
  return b == PKV_BACKEND_CUDA ? "the CUDA backend is not built into this library (configure with nvcc found, -Dcuda=enabled)"
                               : "the HIP backend is not built into this library (configure with hipcc found, -Dhip=enabled)";
}

bool compiled(pkv_backend b) {
  return b == PKV_BACKEND_CPU || (b == PKV_BACKEND_CUDA && PKV_WITH_CUDA) || (b == PKV_BACKEND_HIP && PKV_WITH_HIP);
}

std::unique_ptr<Backend> make(pkv_backend b, const pkv_context_desc &desc) {
  if (!compiled(b)) fail(PKV_ERR_UNSUPPORTED, "%s", missing_reason(b));
#if PKV_WITH_CUDA
  if (b == PKV_BACKEND_CUDA) return make_cuda_backend(desc.device, desc.stream, desc.threads);
#endif
#if PKV_WITH_HIP
  if (b == PKV_BACKEND_HIP) return make_hip_backend(desc.device, desc.stream, desc.threads);
#endif
  return make_cpu_backend(desc.threads);
}

pkv_backend from_environment() {
  const char *env = std::getenv("PKV_BACKEND");
  if (!env || !*env) return PKV_BACKEND_AUTO;
  for (pkv_backend b : {PKV_BACKEND_AUTO, PKV_BACKEND_CPU, PKV_BACKEND_CUDA, PKV_BACKEND_HIP})
    if (std::strcmp(env, pkv_backend_name(b)) == 0) return b;
  fail(PKV_ERR_INVALID_ARGUMENT, "the environment variable PKV_BACKEND is \"%s\": expected auto, cpu, cuda or hip", env);
}

} // namespace

std::unique_ptr<Backend> create_backend(const pkv_context_desc &desc) {
  pkv_backend want = desc.backend;
  if (want == PKV_BACKEND_AUTO) want = from_environment();
  switch (want) {
  case PKV_BACKEND_AUTO:
    // GPU backends first; whatever stops one (no driver, no device, an old driver) moves on to the next.
    for (pkv_backend b : {PKV_BACKEND_CUDA, PKV_BACKEND_HIP}) {
      if (!compiled(b)) continue;
      try {
        return make(b, desc);
      } catch (const Error &) {
      }
    }
    return make_cpu_backend(desc.threads);
  case PKV_BACKEND_CPU:
  case PKV_BACKEND_CUDA:
  case PKV_BACKEND_HIP: return make(want, desc);
  default: fail(PKV_ERR_INVALID_ARGUMENT, "backend %d is not a pkv_backend value", int(want));
  }
}

void query_backend(pkv_backend backend, pkv_backend_info *info) {
  const char *detail = "";
  std::string text;
  switch (backend) {
  case PKV_BACKEND_CPU:
    info->compiled = 1;
    info->device_count = cpu_devices(&text);
    detail = text.c_str();
    break;
  case PKV_BACKEND_CUDA:
  case PKV_BACKEND_HIP:
    info->compiled = compiled(backend);
    info->device_count = 0;
    detail = missing_reason(backend);
#if PKV_WITH_CUDA
    if (backend == PKV_BACKEND_CUDA) {
      info->device_count = cuda_devices(&text);
      detail = text.c_str();
    }
#endif
#if PKV_WITH_HIP
    if (backend == PKV_BACKEND_HIP) {
      info->device_count = hip_devices(&text);
      detail = text.c_str();
    }
#endif
    break;
  default:
    fail(PKV_ERR_INVALID_ARGUMENT, "backend %d: ask for PKV_BACKEND_CPU, PKV_BACKEND_CUDA or PKV_BACKEND_HIP",
         int(backend));
  }
  info->backend = backend;
  std::strncpy(info->detail, detail, sizeof info->detail - 1);
  info->detail[sizeof info->detail - 1] = '\0';
}

} // namespace pkv
