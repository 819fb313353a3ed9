// A check that failed in C++ test code, thrown rather than reported through cmocka's fail_msg: its
// longjmp would skip the destructors of the frames between (and LeakSanitizer would then report the
// test's own vectors). The cmocka test catches it and reports its text.
#pragma once

#include <cstdarg>
#include <cstdio>

struct TestFailure {
  char text[1024];
};

[[noreturn]] inline void test_failure(const char *format, ...) __attribute__((format(printf, 1, 2)));
inline void test_failure(const char *format, ...) {
  TestFailure f;
  va_list args;
  va_start(args, format);
  std::vsnprintf(f.text, sizeof f.text, format, args);
  va_end(args);
  throw f;
}
