#include "cpu_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "../format.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

// GCC or Clang: the vector extension, and on x86-64 target attributes for the AVX2 and AVX-512
// variants.
#define PKV_ALWAYS_INLINE inline __attribute__((always_inline))

namespace pkv {

namespace {

constexpr uint32_t kTokenBlock = 32; // tokens whose scores are taken before one softmax rescale
constexpr uint32_t kPrefetchTokens = 2 * kTokenBlock; // how far ahead rows are asked for

// W floats as one vector (GCC's and Clang's vector extension): 4 for SSE or NEON registers, 8 for
// AVX ones (vectors wider than the registers made slower code than the plain loops had).
template <class T, int W> struct Lanes {
  typedef T type __attribute__((vector_size(sizeof(T) * W)));
};
template <class T, int W> using Vector = typename Lanes<T, W>::type;
template <int W> using Floats = Vector<float, W>;
template <int W> using Ints = Vector<int32_t, W>;

template <int W> PKV_ALWAYS_INLINE Floats<W> load(const float *p) {
  Floats<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W> PKV_ALWAYS_INLINE void store(float *p, Floats<W> v) { std::memcpy(p, &v, sizeof v); }

// Pairwise sums within each 4-lane block, as x86's haddps: lanes 4b, 4b + 1 of the result are x's
// lanes 4b + {0, 1} and 4b + {2, 3} summed, lanes 4b + 2, 4b + 3 y's likewise.
template <int W, std::size_t... I>
PKV_ALWAYS_INLINE Floats<W> hadd(Floats<W> x, Floats<W> y, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, y, ((I % 4 < 2 ? 0 : W) + 4 * (I / 4) + 2 * (I % 2))...) +
         __builtin_shufflevector(x, y, ((I % 4 < 2 ? 0 : W) + 4 * (I / 4) + 2 * (I % 2) + 1)...);
}
template <int W> PKV_ALWAYS_INLINE Floats<W> hadd(Floats<W> x, Floats<W> y) {
  return hadd<W>(x, y, std::make_index_sequence<W>());
}

// out[i] = the sum of v[i]'s lanes, for 8 vectors: two rounds of hadd leave each 4-lane block
// holding one lane of each of 4 vectors' sums; with 8 lanes the two blocks are added.
// With 16 lanes the four 4-lane blocks are first folded to two, which leaves the 8-lane case.
template <int W> PKV_ALWAYS_INLINE void lane_sums(const Floats<W> (&v)[8], float *out) {
  static_assert(W == 4 || W == 8 || W == 16, "4-lane blocks");
  if constexpr (W == 16) {
    const Floats<W> s = hadd<W>(hadd<W>(v[0], v[1]), hadd<W>(v[2], v[3]));
    const Floats<W> t = hadd<W>(hadd<W>(v[4], v[5]), hadd<W>(v[6], v[7]));
    const Floats<8> s8 = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) +
                         __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
    const Floats<8> t8 = __builtin_shufflevector(t, t, 0, 1, 2, 3, 4, 5, 6, 7) +
                         __builtin_shufflevector(t, t, 8, 9, 10, 11, 12, 13, 14, 15);
    store<4>(out, __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7));
    store<4>(out + 4, __builtin_shufflevector(t8, t8, 0, 1, 2, 3) + __builtin_shufflevector(t8, t8, 4, 5, 6, 7));
  } else {
    for (int h = 0; h < 8 / W; h++) {
      const Floats<W> *u = v + 4 * h;
      Floats<W> s = hadd<W>(hadd<W>(u[0], u[1]), hadd<W>(u[2], u[3]));
      if constexpr (W == 8) {
        const Floats<W> t = hadd<W>(hadd<W>(u[4], u[5]), hadd<W>(u[6], u[7]));
        s = __builtin_shufflevector(s, t, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(s, t, 4, 5, 6, 7, 12, 13, 14, 15);
      }
      store<W>(out + 4 * h, s);
    }
  }
}

// Scores of R query rows (D apart) against keys [0, n) rounded up to S / R (the buffer's rows past n
// hold leftovers the caller ignores): out[j * kTokenBlock + i] = q_j . key_i. S sums at once, R
// rows times S / R keys, so that a load serves several multiply-adds and S chains hide their
// latency; head_dim is a multiple of 32. Sixteen sums for four rows where the set has 32 vector
// registers, four keys to each load of the rows' q: 0.93-0.97x the time of eight sums on the
// AVX-512 rows measured (docs/perf/decisions.md).
template <int W, int R>
PKV_ALWAYS_INLINE void score_block(const float *q, const float *keys, uint32_t n, uint32_t D, float *out) {
  constexpr int S = W == 16 && R == 4 ? 16 : 8;
  constexpr int KB = S / R;
  for (uint32_t i0 = 0; i0 < n; i0 += KB) {
    Floats<W> s[S] = {};
    for (uint32_t d = 0; d < D; d += W) {
      Floats<W> qv[R];
      for (int j = 0; j < R; j++) qv[j] = load<W>(q + j * D + d);
      for (int k = 0; k < KB; k++) {
        const Floats<W> kv = load<W>(keys + (i0 + k) * D + d);
        for (int j = 0; j < R; j++) s[j * KB + k] += qv[j] * kv;
      }
    }
    float sums[S];
    for (int h = 0; h < S / 8; h++) lane_sums<W>(reinterpret_cast<const Floats<W>(&)[8]>(s[8 * h]), sums + 8 * h);
    for (int j = 0; j < R; j++)
      for (int k = 0; k < KB; k++) out[j * kTokenBlock + i0 + k] = sums[j * KB + k];
  }
}

// acc_j = acc_j * correction_j + the sum of w_j[i] v_i over n rows v_i of D values (D apart), for R
// rows (acc and w kTokenBlock and D apart): V vectors of each at a time, held in registers over all
// the rows, each V load serving the R rows. The block's sum starts from zero and joins acc once, as
// its weights join the normaliser: added one by one to an acc near 1, weights below 2^-24 of the
// largest would count in the normaliser but not here.
template <int W, int R, int V>
PKV_ALWAYS_INLINE void accumulate_part(float *acc, const float *correction, const float *w, const float *v, uint32_t n,
                                       uint32_t D, uint32_t d) {
  Floats<W> a[R][V] = {};
  const float *row = v + d;
  for (uint32_t i = 0; i < n; i++, row += D)
    for (int k = 0; k < V; k++) {
      const Floats<W> vv = load<W>(row + k * W);
      for (int j = 0; j < R; j++) a[j][k] += w[j * kTokenBlock + i] * vv;
    }
  for (int j = 0; j < R; j++)
    for (int k = 0; k < V; k++) {
      float *at = acc + j * D + d + k * W;
      store<W>(at, load<W>(at) * correction[j] + a[j][k]);
    }
}

// Four vectors of each row at a time (eight chains hide the multiply-adds' latency), two for four
// rows on 16-register sets; with 16 lanes a head_dim that is an odd multiple of 32 ends with two.
template <int W, int R>
PKV_ALWAYS_INLINE void accumulate(float *acc, const float *correction, const float *w, const float *v, uint32_t n,
                                  uint32_t D) {
  constexpr int V = R == 4 && W < 16 ? 2 : 4;
  uint32_t d = 0;
  for (; d + V * W <= D; d += V * W) accumulate_part<W, R, V>(acc, correction, w, v, n, D, d);
  if constexpr (W == 16 && V == 4)
    for (; d < D; d += 2 * W) accumulate_part<W, R, 2>(acc, correction, w, v, n, D, d);
}

// e^x lane by lane for x <= 0 or NaN (scores minus their row's maximum): 2^n e^r with n = x / ln 2
// rounded (by adding 1.5 * 2^23, whose low bits then hold n) and |r| <= ln 2 / 2 (ln 2 in two parts,
// the first of 9 bits so that n times it is exact), e^r by Cephes's degree-7 polynomial: within 1e-7
// relative of e^x (measured over [-87, 0]); below -87, where e^x nears the smallest normal float, 0.
template <int W> PKV_ALWAYS_INLINE Floats<W> exp_nonpositive(Floats<W> x) {
  const Floats<W> floor = Floats<W>{} - 87.0f;
  const Floats<W> c = x < floor ? floor : x; // NaN stays
  const Floats<W> t = c * 1.44269504f + 12582912.0f, n = t - 12582912.0f;
  const Floats<W> r = c - n * 0.693359375f + n * 2.12194440e-4f;
  Floats<W> e = r * 1.9875691500e-4f + 1.3981999507e-3f;
  e = e * r + 8.3334519073e-3f;
  e = e * r + 4.1665795894e-2f;
  e = e * r + 1.6666665459e-1f;
  e = e * r + 5.0000001201e-1f;
  e = e * r * r + r + 1.0f;
  // A vector cast keeps the bits: t's as integers, then 2^n's as floats.
  const Ints<W> two_n = (((Ints<W>)t - 0x4B400000) + 127) << 23;
  e *= (Floats<W>)two_n;
  return x < floor ? Floats<W>{} : e;
}

// p[i] = e^(p[i] - top) for i < n (the row's softmax weights, in place), and their sum; p has room
// for n rounded up to W.
template <int W> PKV_ALWAYS_INLINE float weights(float *p, uint32_t n, float top) {
  for (uint32_t i = n; i % W != 0; i++) p[i] = -std::numeric_limits<float>::infinity(); // weigh 0
  Floats<W> sum = {};
  for (uint32_t i = 0; i < n; i += W) {
    const Floats<W> e = exp_nonpositive<W>(load<W>(p + i) - top);
    store<W>(p + i, e);
    sum += e;
  }
  float total = 0.0f;
  for (int j = 0; j < W; j++) total += sum[j];
  return total;
}

// p[i] *= scale for i < n, and the largest of them (a NaN never is, as in std::max(top, p[i])).
template <int W> PKV_ALWAYS_INLINE float scale_scores(float *p, uint32_t n, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Floats<W> tops = Floats<W>{} + neg_inf;
  uint32_t i = 0;
  for (; i + W <= n; i += W) {
    const Floats<W> v = load<W>(p + i) * scale;
    store<W>(p + i, v);
    tops = tops < v ? v : tops;
  }
  float top = neg_inf;
  for (int j = 0; j < W; j++) top = std::max(top, tops[j]);
  for (; i < n; i++) top = std::max(top, p[i] *= scale);
  return top;
}

// The instruction sets a variant is compiled for: W floats a vector, and F16 rows to floats by the
// widest conversion the set has (every conversion here is exact, so every variant decodes a row to
// the same floats).
// bf16_row: n BF16 values to floats, each moved into a float's upper half.
// scale: a quantized group's F16 scale as a float (by F16C where the set has it: the portable
// conversion's bit operations cost as much as the group's 32 values).
// scaled_group: one group of 32 signed quants times its scale (dequantize_q8_0's arithmetic), by
// the set's own widening instructions: GCC 12 turns a vector-extension conversion from 8-bit to
// wider lanes into one scalar conversion a lane (for aarch64 from 16-bit lanes too). The variants
// take and give memory, not vectors: a vector wider than the caller's target is passed differently
// on each side of the call.
template <int Width> struct VectorIsa {
  static constexpr int W = Width;
  static PKV_ALWAYS_INLINE float scale(const uint8_t *p) { return f16_to_f32(load16(p)); }
  static PKV_ALWAYS_INLINE void bf16_row(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i += W) {
      Vector<uint16_t, W> h;
      std::memcpy(&h, src + 2 * i, sizeof h);
      const Vector<uint32_t, W> w = __builtin_convertvector(h, Vector<uint32_t, W>) << 16;
      std::memcpy(dst + i, &w, sizeof w);
    }
  }
};

struct Generic : VectorIsa<4> {
  static void f16_row(const uint8_t *src, uint32_t n, float *dst) { load_f16(src, n, dst); }
  template <pkv_format F> static PKV_ALWAYS_INLINE void fp8_row(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i++) dst[i] = fp8_to_f32(F, src[i]);
  }
  static PKV_ALWAYS_INLINE void scaled_group(const int8_t *q, float s, float *dst) {
    for (uint32_t j = 0; j < kGroup; j++) dst[j] = float(q[j]) * s;
  }
};

#if defined(__x86_64__)
#define PKV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PKV_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")))

// 16 FP8 codes (in 16-bit lanes) as F16 bits (format.hpp's fp8_to_f32): E5M2 shifted up a byte;
// E4M3's fields moved into an F16's, which then holds 2^-8 times the value, and its NaN code made an
// F16 NaN.
template <pkv_format F> PKV_AVX2 inline __m256i fp8_as_f16(__m256i w) {
  if constexpr (F == PKV_FORMAT_FP8_E5M2) return _mm256_slli_epi16(w, 8);
  const __m256i low = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(low, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7e00));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  return _mm256_or_si256(_mm256_or_si256(sign, _mm256_slli_epi16(low, 7)), nan);
}
template <pkv_format F> PKV_AVX2 inline __m256i fp8_codes_as_f16(const uint8_t *src) {
  return fp8_as_f16<F>(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src))));
}
// Plain inline, not always_inline: GCC and Clang inline a function of a narrower target into one of
// a wider target, but refuse always_inline through the template in between.
struct Avx2 : VectorIsa<8> {
  PKV_AVX2 static inline float scale(const uint8_t *p) { return _cvtsh_ss(load16(p)); }
  PKV_AVX2 static inline void f16_row(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 2 * i))));
  }
  PKV_AVX2 static inline void scaled_group(const int8_t *q, float s, float *dst) {
    for (uint32_t j = 0; j < kGroup; j += 8) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(q + j))));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(f, _mm256_set1_ps(s)));
    }
  }
  template <pkv_format F> PKV_AVX2 static inline void fp8_row(const uint8_t *src, uint32_t n, float *dst) {
    const __m256 unit = _mm256_set1_ps(F == PKV_FORMAT_FP8_E4M3 ? 256.0f : 1.0f);
    for (uint32_t i = 0; i < n; i += 16) {
      const __m256i h = fp8_codes_as_f16<F>(src + i);
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), unit));
      _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), unit));
    }
  }
};
struct Avx512 : VectorIsa<16> {
  PKV_AVX512 static inline float scale(const uint8_t *p) { return _cvtsh_ss(load16(p)); }
  // Zero-masked forms: GCC 12 warns of the plain ones' undefined pass-through operand.
  PKV_AVX512 static inline void f16_row(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + 2 * i))));
  }
  PKV_AVX512 static inline void scaled_group(const int8_t *q, float s, float *dst) {
    for (uint32_t j = 0; j < kGroup; j += 16) {
      const __m512 f = _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepi8_epi32(0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i *>(q + j))));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(f, _mm512_set1_ps(s)));
    }
  }
  template <pkv_format F> PKV_AVX512 static inline void fp8_row(const uint8_t *src, uint32_t n, float *dst) {
    const __m512 unit = _mm512_set1_ps(F == PKV_FORMAT_FP8_E4M3 ? 256.0f : 1.0f);
    for (uint32_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xffff, fp8_codes_as_f16<F>(src + i)), unit));
  }
};
#elif defined(__aarch64__)
// NEON is part of every ARMv8-A processor: no target attribute, nothing to detect.
struct Neon {
  static constexpr int W = 4;
  static PKV_ALWAYS_INLINE float scale(const uint8_t *p) {
    __fp16 h;
    std::memcpy(&h, p, 2);
    return float(h);
  }
  static PKV_ALWAYS_INLINE void f16_row(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(src + 2 * i))));
  }
  static PKV_ALWAYS_INLINE void bf16_row(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i += 4)
      vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vreinterpret_u16_u8(vld1_u8(src + 2 * i)), 16)));
  }
  template <pkv_format F> static PKV_ALWAYS_INLINE void fp8_row(const uint8_t *src, uint32_t n, float *dst) {
    const float unit = F == PKV_FORMAT_FP8_E4M3 ? 256.0f : 1.0f;
    for (uint32_t i = 0; i < n; i += 8) {
      const uint16x8_t w = vmovl_u8(vld1_u8(src + i));
      uint16x8_t h;
      if constexpr (F == PKV_FORMAT_FP8_E5M2) {
        h = vshlq_n_u16(w, 8);
      } else {
        const uint16x8_t low = vandq_u16(w, vdupq_n_u16(0x7f));
        const uint16x8_t nan = vandq_u16(vceqq_u16(low, vdupq_n_u16(0x7f)), vdupq_n_u16(0x7e00));
        h = vorrq_u16(vorrq_u16(vshlq_n_u16(vandq_u16(w, vdupq_n_u16(0x80)), 8), vshlq_n_u16(low, 7)), nan);
      }
      vst1q_f32(dst + i, vmulq_n_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))), unit));
      vst1q_f32(dst + i + 4, vmulq_n_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))), unit));
    }
  }
  static PKV_ALWAYS_INLINE void scaled_group(const int8_t *q, float s, float *dst) {
    for (uint32_t j = 0; j < kGroup; j += 8) {
      const int16x8_t h = vmovl_s8(vld1_s8(q + j));
      vst1q_f32(dst + j, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), s));
      vst1q_f32(dst + j + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(h)), s));
    }
  }
};
#endif

// A Q8_0 row of n values (quants, then the row's group scales) to floats.
template <class Isa> PKV_ALWAYS_INLINE void q8_0_row(const uint8_t *quants, const uint8_t *scales, uint32_t n, float *dst) {
  for (uint32_t g = 0; g < n / kGroup; g++)
    Isa::scaled_group(reinterpret_cast<const int8_t *>(quants) + g * kGroup, Isa::scale(scales + 2 * g), dst + g * kGroup);
}

// A Q4_0 row likewise: a group's byte j holds value j (low nibble) and value j + 16 (high nibble),
// each offset by 8 (dequantize_q4_0); the nibbles become a Q8_0 group's signed bytes first.
template <class Isa> PKV_ALWAYS_INLINE void q4_0_row(const uint8_t *quants, const uint8_t *scales, uint32_t n, float *dst) {
  for (uint32_t g = 0; g < n / kGroup; g++) {
    Vector<uint8_t, kGroup / 2> q;
    std::memcpy(&q, quants + g * (kGroup / 2), sizeof q);
    const Vector<int8_t, kGroup / 2> low = (Vector<int8_t, kGroup / 2>)(q & 15) - 8, high = (Vector<int8_t, kGroup / 2>)(q >> 4) - 8;
    int8_t bytes[kGroup];
    std::memcpy(bytes, &low, sizeof low);
    std::memcpy(bytes + kGroup / 2, &high, sizeof high);
    Isa::scaled_group(bytes, Isa::scale(scales + 2 * g), dst + g * kGroup);
  }
}

// Asks for the row of `head` at `slot`, and its scales, to come into the L2 cache (locality 1: on
// x86 prefetcht2; prefetching into L1 measured slower, docs/perf/decisions.md).
PKV_ALWAYS_INLINE void prefetch_row(const uint8_t *part, const PlaneLayout &l, uint32_t head, uint32_t slot) {
  const uint8_t *row = part + l.data_at(head, slot);
  for (uint32_t o = 0; o < l.row_data_bytes; o += 64) __builtin_prefetch(row + o, 0, 1);
  if (l.row_scale_bytes) __builtin_prefetch(part + l.scale_at(head, slot), 0, 1);
}

// One row of format F to floats.
template <class Isa, pkv_format F>
PKV_ALWAYS_INLINE void convert_row(const uint8_t *data, const uint8_t *scales, uint32_t D, float *dst) {
  if constexpr (F == PKV_FORMAT_F32) std::memcpy(dst, data, size_t(D) * 4);
  else if constexpr (F == PKV_FORMAT_F16) Isa::f16_row(data, D, dst);
  else if constexpr (F == PKV_FORMAT_BF16) Isa::bf16_row(data, D, dst);
  else if constexpr (F == PKV_FORMAT_Q8_0) q8_0_row<Isa>(data, scales, D, dst);
  else if constexpr (F == PKV_FORMAT_Q4_0) q4_0_row<Isa>(data, scales, D, dst);
  else Isa::template fp8_row<F>(data, D, dst);
}

// Rows of KV head t.kv_head at positions [t0, t0 + n) of one plane of t.layer (K's: at
// part_offset 0 of a page's block; V's: after K's part), as floats [n][D] into dst; meanwhile the
// rows kPrefetchTokens further on are asked for, one row a row, so that the memory system keeps
// streaming while the block computes. Templates, not lambdas, down to the arithmetic: a lambda does
// not take its enclosing function's target attribute, and where it is not inlined (-O0) its vector
// code would be compiled for the baseline instruction set.
template <class Isa, pkv_format F>
PKV_ALWAYS_INLINE void decode_rows_as(const AttendTask &t, const PlaneLayout &l, uint64_t part_offset, uint64_t t0,
                                      uint32_t n, float *dst) {
  const PoolGeometry &g = *t.g;
  const uint32_t P = g.page_size;
  // Pages and slots counted along, not divided out a row: a 64-bit division costs more than a row's
  // conversion.
  uint64_t page = t0 / P, page_ahead = (t0 + kPrefetchTokens) / P;
  uint32_t slot = uint32_t(t0 % P), slot_ahead = uint32_t((t0 + kPrefetchTokens) % P);
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *part = host(g.k_part(t.layer, t.pages[page])) + part_offset;
    convert_row<Isa, F>(part + l.data_at(t.kv_head, slot), part + l.scale_at(t.kv_head, slot), g.head_dim,
                        dst + size_t(i) * g.head_dim);
    if (t0 + i + kPrefetchTokens < t.end)
      prefetch_row(host(g.k_part(t.layer, t.pages[page_ahead])) + part_offset, l, t.kv_head, slot_ahead);
    if (++slot == P) slot = 0, page++;
    if (++slot_ahead == P) slot_ahead = 0, page_ahead++;
  }
}

template <class Isa>
PKV_ALWAYS_INLINE void decode_rows(const AttendTask &t, const PlaneLayout &l, uint64_t part_offset, uint64_t t0,
                                   uint32_t n, float *dst) {
  switch (l.format) {
  case PKV_FORMAT_F32: return decode_rows_as<Isa, PKV_FORMAT_F32>(t, l, part_offset, t0, n, dst);
  case PKV_FORMAT_F16: return decode_rows_as<Isa, PKV_FORMAT_F16>(t, l, part_offset, t0, n, dst);
  case PKV_FORMAT_BF16: return decode_rows_as<Isa, PKV_FORMAT_BF16>(t, l, part_offset, t0, n, dst);
  case PKV_FORMAT_Q8_0: return decode_rows_as<Isa, PKV_FORMAT_Q8_0>(t, l, part_offset, t0, n, dst);
  case PKV_FORMAT_Q4_0: return decode_rows_as<Isa, PKV_FORMAT_Q4_0>(t, l, part_offset, t0, n, dst);
  case PKV_FORMAT_FP8_E4M3: return decode_rows_as<Isa, PKV_FORMAT_FP8_E4M3>(t, l, part_offset, t0, n, dst);
  default: return decode_rows_as<Isa, PKV_FORMAT_FP8_E5M2>(t, l, part_offset, t0, n, dst);
  }
}

// Hides the scores of the positions a mask row keeps out of sight (p[i] is position t0 + i's score,
// i < n) and returns the largest score left.
PKV_ALWAYS_INLINE float apply_mask(float *p, uint32_t n, uint64_t t0, const TokenView &view) {
  float top = -std::numeric_limits<float>::infinity();
  for (uint32_t i = 0; i < n; i++) {
    if (t0 + i >= view.mask_from) {
      const uint64_t j = t0 + i - view.mask_from;
      if (!(view.mask_row[j / 8] >> (j % 8) & 1)) p[i] = -std::numeric_limits<float>::infinity();
    }
    top = std::max(top, p[i]);
  }
  return top;
}

// A row's scores past the plain case (p[i] is position t0 + i's q.k, i < n; p has room for n rounded
// up to W): scaled, soft-capped, ALiBi-biased by slope times the distance to the query (at
// view.end - 1), and hidden below the view's window start, in that order (pagedkv.h, section 7a);
// returns the largest. tanh by its exponential form on |x|, (1 - e^-2x) / (1 + e^-2x), as the GPU
// kernels take it: within ~1e-7 of tanh, ~5e-6 of a logit under a cap of 50.
template <int W>
PKV_ALWAYS_INLINE float shape_scores(float *p, uint32_t n, uint64_t t0, const TokenView &view, float scale,
                                     float softcap, float slope) {
  if (softcap != 0.0f) {
    const float in = scale / softcap;
    const Floats<W> nine = Floats<W>{} + 9.0f; // tanh is 1 in float past 9
    for (uint32_t i = 0; i < n; i += W) {
      const Floats<W> x = load<W>(p + i) * in;
      const Ints<W> sign = (Ints<W>)x & std::numeric_limits<int32_t>::min();
      Floats<W> a = (Floats<W>)((Ints<W>)x & std::numeric_limits<int32_t>::max());
      a = a > nine ? nine : a; // NaN stays
      const Floats<W> e = exp_nonpositive<W>(a * -2.0f);
      const Floats<W> t = (1.0f - e) / (1.0f + e) * softcap;
      store<W>(p + i, (Floats<W>)((Ints<W>)t | sign));
    }
  } else {
    for (uint32_t i = 0; i < n; i++) p[i] *= scale;
  }
  float top = -std::numeric_limits<float>::infinity();
  for (uint32_t i = 0; i < n; i++) {
    const float s = p[i] - slope * float(view.end - 1 - (t0 + i));
    p[i] = t0 + i < view.begin ? -std::numeric_limits<float>::infinity() : s;
    top = std::max(top, p[i]);
  }
  return top;
}

// Rows r .. r + R - 1 of a block of keys and values at t0 (in t.scratch), each seeing nv of them:
// scores, the online softmax, then the weighted V rows.
template <int W, int R> PKV_ALWAYS_INLINE void update_rows(const AttendTask &t, uint32_t r, uint32_t nv, uint64_t t0) {
  const uint32_t D = t.g->head_dim, group = t.group;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  AttendScratch &scratch = *t.scratch;
  float *p = scratch.scores.data(), *m = scratch.m.data(), *l = scratch.l.data();
  score_block<W, R>(t.q + size_t(r) * D, scratch.keys.data(), nv, D, p);
  float correction[R];
  bool live = false;
  for (int j = 0; j < R; j++) {
    float *pj = p + j * kTokenBlock;
    const TokenView &view = t.views[(r + j) / group];
    float block_max = neg_inf;
    if (t.softcap == 0.0f && !t.slopes && view.begin <= t0)
      block_max = scale_scores<W>(pj, nv, t.scale);
    else
      block_max = shape_scores<W>(pj, nv, t0, view, t.scale, t.softcap, t.slopes ? t.slopes[(r + j) % group] : 0.0f);
    if (view.mask_row && t0 + nv > view.mask_from) block_max = apply_mask(pj, nv, t0, view);
    if (block_max == neg_inf) { // nothing finite to weigh (the row's m may still be -inf)
      correction[j] = 1.0f;
      std::fill(pj, pj + nv, 0.0f);
      continue;
    }
    live = true;
    const float m_new = std::max(m[r + j], block_max);
    correction[j] = std::exp(m[r + j] - m_new); // 0 on the first visible block (m = -inf)
    l[r + j] = l[r + j] * correction[j] + weights<W>(pj, nv, m_new);
    m[r + j] = m_new;
  }
  if (live) accumulate<W, R>(&scratch.acc[size_t(r) * D], correction, p, scratch.values.data(), nv, D);
}

template <class Isa> PKV_ALWAYS_INLINE void attend(const AttendTask &task) {
  constexpr int W = Isa::W;
  const PoolGeometry &g = *task.g;
  // FP8 scales: K's multiplies every score (with the softmax scale), V's the output rows.
  AttendTask t = task;
  t.scale *= plane_scale(g, false, t.layer, t.kv_head);
  const float v_scale = plane_scale(g, true, t.layer, t.kv_head);
  const uint32_t D = g.head_dim, group = t.group, rows = t.tokens * group;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  AttendScratch &scratch = *t.scratch;
  std::vector<float> &acc = scratch.acc, &keys = scratch.keys, &values = scratch.values;
  std::vector<float> &m = scratch.m, &l = scratch.l, &scores = scratch.scores;
  acc.assign(size_t(rows) * D, 0.0f);
  keys.resize(size_t(kTokenBlock) * D);
  values.resize(size_t(kTokenBlock) * D);
  m.assign(rows, neg_inf);
  l.assign(rows, 0.0f);
  scores.resize(4 * kTokenBlock); // a row block of up to four rows

  // Positions in 64 bits: a range may end within a block of 2^32, where 32-bit ones would wrap.
  const uint64_t end = t.end;
  for (uint64_t t0 = t.begin; t0 < end; t0 += kTokenBlock) {
    const uint32_t n = uint32_t(std::min<uint64_t>(kTokenBlock, end - t0));
    decode_rows<Isa>(t, g.k, 0, t0, n, keys.data());
    decode_rows<Isa>(t, g.v, g.k.bytes, t0, n, values.data());
    // Row r sees the block's first seen(r) tokens: positions below its token's view's end.
    auto seen = [&](uint32_t r) {
      const uint64_t visible = t.views[r / group].end;
      return visible <= t0 ? 0 : uint32_t(std::min<uint64_t>(n, visible - t0));
    };
    // Rows in fours, else pairs, where all see as many tokens (rows see more the later their query
    // token, so the last one's count decides): each value row loaded serves them all.
    for (uint32_t r = 0; r < rows;) {
      const uint32_t nv = seen(r);
      const uint32_t R = r + 3 < rows && seen(r + 3) == nv ? 4 : r + 1 < rows && seen(r + 1) == nv ? 2 : 1;
      if (nv > 0 && R == 4) update_rows<W, 4>(t, r, nv, t0);
      else if (nv > 0 && R == 2) update_rows<W, 2>(t, r, nv, t0);
      else if (nv > 0) update_rows<W, 1>(t, r, nv, t0);
      r += R;
    }
  }
  for (uint32_t r = 0; r < rows; r++) {
    const float inv = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
    for (uint32_t d = 0; d < D; d++) t.out[size_t(r) * D + d] = acc[size_t(r) * D + d] * inv;
    t.lse[r] = l[r] > 0.0f ? m[r] + std::log(l[r]) : neg_inf;
  }
}

void attend_generic(const AttendTask &t) { attend<Generic>(t); }

#if defined(__x86_64__)
// The same code for wider vector units: the loops inlined here run W floats a vector and their
// multiply-adds fuse (this file builds with -ffp-contract=fast: it quantizes nothing).
PKV_AVX2 void attend_avx2(const AttendTask &t) { attend<Avx2>(t); }
PKV_AVX512 void attend_avx512(const AttendTask &t) { attend<Avx512>(t); }
#elif defined(__aarch64__)
// Generic's vectors with NEON's conversions of F16, BF16 and quantized rows.
void attend_neon(const AttendTask &t) { attend<Neon>(t); }
#endif

} // namespace

void load_queries(const PoolGeometry &g, pkv_format format, const void *q, uint64_t first, uint32_t tokens,
                  uint32_t q_heads, uint32_t kv_head, std::vector<float> &dst) {
  const uint32_t D = g.head_dim, group = q_heads / g.kv_heads;
  const size_t elem = io_elem_bytes(format);
  dst.resize(size_t(tokens) * group * D);
  for (uint32_t tok = 0; tok < tokens; tok++) {
    const uint64_t row = (first + tok) * q_heads + uint64_t(kv_head) * group;
    load_io(format, static_cast<const uint8_t *>(q) + row * D * elem, size_t(group) * D, &dst[size_t(tok) * group * D]);
  }
}

void add_sink(float *out, uint32_t D, float *lse, float sink) {
  const float top = std::max(*lse, sink);
  const float whole = top + std::log(std::exp(*lse - top) + std::exp(sink - top));
  const float keep = std::exp(*lse - whole); // 0 where the row saw nothing (lse -inf)
  for (uint32_t d = 0; d < D; d++) out[d] *= keep;
  *lse = whole;
}

AttendKernel attend_kernel(const char *want) {
  struct Variant {
    const char *env; // PKV_CPU_KERNEL's value for it
    AttendKernel kernel;
    bool runs; // on this processor
  };
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
#endif
  const Variant variants[] = { // widest first
#if defined(__x86_64__)
      {"avx512", {attend_avx512, "AVX-512"}, avx512},
      {"avx2", {attend_avx2, "AVX2 + FMA + F16C"}, avx2},
#elif defined(__aarch64__)
      {"neon", {attend_neon, "NEON"}, true},
#endif
      {"generic", {attend_generic, "generic"}, true},
  };
  for (const Variant &v : variants) {
    if (!(want && *want)) {
      if (v.runs) return v.kernel;
    } else if (std::strcmp(want, v.env) == 0) {
      return v.runs ? v.kernel : AttendKernel{nullptr, v.kernel.name};
    }
  }
  return {nullptr, nullptr};
}

const char *attend_kernel_names() {
#if defined(__x86_64__)
  return "avx512, avx2 or generic";
#elif defined(__aarch64__)
  return "neon or generic";
#else
  return "generic";
#endif
}

} // namespace pkv
