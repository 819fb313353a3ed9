// The GPU backend's transfers and scratch memory: host pieces packed into one upload through pinned
// staging buffers (by several threads where it is large), results read back through one pinned
// buffer, and device buffers that grow with the work (those a captured graph may hold the address of
// are kept when outgrown).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "../worker_pool.hpp"
#include "runtime.hpp"

namespace pkv {
namespace gpu {

inline uint64_t align16(uint64_t n) { return (n + 15) & ~uint64_t(15); }

// The piece of an upload packed into pinned memory before its transfer is queued: small enough that
// the device starts copying soon, large enough that the transfers' driver calls stay few. An upload
// of less than a chunk a packing thread is cut into one piece a thread (kMinSendChunk at least, and
// only from two of them), so that all of them pack it.
constexpr uint64_t kSendChunk = 1ull << 20;
constexpr uint64_t kMinSendChunk = 64ull << 10;
// Uploads of at least this many bytes are packed by non-temporal stores (staging.cpp): a bound
// between the sizes measured, 0.5 MB (slower streamed) and 16.8 MB (faster).
constexpr uint64_t kStreamUpload = 4ull << 20;
// Uploads of at most kSmallUpload bytes (a decode's plan and page-table changes, q from host memory
// for a step) take turns through kSmallStages pinned buffers of that size, so that a caller whose
// stream runs a few calls behind is not held to the device's pace by each upload (a new plan each
// call: 0.82x the host time of two buffers on an H100, docs/perf/decisions.md).
constexpr uint64_t kSmallUpload = 64ull << 10;
constexpr unsigned kSmallStages = 16;

// Pieces of host memory gathered into one upload: each gets a 16-byte aligned offset.
class Upload {
 public:
  uint64_t add(const void *src, uint64_t bytes) {
    place(align16(total_), src, bytes);
    return pieces_.back().offset;
  }
  // At a given offset (16-byte aligned; the bytes between pieces in offset order are sent as zeros).
  void place(uint64_t offset, const void *src, uint64_t bytes) {
    pieces_.push_back({src, bytes, offset});
    if (offset + bytes > total_) total_ = offset + bytes;
  }
  uint64_t total() const { return total_; }
  // The upload's bytes [begin, begin + bytes) into dst.
  void copy_range(uint8_t *dst, uint64_t begin, uint64_t bytes) const;

 private:
  struct Piece {
    const void *src;
    uint64_t bytes, offset;
  };
  std::vector<Piece> pieces_;
  uint64_t total_ = 0;
};

struct DeviceBuffer {
  DevPtr ptr = 0;
  uint64_t bytes = 0;
};

class Staging {
 public:
  // pack_threads: the threads (the caller's included) that pack an upload of several chunks.
  Staging(const Runtime &rt, uint32_t pack_threads) : rt_(rt), pack_threads_(std::max(1u, pack_threads)) {}
  Staging(const Staging &) = delete;
  Staging &operator=(const Staging &) = delete;

  // Makes the events the staging buffers take turns by.
  void start();
  // Frees everything, in the device's context, the stream idle.
  void release() noexcept;

  // Host pieces packed through a pinned staging buffer into `dst` (0: the device staging buffer),
  // ordered as one transfer on the stream; returns where they land.
  DevPtr send(const Upload &up, DevPtr dst = 0);
  // `bytes` from the device, in one transfer into a pinned buffer, waited for (with the work queued
  // before it).
  const uint8_t *receive(DevPtr src, uint64_t bytes);
  // Grows a scratch buffer; the old one may still be in use by queued work, so wait for it first.
  void ensure(DeviceBuffer *buf, uint64_t bytes);
  // Grows a buffer that captured graphs may hold the address of: the old one is kept (freed with the
  // backend), so a graph replayed with the shape it was captured with still finds memory there.
  // Returns whether it grew.
  bool grow_kept(DeviceBuffer *buf, uint64_t bytes);

 private:
  struct PinnedBuffer {
    void *ptr = nullptr;
    uint64_t bytes = 0;
  };
  struct HostStage {
    PinnedBuffer buffer;
    Event sent = nullptr; // the transfer out of it has finished
    bool pending = false;
  };
  // exact: `bytes` and no more where it grows.
  void ensure_pinned(PinnedBuffer *buf, uint64_t bytes, bool exact = false);
  // The next stage for an upload of `bytes`, its last transfer finished, its buffer large enough.
  HostStage &take_stage(uint64_t bytes);
  WorkerPool *packers();
  // Waits for the stream where a transfer's own wait failed (unsettled_).
  void settle();

  const Runtime &rt_;
  uint32_t pack_threads_;
  std::unique_ptr<WorkerPool> packers_;
  // A transfer through pinned memory was queued but neither its event recorded nor waited for: until
  // the stream is, no pinned buffer may be rewritten or freed.
  bool unsettled_ = false;
  HostStage stages_[2];
  unsigned next_stage_ = 0;
  HostStage small_[kSmallStages];
  unsigned next_small_ = 0;
  PinnedBuffer download_; // receive's
  DeviceBuffer device_stage_;
  std::vector<DeviceBuffer> kept_; // outgrown (grow_kept)
};

} // namespace gpu
} // namespace pkv
