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
// padding row); either way the cap and ALiBi change the scores where set (RowLimits); it leaves
// the weights P = 2^(s - m) in s. LAZY: a row's base m moves only when a score passes it, to that
// stage's max (`reduce` takes the max over the lanes that share the row) plus kMaxSlack; else it is
// the running max, reduced every stage. The output is rescaled through rescale(correction) when a
// base moves. Weights stay at most 1 either way; lazily, most stages, whose scores stay under the
// base, take no reduction over the lanes (a serial chain of shuffles) and no exponential of a
// correction, only a vote before them (where a stage's time is its serial chain, as in the float
// narrow tile at one block a multiprocessor, that measured 1-2% slower than reducing every stage).
constexpr float kMaxSlack = 1.0f; // log2 units

// What the query rows of a block's work item share, kept in shared memory so that it holds none of
// a thread's registers: the variants (variants.cuh; log2 units) and the record's tree mask (`tree`
// null: causal; a row's token is its visible count less first_visible).
struct ItemLimits {
  ScoreVariants vary;
  const uint8_t *tree;
  uint32_t tree_stride, first_visible, start, new_begin;
};

// What a thread's NR query rows see: the positions below visible[i] (counted from the plan's start)
// less what the item's tree mask hides, and what changes their scores: each row's ALiBi slope and
// the item's variants.
template <int NR> struct RowLimits {
  uint32_t visible[NR];
  float slope[NR];
  const ItemLimits &item;

  // Score s of token t for row i, -inf where the row does not see t.
  __device__ __forceinline__ float score(int i, uint32_t t, uint32_t token_end, float s) const {
    if (!(t < token_end && t < visible[i])) return -INFINITY;
    if (item.tree &&
        tree_hides(item.tree + uint64_t(visible[i] - item.first_visible) * item.tree_stride, item.new_begin, item.start + t))
      return -INFINITY;
    return item.vary.on ? vary_score(s, t, visible[i], slope[i], item.vary) : s;
  }
  // Score s of token t for row i where the row sees t (an unmasked round), the cap and ALiBi applied.
  __device__ __forceinline__ float change(int i, uint32_t t, float s) const {
    return change_score(s, visible[i] - 1 - t, slope[i], item.vary);
  }
};

template <bool MASK, bool LAZY, int NE, int NR, class RowOf, class TokenOf, class Reduce, class Rescale>
__device__ __forceinline__ void online_softmax(float (&s)[NE], float (&m)[NR], float (&l)[NR], const RowLimits<NR> &limits,
                                               uint32_t token_end, RowOf row_of, TokenOf token_of, Reduce reduce,
                                               Rescale rescale) {
  float tile_max[NR];
  bool passed = false, moved = false;
  if (!MASK && limits.item.vary.change) // one uniform test a stage
#pragma unroll
    for (int e = 0; e < NE; e++) s[e] = limits.change(row_of(e), token_of(e), s[e]);
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
