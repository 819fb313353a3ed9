#include "error.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <vector>

namespace pkv {

namespace {
// A fixed buffer rather than a std::string: the pointer pkv_last_error() returned stays valid for the
// thread's lifetime, even when a caller reads it after its next call.
thread_local char g_last_error[1024];
}

void fail(pkv_status status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::vector<char> text(n > 0 ? size_t(n) + 1 : 1, '\0');
  if (n > 0) std::vsnprintf(text.data(), text.size(), format, args);
  va_end(args);
  throw Error{status, std::string(text.data())};
}

void set_last_error(pkv_status status, const char *function, const char *message) noexcept {
  const char *name = pkv_status_string(status);
  std::snprintf(g_last_error, sizeof g_last_error, "%.*s: %s: %s", int(std::strcspn(name, ":")), name, function,
                message);
}

void clear_last_error() { g_last_error[0] = '\0'; }

const char *last_error() { return g_last_error; }

} // namespace pkv
