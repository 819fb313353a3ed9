// Page ids and their reference counts. Taking pages is all or nothing, which is what makes a batch
// append transactional.
#pragma once

#include <cstdint>
#include <vector>

namespace pkv {

class PageAllocator {
 public:
  // seed 0: pages come out lowest id first; otherwise in an order shuffled by the seed.
  PageAllocator(uint32_t pages, uint32_t seed);

  uint32_t total() const { return uint32_t(refs_.size()); }
  uint32_t free() const { return uint32_t(free_.size()); }
  uint32_t shared() const { return shared_; }
  uint32_t refs(uint32_t page) const { return refs_[page]; }

  // n pages with one reference each, appended to out; false (and nothing taken) if fewer are free.
  bool take(uint32_t n, std::vector<uint32_t> *out);
  void retain(uint32_t page);
  void release(uint32_t page); // the page is free again when its last reference goes

 private:
  std::vector<uint32_t> refs_;
  std::vector<uint32_t> free_; // a stack: the next page handed out is at the back
  uint32_t shared_ = 0;        // pages with more than one reference
};

} // namespace pkv
