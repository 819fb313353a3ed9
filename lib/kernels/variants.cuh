// The attention variants (pagedkv.h, section 7a) and an extend's tree masks on the device, shared by
// the decode kernels. Each
// kernel keeps its scores in its own units, natural or log2 (scale * log2 e already applied): `unit`
// (1 or kLog2e) turns the natural-log quantities of the call into them. Positions are those of a
// query row's context counted from the plan's start, so distances are what the call's are.
#pragma once

#include <math.h>

#include "device_format.cuh"

namespace pkv_dev {

// What changes every score of a row: the soft cap (in the kernel's units), the window and the row's
// ALiBi slope (in the kernel's units per position); `on` where any does.
struct ScoreVariants {
  float cap;
  uint32_t window;
  bool on;
};

__device__ __forceinline__ ScoreVariants score_variants(const PkvDecodeParams &p, float unit) {
  return {p.softcap * unit, p.window, p.transform != 0};
}

// Query head qh's ALiBi slope, 0 without slopes, and its sink logit, -inf without sinks (kernel units).
__device__ __forceinline__ float row_slope(const PkvDecodeParams &p, uint32_t qh, float unit) {
  return p.slopes ? reinterpret_cast<const float *>(p.slopes)[qh] * unit : 0.0f;
}
__device__ __forceinline__ float row_sink(const PkvDecodeParams &p, uint32_t qh, float unit) {
  return p.sinks ? reinterpret_cast<const float *>(p.sinks)[qh] * unit : -INFINITY;
}

// The score s of position t for a row that sees the positions below `visible` (t among them): -inf
// where the window hides t, else soft-capped (tanhf: the cap's tanh keeps float precision) and
// biased by the slope times the distance.
__device__ __forceinline__ float vary_score(float s, uint32_t t, uint32_t visible, float slope, const ScoreVariants &v) {
  const uint32_t distance = visible - 1 - t;
  if (v.window && distance >= v.window) return -INFINITY;
  if (v.cap > 0.0f) s = v.cap * tanhf(s / v.cap);
  return s - slope * float(distance);
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
