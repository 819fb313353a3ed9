// Element formats: scalar conversions, ggml's Q8_0/Q4_0 group arithmetic, and where a row of
// head_dim values lives inside a page. Knows nothing of backends; GPU kernels mirror this arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedkv.h"

namespace pkv {

constexpr uint32_t kGroup = 32; // values per Q8_0/Q4_0 scale, along head_dim

uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t h);

bool is_io_format(pkv_format f);   // F32, F16, BF16: q, out, source and destination rows
bool is_page_format(pkv_format f); // every format a page may hold
bool is_quantized(pkv_format f);
size_t io_elem_bytes(pkv_format f);

// n values between F32 and an I/O format.
void load_io(pkv_format f, const void *src, size_t n, float *dst);
void store_io(pkv_format f, const float *src, size_t n, void *dst);

// One group of 32 values, ggml's reference arithmetic. Q4_0 packs element j in the low nibble of
// byte j and element j + 16 in its high nibble, offset by 8.
void quantize_q8_0(const float *x, uint16_t *d, int8_t *q);
void quantize_q4_0(const float *x, uint16_t *d, uint8_t *q);
void dequantize_q8_0(uint16_t d, const int8_t *q, float *x);
void dequantize_q4_0(uint16_t d, const uint8_t *q, float *x);

// Bytes of n values in ggml's row encoding (blocks of scale + quants for Q formats); 0 if n is invalid.
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

// One row of head_dim values into / out of a page part at (head, slot).
void encode_row(const PlaneLayout &layout, uint8_t *part, uint32_t head, uint32_t slot, const float *src);
void decode_row(const PlaneLayout &layout, const uint8_t *part, uint32_t head, uint32_t slot, float *dst);

} // namespace pkv
