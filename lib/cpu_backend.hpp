// The CPU backend: the reference implementation, and what serves wherever no GPU runtime is found.
#pragma once

#include <memory>

#include "backend.hpp"

namespace pkv {

std::unique_ptr<Backend> make_cpu_backend(uint32_t threads);
// The processor's name, thread count and decode variant, for pkv_backend_query.
std::string cpu_description();

} // namespace pkv
