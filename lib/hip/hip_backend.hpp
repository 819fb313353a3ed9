// The HIP backend: the GPU backend (lib/gpu/) on the HIP runtime, opened at run time, with the same
// kernel sources compiled by hipcc (embedded code objects, hip_images.hpp) (hip_device.cpp). The
// tensor-core kernels are CUDA-only: on HIP the CUDA-core specialised and the generic kernels serve.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "../backend.hpp"

namespace pkv {

// Throws with a clear status (no runtime, no such device, no code object for the device, a decode
// kernel asked for that HIP lacks).
std::unique_ptr<Backend> make_hip_backend(int ordinal, void *stream, uint32_t threads);
// Device count and a description of each device, or why there is none.
int hip_devices(std::string *detail);

} // namespace pkv
