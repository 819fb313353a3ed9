#include "handle_table.hpp"

#include <atomic>

#include "error.hpp"

namespace pkv {

namespace {

constexpr uint32_t kGenBits = 32;
constexpr uint32_t kTagBits = 64 - kGenBits - HandleTable::kSlotBits;

// Each pool takes the next tag, so a handle handed to the wrong pool is caught (among the last
// 2^12 - 1 pools made by the process).
uint64_t next_tag() {
  static std::atomic<uint64_t> counter{0};
  uint64_t t;
  do t = counter.fetch_add(1) % (1u << kTagBits);
  while (t == 0);
  return t;
}

uint64_t pack(uint64_t tag, uint32_t generation, uint32_t slot) {
  return tag << (kGenBits + HandleTable::kSlotBits) | uint64_t(generation) << HandleTable::kSlotBits | slot;
}

} // namespace

HandleTable::HandleTable(uint32_t capacity) : tag_(next_tag()), generation_(capacity, 0) {
  free_.reserve(capacity);
  for (uint32_t s = capacity; s-- > 0;) free_.push_back(s); // lowest slot first
}

pkv_seq HandleTable::acquire(uint32_t *slot) {
  const uint32_t s = free_.back();
  free_.pop_back();
  generation_[s] += 1; // even -> odd: live
  *slot = s;
  return pkv_seq{pack(tag_, generation_[s], s)};
}

void HandleTable::release(uint32_t slot) {
  generation_[slot] += 1; // odd -> even: every handle of this slot is now stale
  free_.push_back(slot);
}

bool HandleTable::live_slot(pkv_seq seq, uint32_t *slot) const {
  const uint32_t s = uint32_t(seq.id & (kMaxSlots - 1));
  if (seq.id == 0 || seq.id >> (kGenBits + kSlotBits) != tag_ || s >= capacity() ||
      uint32_t(seq.id >> kSlotBits) != generation_[s])
    return false;
  *slot = s;
  return true;
}

uint32_t HandleTable::resolve(pkv_seq seq, const char *what) const {
  uint32_t slot;
  if (live_slot(seq, &slot)) return slot;
  if (seq.id == 0) fail(PKV_ERR_STALE_HANDLE, "%s is the zero handle, which is never valid", what);
  slot = uint32_t(seq.id & (kMaxSlots - 1));
  if (seq.id >> (kGenBits + kSlotBits) != tag_ || slot >= capacity())
    fail(PKV_ERR_STALE_HANDLE, "%s (0x%016llx) belongs to another pool", what, (unsigned long long)seq.id);
  fail(PKV_ERR_STALE_HANDLE, "%s (0x%016llx) was freed: slot %u is at generation %u, the handle has %u", what,
       (unsigned long long)seq.id, slot, generation_[slot], uint32_t(seq.id >> kSlotBits));
}

} // namespace pkv
