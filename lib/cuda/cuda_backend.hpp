// The CUDA backend: the GPU backend (lib/gpu/) on the CUDA driver, opened at run time, with the
// kernels nvcc built (lib/kernels/*.cu, embedded fatbins) in the device's primary context
// (cuda_device.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "../backend.hpp"

namespace pkv {

// Throws with a clear status (no driver, no such device, driver too old for the kernels).
std::unique_ptr<Backend> make_cuda_backend(int ordinal, void *stream, uint32_t threads);
// Device count and a description of each device, or why there is none.
int cuda_devices(std::string *detail);

} // namespace pkv
