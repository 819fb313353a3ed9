// The fault injection build's counters, and its operator new: every C++ allocation in the process
// goes through it, but only points reached while a test has armed a kind are counted.
#include "fault.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace pkv {
namespace fault {

namespace {
std::atomic<bool> g_armed{false};
std::atomic<uint32_t> g_kind{0};
std::atomic<uint64_t> g_nth{0}, g_reached{0}, g_bytes{0};
std::atomic<bool> g_persistent{false}, g_fired{false};
} // namespace

bool fails(Kind kind) noexcept {
  if (!g_armed.load(std::memory_order_acquire) || uint32_t(kind) != g_kind.load()) return false;
  const uint64_t n = g_reached.fetch_add(1) + 1, nth = g_nth.load();
  const bool fail = nth != 0 && (n == nth || (g_persistent.load() && n > nth));
  if (fail) g_fired.store(true);
  return fail;
}

void arm(Kind kind, uint64_t nth, bool persistent) noexcept {
  g_armed.store(false);
  g_kind.store(uint32_t(kind));
  g_nth.store(nth);
  g_persistent.store(persistent);
  g_reached.store(0);
  g_bytes.store(0);
  g_fired.store(false);
  g_armed.store(true, std::memory_order_release);
}

void disarm() noexcept { g_armed.store(false); }
uint64_t reached() noexcept { return g_reached.load(); }
bool fired() noexcept { return g_fired.load(); }
uint64_t bytes_requested() noexcept { return g_bytes.load(); }

void *allocate(std::size_t size) noexcept {
  if (g_armed.load(std::memory_order_acquire)) g_bytes.fetch_add(size);
  if (fails(Kind::host_alloc)) return nullptr;
  return std::malloc(size ? size : 1);
}

} // namespace fault
} // namespace pkv

void *operator new(std::size_t size) {
  if (void *p = pkv::fault::allocate(size)) return p;
  throw std::bad_alloc();
}
void *operator new[](std::size_t size) { return operator new(size); }
void *operator new(std::size_t size, const std::nothrow_t &) noexcept { return pkv::fault::allocate(size); }
void *operator new[](std::size_t size, const std::nothrow_t &) noexcept { return pkv::fault::allocate(size); }
void operator delete(void *p) noexcept { std::free(p); }
void operator delete[](void *p) noexcept { std::free(p); }
void operator delete(void *p, std::size_t) noexcept { std::free(p); }
void operator delete[](void *p, std::size_t) noexcept { std::free(p); }
void operator delete(void *p, const std::nothrow_t &) noexcept { std::free(p); }
void operator delete[](void *p, const std::nothrow_t &) noexcept { std::free(p); }
