// The few things the kernel sources say differently for nvcc (CUDA) and hipcc (HIP, AMD GPUs); the
// kernels themselves are one source for both (docs/hip.md).
//
// Warps: the kernels are written for a logical warp of 32 lanes (lane = threadIdx.x % 32, shuffles
// of width 32 or less). AMD GPUs run wavefronts of 64 lanes (gfx9, CDNA) or 32 (gfx10 and later):
// a shuffle of width w exchanges values only inside aligned groups of w lanes, so a 64-lane
// wavefront simply holds two logical warps that never read each other's lanes, and no kernel
// depends on the hardware width. The host still asks the runtime for it (the wavefront size exists
// in device code only) to shape blocks as whole wavefronts.
#pragma once

#include <stdint.h>

#if defined(__HIPCC__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace pkv_dev {

// x from lane (lane ^ mask) inside its aligned group of `width` lanes (a power of two, at most 32);
// every lane of the group takes part.
__device__ __forceinline__ float shfl_xor(float x, int mask, int width = 32) {
#if defined(__HIPCC__)
  return __shfl_xor(x, mask, width); // ROCm's *_sync variants want a 64-bit mask, and 5.x has none
#else
  return __shfl_xor_sync(0xffffffffu, x, mask, width);
#endif
}

// Round to nearest even, as lib/format.cpp's f32_to_bf16; ROCm 5 has no bf16 conversion intrinsics,
// so HIP does it on the bits (a NaN stays a quiet NaN, as on the CPU).
__device__ __forceinline__ uint16_t float_to_bf16(float x) {
#if defined(__HIPCC__)
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#endif
}

// A 16-byte read that need not stay in the caches (the bandwidth measurement streams through a
// buffer far larger than them); HIP has no such hint for vector structs, and a plain load does.
__device__ __forceinline__ uint4 load_streaming(const uint4 *p) {
#if defined(__HIPCC__)
  return *p;
#else
  return __ldcs(p);
#endif
}

// Copies global memory into shared memory, `bytes` = 16, 8 or 4 (aligned to that). On CUDA they are
// cp.async copies in flight until a cp_async_wait<N> leaves at most N committed groups pending; on
// HIP plain loads and stores that are complete at once, so committing and waiting are no-ops (the
// kernels' __syncthreads() after each wait still orders them between threads).
__device__ __forceinline__ void cp_async(void *smem, const void *global, int bytes) {
#if defined(__HIPCC__)
  if (bytes == 16)
    *static_cast<uint4 *>(smem) = *static_cast<const uint4 *>(global);
  else if (bytes == 8)
    *static_cast<uint2 *>(smem) = *static_cast<const uint2 *>(global);
  else
    *static_cast<uint32_t *>(smem) = *static_cast<const uint32_t *>(global);
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(global));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(global));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if !defined(__HIPCC__)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N> __device__ __forceinline__ void cp_async_wait() {
#if !defined(__HIPCC__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

} // namespace pkv_dev
