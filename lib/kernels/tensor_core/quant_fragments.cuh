// Q8_0 and Q4_0 rows as MMA operands: int8 words for K, exact f16 pairs for V, the group scales.
#pragma once

#include "ptx.cuh"
#include "stage_layout.cuh"

namespace pkv_mma {

// A warp's 16 quantized rows (R) of one 32-value group by matrix loads: w[h][i] holds bytes
// [16 i, 16 i + 16) of the group (Q8_0; Q4_0's group is its 16 bytes, i = 0) of MMA rows 8h .. 8h + 7;
// lane (c, t) gets bytes 4t .. 4t + 3 of row c, or TRANS, bytes 2c, 2c + 1 of rows 2t and 2t + 1
// (the first row's in the low half). Q4_0 byte j holds value j in its low nibble and value j + 16 in
// its high one, each stored plus 8.
template <class R, bool TRANS>
__device__ __forceinline__ void group_words(const uint8_t *rows, int g, int lane, uint32_t (&w)[2][2]) {
  const uint8_t *row = R::row(rows, lane % 8, (lane / 8) % 2);
  if constexpr (R::format == Q8_0) { // two matrices a row
    uint32_t x[4];
    ldmatrix<4, TRANS>(x, row + 32 * g + 16 * (lane / 16));
    w[0][0] = x[0], w[1][0] = x[1], w[0][1] = x[2], w[1][1] = x[3];
  } else {
    uint32_t x[2];
    ldmatrix<2, TRANS>(x, row + 16 * g);
    w[0][0] = x[0], w[1][0] = x[1], w[0][1] = w[1][1] = 0;
  }
}
// (x & M) ^ C (XOR) or (x & M) | C; ONE: as one LOP3 (ptxas keeps C in a register for the loop;
// written in C it takes two LOP3s with an immediate each).
template <uint32_t M, uint32_t C, bool XOR, bool ONE> __device__ __forceinline__ uint32_t mask_then(uint32_t x) {
  if constexpr (!ONE) return XOR ? (x & M) ^ C : (x & M) | C;
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(y) : "r"(x), "n"(M), "n"(C), "n"(XOR ? 0x6a : 0xea));
  return y;
}
// K as int8 MMA operands: w[h][i] holds values 16 i + 4t .. 16 i + 4t + 3 of MMA row c + 8h, a byte
// each; Q4_0's as 16 times the value: a nibble n (the value n - 8) in a byte's high half with its top
// bit flipped is 16 (n - 8) in two's complement, one logic op (after a shift for a low nibble), so
// the dot products need no correction for the 8 (q's scale carries the 1/16).
template <class R> __device__ __forceinline__ void k_group(const uint8_t *rows, int g, int lane, uint32_t (&w)[2][2]) {
  group_words<R, false>(rows, g, lane, w);
  if constexpr (R::format == Q4_0)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      w[h][1] = mask_then<0xf0f0f0f0u, 0x80808080u, true, true>(w[h][0]);
      w[h][0] = mask_then<0xf0f0f0f0u, 0x80808080u, true, true>(w[h][0] << 4);
    }
}
// Quantized values as an f16 pair, exactly: V's value pair_value(c, j) of the two tokens in
// group_words<R, true>'s w[h] (K's in Narrow's f16 path, from group_words<R, false>), without a
// conversion instruction: a mask and a logic operation put the value into an f16 whose
// mantissa counts it (0x64nn = 1024 + nn: Q8_0 its byte with the sign bit flipped, nn = value + 128;
// a low Q4_0 nibble n; 0x54n0 = 64 + n for a high nibble left in place: 64's mantissa counts
// sixteenths), one f16 subtraction leaves the value. The masking in one instruction measured 1-3%
// faster where V is Q4_0 at head_dim 128 (the narrow loop 548 -> 515 instructions), but 5% slower
// for Q4_0 at 256 (8x32K), which ptxas then schedules worse, and mixed for Q8_0 (-1.5% to +5%; H200,
// docs/perf/decisions.md).
template <uint32_t F, int D> __device__ __forceinline__ uint32_t pair_f16(const uint32_t (&w)[2], int j) {
  constexpr bool ONE = F == Q4_0 && D == 128;
  const uint32_t x = (F == Q8_0 ? w[j % 2] : w[0]) >> (8 * (j / 2));
  uint32_t y, bias;
  if (F == Q8_0) y = mask_then<0x00ff00ffu, 0x64806480u, true, ONE>(x), bias = 0x64806480u; // 1152 = 1024 + 128
  else if (j % 2 == 0) y = mask_then<0x000f000fu, 0x64006400u, false, ONE>(x), bias = 0x64086408u; // 1032 = 1024 + 8
  else y = mask_then<0x00f000f0u, 0x54005400u, false, ONE>(x), bias = 0x54805480u;               // 72 = 64 + 8
  const __half2 v = __hsub2(*reinterpret_cast<const __half2 *>(&y), *reinterpret_cast<const __half2 *>(&bias));
  return *reinterpret_cast<const uint32_t *>(&v);
}
// Which of its group's values pair_f16(w, j) gives the thread with c = lane / 4.
__device__ __forceinline__ int pair_value(int c, int j) { return 2 * c + 16 * (j % 2) + j / 2; }

// Each pair of tokens' V scales for group c (= lane / 4) where group_words' words hold the tokens'
// values: s[h] = (scale of token 2t (+ 8h), of 2t + 1), an f16 pair; a group's pairs are then a
// shuffle away (group_scales).
template <class R> __device__ __forceinline__ void pair_scales(const uint8_t *rows, int lane, uint32_t (&s)[2]) {
  static_assert(R::stride - R::data >= 16, "a matrix row from the scales stays within the row slot");
  ldmatrix<2, true>(s, R::row(rows, lane % 8, (lane / 8) % 2) + R::data);
}
__device__ __forceinline__ uint32_t group_scales(uint32_t s, int g, int lane) {
  return __shfl_sync(0xffffffffu, s, 4 * g + lane % 4);
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  const __half2 v = __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b));
  return *reinterpret_cast<const uint32_t *>(&v);
}

} // namespace pkv_mma
