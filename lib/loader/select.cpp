#include "select.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

#include "../cpu_backend.hpp"
#include "../error.hpp"

namespace pkv {

namespace {

// The GPU backends are not in this build yet: both say so, in the words a user can act on.
const char *missing_reason(pkv_backend b) {
  return b == PKV_BACKEND_CUDA ? "the CUDA backend is not built into this library version"
                               : "the HIP backend is not built into this library version";
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
  case PKV_BACKEND_CPU: return make_cpu_backend(desc.threads);
  case PKV_BACKEND_CUDA:
  case PKV_BACKEND_HIP: fail(PKV_ERR_UNSUPPORTED, "%s", missing_reason(want));
  default: fail(PKV_ERR_INVALID_ARGUMENT, "backend %d is not a pkv_backend value", int(want));
  }
}

void query_backend(pkv_backend backend, pkv_backend_info *info) {
  const char *detail = "";
  std::string cpu;
  switch (backend) {
  case PKV_BACKEND_CPU:
    cpu = cpu_description();
    detail = cpu.c_str();
    info->compiled = 1;
    info->device_count = 1;
    break;
  case PKV_BACKEND_CUDA:
  case PKV_BACKEND_HIP:
    detail = missing_reason(backend);
    info->compiled = 0;
    info->device_count = 0;
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
