#include "cpu_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "format.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

// GCC or Clang: the vector extension, and on x86-64 target attributes for the AVX2 variant.
#define PKV_ALWAYS_INLINE inline __attribute__((always_inline))

namespace pkv {

namespace {

constexpr uint32_t kTokenBlock = 32; // tokens whose scores are taken before one softmax rescale

// W floats as one vector (GCC's and Clang's vector extension): 4 for SSE or NEON registers, 8 for
// AVX ones (vectors wider than the registers made slower code than the plain loops had).
template <int W> struct Lanes {
  typedef float type __attribute__((vector_size(4 * W)));
};
template <int W> using Floats = typename Lanes<W>::type;

template <int W> PKV_ALWAYS_INLINE Floats<W> load(const float *p) {
  Floats<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W> PKV_ALWAYS_INLINE void store(float *p, Floats<W> v) { std::memcpy(p, &v, sizeof v); }

// Two vectors of partial sums (two dependency chains), added lane by lane at the end; head_dim is a
// multiple of 32. (Written out: the compiler does not reorder a float sum into vector lanes itself.)
template <int W> PKV_ALWAYS_INLINE float dot(const float *a, const float *b, uint32_t n) {
  Floats<W> s0 = {}, s1 = {};
  for (const float *end = a + n; a < end; a += 2 * W, b += 2 * W) {
    s0 += load<W>(a) * load<W>(b);
    s1 += load<W>(a + W) * load<W>(b + W);
  }
  const Floats<W> s = s0 + s1;
  float sum = 0.0f;
  for (int j = 0; j < W; j++) sum += s[j];
  return sum;
}

// acc = acc * correction + the sum of w[i] v_i over n rows v_i of D values (D apart): 4 W values of
// acc at a time, held in registers over all the rows.
template <int W>
PKV_ALWAYS_INLINE void accumulate(float *acc, float correction, const float *w, const float *v, uint32_t n,
                                  uint32_t D) {
  for (uint32_t d = 0; d < D; d += 4 * W) {
    Floats<W> a[4];
    for (int k = 0; k < 4; k++) a[k] = load<W>(acc + d + k * W) * correction;
    const float *row = v + d;
    for (uint32_t i = 0; i < n; i++, row += D)
      for (int k = 0; k < 4; k++) a[k] += w[i] * load<W>(row + k * W);
    for (int k = 0; k < 4; k++) store<W>(acc + d + k * W, a[k]);
  }
}

// How a variant reads one page row into floats (decode_row's signature).
using RowDecoder = void (*)(const PlaneLayout &, const uint8_t *, uint32_t, uint32_t, float *);

// W: floats a vector; Decode: the page rows' conversion.
template <int W, RowDecoder Decode> PKV_ALWAYS_INLINE void attend(const ChunkTask &t) {
  const PoolGeometry &g = *t.g;
  const DecodeBatch &b = *t.b;
  const uint32_t D = g.head_dim, group = b.q_heads / g.kv_heads, s = t.chunk->seq, rows = b.q_tokens * group;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  AttendScratch &scratch = *t.scratch;
  std::vector<float> &q = scratch.q, &acc = scratch.acc, &keys = scratch.keys, &values = scratch.values;
  std::vector<float> &m = scratch.m, &l = scratch.l, &scores = scratch.scores;
  q.resize(size_t(rows) * D);
  acc.assign(size_t(rows) * D, 0.0f);
  keys.resize(size_t(kTokenBlock) * D);
  values.resize(size_t(kTokenBlock) * D);
  m.assign(rows, neg_inf);
  l.assign(rows, 0.0f);
  scores.resize(kTokenBlock);

  const size_t q_elem = io_elem_bytes(b.q_format);
  for (uint32_t tok = 0; tok < b.q_tokens; tok++) {
    const size_t first = (size_t(s) * b.q_tokens + tok) * b.q_heads + size_t(t.kv_head) * group;
    load_io(b.q_format, static_cast<const uint8_t *>(b.q) + first * D * q_elem, size_t(group) * D,
            &q[size_t(tok) * group * D]);
  }

  const uint32_t *pages = reinterpret_cast<const uint32_t *>(host(g.table)) + size_t(b.seq_slots[s]) * g.table_stride;
  for (uint32_t t0 = t.chunk->token_begin; t0 < t.chunk->token_end; t0 += kTokenBlock) {
    const uint32_t n = std::min(kTokenBlock, t.chunk->token_end - t0);
    for (uint32_t i = 0; i < n; i++) {
      const uint32_t page = pages[(t0 + i) / g.page_size], slot = (t0 + i) % g.page_size;
      Decode(g.k, host(g.k_part(b.layer, page)), t.kv_head, slot, &keys[size_t(i) * D]);
      Decode(g.v, host(g.v_part(b.layer, page)), t.kv_head, slot, &values[size_t(i) * D]);
    }
    for (uint32_t r = 0; r < rows; r++) {
      // The row sees the block's first nv tokens: positions below length - q_tokens + its token + 1.
      const uint32_t visible = b.lengths[s] - b.q_tokens + r / group + 1;
      if (visible <= t0) continue;
      const uint32_t nv = std::min(n, visible - t0);
      float *p = scores.data();
      float block_max = neg_inf;
      for (uint32_t i = 0; i < nv; i++) {
        p[i] = b.scale * dot<W>(&q[size_t(r) * D], &keys[size_t(i) * D], D);
        block_max = std::max(block_max, p[i]);
      }
      if (block_max == neg_inf) continue;
      const float m_new = std::max(m[r], block_max);
      const float correction = std::exp(m[r] - m_new); // 0 on the first visible block (m = -inf)
      float sum = 0.0f;
      for (uint32_t i = 0; i < nv; i++) sum += p[i] = std::exp(p[i] - m_new);
      l[r] = l[r] * correction + sum;
      accumulate<W>(&acc[size_t(r) * D], correction, p, values.data(), nv, D);
      m[r] = m_new;
    }
  }
  for (uint32_t r = 0; r < rows; r++) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (uint32_t d = 0; d < D; d++) t.out[size_t(r) * D + d] = acc[size_t(r) * D + d] * inv;
    t.lse[r] = l[r] > 0.0f ? m[r] + std::log(l[r]) : neg_inf;
  }
}

void attend_generic(const ChunkTask &t) { attend<4, decode_row>(t); }

#if defined(__x86_64__)
// F16 rows through F16C, 8 values an instruction (exact, as f16_to_f32's ten or so: F16 rows 3-15%
// faster, docs/perf/2026-12-04-cpu-f16c.md); other formats as decode_row.
__attribute__((target("avx2,fma,f16c"))) void decode_row_f16c(const PlaneLayout &l, const uint8_t *part, uint32_t head,
                                                               uint32_t slot, float *dst) {
  if (l.format != PKV_FORMAT_F16) return decode_row(l, part, head, slot, dst);
  const uint8_t *src = part + l.data_at(head, slot);
  for (uint32_t i = 0; i < l.head_dim; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + 2 * i))));
}

// The same code for AVX2, FMA and F16C: the loops inlined here run 8 floats a vector and their
// multiply-adds fuse (this file builds with -ffp-contract=fast: it quantizes nothing).
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const ChunkTask &t) { attend<8, decode_row_f16c>(t); }

bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

} // namespace

AttendKernel attend_kernel(const char *want) {
  const bool generic = want && std::strcmp(want, "generic") == 0;
  if (want && *want && !generic) return {nullptr, nullptr};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c())
    return {attend_avx2, "AVX2 + FMA + F16C"};
#endif
  return {attend_generic, "generic"};
}

} // namespace pkv
