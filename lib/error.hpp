// Failures inside the library are thrown as pkv::Error and turned into a status and this thread's
// last-error text at the API boundary (api.cpp); nothing is thrown across it.
#pragma once

#include <string>

#include "pagedkv.h"

namespace pkv {

struct Error {
  pkv_status status;
  std::string message;
};

// Throws Error{status, printf-formatted message}.
// MinGW formats through its own C99 printf, which its gcc checks as gnu_printf.
#if defined(__MINGW32__)
#define PKV_PRINTF_LIKE(f, a) __attribute__((format(__MINGW_PRINTF_FORMAT, f, a)))
#elif defined(__GNUC__)
#define PKV_PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PKV_PRINTF_LIKE(f, a)
#endif

[[noreturn]] void fail(pkv_status status, const char *format, ...) PKV_PRINTF_LIKE(2, 3);

// "<status name>: <function>: <message>", into a fixed per-thread buffer: allocates nothing.
void set_last_error(pkv_status status, const char *function, const char *message) noexcept;
void clear_last_error();
const char *last_error();

} // namespace pkv
