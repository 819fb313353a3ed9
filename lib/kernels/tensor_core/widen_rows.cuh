// FP8 pages in the tensor-core decode: a stage's FP8 rows, copied from the pages as they are (half
// the bytes of F16), widened in shared memory to F16 rows that the float tiles then take as F16
// pages. Every FP8 value is exactly an F16 (E5M2 is an F16's upper byte; E4M3's 3-bit mantissa and
// exponents down to 2^-9 lie within F16's), so the products with q stay exact; the plane's scale
// multiplies the scores (K) and the output (V) instead of each value.
#pragma once

#include "stage_layout.cuh"

namespace pkv_mma {

// The page format whose rows the MMAs take for rows stored in format F.
__host__ __device__ constexpr uint32_t widened_format(uint32_t f) { return f == FP8_E4M3 || f == FP8_E5M2 ? F16 : f; }

// Two FP8 codes (the low 16 bits of x) as an F16 pair, the first in the low half.
template <uint32_t F> __device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t x) {
  const uint32_t h = __byte_perm(x, 0, 0x1404); // each code in the upper byte of its half
  if constexpr (F == FP8_E5M2) {
    return h;
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t y;
    asm("{\n .reg .b16 c;\n cvt.u16.u32 c, %1;\n cvt.rn.f16x2.e4m3x2 %0, c;\n}\n" : "=r"(y) : "r"(x));
    return y;
#else
    // The fields moved into an F16's give 2^-8 times the value; the NaN code (all of its fields set)
    // then lies at 0x3f80, which one carry turns into an F16 NaN.
    uint32_t y = ((h >> 1) & 0x3f803f80u) | (h & 0x80008000u);
    y |= ((y & 0x3f803f80u) + 0x00800080u) & 0x40004000u;
    const __half2 v = __hmul2(*reinterpret_cast<const __half2 *>(&y), __float2half2_rn(256.0f));
    return *reinterpret_cast<const uint32_t *>(&v);
#endif
  }
}

// Widens the SUB rows of layout S (FP8) into layout W (F16) that slice `slice`'s warps compute (Tok),
// 16 values a thread at a time; `threads` threads from `index`. A slice's warps read only their own
// tokens' rows, so they wait for each other, not for the block.
template <class Tok, class S, class W>
__device__ __forceinline__ void widen_rows(const uint8_t *src, uint8_t *dst, int slice, int index, int threads) {
  static_assert(W::data == 2 * S::data && !S::quantized && !W::quantized, "FP8 rows into F16 rows");
  constexpr int PIECES = S::data / 16; // 16-byte pieces a row
  for (int e = index; e < SUB * PIECES; e += threads) {
    const uint32_t t = Tok::warp_first(slice) + Tok::of_row(e / PIECES);
    const int piece = e % PIECES;
    const uint4 x = *reinterpret_cast<const uint4 *>(src + S::of_token(t) + 16 * piece);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    uint32_t y[8];
#pragma unroll
    for (int i = 0; i < 4; i++) y[2 * i] = fp8x2_to_f16x2<S::format>(w[i]), y[2 * i + 1] = fp8x2_to_f16x2<S::format>(w[i] >> 16);
    uint4 *out = reinterpret_cast<uint4 *>(dst + W::of_token(t) + 32 * piece);
    out[0] = make_uint4(y[0], y[1], y[2], y[3]);
    out[1] = make_uint4(y[4], y[5], y[6], y[7]);
  }
}

} // namespace pkv_mma
