// The HIP backend: the CUDA backend's behaviour on AMD GPUs, with the same kernel sources compiled
// by hipcc (embedded code objects, lib/hip/hip_images.hpp) and the HIP runtime opened at run time.
#pragma once

#include <memory>
#include <string>

#include "../backend.hpp"

namespace pkv {

// Throws with a clear status (no runtime, no such device, no code object for the device).
std::unique_ptr<Backend> make_hip_backend(int ordinal, void *stream);
// Device count and a description of each device, or why there is none.
int hip_devices(std::string *detail);

} // namespace pkv
