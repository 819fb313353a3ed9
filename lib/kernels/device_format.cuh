// Element formats on the device: the same arithmetic as lib/format.cpp, operation for operation
// (explicitly rounded multiplies and adds, so no fused multiply-add changes a quantized value), so
// that pages written here are byte-identical to the CPU backend's.
#pragma once

#include <stdint.h>

#include "kernel_params.h"
#include "portability.cuh"

namespace pkv_dev {

// pkv_format values (include/pagedkv.h).
enum : uint32_t { F32 = 1, F16 = 2, BF16 = 3, Q8_0 = 4, Q4_0 = 5, FP8_E4M3 = 6, FP8_E5M2 = 7 };
constexpr uint32_t kGroup = 32;
constexpr float kLog2e = 1.4426950408889634f; // natural-log units to log2 units
constexpr uint32_t kNoPart = 0xffffffffu; // PkvRecord.part of a sequence's only chunk
constexpr uint32_t kNoSeq = 0xffffffffu;  // PkvRecord.seq of a balanced plan's filler

__device__ __forceinline__ float half_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t float_to_half(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ float bf16_to_float(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ __forceinline__ bool is_fp8(uint32_t format) { return format == FP8_E4M3 || format == FP8_E5M2; }

// FP8 codes (lib/format.hpp's fp8_to_f32 and f32_to_fp8): E5M2 is an F16's upper byte; E4M3's
// fields moved into an F16's give 2^-8 times its value, its NaN code excepted.
__device__ __forceinline__ float fp8_to_float(uint32_t format, uint32_t c) {
  if (format == FP8_E5M2) return half_to_float(uint16_t(c << 8));
  if ((c & 0x7fu) == 0x7fu) return __uint_as_float((c & 0x80u) << 24 | 0x7fc00000u);
  return half_to_float(uint16_t((c & 0x80u) << 8 | (c & 0x7fu) << 7)) * 256.0f;
}

// Round to nearest even, saturating to the largest finite value, NaN kept: both codes computed and
// one taken, as the host does (subnormals rounded by adding and taking off 2^23).
__device__ __forceinline__ uint8_t float_to_fp8(uint32_t format, float x) {
  const bool e4m3 = format == FP8_E4M3;
  const uint32_t mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, largest = e4m3 ? 0x7eu : 0x7bu;
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  const uint32_t smallest_normal = (127u + 1 - bias) << 23;
  const float units = __fmul_rn(__uint_as_float(min(a, smallest_normal)), e4m3 ? 512.0f : 65536.0f);
  const uint32_t subnormal = uint32_t(__fadd_rn(__fadd_rn(units, 8388608.0f), -8388608.0f));
  const uint32_t shift = 23 - mantissa;
  const uint32_t normal = ((a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u)) >> shift) - ((127u - bias) << mantissa);
  const uint32_t code = a < smallest_normal ? subnormal : min(normal, largest);
  return uint8_t(sign | (a > 0x7f800000u ? 0x7fu : code));
}

// The FP8 scale of a plane's rows of (layer, head); 1 for the other formats.
__device__ __forceinline__ float plane_scale(const PkvPool &p, bool v, uint32_t layer, uint32_t head) {
  if (!is_fp8(v ? p.v.format : p.k.format)) return 1.0f;
  return reinterpret_cast<const float *>(p.scales)[(uint64_t(v) * p.layers + layer) * p.kv_heads + head];
}

// Element i of an F32/F16/BF16 array.
__device__ __forceinline__ float load_io(uint32_t format, const void *p, uint64_t i) {
  switch (format) {
  case F32: return static_cast<const float *>(p)[i];
  case F16: return half_to_float(static_cast<const uint16_t *>(p)[i]);
  default: return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
  }
}

__device__ __forceinline__ void store_io(uint32_t format, void *p, uint64_t i, float x) {
  switch (format) {
  case F32: static_cast<float *>(p)[i] = x; break;
  case F16: static_cast<uint16_t *>(p)[i] = float_to_half(x); break;
  default: static_cast<uint16_t *>(p)[i] = float_to_bf16(x); break;
  }
}

__device__ __forceinline__ uint32_t io_bytes(uint32_t format) { return format == F32 ? 4 : 2; }

// The K (or V) part of block (layer, page).
__device__ __forceinline__ uint8_t *part(const PkvPool &p, uint32_t layer, uint32_t page, bool v) {
  return reinterpret_cast<uint8_t *>(p.base) + (uint64_t(layer) * p.pages + page) * p.block_bytes + (v ? p.k_bytes : 0);
}

__device__ __forceinline__ uint64_t row_index(const PkvPool &p, uint32_t head, uint32_t slot) {
  return uint64_t(head) * p.page_size + slot;
}

// Value d of the row (head, slot) of a page part; fp8_scale is the row's FP8 scale (plane_scale).
__device__ __forceinline__ float load_value(const PkvPlane &pl, const PkvPool &p, const uint8_t *part_ptr,
                                            uint32_t head, uint32_t slot, uint32_t d, float fp8_scale) {
  const uint64_t row = row_index(p, head, slot);
  const uint8_t *data = part_ptr + row * pl.row_data_bytes;
  if (is_fp8(pl.format)) return __fmul_rn(fp8_to_float(pl.format, data[d]), fp8_scale);
  if (pl.format == Q8_0 || pl.format == Q4_0) {
    const uint16_t scale =
        reinterpret_cast<const uint16_t *>(part_ptr + pl.scale_offset + row * pl.row_scale_bytes)[d / kGroup];
    const uint32_t e = d % kGroup;
    int q;
    if (pl.format == Q8_0) {
      q = reinterpret_cast<const int8_t *>(data)[d];
    } else {
      const uint8_t byte = data[(d / kGroup) * (kGroup / 2) + (e % (kGroup / 2))];
      q = int(e < kGroup / 2 ? (byte & 15) : (byte >> 4)) - 8;
    }
    return float(q) * half_to_float(scale);
  }
  return load_io(pl.format, data, d);
}

// Group g (32 values) of the row (head, slot): quantized with ggml's reference arithmetic, divided by
// the FP8 scale and rounded (FP8), or rounded to the page's float format.
__device__ __forceinline__ void store_group(const PkvPlane &pl, const PkvPool &p, uint8_t *part_ptr, uint32_t head,
                                            uint32_t slot, uint32_t g, float fp8_scale, const float *x) {
  const uint64_t row = row_index(p, head, slot);
  uint8_t *data = part_ptr + row * pl.row_data_bytes;
  if (is_fp8(pl.format)) {
    for (uint32_t j = 0; j < kGroup; j++) data[g * kGroup + j] = float_to_fp8(pl.format, __fdiv_rn(x[j], fp8_scale));
    return;
  }
  if (pl.format == Q8_0 || pl.format == Q4_0) {
    uint16_t *scale = reinterpret_cast<uint16_t *>(part_ptr + pl.scale_offset + row * pl.row_scale_bytes) + g;
    if (pl.format == Q8_0) {
      float amax = 0.0f;
      for (uint32_t j = 0; j < kGroup; j++) amax = fmaxf(amax, fabsf(x[j]));
      const float d = __fdiv_rn(amax, 127.0f);
      const float id = d != 0.0f ? __frcp_rn(d) : 0.0f;
      *scale = float_to_half(d);
      int8_t *q = reinterpret_cast<int8_t *>(data) + g * kGroup;
      for (uint32_t j = 0; j < kGroup; j++) q[j] = int8_t(roundf(__fmul_rn(x[j], id)));
    } else {
      float amax = 0.0f, max = 0.0f;
      for (uint32_t j = 0; j < kGroup; j++) {
        if (amax < fabsf(x[j])) {
          amax = fabsf(x[j]);
          max = x[j];
        }
      }
      const float d = __fdiv_rn(max, -8.0f);
      const float id = d != 0.0f ? __frcp_rn(d) : 0.0f;
      *scale = float_to_half(d);
      uint8_t *q = data + g * (kGroup / 2);
      for (uint32_t j = 0; j < kGroup / 2; j++) {
        // int(): NaN to 0, saturating, as the host's to_int_rz (lib/format.cpp) for non-finite rows.
        const int lo = min(15, int(__fadd_rn(__fmul_rn(x[j], id), 8.5f)));
        const int hi = min(15, int(__fadd_rn(__fmul_rn(x[j + kGroup / 2], id), 8.5f)));
        q[j] = uint8_t(unsigned(lo) | unsigned(hi) << 4); // unsigned: lo or hi is INT_MIN for a tiny group's inf
      }
    }
    return;
  }
  for (uint32_t j = 0; j < kGroup; j++) store_io(pl.format, data, g * kGroup + j, x[j]);
}

} // namespace pkv_dev
