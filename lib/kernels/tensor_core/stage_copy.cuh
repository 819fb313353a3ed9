// Queuing a stage's rows from the pages into shared memory: cp.async pieces or bulk copies.
#pragma once

#include <stddef.h>

#include "ptx.cuh"
#include "stage_layout.cuh"

namespace pkv_mma {

// Where token t0 + r of a stage lies: the part of its page in the layer (the layer's first part
// when there is nothing to read: past the chunk, or a corrupted table entry) and its row there.
// Looked up once per token and stage, a stage ahead, so queuing a stage's copies waits on no load.
struct alignas(16) StageRow {
  const uint8_t *part;
  uint32_t row, read; // one of the values below
  // kNone: the row stays zero; kRow: the row is read; kEighth: the row and the rest of its eighth of
  // the stage, 8 rows of one page in order (one bulk copy).
  enum : uint32_t { kNone = 0, kRow = 1, kEighth = 3 };
  // One 16-byte shared-memory load (a copy of the struct takes two).
  __device__ static StageRow load(const StageRow *p) {
    const uint4 w = *reinterpret_cast<const uint4 *>(p);
    return {reinterpret_cast<const uint8_t *>(uint64_t(w.y) << 32 | w.x), w.z, w.w};
  }
};
static_assert(sizeof(StageRow) == 16 && offsetof(StageRow, row) == 8, "StageRow::load's layout");

// Queues NR rows of a stage from `first` on into shared memory, for each of PARTS parts of the same
// layout (K's rows, or V's: offset k_bytes into the block), NT threads (j: this one): TPR threads per
// row take its 16-byte pieces in turn, so a thread computes the addresses of its rows and issues all
// of its copies from them with constant offsets. A warp instruction reads whole 128-byte lines (TPR *
// 16 bytes of a row, or whole rows when shorter): the L2 serves a line as one request; half lines
// double the requests, and the L2 becomes the limit. Quantized rows' scales: copy_scales.
template <class R, int NT, int NR, int PARTS>
__device__ __forceinline__ void copy_rows(uint8_t *const (&dst)[PARTS], const uint64_t (&part_offset)[PARTS],
                                          const StageRow *rows, int first, int j) {
  constexpr int P = R::data / 16, TPR = P < 8 ? P : 8, STEP = NT / TPR, N = NR / STEP;
  static_assert(NT % TPR == 0 && NR % STEP == 0, "the threads cover whole rows");
  const int p0 = j % TPR;
  StageRow s[N]; // all loaded first: the copies then wait on no shared-memory load
#pragma unroll
  for (int i = 0; i < N; i++) s[i] = StageRow::load(&rows[first + j / TPR + STEP * i]);
#pragma unroll
  for (int i = 0; i < N; i++) {
    const uint8_t *src = s[i].part + uint64_t(s[i].row) * R::data + p0 * 16;
    const uint32_t d = R::of_token(first + j / TPR + STEP * i) + p0 * 16;
#pragma unroll
    for (int part = 0; part < PARTS; part++)
#pragma unroll
      for (int k = 0; k < P / TPR; k++)
        cp_async_zfill(dst[part] + d + TPR * 16 * k, src + part_offset[part] + TPR * 16 * k,
                       s[i].read != StageRow::kNone);
  }
}
// Queues a row's BYTES of scales to `dst` from the scales at `offset` in its page part.
template <uint32_t BYTES> __device__ __forceinline__ void copy_scales(uint8_t *dst, const StageRow *row, uint64_t offset) {
  const StageRow s = StageRow::load(row);
  cp_async_small_zfill<BYTES>(dst, s.part + offset + uint64_t(s.row) * BYTES, s.read != StageRow::kNone);
}

// Queues float row i of a stage with bulk copies completing on `bar`: an eighth of the stage read
// from one page is one copy, by its first row's thread; otherwise each row is (zeros when there is
// nothing to read). Every copying thread arrives once.
template <class R>
__device__ __forceinline__ void bulk_row(uint8_t *dst, const StageRow *rows, uint64_t part_offset, int i, uint64_t *bar) {
  const StageRow s = StageRow::load(&rows[i]);
  uint8_t *d = dst + R::of_token(i);
  if (s.read == StageRow::kEighth) {
    const bool mine = i % 8 == 0;
    mbar_arrive(bar, mine ? 8 * R::data : 0);
    if (mine) bulk_copy(d, s.part + part_offset + uint64_t(s.row) * R::data, 8 * R::data, bar);
  } else if (s.read != StageRow::kNone) {
    mbar_arrive(bar, R::data);
    bulk_copy(d, s.part + part_offset + uint64_t(s.row) * R::data, R::data, bar);
  } else {
#pragma unroll
    for (uint32_t b = 0; b < R::data; b += 16) *reinterpret_cast<uint4 *>(d + b) = make_uint4(0, 0, 0, 0);
    mbar_arrive(bar, 0);
  }
}

} // namespace pkv_mma
