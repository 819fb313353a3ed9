// A pool: pages for every layer of one model, the sequences that hold them, and the operations of an
// engine step. Bookkeeping happens here; the bytes are moved by the context's backend.
// Arguments arrive checked by api.cpp (shape, range, NULL); the pool checks only what its state
// decides: handles, sequence lengths against positions, shared pages, free pages and sequence slots.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "backend.hpp"
#include "context.hpp"
#include "handle_table.hpp"
#include "page_allocator.hpp"
#include "plan_cache.hpp"
#include "seq_image.hpp"
#include "pagedkv.h"

struct pkv_pool {
 public:
  // desc is already validated.
  pkv_pool(pkv_context *ctx, const pkv_pool_desc &desc);
  ~pkv_pool();
  pkv_pool(const pkv_pool &) = delete;
  pkv_pool &operator=(const pkv_pool &) = delete;

  pkv_seq alloc();
  void free(pkv_seq seq);
  pkv_seq fork(pkv_seq parent);
  void truncate(pkv_seq seq, uint32_t new_length);
  // Gives back the pages wholly before `position` and marks positions below it released.
  void release_before(pkv_seq seq, uint32_t position);
  uint32_t length(pkv_seq seq);
  void append(const pkv_seq *seqs, const uint32_t *n_new, uint32_t count);
  void write(const pkv_write_args &args);
  void read(const pkv_read_args &args);
  void decode(const pkv_decode_args &args);
  // Applies queued page-table changes and puts the batch's plan on the device without decoding.
  void decode_prepare(const pkv_decode_args &args);
  // Arguments checked by api.cpp: offsets, total rows and mask included.
  void extend(const pkv_extend_args &args);
  // Applies queued page-table changes and puts the batch's plans on the device without attending.
  void extend_prepare(const pkv_extend_args &args);
  pkv_pool_stats stats();
  // Arguments checked by api.cpp (layers, shape, values, FP8 planes only).
  void set_scales(const pkv_scales_args &args);
  void get_scales(uint32_t first, uint32_t count, float *k, float *v);
  // Images of layers [first, first + count) of a sequence (the range checked by api.cpp).
  uint64_t export_size(pkv_seq seq, uint32_t first, uint32_t count);
  void export_seq(const pkv_export_args &args, uint32_t first, uint32_t count);
  pkv_seq import_seq(const pkv_import_args &args);
  // The pool's memory regions (the count; the first `capacity` written), and a sequence's spans in
  // them (the count; all written when spans is not null, which needs capacity for all).
  uint32_t regions(pkv_memory_region *out, uint32_t capacity) const;
  uint64_t page_spans(pkv_seq seq, uint32_t first, uint32_t count, pkv_page_span *spans, uint64_t capacity);

  const pkv::PoolGeometry &geometry() const { return geometry_; }

 private:
  // A page entry release_before gave back: the sequence keeps its place, not the page.
  static constexpr uint32_t kReleasedPage = UINT32_MAX;

  struct Sequence {
    uint32_t length = 0;
    uint32_t released = 0; // positions below it were released: no call reads or writes them
    std::vector<uint32_t> pages;
  };

  uint32_t pages_for(uint64_t tokens) const { return uint32_t((tokens + geometry_.page_size - 1) / geometry_.page_size); }
  // Slots of a batch of sequences, each resolved and checked to appear once.
  std::vector<uint32_t> resolve_batch(const pkv_seq *seqs, uint32_t count, const char *what, bool unique);
  void drop_pages(Sequence &s, uint32_t keep);
  // Fails unless the positions from `first` on are held, naming the sequence (seqs[index], or seq
  // when index is kSingle) and the call.
  static constexpr uint32_t kSingle = UINT32_MAX;
  static void check_held(const Sequence &s, uint64_t first, uint32_t index, const char *call);
  // Fails for a sequence with released positions: an image or spans cover every page.
  static void check_whole(const Sequence &s, const char *call);
  pkv::RowSlot slot_of(const Sequence &s, uint32_t position) const;
  // The queued page-table changes, last write per entry kept, ready for the next device operation.
  pkv::TableUpdates table_updates();
  // A scatter's or gather's common part: rows to or from `slots`, with the queued table changes.
  void run_decode(const pkv_decode_args &args, bool launch);
  void run_extend(const pkv_extend_args &args, bool launch);
  // Room for `more` queued page-table changes, growing the queue geometrically.
  void reserve_pending(size_t more);
  pkv::RowTransfer transfer(uint32_t layer, const std::vector<pkv::RowSlot> &slots, pkv_format format,
                            pkv_memory memory);

  // The pool's device memory (pages, page table, plan buffer), held from construction to destruction.
  // A member declared before the bookkeeping, so it is asked for first: a pool the device cannot hold
  // fails before the host builds per-page counts for it, and bookkeeping that fails gives it back.
  struct DeviceMemory {
    DeviceMemory(pkv_context *ctx, pkv::PoolGeometry *g);
    ~DeviceMemory();
    DeviceMemory(const DeviceMemory &) = delete;
    DeviceMemory &operator=(const DeviceMemory &) = delete;
    void release() noexcept;
    pkv_context *ctx;
    pkv::PoolGeometry *g;
  };

  pkv_context *ctx_;
  pkv::PoolGeometry geometry_;
  DeviceMemory memory_;
  std::mutex mu_;
  pkv::HandleTable handles_;
  pkv::PageAllocator pages_;
  std::vector<Sequence> seqs_;
  uint64_t tokens_live_ = 0;
  uint64_t max_length_;
  std::vector<pkv::TableEntry> pending_;
  pkv::PlanCache plans_; // under mu_, like everything the pool's calls touch
  std::vector<float> scales_; // the host's copy of PoolGeometry::scales
};
