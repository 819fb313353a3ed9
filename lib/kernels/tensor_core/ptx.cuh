// The tensor-core decode's instructions, as inline PTX: asynchronous copies (cp.async, sm_90's
// bulk copies and their mbarriers), the merge counter's atomic, matrix loads and the MMAs.
#pragma once

#include "common.cuh"

namespace pkv_mma {

__device__ __forceinline__ void cp_async_zfill(void *smem, const void *global, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global), "r"(src_bytes));
}
template <int BYTES> __device__ __forceinline__ void cp_async_small_zfill(void *smem, const void *global, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? BYTES : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(global), "n"(BYTES), "r"(src_bytes));
}
// Bulk copies (sm_90): one instruction moves a whole row into shared memory and completes on an
// mbarrier, which counts the bytes it expects. They need fewer L2 requests than 16-byte cp.async
// pieces: float head_dim 128 5-8% faster on the H200, 256 0-5% (docs/perf/decisions.md).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkCopies = true;
#else
constexpr bool kBulkCopies = false;
#endif
// [[maybe_unused]]: GPUs before sm_90 compile none of their callers.
#define PKV_BULK_HELPER [[maybe_unused]] __device__ __forceinline__
PKV_BULK_HELPER unsigned smem_addr(const void *p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
PKV_BULK_HELPER void mbar_init(uint64_t *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
PKV_BULK_HELPER void mbar_arrive(uint64_t *bar, unsigned tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(tx_bytes)
               : "memory");
}
PKV_BULK_HELPER void mbar_wait(uint64_t *bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
}
// Orders this thread's shared-memory writes before later bulk copies into the same bytes.
PKV_BULK_HELPER void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
PKV_BULK_HELPER void bulk_copy(void *smem, const void *global, unsigned bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(global), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
#undef PKV_BULK_HELPER
// The old value; the add releases this thread's earlier writes (and those a barrier ordered before
// it) to the GPU and acquires what other blocks released with theirs.
__device__ __forceinline__ uint32_t atomic_add_acq_rel(uint32_t *p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// N (2 or 4) 8x8 matrices of 16-bit values, lanes 8i .. 8i + 7 giving the rows of matrix i: lane
// (g, t) receives row g, columns 2t, 2t + 1 of each, or with TRANS rows 2t, 2t + 1 of column g.
template <int N, bool TRANS> __device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void *smem) {
  static_assert(N == 2 || N == 4, "two or four matrices");
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (N == 4 && TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else if constexpr (N == 4)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// The transpose of an 8x8 matrix of 16-bit pairs held as one fragment (lane (g, t): row g, columns
// 2t, 2t + 1).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// d += a b for one 16x8 tile, 16-bit float inputs (f16 when F16, else bf16).
template <bool F16> __device__ __forceinline__ void mma16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (F16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = c + a b for one 16x8 tile of int8 inputs, k = 32.
__device__ __forceinline__ void mma_s8(int d[4], const uint32_t a[4], uint32_t b0, uint32_t b1, const int c[4]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%10,%11,%12,%13};\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]),
                 "r"(c[3]));
}

} // namespace pkv_mma
