// The kernel images nvcc built (one fatbin per lib/kernels/*.cu), embedded by lib/kernels/embed.py
// at build time.
#pragma once

namespace pkv {
extern const unsigned char cuda_image_pages[];
extern const unsigned char cuda_image_decode_generic[];
extern const unsigned char cuda_image_decode_cuda_core[];
extern const unsigned char cuda_image_decode_tensor_core[];
extern const unsigned char cuda_image_extend_tensor_core[];
} // namespace pkv
