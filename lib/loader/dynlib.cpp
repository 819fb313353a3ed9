#include "dynlib.hpp"

#include <algorithm>
#include <utility>
#include <vector>

#if defined(_WIN32)
#include <windows.h>
#else
#include <dlfcn.h>
#endif

namespace pkv {

namespace {

#if defined(_WIN32)
std::string system_error_text() {
  const DWORD code = GetLastError();
  char *text = nullptr;
  FormatMessageA(FORMAT_MESSAGE_ALLOCATE_BUFFER | FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, nullptr,
                 code, 0, reinterpret_cast<char *>(&text), 0, nullptr);
  std::string out = text ? text : "error " + std::to_string(code);
  if (text) LocalFree(text);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}
#endif

} // namespace

DynLib::~DynLib() {
  if (!handle_) return;
#if defined(_WIN32)
  FreeLibrary(static_cast<HMODULE>(handle_));
#else
  dlclose(handle_);
#endif
}

DynLib::DynLib(DynLib &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}

DynLib &DynLib::operator=(DynLib &&other) noexcept {
  std::swap(handle_, other.handle_);
  return *this;
}

DynLib DynLib::open(const std::string &name, std::string *error) {
  DynLib lib;
#if defined(_WIN32)
  // A bare vendor DLL name is taken from the system directory, never from the current directory.
  const bool bare = name.find_first_of("/\\") == std::string::npos;
  lib.handle_ = LoadLibraryExA(name.c_str(), nullptr, bare ? LOAD_LIBRARY_SEARCH_SYSTEM32 : 0);
  if (!lib.handle_) *error = name + ": " + system_error_text();
#else
  lib.handle_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib.handle_) {
    const char *text = dlerror();
    *error = text ? text : name + ": could not be opened";
  }
#endif
  return lib;
}

DynLib DynLib::open_first(const std::vector<std::string> &names, std::string *opened, std::string *tried) {
  std::vector<std::pair<std::string, std::string>> answers; // an answer, the names that got it
  DynLib lib;
  opened->clear();
  for (const std::string &name : names) {
    std::string error;
    lib = open(name, &error);
    if (lib) {
      *opened = name;
      break;
    }
    // The system's text usually starts with the name itself: keep only the answer.
    const std::string prefix = name + ": ";
    if (error.compare(0, prefix.size(), prefix) == 0) error.erase(0, prefix.size());
    auto same = std::find_if(answers.begin(), answers.end(), [&](const auto &a) { return a.first == error; });
    if (same == answers.end()) answers.emplace_back(error, name);
    else same->second += ", " + name;
  }
  tried->clear();
  for (const auto &a : answers) *tried += (tried->empty() ? "" : "; ") + a.second + ": " + a.first;
  return lib;
}

void *DynLib::symbol(const char *name) const {
  if (!handle_) return nullptr;
#if defined(_WIN32)
  return reinterpret_cast<void *>(GetProcAddress(static_cast<HMODULE>(handle_), name));
#else
  return dlsym(handle_, name);
#endif
}

} // namespace pkv
