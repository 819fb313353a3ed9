// The CUDA backend: pages in device memory, work on one stream of the device's primary context,
// kernels from the fatbin embedded at build time (lib/cuda/*.cu), the driver opened at run time.
#pragma once

#include <memory>
#include <string>

#include "../backend.hpp"

namespace pkv {

// Throws with a clear status (no driver, no such device, driver too old for the kernels).
std::unique_ptr<Backend> make_cuda_backend(int ordinal, void *stream);
// Device count and a description of each device, or why there is none.
int cuda_devices(std::string *detail);

} // namespace pkv
