// Element formats: scalar conversions, ggml's Q8_0/Q4_0 group arithmetic, and where a row of
// head_dim values lives inside a page. Knows nothing of backends; GPU kernels mirror this arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "pagedkv.h"

namespace pkv {

constexpr uint32_t kGroup = 32; // values per Q8_0/Q4_0 scale, along head_dim

uint16_t f32_to_f16(float x);
uint16_t f32_to_bf16(float x);

// The conversions from page formats to floats are defined below, inline, so that the CPU decode's
// variant for wider vector units (lib/cpu/cpu_attention.cpp) compiles them for those units too (F16
// rows excepted: load_f16 takes F16C where the processor has it). Each is exact, so every variant
// gives the same floats.
inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline uint16_t load16(const void *p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Branch-free, so loops over rows vectorise: the half's exponent and mantissa are moved into float
// position and rescaled by a power of two (which also carries infinities and NaNs over); subnormal
// halves are instead built as 0.5 + m * 2^-24 with the bits of 0.5's exponent, minus 0.5.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normal = float_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = float_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t is_subnormal = 0u - uint32_t(two_w < (1u << 27)); // a mask, not a branch
  return float_from_bits(sign | (float_bits(subnormal) & is_subnormal) | (float_bits(normal) & ~is_subnormal));
}

inline float bf16_to_f32(uint16_t h) { return float_from_bits(uint32_t(h) << 16); }

// FP8 (OCP): E5M2 is an F16's upper byte; E4M3's exponent and mantissa, moved to an F16's, make an
// F16 of 2^-8 times its value (subnormals included), except its NaN (S.1111.111), which has no
// infinity beside it.
inline float fp8_to_f32(pkv_format f, uint8_t c) {
  if (f == PKV_FORMAT_FP8_E5M2) return f16_to_f32(uint16_t(c << 8));
  if ((c & 0x7fu) == 0x7fu) return float_from_bits(uint32_t(c & 0x80u) << 24 | 0x7fc00000u);
  return f16_to_f32(uint16_t((c & 0x80u) << 8 | (c & 0x7fu) << 7)) * 256.0f;
}
// Round to nearest even; magnitudes past the largest finite value (infinities too) saturate to it;
// NaN stays NaN (sign.1111111).
uint8_t f32_to_fp8(pkv_format f, float x);

bool is_io_format(pkv_format f);   // F32, F16, BF16: q, out, source and destination rows
bool is_page_format(pkv_format f); // every format a page may hold
inline bool is_quantized(pkv_format f) { return f == PKV_FORMAT_Q8_0 || f == PKV_FORMAT_Q4_0; }
inline bool is_fp8(pkv_format f) { return f == PKV_FORMAT_FP8_E4M3 || f == PKV_FORMAT_FP8_E5M2; }
size_t io_elem_bytes(pkv_format f);
// Bytes of one value of a format stored element by element (not block-quantized): 4, 2 or 1.
inline size_t elem_bytes(pkv_format f) { return is_fp8(f) ? 1 : io_elem_bytes(f); }

#if defined(__x86_64__)
// Whether the processor (and the OS, for AVX's registers) runs F16C's conversions.
bool has_f16c();
#endif

// n F16 values to floats: by F16C where the processor has it (x86-64), else f16_to_f32 (the same floats; a signalling
// NaN may come out quiet).
void load_f16(const uint8_t *src, size_t n, float *dst);

// n values between F32 and an I/O format.
inline void load_io(pkv_format f, const void *src, size_t n, float *dst) {
  const auto *p = static_cast<const uint8_t *>(src);
  switch (f) {
  case PKV_FORMAT_F32: std::memcpy(dst, src, n * 4); break;
  case PKV_FORMAT_F16: load_f16(p, n, dst); break;
  default:
    for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(load16(p + 2 * i));
    break;
  }
}
void store_io(pkv_format f, const float *src, size_t n, void *dst);

// One group of 32 values, ggml's reference arithmetic. Q4_0 packs element j in the low nibble of
// byte j and element j + 16 in its high nibble, offset by 8.
void quantize_q8_0(const float *x, uint16_t *d, int8_t *q);
void quantize_q4_0(const float *x, uint16_t *d, uint8_t *q);
// __restrict: the bytes may alias anything, and only a promise that they do not lets the loop run
// as vector code.
inline void dequantize_q8_0(uint16_t d, const int8_t *__restrict q, float *__restrict x) {
  const float s = f16_to_f32(d);
  for (uint32_t j = 0; j < kGroup; j++) x[j] = float(q[j]) * s;
}
inline void dequantize_q4_0(uint16_t d, const uint8_t *__restrict q, float *__restrict x) {
  const float s = f16_to_f32(d);
  // Kept a loop: unrolled into 16 statements where the CPU decode inlines it, the compiler converted
  // each nibble on its own instead of as vectors.
#pragma GCC unroll 1
  for (uint32_t j = 0; j < kGroup / 2; j++) {
    x[j] = float(int(q[j] & 15) - 8) * s;
    x[j + kGroup / 2] = float(int(q[j] >> 4) - 8) * s;
  }
}
// Quants of one group: Q8_0 one byte a value, Q4_0 half a byte.
inline uint32_t group_quant_bytes(pkv_format f) { return f == PKV_FORMAT_Q8_0 ? kGroup : kGroup / 2; }
inline void dequantize_group(pkv_format f, uint16_t d, const uint8_t *q, float *x) {
  if (f == PKV_FORMAT_Q8_0) dequantize_q8_0(d, reinterpret_cast<const int8_t *>(q), x);
  else dequantize_q4_0(d, q, x);
}

// n FP8 codes to floats, each times `scale`, and n floats divided by `scale` to codes.
void load_fp8(pkv_format f, const uint8_t *src, size_t n, float scale, float *dst);
void store_fp8(pkv_format f, const float *src, size_t n, float scale, uint8_t *dst);

// Bytes of n values in ggml's row encoding (blocks of scale + quants for Q formats, a byte a value
// for FP8); 0 if n is invalid.
size_t row_bytes(pkv_format f, size_t n);
void encode_ggml_row(pkv_format f, const float *src, size_t n, void *dst);
void decode_ggml_row(pkv_format f, const void *src, size_t n, float *dst);

// The K (or V) part of one page of one layer: a data plane [kv_head][slot][row_data_bytes] and, for
// quantized formats, a scale plane [kv_head][slot][head_dim / 32] of fp16, so that both planes are
// contiguous and 16-byte loads stay aligned. Planes start 64-byte aligned.
struct PlaneLayout {
  pkv_format format;
  uint32_t kv_heads, page_size, head_dim;
  uint64_t row_data_bytes;  // one row's quants or elements
  uint64_t row_scale_bytes; // one row's scales (0 for unquantized formats)
  uint64_t scale_offset;    // where the scale plane starts
  uint64_t bytes;           // the whole part, padded to 64 bytes

  uint64_t data_at(uint32_t head, uint32_t slot) const {
    return (uint64_t(head) * page_size + slot) * row_data_bytes;
  }
  uint64_t scale_at(uint32_t head, uint32_t slot) const {
    return scale_offset + (uint64_t(head) * page_size + slot) * row_scale_bytes;
  }
  uint64_t bytes_per_token() const { return uint64_t(kv_heads) * (row_data_bytes + row_scale_bytes); }
};

PlaneLayout make_plane_layout(pkv_format f, uint32_t kv_heads, uint32_t page_size, uint32_t head_dim);

// One row of head_dim values into / out of a page part at (head, slot); `scale` is the row's FP8
// scale (pagedkv.h, section 5a: stored codes are values / scale), ignored by the other formats.
void encode_row(const PlaneLayout &layout, uint8_t *part, uint32_t head, uint32_t slot, float scale, const float *src);
inline void decode_row(const PlaneLayout &l, const uint8_t *part, uint32_t head, uint32_t slot, float scale, float *dst) {
  const uint8_t *data = part + l.data_at(head, slot);
  if (is_fp8(l.format)) return load_fp8(l.format, data, l.head_dim, scale, dst);
  if (!is_quantized(l.format)) return load_io(l.format, data, l.head_dim, dst);
  const uint8_t *scales = part + l.scale_at(head, slot);
  const uint32_t qb = group_quant_bytes(l.format);
  for (uint32_t g = 0; g < l.head_dim / kGroup; g++)
    dequantize_group(l.format, load16(scales + 2 * g), data + g * qb, dst + g * kGroup);
}

} // namespace pkv
