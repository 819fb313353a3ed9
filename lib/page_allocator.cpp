#include "page_allocator.hpp"

#include <utility>

namespace pkv {

PageAllocator::PageAllocator(uint32_t pages, uint32_t seed) : refs_(pages, 0) {
  free_.reserve(pages);
  for (uint32_t p = pages; p-- > 0;) free_.push_back(p);
  if (seed != 0) {
    // Fisher-Yates with a small xorshift: a fixed seed gives the same order on every platform.
    uint64_t s = 0x9E3779B97F4A7C15ull ^ seed;
    for (uint32_t i = pages; i > 1; i--) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      std::swap(free_[i - 1], free_[s % i]);
    }
  }
}

bool PageAllocator::take(uint32_t n, std::vector<uint32_t> *out) {
  if (n > free_.size()) return false;
  for (uint32_t i = 0; i < n; i++) {
    const uint32_t p = free_.back();
    free_.pop_back();
    refs_[p] = 1;
    out->push_back(p);
  }
  return true;
}

void PageAllocator::retain(uint32_t page) {
  if (++refs_[page] == 2) shared_++;
}

void PageAllocator::release(uint32_t page) {
  const uint32_t r = --refs_[page];
  if (r == 1) shared_--;
  if (r == 0) free_.push_back(page);
}

} // namespace pkv
