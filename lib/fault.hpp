// Fault injection for the torture tests (meson option fault_injection, off by default): the library
// asks fails(kind) at each point where the outside world may refuse it something (a host allocation,
// a thread, a GPU runtime call); a test arms the Nth point of a kind to fail, once or from then on,
// and walks N over every point a call reaches (tests/internal/test_faults.cpp). In other builds fails() is a
// constant false and costs nothing.
//
// Points: every operator new and the CPU backend's page memory (host_alloc), every worker thread
// (thread), and every GPU runtime call that may fail at run time (gpu_call: lib/gpu/fault_device.hpp
// asks before each call of either vendor's runtime and answers its out-of-memory code, 2; calls that
// release never fail).
#pragma once

#include <cstdint>

namespace pkv {
namespace fault {

enum class Kind : uint32_t { host_alloc, thread, gpu_call, count };

#if defined(PKV_FAULT_INJECTION) && PKV_FAULT_INJECTION
bool fails(Kind kind) noexcept;

// Counts the points of `kind` from now on; point `nth` (1-based) fails, and with `persistent` every
// point of that kind after it too. nth 0: count only.
void arm(Kind kind, uint64_t nth, bool persistent) noexcept;
void disarm() noexcept;
// Points of the armed kind reached since arm(), and whether one failed.
uint64_t reached() noexcept;
bool fired() noexcept;
// Bytes asked of operator new since arm(), failed requests included.
uint64_t bytes_requested() noexcept;
#else
inline bool fails(Kind) noexcept { return false; }
#endif

} // namespace fault
} // namespace pkv
