#include "plain_copy.hpp"

#include <cstring>

namespace bench {

Buffer::Buffer(Env &env, bool on_device, size_t n) : e(env), device(on_device), bytes(n) {
  if (!e.dev) {
    host.resize(n);
    ptr = host.data();
  } else {
    ptr = device ? e.dev->alloc(n) : e.dev->alloc_pinned(n);
  }
}

Buffer::~Buffer() {
  if (e.dev) device ? e.dev->release(ptr) : e.dev->release_pinned(ptr);
}

double plain_copy_us(Env &e, const Buffer &dst, const Buffer &src, uint32_t iters) {
  const size_t bytes = src.bytes;
  const BenchDevice::Direction d = src.device ? (dst.device ? BenchDevice::kDeviceToDevice : BenchDevice::kDeviceToHost)
                                              : BenchDevice::kHostToDevice;
  return time_us(e, iters, [&] {
    if (e.dev) e.dev->copy(dst.ptr, src.ptr, bytes, d);
    else std::memcpy(dst.ptr, src.ptr, bytes);
  });
}

} // namespace bench
