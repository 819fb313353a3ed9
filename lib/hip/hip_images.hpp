// The kernel images hipcc built: per kernel file, one clang offload bundle holding a code object for
// every target of -Dhip_archs (lib/hip/meson.build), embedded by lib/kernels/embed.py at build
// time.
#pragma once

namespace pkv {
extern const unsigned char hip_image_pages[];
extern const unsigned char hip_image_decode_generic[];
extern const unsigned char hip_image_decode_cuda_core[];
} // namespace pkv
