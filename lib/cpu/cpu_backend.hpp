// The CPU backend: the reference implementation, and what serves wherever no GPU runtime is found.
#pragma once

#include <memory>

#include "../backend.hpp"

namespace pkv {

std::unique_ptr<Backend> make_cpu_backend(uint32_t threads);
// The processor's name, thread count and decode variant, for pkv_backend_query.
std::string cpu_description();
// 1 when a CPU context can be created (PKV_CPU_KERNEL names a decode this build has), else 0; *detail:
// the processor and its decode, or why none.
int32_t cpu_devices(std::string *detail);

} // namespace pkv
