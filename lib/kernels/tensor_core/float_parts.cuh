// Floats as packed 16-bit MMA operands: one rounded part, or a high and a low part that keep
// ~16-22 bits.
#pragma once

#include "common.cuh"

namespace pkv_mma {

// Two floats as a packed pair of 16-bit floats (x low, y high), rounded: one conversion for both.
template <bool F16> __device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (F16) {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t *>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t *>(&h);
  }
}

// Splits x and y into hi + lo 16-bit parts each and packs them (x low, y high): hi[0] the high parts,
// hi[stride] the low ones. bf16: hi rounded, read back by a shift. f16: hi keeps 11 significant bits
// (Veltkamp's split, explicitly rounded operations), so it converts exactly; lo is the remainder.
// Two conversions a pair either way (the conversion unit is the scarce one).
template <bool F16> __device__ __forceinline__ void split_pair(float x, float y, uint32_t *out, int stride) {
  float hx, hy;
  if constexpr (F16) {
    const float tx = __fmul_rn(x, 8193.0f), ty = __fmul_rn(y, 8193.0f); // 2^13 + 1: keeps 24 - 13 bits
    hx = __fsub_rn(tx, __fsub_rn(tx, x));
    hy = __fsub_rn(ty, __fsub_rn(ty, y));
    out[0] = pack2<true>(hx, hy);
  } else {
    const uint32_t h = pack2<false>(x, y);
    out[0] = h;
    hx = __uint_as_float(h << 16);
    hy = __uint_as_float(h & 0xffff0000u);
  }
  out[stride] = pack2<F16>(__fsub_rn(x, hx), __fsub_rn(y, hy));
}
// x and y in PARTS packed 16-bit parts: one rounded pair, or split_pair's two.
template <bool F16, int PARTS> __device__ __forceinline__ void pair_parts(float x, float y, uint32_t *out, int stride) {
  static_assert(PARTS == 1 || PARTS == 2, "one or two parts");
  if constexpr (PARTS == 1) out[0] = pack2<F16>(x, y);
  else split_pair<F16>(x, y, out, stride);
}

} // namespace pkv_mma
