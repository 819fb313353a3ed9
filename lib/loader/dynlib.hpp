// Opening a shared library at run time and finding its symbols: dlopen on POSIX, LoadLibrary on
// Windows. Failures carry the system's own error text.
#pragma once

#include <string>
#include <vector>

namespace pkv {

class DynLib {
 public:
  DynLib() = default;
  ~DynLib();
  DynLib(DynLib &&other) noexcept;
  DynLib &operator=(DynLib &&other) noexcept;
  DynLib(const DynLib &) = delete;
  DynLib &operator=(const DynLib &) = delete;

  // Opens `name` (a path, or a name the platform searches for; on Windows a bare name is looked up
  // in the system directory only). On failure returns an empty DynLib and sets *error.
  static DynLib open(const std::string &name, std::string *error);
  // Opens the first of `names` that opens and sets *opened to it. *tried says what every name before
  // it answered, names with the same answer together ("a, b: cannot open shared object file: No such
  // file or directory; c: ..."), so a failure can list every library tried in a few words.
  static DynLib open_first(const std::vector<std::string> &names, std::string *opened, std::string *tried);

  explicit operator bool() const { return handle_ != nullptr; }
  void *symbol(const char *name) const; // nullptr when absent

 private:
  void *handle_ = nullptr;
};

} // namespace pkv
