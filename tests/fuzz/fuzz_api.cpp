// libFuzzer harness: each input is a small pool and a sequence of API calls, run against the
// reference model of tests/support/api_model.cpp, which checks the pool after every call. A
// disagreement aborts with what differed; the sanitizers catch the rest. tools/fuzz runs it.
#include <cstdio>
#include <cstdlib>

#include "api_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint32_t calls = 0;
  char why[512];
  if (pkv_model_run(data, size, &calls, why, sizeof why) != 0) {
    std::fprintf(stderr, "model mismatch after %u calls: %s\n", calls, why);
    std::abort();
  }
  return 0;
}
