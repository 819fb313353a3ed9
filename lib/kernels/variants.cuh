// The attention variants (pagedkv.h, section 7a) and an extend's tree masks on the device, shared by
// the decode kernels. Each
// kernel keeps its scores in its own units, natural or log2 (scale * log2 e already applied): `unit`
// (1 or kLog2e) turns the natural-log quantities of the call into them. Positions are those of a
// query row's context counted from the plan's start, so distances are what the call's are.
#pragma once

#include <math.h>

#include "device_format.cuh"

namespace pkv_dev {

// What the variants do to a row's scores: the soft cap (in the kernel's units; 0: none) and its
// inverse, the window; `change` where the cap or ALiBi slopes change scores, `on` where the window
// may hide some too.
struct ScoreVariants {
  float cap, inv_cap;
  uint32_t window;
  bool change, on;
};

__device__ __forceinline__ ScoreVariants score_variants(const PkvDecodeParams &p, float unit) {
  const float cap = p.softcap * unit;
  return {cap, cap > 0.0f ? 1.0f / cap : 0.0f, p.window, p.transform != 0, p.transform != 0 || p.window != 0};
}

// Query head qh's ALiBi slope, 0 without slopes, and its sink logit, -inf without sinks (kernel units).
__device__ __forceinline__ float row_slope(const PkvDecodeParams &p, uint32_t qh, float unit) {
  return p.slopes ? reinterpret_cast<const float *>(p.slopes)[qh] * unit : 0.0f;
}
__device__ __forceinline__ float row_sink(const PkvDecodeParams &p, uint32_t qh, float unit) {
  return p.sinks ? reinterpret_cast<const float *>(p.sinks)[qh] * unit : -INFINITY;
}

// A score s soft-capped (cap > 0) and biased by the slope times its distance from the query. tanh by
// its exponential form, 1 - 2 / (e^2x + 1) on |x| (two fast special-function instructions): its
// error is ~1e-7 absolute, ~5e-6 of a logit under a cap of 50, where tanh.approx's (2^-11 relative)
// would be 0.025; past |x| = 9, tanh is 1 in float.
__device__ __forceinline__ float change_score(float s, uint32_t distance, float slope, const ScoreVariants &v) {
  if (v.cap > 0.0f) {
    const float x = fminf(fabsf(s) * v.inv_cap, 9.0f);
    s = copysignf(v.cap * (1.0f - __fdividef(2.0f, __expf(2.0f * x) + 1.0f)), s);
  }
  return s - slope * float(distance);
}

// The score s of position t for a row that sees the positions below `visible` (t among them): -inf
// where the window hides t, else as change_score makes it.
__device__ __forceinline__ float vary_score(float s, uint32_t t, uint32_t visible, float slope, const ScoreVariants &v) {
  const uint32_t distance = visible - 1 - t;
  if (v.window && distance >= v.window) return -INFINITY;
  return v.change ? change_score(s, distance, slope, v) : s;
}

// An extend's tree mask (PkvRecord.mask): query token `tok`'s row of bits, null where the record is
// causal; whether that row hides the sequence's position `at`: a new token whose bit is clear.
__device__ __forceinline__ const uint8_t *tree_row(const PkvDecodeParams &p, const PkvRecord &c, uint32_t tok) {
  return c.mask_stride ? reinterpret_cast<const uint8_t *>(p.mask) + c.mask + uint64_t(tok) * c.mask_stride : nullptr;
}
__device__ __forceinline__ bool tree_hides(const uint8_t *row, uint32_t new_begin, uint32_t at) {
  if (!row || at < new_begin) return false;
  const uint32_t j = at - new_begin;
  return !(row[j >> 3] >> (j & 7) & 1u);
}

// Joins a sink logit (kernel units, -inf: none) to a row's softmax, given as its base `top` and the sum
// of its weights relative to it, once a row: the sink adds to the sum and no value. Returns what the
// weights already taken must be multiplied by (the base may rise).
template <bool LOG2> __device__ __forceinline__ float join_sink(float &top, float &sum, float sink) {
  if (sink == -INFINITY) return 1.0f;
  const float base = fmaxf(top, sink);
  const float rescale = top == -INFINITY ? 0.0f : LOG2 ? exp2f(top - base) : expf(top - base);
  sum = sum * rescale + (LOG2 ? exp2f(sink - base) : expf(sink - base));
  top = base;
  return rescale;
}

} // namespace pkv_dev
