#include "staging.hpp"

#include <algorithm>
#include <cstring>

namespace pkv {
namespace gpu {

// The bytes between pieces are zeroed, so an upload sends the same bytes on every run, nothing left
// in the pinned buffer by an earlier one.
void Upload::copy_into(uint8_t *dst) const {
  uint64_t end = 0;
  for (const Piece &p : pieces_) {
    if (p.offset > end) std::memset(dst + end, 0, size_t(p.offset - end));
    if (p.bytes) std::memcpy(dst + p.offset, p.src, size_t(p.bytes));
    end = std::max(end, p.offset + p.bytes);
  }
}

void Staging::start() {
  for (HostStage &h : stages_) rt_.check(rt_.dev->event_create(&h.sent, false));
}

void Staging::release() noexcept {
  Device &dev = *rt_.dev;
  if (device_stage_.ptr) dev.free(device_stage_.ptr);
  for (DeviceBuffer &b : kept_)
    if (b.ptr) dev.free(b.ptr);
  if (download_.ptr) dev.host_free(download_.ptr);
  for (HostStage &h : stages_) {
    if (h.buffer.ptr) dev.host_free(h.buffer.ptr);
    if (h.sent) dev.event_destroy(h.sent);
  }
}

void Staging::ensure(DeviceBuffer *buf, uint64_t bytes) {
  if (bytes <= buf->bytes) return;
  rt_.check(rt_.dev->stream_synchronize(rt_.stream));
  const uint64_t want = std::max(bytes, 2 * buf->bytes);
  if (buf->ptr) rt_.dev->free(buf->ptr);
  *buf = DeviceBuffer{};
  rt_.check(rt_.dev->alloc(&buf->ptr, size_t(want)), " (scratch)");
  buf->bytes = want;
}

// Grows send's or receive's pinned host memory (to twice its size and 1 MB more, at least); no
// transfer through it is in flight: send waits for its own first, receive's are waited for.
void Staging::ensure_pinned(PinnedBuffer *buf, uint64_t bytes) {
  if (bytes <= buf->bytes) return;
  const uint64_t want = std::max<uint64_t>(bytes, 2 * buf->bytes + (1 << 20));
  if (buf->ptr) rt_.dev->host_free(buf->ptr);
  *buf = PinnedBuffer{};
  rt_.check(rt_.dev->host_alloc(&buf->ptr, size_t(want)), " (staging)");
  buf->bytes = want;
}

bool Staging::grow_kept(DeviceBuffer *buf, uint64_t bytes) {
  if (bytes <= buf->bytes) return false;
  kept_.push_back(*buf);
  *buf = DeviceBuffer{};
  rt_.check(rt_.dev->alloc(&buf->ptr, size_t(bytes)), " (decode scratch)");
  buf->bytes = bytes;
  return true;
}

void Staging::settle() {
  if (!unsettled_) return;
  rt_.check(rt_.dev->stream_synchronize(rt_.stream));
  unsettled_ = false;
}

// Two pinned buffers take turns, so the host waits only when the transfer before last is still going.
DevPtr Staging::send(const Upload &up, DevPtr dst) {
  if (up.total() == 0) return 0;
  settle();
  HostStage &h = stages_[next_stage_];
  next_stage_ = 1 - next_stage_;
  if (h.pending) rt_.check(rt_.dev->event_synchronize(h.sent));
  h.pending = false;
  ensure_pinned(&h.buffer, up.total());
  if (!dst) {
    ensure(&device_stage_, up.total()); // one device buffer: uploads are ordered by the stream
    dst = device_stage_.ptr;
  }
  up.copy_into(static_cast<uint8_t *>(h.buffer.ptr));
  rt_.check(rt_.dev->copy_to_device(dst, h.buffer.ptr, size_t(up.total()), rt_.stream));
  unsettled_ = true;
  rt_.check(rt_.dev->event_record(h.sent, rt_.stream));
  unsettled_ = false;
  h.pending = true;
  return dst;
}

// Into the caller's pageable memory the runtime would stage each copy itself: a decode with
// host-memory results took two such copies.
const uint8_t *Staging::receive(DevPtr src, uint64_t bytes) {
  settle();
  ensure_pinned(&download_, bytes);
  rt_.check(rt_.dev->copy_to_host(download_.ptr, src, size_t(bytes), rt_.stream));
  unsettled_ = true;
  rt_.check(rt_.dev->stream_synchronize(rt_.stream));
  unsettled_ = false;
  return static_cast<const uint8_t *>(download_.ptr);
}

} // namespace gpu
} // namespace pkv
