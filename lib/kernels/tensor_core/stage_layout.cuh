// Where a stage's K and V rows lie in shared memory, and which tokens the warps' MMA rows take.
#pragma once

#include "common.cuh"

namespace pkv_mma {

// Which of a stage's TILE tokens the warps' MMA rows take. SPREAD (K or V rows are float): the eight
// rows one matrix load reads are eight tokens apart, in eight blocks of Row's layout: row m of warp
// w is token 8 (m % 8) + 2 w + m / 8. Otherwise in order: token 16 w + m (the quantized kernels,
// bound by their instructions, measured 1-3% slower with rows spread and padded on the H200:
// docs/perf/decisions.md).
template <bool SPREAD> struct Tokens {
  static constexpr bool spread = SPREAD;
  __device__ static uint32_t warp_first(int w) { return SPREAD ? 2 * w : SUB * w; }
  // of_row(a + b) = of_row(a) + of_row(b) while a % 8 + b % 8 < 8: the masks take a thread's part once.
  __device__ static uint32_t of_row(int m) { return SPREAD ? 8 * (m % 8) + m / 8 : m; }
};

template <uint32_t F, int D, bool SPREAD> struct Row {
  static constexpr uint32_t format = F;
  static constexpr bool quantized = quantized_format(format);
  static constexpr uint32_t data = F == Q8_0 || F == FP8_E4M3 || F == FP8_E5M2 ? D : F == Q4_0 ? D / 2 : 2 * D;
  static constexpr uint32_t scales = quantized ? D / 32 * 2 : 0;
  // Float rows (FP8 too) as the page holds them, by token, in blocks of 8 (an eighth of the stage,
  // often 8 rows of one page, copied whole) each followed by 16 bytes of padding: the eight rows a
  // matrix load reads are in eight blocks, so in different banks. Quantized rows (data then scales, padded
  // to an odd number of 16-byte units, so the 8 rows a matrix load reads fall in different banks)
  // by MMA row: warp w's row m at slot 16 w + m.
  static constexpr uint32_t units = (data + scales + 15) / 16;
  static constexpr uint32_t stride = quantized ? (units % 2 ? units : units + 1) * 16 : data;
  static constexpr uint32_t block = quantized ? 8 * stride : 8 * stride + 16;
  static constexpr uint32_t bytes = 8 * block;
  static_assert(bytes == pkv_mma_part_bytes(data + scales, quantized), "the host sizes shared memory alike");
  // Where the stage's token t lies in its part (quantized: its slot is SPREAD's inverse).
  __device__ static uint32_t of_token(uint32_t t) {
    if constexpr (!quantized) return t / 8 * block + t % 8 * stride;
    return (SPREAD ? SUB * (t % 8 / 2) + 8 * (t % 2) + t / 8 : t) * stride;
  }
  // Where warp w's rows begin in a stage part.
  __device__ static const uint8_t *warp_rows(const uint8_t *part, int w) {
    return part + (quantized ? 2 * block : 2 * stride) * w;
  }
  // MMA row r + 8 h (r < 8, h < 2): callers give the parts, which no division need recover.
  __device__ static const uint8_t *row(const uint8_t *rows, int r, int h) {
    return rows + (quantized ? h * block + r * stride : r * block + h * stride);
  }
  __device__ static float scale(const uint8_t *row, int group) {
    return half_to_float(reinterpret_cast<const uint16_t *>(row + data)[group]);
  }
  // All of a row's group scales in one shared-memory load (D / 16 bytes); group g's is at(g).
  struct Scales {
    static constexpr int N = (D / 32 + 1) / 2; // words, two f16 scales each
    uint32_t w[N];
    __device__ float at(int g) const { return half_to_float(uint16_t(w[g / 2] >> (16 * (g % 2)))); }
    __device__ uint32_t pair(int g) const { return __byte_perm(w[g / 2], 0, g % 2 ? 0x3232 : 0x1010); } // (at(g), at(g)) in f16
  };
  __device__ static Scales scales_of(const uint8_t *row) {
    Scales s;
    const uint32_t *p = reinterpret_cast<const uint32_t *>(row + data);
    if constexpr (Scales::N == 4) *reinterpret_cast<uint4 *>(s.w) = *reinterpret_cast<const uint4 *>(p);
    else if constexpr (Scales::N == 2) *reinterpret_cast<uint2 *>(s.w) = *reinterpret_cast<const uint2 *>(p);
    else s.w[0] = p[0];
    return s;
  }
};

} // namespace pkv_mma
