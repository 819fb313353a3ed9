#include "cuda_driver.hpp"

#include <cstdlib>
#include <mutex>
#include <vector>

#include "../loader/runtime_library.hpp"

namespace pkv {

namespace {

using namespace cu;

using GetProcAddressV2 = CUresult (*)(const char *, void **, int, unsigned long long, int *);
using GetProcAddressV1 = CUresult (*)(const char *, void **, int, unsigned long long);

std::vector<std::string> candidates() {
  if (const char *env = std::getenv("PKV_CUDA_DRIVER"); env && *env) return {env};
#if defined(_WIN32)
  return {"nvcuda.dll"};
#else
  return {"libcuda.so.1", "libcuda.so"};
#endif
}

// Resolves every entry point through cuGetProcAddress at our pinned API version, which picks the
// right _v2/_v3 variant; where that is missing, the versioned symbol is looked up directly.
bool resolve(const DynLib &lib, Driver *d, std::string *why) {
  auto v2 = reinterpret_cast<GetProcAddressV2>(lib.symbol("cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(lib.symbol("cuGetProcAddress"));
  auto find = [&](const char *name, const char *symbol) -> void * {
    void *fn = nullptr;
    if (v2 && v2(name, &fn, kApiVersion, 0, nullptr) == CUDA_SUCCESS && fn) return fn;
    if (v1 && v1(name, &fn, kApiVersion, 0) == CUDA_SUCCESS && fn) return fn;
    return lib.symbol(symbol);
  };
#define PKV_CUDA_RESOLVE(name, symbol, params)                                                     \
  d->name = reinterpret_cast<decltype(d->name)>(find(#name, symbol));                              \
  if (!d->name) {                                                                                  \
    *why = d->library + ": the driver has no " symbol;                                             \
    return false;                                                                                  \
  }
  PKV_CUDA_DRIVER_FUNCTIONS(PKV_CUDA_RESOLVE)
#undef PKV_CUDA_RESOLVE
  return true;
}

// cuInit, then the driver's version.
bool init(Driver *d, std::string *why) {
  const CUresult r = d->cuInit(0);
  if (r != CUDA_SUCCESS) {
    *why = d->library + ": cuInit failed: " + d->describe(r);
    return false;
  }
  d->cuDriverGetVersion(&d->version);
  return true;
}

} // namespace

std::string cu::Driver::describe(CUresult r) const {
  const char *name = nullptr, *text = nullptr;
  if (cuGetErrorName) cuGetErrorName(r, &name);
  if (cuGetErrorString) cuGetErrorString(r, &text);
  return std::string(name ? name : "CUDA error " + std::to_string(r)) + " (" + (text ? text : "no description") + ")";
}

const cu::Driver *cuda_driver(std::string *why) {
  static std::once_flag once;
  static const RuntimeLibrary<Driver> *loaded = nullptr;
  std::call_once(once, [] { loaded = open_runtime_library<Driver>(candidates(), "CUDA driver library", resolve, init); });
  if (!loaded->why.empty()) {
    *why = loaded->why;
    return nullptr;
  }
  return &loaded->table;
}

} // namespace pkv
