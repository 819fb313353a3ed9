// The online softmax over a warp's tokens of a stage, in log2 units, and the reductions over lanes.
#pragma once

#include <math.h>

#include "../variants.cuh"
#include "common.cuh"

namespace pkv_mma {

// 2^x with results below 2^-126 flushed to zero (one MUFU instruction; exp2f adds three more a call to
// keep subnormal results, which no weight here needs).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax over a warp's 16 tokens of a stage, NE scores a thread: score e belongs to the
// thread's row row_of(e) (of NR) and to token token_of(e). MASK: hides what a row may not see (tokens
// past the chunk, past a speculative token's position or before its window, every token from a
// padding row) and applies the variants that change scores (RowLimits::score), and leaves
// the weights P = 2^(s - m) in s. LAZY: a row's base m moves only when a score passes it, to that
// stage's max (`reduce` takes the max over the lanes that share the row) plus kMaxSlack; else it is
// the running max, reduced every stage. The output is rescaled through rescale(correction) when a
// base moves. Weights stay at most 1 either way; lazily, most stages, whose scores stay under the
// base, take no reduction over the lanes (a serial chain of shuffles) and no exponential of a
// correction, only a vote before them (where a stage's time is its serial chain, as in the float
// narrow tile at one block a multiprocessor, that measured 1-2% slower than reducing every stage).
constexpr float kMaxSlack = 1.0f; // log2 units

// What a thread's NR query rows see: the positions below visible[i] (counted from the plan's start)
// less what a tree mask hides (the record's rows from `tree`, null: causal; a row's token is
// visible[i] - first_visible), and what changes their scores (variants.cuh; log2 units): each row's
// ALiBi slope, the call's window and soft cap.
template <int NR> struct RowLimits {
  uint32_t visible[NR];
  float slope[NR];
  ScoreVariants vary;
  const uint8_t *tree;
  uint32_t tree_stride, first_visible, start, new_begin;

  // Score s of token t for row i, -inf where the row does not see t.
  __device__ __forceinline__ float score(int i, uint32_t t, uint32_t token_end, float s) const {
    if (!(t < token_end && t < visible[i])) return -INFINITY;
    if (tree && tree_hides(tree + uint64_t(visible[i] - first_visible) * tree_stride, new_begin, start + t))
      return -INFINITY;
    return vary.on ? vary_score(s, t, visible[i], slope[i], vary) : s;
  }
};

template <bool MASK, bool LAZY, int NE, int NR, class RowOf, class TokenOf, class Reduce, class Rescale>
__device__ __forceinline__ void online_softmax(float (&s)[NE], float (&m)[NR], float (&l)[NR], const RowLimits<NR> &limits,
                                               uint32_t token_end, RowOf row_of, TokenOf token_of, Reduce reduce,
                                               Rescale rescale) {
  float tile_max[NR];
  bool passed = false, moved = false;
#pragma unroll
  for (int i = 0; i < NR; i++) tile_max[i] = -INFINITY;
#pragma unroll
  for (int e = 0; e < NE; e++) {
    if (MASK) s[e] = limits.score(row_of(e), token_of(e), token_end, s[e]);
    tile_max[row_of(e)] = fmaxf(tile_max[row_of(e)], s[e]);
  }
#pragma unroll
  for (int i = 0; i < NR; i++) passed |= tile_max[i] > m[i];
  if (!LAZY || __any_sync(0xffffffffu, passed)) {
    float correction[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) {
      const float top = reduce(tile_max[i]), m_new = top > m[i] ? top + (LAZY ? kMaxSlack : 0.0f) : m[i];
      // 1 where the base stays (a row that has seen nothing, a padding row of the tile, too).
      correction[i] = m_new == m[i] ? 1.0f : exp2_ftz(m[i] - m_new);
      moved |= correction[i] != 1.0f;
      m[i] = m_new;
      l[i] *= correction[i];
    }
    if (LAZY || __any_sync(0xffffffffu, moved)) rescale(correction);
  }
#pragma unroll
  for (int e = 0; e < NE; e++) {
    s[e] = exp2_ftz(s[e] - (m[row_of(e)] == -INFINITY ? 0.0f : m[row_of(e)])); // nothing seen yet: weights 0
    l[row_of(e)] += s[e];
  }
}

// The max (or sum) of x over the lanes whose lane bits outside `MASK` agree.
template <int MASK> __device__ __forceinline__ float lanes_max(float x) {
#pragma unroll
  for (int b = 1; b < 32; b *= 2)
    if (MASK & b) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, b));
  return x;
}
template <int MASK> __device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int b = 1; b < 32; b *= 2)
    if (MASK & b) x += __shfl_xor_sync(0xffffffffu, x, b);
  return x;
}

} // namespace pkv_mma
