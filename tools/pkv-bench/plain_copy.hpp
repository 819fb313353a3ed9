// The baseline of a transfer row: buffers in the memory the row's call moves bytes between, and the
// time of a plain copy of the same bytes in the same direction, measured in the same run.
#pragma once

#include "common.hpp"

namespace bench {

// Pinned host memory (device == false) or device memory from the bench's GPU; on the CPU plain host
// memory, as the CPU backend's device memory is.
struct Buffer {
  Env &e;
  bool device;
  size_t bytes;
  void *ptr = nullptr;
  std::vector<uint8_t> host;
  Buffer(Env &env, bool on_device, size_t n);
  ~Buffer();
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
  pkv_memory memory() const { return !e.dev ? PKV_MEMORY_HOST : device ? PKV_MEMORY_DEVICE : PKV_MEMORY_HOST_PINNED; }
};

// The median time of `iters` calls of fn (after one warm-up), each timed on the bench's stream on a
// GPU, by the clock around fn and a synchronize on the CPU.
template <class Fn> double time_us(Env &e, uint32_t iters, Fn fn) {
  std::vector<double> t;
  for (uint32_t i = 0; i <= iters; i++) {
    double us;
    if (e.dev) {
      e.dev->start();
      fn();
      us = e.dev->stop_us();
    } else {
      auto t0 = Clock::now();
      fn();
      check(pkv_context_synchronize(e.ctx), "pkv_context_synchronize");
      us = us_since(t0);
    }
    if (i > 0) t.push_back(us);
  }
  return median(t);
}

// time_us of copying src into dst (as many bytes as src holds) in one call: the device's copy on a
// GPU, memcpy on the CPU.
double plain_copy_us(Env &e, const Buffer &dst, const Buffer &src, uint32_t iters);

} // namespace bench
