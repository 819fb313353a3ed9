#include "hip_runtime.hpp"

#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "dynlib.hpp"

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

struct Loaded {
  DynLib lib;
  Runtime runtime;
  std::string why;
  bool ok = false;
};

std::unique_ptr<Loaded> load() {
  auto out = std::make_unique<Loaded>();
  std::string name, tried;
  DynLib lib = DynLib::open_first(candidates(), &name, &tried);
  if (!lib) {
    out->why = "no HIP runtime library could be opened (" + tried + ")";
    return out;
  }
  // What was tried before the library that opened belongs to the story of a failure.
  const std::string before = tried.empty() ? "" : " (not opened: " + tried + ")";
  out->runtime.library = name;
  // Kept open whatever follows: hipInit may have started the runtime's own threads and exit
  // handlers, which must not find their code unloaded.
  out->lib = std::move(lib);
  if (!resolve(out->lib, &out->runtime, &out->why)) {
    out->why += before;
    return out;
  }
  const hipError_t e = out->runtime.hipInit(0);
  if (e != hipSuccess) {
    out->why = name + ": hipInit failed: " + out->runtime.describe(e) + before;
    return out;
  }
  out->runtime.hipRuntimeGetVersion(&out->runtime.version);
  out->ok = true;
  return out;
}

} // namespace

std::string hip::Runtime::describe(hipError_t e) const {
  const char *name = hipGetErrorName ? hipGetErrorName(e) : nullptr;
  const char *text = hipGetErrorString ? hipGetErrorString(e) : nullptr;
  return std::string(name ? name : "HIP error " + std::to_string(e)) + " (" + (text ? text : "no description") + ")";
}

const hip::Runtime *hip_runtime(std::string *why) {
  static std::once_flag once;
  static Loaded *loaded = nullptr; // never destroyed, so the runtime is never unloaded (see load)
  std::call_once(once, [] { loaded = load().release(); });
  if (!loaded->ok) {
    *why = loaded->why;
    return nullptr;
  }
  return &loaded->runtime;
}

} // namespace pkv
