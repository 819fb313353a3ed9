// The tensor-core decode's shared names: the block's shape (warps, tokens a stage) and which
// page formats are quantized.
#pragma once

#include "../device_format.cuh"

namespace pkv_mma {
using namespace pkv_dev;

constexpr int WARPS = PKV_MMA_WARPS, THREADS = WARPS * 32; // per tile of query rows
constexpr int SUB = PKV_MMA_TOKENS;   // tokens per warp per stage
constexpr int TILE = WARPS * SUB;     // tokens per stage
static_assert(THREADS == 2 * TILE, "a row tile's threads copy a stage: half K rows, half V rows");

constexpr bool quantized_format(uint32_t f) { return f == Q8_0 || f == Q4_0; }

} // namespace pkv_mma
