// Which decode kernel the GPU backend runs for a pool and a number of query rows a KV head serves,
// with its launch shape and the planner's inputs for it (a DecodeConfig): the kernel family the
// policy and the pool's formats allow, the tensor-core kernel's tile, stages and blocks per
// multiprocessor as the device's shared memory and occupancy give them. Kernels are looked up once.
#pragma once

#include <cstdint>

#include "../backend.hpp"
#include "decode_policy.hpp"
#include "runtime.hpp"

namespace pkv {
namespace gpu {

class KernelChoice {
 public:
  // The modules of the generic, CUDA-core and tensor-core decode kernels and of the extend kernel
  // (the last two null where the runtime has none). Throws PKV_ERR_UNSUPPORTED where the policy asks
  // for a family the device lacks.
  KernelChoice(const Runtime &rt, const DecodePolicy &policy, Module generic, Module cuda_core, Module tensor_core,
               Module extend, uint32_t multiprocessors, unsigned warp);

  // The device must be current.
  DecodeConfig config(const PoolGeometry &g, uint32_t rows);
  // What a pool's plan buffer must hold: the most a plan of the planner's own choice has.
  PlanLimits plan_limits(const PoolGeometry &g);
  // The extend kernel (lib/kernels/extend_tensor_core.cu) for the pool with q in q_parts parts
  // (extend_q_parts), its shared memory set; null where there is none (HIP; F32 pages, FP8 beside
  // another format, float K with quantized V, head_dim other than 64, 128 or 256), its block does
  // not fit, or PKV_EXTEND_KERNEL=blocks. Looked up once.
  Function extend(const PoolGeometry &g, uint32_t q_parts);
  // Whether a call whose long entries make `tiles` tiles (of PKV_EXTEND_ROWS query rows, each KV
  // head's) runs them on the extend kernel: where they fill the device once (a tile attends over
  // its entry's whole context, while decode's blocks split long contexts over the device), or as
  // PKV_EXTEND_KERNEL=tiles always.
  bool extend_fills(uint64_t tiles) const;
  // q's 16-bit parts in the extend kernel: one where it is in the format of K's MMAs (F16, or BF16
  // for BF16 pages) or K is quantized (its widened values are rounded to f16 already), else two.
  static uint32_t extend_q_parts(const PoolGeometry &g, pkv_format q_format);

 private:
  // The tensor-core kernel's tiles of query rows: wide, narrow of 1, 2 or 4 n-tiles, or the group
  // tile (the warpgroup MMA of sm_90a) of 4.
  enum Tile : unsigned { kWide, kNarrow1, kNarrow2, kNarrow4, kGroup4, kTiles };
  struct Shape;

  KernelFamily family(const PoolGeometry &g);
  Function cuda_core_function(const PoolGeometry &g);
  Function tensor_core_function(const PoolGeometry &g, Tile tile);
  bool four_block_variant(const PoolGeometry &g) const;
  Function four_block_function(const std::string &name, unsigned bytes);
  unsigned stages(const PoolGeometry &g, Tile tile);
  bool tensor_core_fits(const PoolGeometry &g);
  bool fits_shared_memory(Function f, unsigned dynamic, const std::string &name);
  Shape shape(const PoolGeometry &g, uint32_t rows);
  bool group_tile(const PoolGeometry &g);
  uint32_t blocks_per_sm(const PoolGeometry &g, Shape shape);
  uint32_t workers(const PoolGeometry &g, uint32_t rows);
  uint32_t full_rate_workers(const PoolGeometry &g, uint32_t rows);

  const Runtime &rt_;
  DecodePolicy policy_;
  Module generic_, cuda_core_, tensor_core_, extend_;
  uint32_t sms_;
  unsigned warp_; // lanes a warp (wavefront) has
  KernelFamily best_; // the policy's family, or the best the device has
  bool group_tiles_;  // the image has the group tile's kernels (all or none)
  Function generic_functions_[8] = {}; // by head_dim / 32 - 1
  // Looked up once, by [head_dim / 128][K format][V format] (from F16: F16 to Q4_0 for the CUDA-core
  // kernel, to FP8_E5M2 for the tensor-core one); the tensor-core kernel's first by [Tile].
  static constexpr int kFormats = PKV_FORMAT_FP8_E5M2 - PKV_FORMAT_F16 + 1;
  Function cuda_core_functions_[3][4][4] = {}, tensor_core_functions_[kTiles][3][kFormats][kFormats] = {};
  uint8_t stages_[kTiles][3][kFormats][kFormats] = {}; // 0 until looked up, and where no block fits
  uint32_t blocks_per_sm_[2 * kTiles][3][kFormats][kFormats] = {}; // first by shape: tile + kTiles (mtiles - 1)
  // The extend kernel by [head_dim / 128][K format][V format][q parts - 1], once looked up.
  struct Looked {
    Function fn = nullptr;
    bool done = false;
  } extend_functions_[3][kFormats][kFormats][2];
};

} // namespace gpu
} // namespace pkv
