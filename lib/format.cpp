#include "format.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace pkv {

namespace {

uint64_t align64(uint64_t n) { return (n + 63) & ~uint64_t(63); }

void store16(void *p, uint16_t v) { std::memcpy(p, &v, 2); }

#if defined(__x86_64__)
// Whether the host conversions' AVX2 variants run here (asked once).
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

} // namespace

uint16_t f32_to_f16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN stays NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u); // rounds past 65504: infinity
  if (a < 0x38800000u) {                                 // below 2^-14: subnormal half
    // Scale into units of 2^-24 with the float unit's own round-to-nearest-even.
    const float scaled = float_from_bits(a) * 16777216.0f;
    return uint16_t(sign | uint16_t(std::nearbyint(scaled)));
  }
  // Normal: drop 13 mantissa bits, rounding to nearest even; a carry correctly bumps the exponent.
  const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t((rounded - 0x38000000u) >> 13));
}

uint16_t f32_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

uint8_t f32_to_fp8(pkv_format f, float x) {
  const bool e4m3 = f == PKV_FORMAT_FP8_E4M3;
  const uint32_t mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, largest = e4m3 ? 0x7eu : 0x7bu;
  const uint32_t u = float_bits(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  // Below the smallest normal: units of the smallest subnormal, 2^(1 - bias - mantissa) (a scaling by
  // a power of two, exact), rounded to nearest even by adding and taking off 2^23 (the units stay
  // at most 2^mantissa). Else: 23 - mantissa bits dropped, rounding to nearest even (a carry bumps the
  // exponent), then rebiased. Both are computed and one is taken, so that loops over rows vectorise.
  const uint32_t smallest_normal = (127u + 1 - bias) << 23;
  const float units = float_from_bits(std::min(a, smallest_normal)) * (e4m3 ? 512.0f : 65536.0f);
  const uint32_t subnormal = uint32_t((units + 8388608.0f) - 8388608.0f);
  const uint32_t shift = 23 - mantissa;
  const uint32_t normal = ((a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u)) >> shift) - ((127u - bias) << mantissa);
  const uint32_t code = a < smallest_normal ? subnormal : std::min(normal, largest);
  return uint8_t(sign | (a > 0x7f800000u ? 0x7fu : code));
}

void load_fp8(pkv_format f, const uint8_t *src, size_t n, float scale, float *dst) {
  for (size_t i = 0; i < n; i++) dst[i] = fp8_to_f32(f, src[i]) * scale;
}

namespace {

// A loop a format, whose constants are then known.
void store_fp8_rows(pkv_format f, const float *src, size_t n, float scale, uint8_t *dst) {
  if (f == PKV_FORMAT_FP8_E4M3)
    for (size_t i = 0; i < n; i++) dst[i] = f32_to_fp8(PKV_FORMAT_FP8_E4M3, src[i] / scale);
  else
    for (size_t i = 0; i < n; i++) dst[i] = f32_to_fp8(PKV_FORMAT_FP8_E5M2, src[i] / scale);
}

#if defined(__x86_64__)
// f32_to_fp8 on 8 lanes (the compilers leave its loop scalar: AVX2 has no float-to-unsigned
// conversion), every step the same integer and float operation.
template <pkv_format F> __attribute__((target("avx2"))) __m256i fp8_lanes(__m256 x) {
  constexpr bool e4m3 = F == PKV_FORMAT_FP8_E4M3;
  constexpr int mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, shift = 23 - mantissa;
  constexpr int smallest_normal = (127 + 1 - bias) << 23, largest = e4m3 ? 0x7e : 0x7b;
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256 units = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_min_epi32(a, _mm256_set1_epi32(smallest_normal))),
                                     _mm256_set1_ps(e4m3 ? 512.0f : 65536.0f));
  const __m256i subnormal = _mm256_cvttps_epi32(
      _mm256_sub_ps(_mm256_add_ps(units, _mm256_set1_ps(8388608.0f)), _mm256_set1_ps(8388608.0f)));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, shift), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (shift - 1)) - 1)), odd), shift);
  const __m256i normal = _mm256_min_epu32(_mm256_sub_epi32(rounded, _mm256_set1_epi32((127 - bias) << mantissa)),
                                          _mm256_set1_epi32(largest));
  const __m256i code = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(smallest_normal), a));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  return _mm256_or_si256(sign, _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), nan));
}

template <pkv_format F>
__attribute__((target("avx2"))) void store_fp8_avx2_as(const float *src, size_t n, float scale, uint8_t *dst) {
  size_t i = 0;
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 32 <= n; i += 32) {
    __m256i c[4];
    for (int k = 0; k < 4; k++) c[k] = fp8_lanes<F>(_mm256_div_ps(_mm256_loadu_ps(src + i + 8 * k), s));
    // Codes below 256: the unsigned packs saturate nothing; the permute undoes their interleaving.
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + i),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  // Only where values remain: entering the baseline's SSE code with the vector registers' upper
  // halves in use costs more than a row's conversion on some processors.
  if (i < n) store_fp8_rows(F, src + i, n - i, scale, dst + i);
}

__attribute__((target("avx2"))) void store_fp8_avx2(pkv_format f, const float *src, size_t n, float scale,
                                                    uint8_t *dst) {
  if (f == PKV_FORMAT_FP8_E4M3) store_fp8_avx2_as<PKV_FORMAT_FP8_E4M3>(src, n, scale, dst);
  else store_fp8_avx2_as<PKV_FORMAT_FP8_E5M2>(src, n, scale, dst);
}
#endif

} // namespace

void store_fp8(pkv_format f, const float *src, size_t n, float scale, uint8_t *dst) {
#if defined(__x86_64__)
  if (has_avx2()) return store_fp8_avx2(f, src, n, scale, dst);
#endif
  store_fp8_rows(f, src, n, scale, dst);
}

bool is_io_format(pkv_format f) {
  return f == PKV_FORMAT_F32 || f == PKV_FORMAT_F16 || f == PKV_FORMAT_BF16;
}

bool is_page_format(pkv_format f) { return is_io_format(f) || is_quantized(f) || is_fp8(f); }

size_t io_elem_bytes(pkv_format f) { return f == PKV_FORMAT_F32 ? 4 : 2; }

#if defined(__x86_64__)
bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

namespace {

void load_f16_portable(const uint8_t *src, size_t n, float *dst) {
  for (size_t i = 0; i < n; i++) dst[i] = f16_to_f32(load16(src + 2 * i));
}

void store_f16_portable(const float *src, size_t n, uint8_t *dst) {
  for (size_t i = 0; i < n; i++) store16(dst + 2 * i, f32_to_f16(src[i]));
}

void store_bf16_portable(const float *src, size_t n, uint8_t *dst) {
  for (size_t i = 0; i < n; i++) store16(dst + 2 * i, f32_to_bf16(src[i]));
}

#if defined(__x86_64__)
// 8 values an instruction, exact both ways (checked against the portable loops for every float and
// every half; appends to F16 pages 1.3-6x faster, a tiny decode 1.5x: docs/perf/decisions.md).
// F16C keeps a NaN's payload where f32_to_f16 writes the canonical NaN, so 8 floats with a NaN
// among them go the portable way.
__attribute__((target("avx,f16c"))) void load_f16_f16c(const uint8_t *src, size_t n, float *dst) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 2 * i))));
  if (i < n) load_f16_portable(src + 2 * i, n - i, dst + i); // only where values remain, as for FP8
}

__attribute__((target("avx,f16c"))) void store_f16_f16c(const float *src, size_t n, uint8_t *dst) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) store_f16_portable(src + i, 8, dst + 2 * i);
    else _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + 2 * i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  if (i < n) store_f16_portable(src + i, n - i, dst + 2 * i);
}

// f32_to_bf16 on 8 lanes of 32 bits, then the two halves' results packed: 16 values a step where the
// baseline's SSE2, without a 32-to-16-bit pack, took 8 values in twice the instructions (a host
// append to BF16 pages spent its time there).
__attribute__((target("avx2"))) __m256i bf16_lanes(__m256i u) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

__attribute__((target("avx2"))) void store_bf16_avx2(const float *src, size_t n, uint8_t *dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = bf16_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i)));
    const __m256i b = bf16_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i + 8)));
    // packus works within 128-bit halves (a0-3 b0-3 a4-7 b4-7); the permute puts them in order.
    // Every lane is below 2^16, so the unsigned saturation never changes one.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + 2 * i), packed);
  }
  if (i < n) store_bf16_portable(src + i, n - i, dst + 2 * i); // only where values remain, as for FP8
}

#endif

struct HalfRows {
  void (*load_f16)(const uint8_t *, size_t, float *);
  void (*store_f16)(const float *, size_t, uint8_t *);
  void (*store_bf16)(const float *, size_t, uint8_t *);
};

const HalfRows &half_rows() {
#if defined(__x86_64__)
  static const HalfRows rows{has_f16c() ? load_f16_f16c : load_f16_portable,
                             has_f16c() ? store_f16_f16c : store_f16_portable,
                             has_avx2() ? store_bf16_avx2 : store_bf16_portable};
#else
  static const HalfRows rows{load_f16_portable, store_f16_portable, store_bf16_portable};
#endif
  return rows;
}

} // namespace

void load_f16(const uint8_t *src, size_t n, float *dst) { half_rows().load_f16(src, n, dst); }

void store_io(pkv_format f, const float *src, size_t n, void *dst) {
  auto *p = static_cast<uint8_t *>(dst);
  switch (f) {
  case PKV_FORMAT_F32: std::memcpy(dst, src, n * 4); break;
  case PKV_FORMAT_F16: half_rows().store_f16(src, n, p); break;
  default: half_rows().store_bf16(src, n, p); break;
  }
}

namespace {

// A float to an int as PTX's cvt does it in the CUDA kernels (towards zero, NaN to 0, beyond the
// range to its end), so that non-finite rows quantize to defined bits, the GPU's: C++ leaves those
// conversions undefined (and then shifted a negative nibble). Finite values of a block convert well
// inside the range, as before.
int to_int_rz(float x) {
  if (x != x) return 0;
  if (x >= 2147483648.0f) return INT32_MAX;
  if (x <= -2147483648.0f) return INT32_MIN;
  return int(x);
}

// Rounds half away from zero, for |x| < 2^31: x minus its truncation is exact.
int round_near(float x) {
  const int i = int(x);
  const float r = x - float(i);
  return i + (r >= 0.5f) - (r <= -0.5f);
}

// to_int_rz(std::roundf(x)) without a library call: from 2^23 on a float is an integer already.
int round_to_int(float x) { return std::fabs(x) < 8388608.0f ? round_near(x) : to_int_rz(x); }

// Whether a group's values times id convert without to_int_rz's guards: all finite, id too (a
// subnormal scale makes it infinite), so the products lie within a few units of the group's range.
// The loops of such groups are the ones the compiler vectorises.
bool plain_group(const float *x, float id) {
  bool finite = std::fabs(id) <= FLT_MAX;
  for (uint32_t j = 0; j < kGroup; j++) finite &= std::fabs(x[j]) <= FLT_MAX;
  return finite;
}

} // namespace

#if defined(__x86_64__)
namespace {

// A group's 32 values (v) and magnitudes (a) in four vectors and its largest magnitude; false where
// a value is not finite (x - x is NaN there), which the portable code's guarded conversions take.
__attribute__((target("avx2"))) bool finite_group(const float *x, __m256 *v, __m256 *a, float *amax) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps(), zero = _mm256_setzero_ps();
  for (int k = 0; k < 4; k++) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    zero = _mm256_add_ps(zero, _mm256_sub_ps(v[k], v[k]));
    a[k] = _mm256_and_ps(v[k], magnitude);
    top = _mm256_max_ps(top, a[k]);
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(zero, zero, _CMP_UNORD_Q)) != 0) return false;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  *amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  return true;
}

// quantize_q8_0 of a group whose values and scale inverse are finite, with AVX2: the same operations
// (a maximum is the same in any order; the products, truncations and comparisons are exact lane by
// lane), 8 values a step. False, nothing written, for any other group.
__attribute__((target("avx2"))) bool quantize_q8_0_avx2(const float *x, uint16_t *d_out, int8_t *q) {
  __m256 v[4], a[4];
  float amax;
  if (!finite_group(x, v, a, &amax)) return false;
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  if (!(std::fabs(id) <= FLT_MAX)) return false;
  *d_out = f32_to_f16(d);
  // round_near: the truncation, plus one where the rest is >= 0.5, minus one where it is <= -0.5
  // (a comparison's true lane is -1).
  __m256i t[4];
  for (int k = 0; k < 4; k++) {
    const __m256 p = _mm256_mul_ps(v[k], _mm256_set1_ps(id));
    const __m256i i = _mm256_cvttps_epi32(p);
    const __m256 r = _mm256_sub_ps(p, _mm256_cvtepi32_ps(i));
    t[k] = _mm256_add_epi32(_mm256_sub_epi32(i, _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_set1_ps(0.5f), _CMP_GE_OQ))),
                            _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_set1_ps(-0.5f), _CMP_LE_OQ)));
  }
  // Quants within [-127, 127]: the packs saturate nothing. They work within 128-bit halves, leaving
  // the four vectors' quarters interleaved; the permute puts them in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]), _mm256_packs_epi32(t[2], t[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return true;
}

// quantize_q4_0 likewise: the scale's value is the first of the group's values of the largest
// magnitude (the portable loop's strict comparison), +0 where all are zeros.
__attribute__((target("avx2"))) bool quantize_q4_0_avx2(const float *x, uint16_t *d_out, uint8_t *q) {
  __m256 v[4], a[4];
  float amax;
  if (!finite_group(x, v, a, &amax)) return false;
  float max = 0.0f;
  if (amax > 0.0f) {
    const __m256 all = _mm256_set1_ps(amax);
    uint32_t hits = 0;
    for (int k = 0; k < 4; k++) hits |= uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a[k], all, _CMP_EQ_OQ))) << (8 * k);
    max = x[__builtin_ctz(hits)];
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  if (!(std::fabs(id) <= FLT_MAX)) return false;
  *d_out = f32_to_f16(d);
  // min(15, int(x * id + 8.5)), values j (low nibble) and j + 16 (high nibble) joined in 32-bit lanes.
  __m256i nibbles[4];
  for (int k = 0; k < 4; k++) {
    const __m256 p = _mm256_add_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)), _mm256_set1_ps(8.5f));
    nibbles[k] = _mm256_min_epi32(_mm256_cvttps_epi32(p), _mm256_set1_epi32(15));
  }
  const __m256i low = _mm256_or_si256(nibbles[0], _mm256_slli_epi32(nibbles[2], 4));
  const __m256i high = _mm256_or_si256(nibbles[1], _mm256_slli_epi32(nibbles[3], 4));
  // Bytes below 256: the unsigned packs saturate nothing; the permute undoes packus's interleaving.
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i *>(q),
                   _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
  return true;
}

} // namespace
#endif

void quantize_q8_0(const float *x, uint16_t *d_out, int8_t *q) {
#if defined(__x86_64__)
  if (has_avx2() && quantize_q8_0_avx2(x, d_out, q)) return;
#endif
  // The largest magnitude (a NaN passed over, as std::fmax does) and whether every value is finite
  // (x - x is 0 for finite x, NaN else), four lanes at a time (GCC's and Clang's vector extension): a
  // maximum is the same in any order, and the compilers left the scalar loops scalar.
  using Floats = float __attribute__((vector_size(16)));
  using Ints = int32_t __attribute__((vector_size(16)));
  Floats top = {}, zero = {};
  for (uint32_t j = 0; j < kGroup; j += 4) {
    Floats v;
    std::memcpy(&v, x + j, sizeof v);
    zero += v - v;
    const Floats a = (Floats)((Ints)v & 0x7fffffff);
    top = a > top ? a : top;
  }
  float amax = 0.0f;
  for (int k = 0; k < 4; k++) amax = top[k] > amax ? top[k] : amax;
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = f32_to_f16(d);
  auto quants = [&](auto round) {
    for (uint32_t j = 0; j < kGroup; j++) q[j] = int8_t(round(x[j] * id));
  };
  const bool finite = zero[0] + zero[1] + zero[2] + zero[3] == 0.0f && std::fabs(id) <= FLT_MAX; // plain_group's test
  if (finite) quants([](float v) { return round_near(v); });
  else quants([](float v) { return round_to_int(v); });
}

void quantize_q4_0(const float *x, uint16_t *d_out, uint8_t *q) {
#if defined(__x86_64__)
  if (has_avx2() && quantize_q4_0_avx2(x, d_out, q)) return;
#endif
  float amax = 0.0f, max = 0.0f;
  for (uint32_t j = 0; j < kGroup; j++) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = f32_to_f16(d);
  auto quants = [&](auto truncate) {
    for (uint32_t j = 0; j < kGroup / 2; j++) {
      const int lo = std::min(15, truncate(x[j] * id + 8.5f));
      const int hi = std::min(15, truncate(x[j + kGroup / 2] * id + 8.5f));
      // Unsigned: a group whose scale's inverse overflows (largest magnitude below ~2.3e-38) gives
      // INT32_MIN quants, whose shift would be undefined; the low 8 bits are the GPU's either way.
      q[j] = uint8_t(unsigned(lo) | unsigned(hi) << 4);
    }
  };
  if (plain_group(x, id)) quants([](float v) { return int(v); });
  else quants([](float v) { return to_int_rz(v); });
}

namespace {

void quantize_group(pkv_format f, const float *x, uint16_t *d, uint8_t *q) {
  if (f == PKV_FORMAT_Q8_0) quantize_q8_0(x, d, reinterpret_cast<int8_t *>(q));
  else quantize_q4_0(x, d, q);
}

} // namespace

size_t row_bytes(pkv_format f, size_t n) {
  if (is_fp8(f)) return n;
  if (is_io_format(f)) return n <= SIZE_MAX / io_elem_bytes(f) ? n * io_elem_bytes(f) : 0;
  if (!is_quantized(f) || n % kGroup != 0) return 0;
  return n / kGroup * (2 + group_quant_bytes(f));
}

void encode_ggml_row(pkv_format f, const float *src, size_t n, void *dst) {
  if (is_fp8(f)) return store_fp8(f, src, n, 1.0f, static_cast<uint8_t *>(dst));
  if (is_io_format(f)) return store_io(f, src, n, dst);
  auto *p = static_cast<uint8_t *>(dst);
  const size_t block = 2 + group_quant_bytes(f);
  for (size_t g = 0; g < n / kGroup; g++) {
    uint16_t d;
    quantize_group(f, src + g * kGroup, &d, p + g * block + 2);
    store16(p + g * block, d);
  }
}

void decode_ggml_row(pkv_format f, const void *src, size_t n, float *dst) {
  if (is_fp8(f)) return load_fp8(f, static_cast<const uint8_t *>(src), n, 1.0f, dst);
  if (is_io_format(f)) return load_io(f, src, n, dst);
  const auto *p = static_cast<const uint8_t *>(src);
  const size_t block = 2 + group_quant_bytes(f);
  for (size_t g = 0; g < n / kGroup; g++)
    dequantize_group(f, load16(p + g * block), p + g * block + 2, dst + g * kGroup);
}

PlaneLayout make_plane_layout(pkv_format f, uint32_t kv_heads, uint32_t page_size, uint32_t head_dim) {
  PlaneLayout l{};
  l.format = f;
  l.kv_heads = kv_heads;
  l.page_size = page_size;
  l.head_dim = head_dim;
  const uint64_t rows = uint64_t(kv_heads) * page_size;
  if (is_quantized(f)) {
    l.row_data_bytes = uint64_t(head_dim / kGroup) * group_quant_bytes(f);
    l.row_scale_bytes = uint64_t(head_dim / kGroup) * 2;
  } else {
    l.row_data_bytes = uint64_t(head_dim) * elem_bytes(f);
  }
  l.scale_offset = align64(rows * l.row_data_bytes);
  l.bytes = align64(l.scale_offset + rows * l.row_scale_bytes);
  return l;
}

void encode_row(const PlaneLayout &l, uint8_t *part, uint32_t head, uint32_t slot, float scale, const float *src) {
  uint8_t *data = part + l.data_at(head, slot);
  if (is_fp8(l.format)) return store_fp8(l.format, src, l.head_dim, scale, data);
  if (!is_quantized(l.format)) return store_io(l.format, src, l.head_dim, data);
  uint8_t *scales = part + l.scale_at(head, slot);
  const uint32_t qb = group_quant_bytes(l.format);
  for (uint32_t g = 0; g < l.head_dim / kGroup; g++) {
    uint16_t d;
    quantize_group(l.format, src + g * kGroup, &d, data + g * qb);
    store16(scales + 2 * g, d);
  }
}

} // namespace pkv
