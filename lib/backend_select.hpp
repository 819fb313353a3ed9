// Backend selection: which backend a context gets, and what each backend offers on this machine.
#pragma once

#include <memory>

#include "backend.hpp"

namespace pkv {

// PKV_BACKEND_AUTO reads the environment variable PKV_BACKEND, then takes the first backend that
// works (GPU backends first, the CPU last). Throws with the reason when the asked-for one cannot.
std::unique_ptr<Backend> create_backend(const pkv_context_desc &desc);
void query_backend(pkv_backend backend, pkv_backend_info *info);

} // namespace pkv
