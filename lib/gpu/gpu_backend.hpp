// The GPU backend: pages in device memory, work on one stream of one device, the kernels of
// lib/kernels/*.cu. One implementation for every vendor runtime that provides a gpu::Device (the
// CUDA driver, the HIP runtime).
#pragma once

#include <memory>

#include "../backend.hpp"
#include "gpu_device.hpp"

namespace pkv {

// A block's fixed cost and the planner's granule (Backend::min_chunk_tokens, chunk_granule_tokens):
// the tensor-core kernel's stage of PKV_MMA_WARPS x PKV_MMA_TOKENS tokens.
constexpr uint32_t kGpuChunkTokens = 64;

// The threads that pack a large host upload (appended rows, images from pageable memory) by default,
// the hardware's if fewer: one core packed ~6 GB/s into pinned memory where the link took 55 GB/s,
// and four took a 4K-token append to 0.38x the time (8: 0.31x; H100, docs/perf/decisions.md).
constexpr uint32_t kDefaultPackThreads = 4;

// `stream`: the engine's stream, or null for one of the backend's own. `threads`: those that pack a
// large upload (pkv_context_desc.threads; 0: kDefaultPackThreads at most). Throws with a clear status
// when the device's kernels do not load or a decode kernel asked for does not exist on it.
std::unique_ptr<Backend> make_gpu_backend(std::unique_ptr<gpu::Device> device, void *stream, uint32_t threads);

} // namespace pkv
