// What pkv-bench needs of a GPU beyond pagedkv's API, brought the way an engine brings it: a stream
// of its own (handed to pkv_context_desc.stream), device buffers for q and out, and events that time
// each call on that stream.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

class BenchDevice {
 public:
  virtual ~BenchDevice() = default;
  virtual void *stream() = 0;
  virtual void *alloc(size_t bytes) = 0; // freed with the device, or by release
  virtual void release(void *ptr) = 0;
  virtual void upload(void *dst, const void *src, size_t bytes) = 0;
  virtual void *alloc_pinned(size_t bytes) = 0; // page-locked host memory, freed by release_pinned
  virtual void release_pinned(void *ptr) = 0;
  enum Direction { kHostToDevice, kDeviceToHost, kDeviceToDevice };
  virtual void copy(void *dst, const void *src, size_t bytes, Direction d) = 0; // queued on the stream
  virtual void start() = 0;      // holds the stream briefly, then records the start event on it
  virtual double stop_us() = 0;  // records the end event, waits for it, returns the time between
  virtual std::string name() = 0;

  // A new device buffer holding a copy of `bytes` at src.
  void *copy_of(const void *src, size_t bytes) {
    void *p = alloc(bytes);
    upload(p, src, bytes);
    return p;
  }
};

// The CUDA device `ordinal`, or nullptr (with *why) where the build or the machine has none.
std::unique_ptr<BenchDevice> open_cuda_bench_device(int ordinal, std::string *why);
