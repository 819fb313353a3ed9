#include "handle_table.hpp"

#include <mutex>

#include "error.hpp"

namespace pkv {

namespace {

constexpr uint32_t kGenBits = 32;
constexpr uint32_t kTagBits = HandleTable::kTagBits;
static_assert(kGenBits + HandleTable::kSlotBits + kTagBits == 64, "a handle is 64 bits");

// The tags of live tables. Tags are handed out in turn, skipping live ones, so a handle of a
// destroyed pool meets its tag again only after kMaxLive - 1 more pools were made.
struct Tags {
  std::mutex mu;
  bool live[1u << kTagBits] = {};
  uint32_t next = 1;
};

Tags &tags() {
  static Tags t;
  return t;
}

uint64_t take_tag() {
  Tags &t = tags();
  std::lock_guard<std::mutex> lock(t.mu);
  for (uint32_t tries = 0; tries < HandleTable::kMaxLive; tries++) {
    const uint32_t tag = t.next;
    t.next = t.next % HandleTable::kMaxLive + 1;
    if (!t.live[tag]) {
      t.live[tag] = true;
      return tag;
    }
  }
  fail(PKV_ERR_UNSUPPORTED, "%u pools are alive in this process, the most whose handles it tells apart: destroy one first",
       HandleTable::kMaxLive);
}

void drop_tag(uint64_t tag) {
  Tags &t = tags();
  std::lock_guard<std::mutex> lock(t.mu);
  t.live[tag] = false;
}

uint64_t pack(uint64_t tag, uint32_t generation, uint32_t slot) {
  return tag << (kGenBits + HandleTable::kSlotBits) | uint64_t(generation) << HandleTable::kSlotBits | slot;
}

} // namespace

HandleTable::HandleTable(uint32_t capacity, uint32_t first_generation)
    : tag_(0), generation_(capacity, first_generation & ~1u) {
  free_.reserve(capacity);
  for (uint32_t s = capacity; s-- > 0;) free_.push_back(s); // lowest slot first
  tag_ = take_tag();                                         // last: nothing after it throws
}

HandleTable::~HandleTable() { drop_tag(tag_); }

pkv_seq HandleTable::acquire(uint32_t *slot) {
  const uint32_t s = free_.back();
  free_.pop_back();
  generation_[s] += 1; // even -> odd: live
  *slot = s;
  return pkv_seq{pack(tag_, generation_[s], s)};
}

void HandleTable::release(uint32_t slot) {
  if (generation_[slot] == UINT32_MAX) { // the next generation would wrap to handles given out before
    generation_[slot] = 0;               // even: no handle of it is live
    retired_++;
    return;
  }
  generation_[slot] += 1; // odd -> even: every handle of this slot is now stale
  free_.push_back(slot);
}

bool HandleTable::live_slot(pkv_seq seq, uint32_t *slot) const {
  const uint32_t s = uint32_t(seq.id & (kMaxSlots - 1));
  if (seq.id == 0 || seq.id >> (kGenBits + kSlotBits) != tag_ || s >= capacity() ||
      uint32_t(seq.id >> kSlotBits) != generation_[s] || (generation_[s] & 1) == 0)
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
  if ((seq.id >> kSlotBits & 1) == 0)
    fail(PKV_ERR_STALE_HANDLE, "%s (0x%016llx) was never handed out: its generation is even", what,
         (unsigned long long)seq.id);
  fail(PKV_ERR_STALE_HANDLE, "%s (0x%016llx) was freed: slot %u is at generation %u, the handle has %u", what,
       (unsigned long long)seq.id, slot, generation_[slot], uint32_t(seq.id >> kSlotBits));
}

} // namespace pkv
