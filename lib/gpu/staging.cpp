#include "staging.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pkv {
namespace gpu {

namespace {

// Copies into pinned memory by non-temporal stores where the processor has them (SSE2: every x86-64
// one): the host never reads the staged bytes back, and a streaming store does not first read each
// cache line it fills (a 4K-token prefill's upload: 0.62x the time on an H100). The caller fences
// (stream_fence) before the device may read them. Only for uploads of kStreamUpload or more: a
// 128-sequence step's 0.5 MB, written by the caller just before, came from the caches faster by a
// plain copy (streaming: 1.41x the time; docs/perf/decisions.md).
void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(__x86_64__)
  const size_t head = std::min(n, size_t(-reinterpret_cast<uintptr_t>(dst) & 15));
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64)
    for (size_t j = 0; j < 64; j += 16)
      _mm_stream_si128(reinterpret_cast<__m128i *>(dst + i + j),
                       _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i + j)));
  for (; i + 16 <= n; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i *>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i)));
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

} // namespace

// The bytes of [begin, begin + bytes) between pieces are zeroed, so an upload sends the same bytes on
// every run, nothing left in the pinned buffer by an earlier one.
void Upload::copy_range(uint8_t *dst, uint64_t begin, uint64_t bytes) const {
  const bool streaming = total_ >= kStreamUpload;
  const uint64_t end = begin + bytes;
  uint64_t done = begin; // [begin, done) is written
  for (const Piece &p : pieces_) {
    const uint64_t from = std::max(p.offset, begin), to = std::min(p.offset + p.bytes, end);
    if (from >= to) continue;
    if (from > done) std::memset(dst + (done - begin), 0, size_t(from - done));
    const uint8_t *src = static_cast<const uint8_t *>(p.src) + (from - p.offset);
    if (streaming) stream_copy(dst + (from - begin), src, size_t(to - from));
    else std::memcpy(dst + (from - begin), src, size_t(to - from));
    done = std::max(done, to);
  }
  if (end > done) std::memset(dst + (done - begin), 0, size_t(end - done));
  if (streaming) stream_fence();
}

void Staging::start() {
  for (HostStage &h : stages_) rt_.check(rt_.dev->event_create(&h.sent, false));
  for (HostStage &h : small_) rt_.check(rt_.dev->event_create(&h.sent, false));
}

void Staging::release() noexcept {
  Device &dev = *rt_.dev;
  if (device_stage_.ptr) dev.free(device_stage_.ptr);
  for (DeviceBuffer &b : kept_)
    if (b.ptr) dev.free(b.ptr);
  if (download_.ptr) dev.host_free(download_.ptr);
  auto free_stage = [&](HostStage &h) {
    if (h.buffer.ptr) dev.host_free(h.buffer.ptr);
    if (h.sent) dev.event_destroy(h.sent);
  };
  for (HostStage &h : stages_) free_stage(h);
  for (HostStage &h : small_) free_stage(h);
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

// Grows send's or receive's pinned host memory (to twice its size and 1 MB more, at least, unless
// exact); no transfer through it is in flight: send waits for its own first, receive's are waited for.
void Staging::ensure_pinned(PinnedBuffer *buf, uint64_t bytes, bool exact) {
  if (bytes <= buf->bytes) return;
  const uint64_t want = exact ? bytes : std::max<uint64_t>(bytes, 2 * buf->bytes + (1 << 20));
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

// The pack threads, made at the first upload that would use them; where the system refuses a thread,
// uploads are packed on the calling thread alone.
WorkerPool *Staging::packers() {
  if (!packers_ && pack_threads_ > 1) {
    try {
      packers_ = std::make_unique<WorkerPool>(pack_threads_);
    } catch (...) {
      pack_threads_ = 1;
    }
  }
  return packers_.get();
}

// Two pinned buffers take turns for large uploads, kSmallStages for small ones, so the host waits only
// when the transfer that many uploads back is still going.
Staging::HostStage &Staging::take_stage(uint64_t bytes) {
  const bool small = bytes <= kSmallUpload;
  HostStage &h = small ? small_[next_small_] : stages_[next_stage_];
  if (small) next_small_ = (next_small_ + 1) % kSmallStages;
  else next_stage_ = 1 - next_stage_;
  if (h.pending) rt_.check(rt_.dev->event_synchronize(h.sent));
  h.pending = false;
  if (small) ensure_pinned(&h.buffer, kSmallUpload, true);
  else ensure_pinned(&h.buffer, bytes);
  return h;
}

// The upload is packed a chunk at a time, each chunk's transfer queued once it and the chunks before
// it are packed, so the device copies while the host packs on. An upload of several chunks is packed
// by the pack threads, each queuing the chunks it packed, in chunk order, all before the work queued
// after the call.
DevPtr Staging::send(const Upload &up, DevPtr dst) {
  if (up.total() == 0) return 0;
  settle();
  HostStage &h = take_stage(up.total());
  if (!dst) {
    ensure(&device_stage_, up.total()); // one device buffer: uploads are ordered by the stream
    dst = device_stage_.ptr;
  }
  auto *buf = static_cast<uint8_t *>(h.buffer.ptr);
  WorkerPool *pool = up.total() >= 2 * kMinSendChunk ? packers() : nullptr;
  const uint64_t share = (up.total() + pack_threads_ - 1) / pack_threads_;
  const uint64_t chunk = pool ? std::clamp((share + 4095) & ~uint64_t(4095), kMinSendChunk, kSendChunk) : kSendChunk;
  const uint64_t chunks = (up.total() + chunk - 1) / chunk;
  auto at = [&](uint64_t c) { return c * chunk; };
  auto bytes = [&](uint64_t c) { return std::min(chunk, up.total() - at(c)); };
  auto pack = [&](uint64_t c) { up.copy_range(buf + at(c), at(c), bytes(c)); };
  auto queue = [&](uint64_t c) {
    rt_.check(rt_.dev->copy_to_device(dst + at(c), buf + at(c), size_t(bytes(c)), rt_.stream));
  };
  unsettled_ = true;
  if (pool && chunks > 1) {
    // Chunks are queued in order (the pool hands them out in order, so a thread waits only for
    // chunks taken before its own): an upload makes the same transfer calls every time. A failed
    // queue releases the waiting threads; the pool rethrows its error.
    std::mutex queue_mu;
    std::condition_variable queued_cv;
    uint64_t queued = 0;
    bool failed = false;
    pool->run(uint32_t(chunks), [&](uint32_t c, uint32_t) {
      pack(c);
      std::unique_lock<std::mutex> lock(queue_mu);
      queued_cv.wait(lock, [&] { return queued == c || failed; });
      if (failed) return;
      try {
        Current current(rt_); // a pack thread's own: the device made current on it
        queue(c);
      } catch (...) {
        failed = true;
        queued_cv.notify_all();
        throw;
      }
      queued++;
      queued_cv.notify_all();
    });
  } else {
    for (uint64_t c = 0; c < chunks; c++) pack(c), queue(c);
  }
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
