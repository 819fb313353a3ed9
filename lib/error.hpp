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
[[noreturn]] void fail(pkv_status status, const char *format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

void set_last_error(pkv_status status, const std::string &message);
void clear_last_error();
const char *last_error();

} // namespace pkv
