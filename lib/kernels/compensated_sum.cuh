// Running sums of softmax weights beside a dominant one: a weight below 2^-24 of the sum drops out
// of a plain float sum, and a long tail of them moves lse and out (numerator and denominator lose
// differently). The decode kernels carry what each addition lost and take it back at the end.
#pragma once

namespace pkv_dev {

// sum = sum * scale + add, with `lost` the rounding loss carried from step to step (Kahan); the
// exact sum is sum - lost. Rounded step by step (no fused multiply-add), so that `lost` is exactly
// what the sum dropped.
__device__ inline void compensated_step(float &sum, float &lost, float scale, float add) {
  const float scaled = __fmul_rn(sum, scale), y = __fsub_rn(add, __fmul_rn(lost, scale));
  sum = __fadd_rn(scaled, y);
  lost = __fsub_rn(__fsub_rn(sum, scaled), y);
}

} // namespace pkv_dev
