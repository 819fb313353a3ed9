// What the tile shapes share: the rows' layouts, how q and P enter the MMAs.
#pragma once

#include "stage_layout.cuh"

namespace pkv_mma {

// Float K: how q enters the score MMAs, unscaled: in one part where its format is the pages' own
// 16-bit format (exact), else split into SPLIT parts (split); the fp32 scores are multiplied by `mul`,
// the scale.
struct QParts {
  bool split;
  float mul;
};

// A warp's share of one stage, in one of the tile shapes (tile_wide.cuh, tile_narrow.cuh,
// tile_group.cuh). Each holds: ROWS query rows a tile; the output accumulators o (acc_row, acc_col:
// where each lies), the running max m and sum l of the thread's two rows (row_of_thread(lane, i),
// shared with the lanes differing in ROW_LANES); q_slot(r, k), where word k (of 8) of row r's 16
// values (float K) or 32 values (quantized K) lies among a lane's QW words of a k-step's q
// fragment; stage(), which adds 16 tokens. Their comments number a warp's tokens by MMA row; Tokens
// says which of the stage's tokens each is.

// What both tile shapes share: the page rows' layouts and the steps over q.
template <int D, uint32_t KF, uint32_t VF> struct TileBase {
  using Tok = Tokens<!quantized_format(KF) || !quantized_format(VF)>;
  using K = Row<KF, D, Tok::spread>;
  using V = Row<VF, D, Tok::spread>;
  // Float operands that are not page values (q, P) go to the MMA as hi + lo parts, f16 or bf16.
  static constexpr int SPLIT = 2;
  // P enters the MMA as f16 where V is quantized (its integers too) or F16, else bf16; in one part
  // where K and V are quantized (q's and K's rounding move the logits far more than P's 11 bits do),
  // else SPLIT.
  static constexpr bool P_F16 = quantized_format(VF) || VF == F16;
  static constexpr int P_PARTS = quantized_format(KF) && quantized_format(VF) ? 1 : SPLIT;
  enum : int { KSTEPS = D / 16, GROUPS = D / 32 }; // 16-wide k-steps, 32-value groups
  // The narrow tile's base moves lazily (online_softmax) where a page format is quantized; the wide
  // tile's always.
  static constexpr bool LAZY_MAX = quantized_format(KF) || quantized_format(VF);
  static constexpr bool Q_F16 = false; // q in the layouts above (Narrow's many n-tiles: one f16 part)
  // Group: the block's warps compute a stage together (barriers a round, shared bases) and hold
  // one output, which the combine takes from the first warp's place.
  static constexpr bool GROUPED = false;
  static constexpr int COMBINE_WARPS = WARPS;
  static constexpr uint32_t SCRATCH_BYTES = 16; // Group's static shared memory (none used elsewhere)
};

} // namespace pkv_mma
