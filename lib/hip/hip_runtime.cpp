#include "hip_runtime.hpp"

#include <cstdlib>
#include <mutex>
#include <vector>

#include "../loader/runtime_library.hpp"

namespace pkv {

namespace {

using namespace hip;

// Newest runtime first: one library binary serves machines with ROCm 5, 6 or 7. On Linux the names
// are tried through the loader's search path, then in ROCm's default install folder, which is often
// not on that path.
std::vector<std::string> candidates() {
  if (const char *env = std::getenv("PKV_HIP_RUNTIME"); env && *env) return {env};
#if defined(_WIN32)
  return {"amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll"};
#else
  std::vector<std::string> names;
  for (const char *dir : {"", "/opt/rocm/lib/"})
    for (const char *name : {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"})
      names.push_back(std::string(dir) + name);
  return names;
#endif
}

bool resolve(const DynLib &lib, Runtime *r, std::string *why) {
#define PKV_HIP_RESOLVE(ret, name, params)                                                                             \
  r->name = reinterpret_cast<decltype(r->name)>(lib.symbol(#name));                                                    \
  if (!r->name) {                                                                                                      \
    *why = r->library + ": the runtime has no " #name;                                                                 \
    return false;                                                                                                      \
  }
  PKV_HIP_RUNTIME_FUNCTIONS(PKV_HIP_RESOLVE)
#undef PKV_HIP_RESOLVE
  return true;
}

// hipInit, then the runtime's version.
bool init(Runtime *r, std::string *why) {
  const hipError_t e = r->hipInit(0);
  if (e != hipSuccess) {
    *why = r->library + ": hipInit failed: " + r->describe(e);
    return false;
  }
  r->hipRuntimeGetVersion(&r->version);
  return true;
}

} // namespace

std::string hip::Runtime::describe(hipError_t e) const {
  const char *name = hipGetErrorName ? hipGetErrorName(e) : nullptr;
  const char *text = hipGetErrorString ? hipGetErrorString(e) : nullptr;
  return std::string(name ? name : "HIP error " + std::to_string(e)) + " (" + (text ? text : "no description") + ")";
}

const hip::Runtime *hip_runtime(std::string *why) {
  static std::once_flag once;
  static const RuntimeLibrary<Runtime> *loaded = nullptr;
  std::call_once(once, [] { loaded = open_runtime_library<Runtime>(candidates(), "HIP runtime library", resolve, init); });
  if (!loaded->why.empty()) {
    *why = loaded->why;
    return nullptr;
  }
  return &loaded->table;
}

} // namespace pkv
