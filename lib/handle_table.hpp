// Sequence slots and their value handles. A handle packs a pool tag, the slot's generation and the
// slot index; freeing a slot bumps its generation, so every earlier handle of that slot is stale. A
// slot whose generation would wrap is retired instead of reused, and no two live tables share a tag.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedkv.h"

namespace pkv {

class HandleTable {
 public:
  static constexpr uint32_t kSlotBits = 20;
  static constexpr uint32_t kMaxSlots = 1u << kSlotBits;

  static constexpr uint32_t kTagBits = 12;
  // Tables alive at once: each takes a tag no other live table has (0 is never a tag).
  static constexpr uint32_t kMaxLive = (1u << kTagBits) - 1;

  // Throws PKV_ERR_UNSUPPORTED when kMaxLive tables are alive. first_generation (even): every slot's
  // generation before its first use; tests start near the wrap.
  explicit HandleTable(uint32_t capacity, uint32_t first_generation = 0);
  ~HandleTable();
  HandleTable(const HandleTable &) = delete;
  HandleTable &operator=(const HandleTable &) = delete;

  uint32_t capacity() const { return uint32_t(generation_.size()); }
  uint32_t live() const { return capacity() - uint32_t(free_.size()) - retired_; }
  uint32_t retired() const { return retired_; }
  bool full() const { return free_.empty(); }

  // A fresh handle; the table must not be full.
  pkv_seq acquire(uint32_t *slot);
  void release(uint32_t slot);
  // The slot of a live handle, or a thrown PKV_ERR_STALE_HANDLE naming what is wrong with it.
  uint32_t resolve(pkv_seq seq, const char *what) const;
  // The same without the error: false for a stale handle. What a batch checks each sequence with,
  // naming one (resolve) only when it fails.
  bool live_slot(pkv_seq seq, uint32_t *slot) const;

 private:
  uint64_t tag_;
  std::vector<uint32_t> generation_; // odd: the slot is live
  std::vector<uint32_t> free_;
  uint32_t retired_ = 0; // slots whose generation reached its end: never handed out again
};

} // namespace pkv
