#include "kernel_choice.hpp"

#include <algorithm>
#include <string>

#include "../kernels/kernel_params.h"
#include "../format.hpp"
#include "../plan.hpp"
#include "gpu_backend.hpp"

namespace pkv {
namespace gpu {

namespace {

constexpr unsigned kCudaCoreSharedLimit = 48 * 1024; // what a block gets without opting in
constexpr uint64_t kTensorCoreBytesInFlight = 64 * 1024; // per multiprocessor, to keep pace with its share of the bandwidth

uint64_t align16(uint64_t n) { return (n + 15) & ~uint64_t(15); }

bool float_pages(const PoolGeometry &g) { return !is_quantized(g.k.format) && !is_quantized(g.v.format); }
bool fp8_pages(const PoolGeometry &g) { return is_fp8(g.k.format) && is_fp8(g.v.format); }
bool sixteen_bit_pages(const PoolGeometry &g) { return float_pages(g) && !is_fp8(g.k.format) && !is_fp8(g.v.format); }

// The tensor-core kernel's shared memory, as decode_tensor_core.cu's Mma<> lays it out (it checks the
// kernel_params.h sizes at compile time): `stages` stages of PKV_MMA_WARPS x PKV_MMA_TOKENS K and V
// rows, for FP8 pages one stage of them widened to F16, q fragments of each row tile, and the warps'
// combine area of each row tile (which reuses the others once a chunk is done).
unsigned stage_bytes(const PoolGeometry &g) {
  auto part = [&](const PlaneLayout &l) {
    return pkv_mma_part_bytes(uint32_t(l.row_data_bytes + l.row_scale_bytes), is_quantized(l.format));
  };
  return part(g.k) + part(g.v);
}

} // namespace

static_assert(kGpuChunkTokens == PKV_MMA_WARPS * PKV_MMA_TOKENS, "a block's stage");

// The query rows one block of the tensor-core kernel serves: a narrow tile (PKV_MMA_NARROW_ROWS)
// when a KV head's rows fit one; where K and V are quantized (head_dim 64 and 128), a narrow tile of
// 2 or 4 n-tiles (16 or 32 rows), which converts each K and V fragment once for all of them; else
// one or two wide tiles (PKV_MMA_ROWS each, PKV_MMA_WARPS warps each): two when a KV head has more
// rows than one, so the stages serve them all.
struct KernelChoice::Shape {
  Tile tile;
  unsigned mtiles; // wide row tiles a block; 1 for narrow tiles
  bool narrow() const { return tile != kWide; }
  unsigned rows() const {
    if (tile == kGroup4) return 4 * PKV_MMA_NARROW_ROWS;
    return narrow() ? PKV_MMA_NARROW_ROWS << (tile - kNarrow1) : PKV_MMA_ROWS * mtiles;
  }
  unsigned shared_bytes(const PoolGeometry &g, unsigned stages) const {
    const unsigned D = g.head_dim, tile_rows = rows() / mtiles;
    const unsigned q = pkv_mma_q_bytes(D, tile_rows, is_quantized(g.k.format), tile > kNarrow1);
    const unsigned outputs = tile == kGroup4 ? 1 : PKV_MMA_WARPS;
    return std::max(stages * stage_bytes(g) + pkv_mma_widened_bytes(D, fp8_pages(g)) + mtiles * q,
                    mtiles * pkv_mma_combine_bytes(D, tile_rows, outputs));
  }
};

KernelChoice::KernelChoice(const Runtime &rt, const DecodePolicy &policy, Module generic, Module cuda_core,
                           Module tensor_core, Module extend, uint32_t multiprocessors, unsigned warp)
    : rt_(rt), policy_(policy), generic_(generic), cuda_core_(cuda_core), tensor_core_(tensor_core), extend_(extend),
      sms_(multiprocessors), warp_(warp) {
  if (!policy.tensor_core_switch.empty() && !tensor_core)
    fail(PKV_ERR_UNSUPPORTED, "%s: the tensor-core decode kernels are CUDA-only; the %s backend has the CUDA-core "
         "and generic ones", policy.tensor_core_switch.c_str(), rt.dev->name());
  best_ = policy.family_set ? policy.family : tensor_core ? KernelFamily::tensor_core : KernelFamily::cuda_core;
  // The image lacks the group tile's kernels where it has no sm_90a code; any other failure to look
  // one up is the device's, and reported.
  group_tiles_ = false;
  if (policy.tiles == TileSet::all && tensor_core) {
    Function group = nullptr;
    const Call c = rt.dev->function(&group, tensor_core, "pkv_decode_mmag_128_5_5_3");
    if (c.result != kNotFound) rt.check(c, " pkv_decode_mmag_128_5_5_3");
    group_tiles_ = c.result == kSuccess;
  }
  for (int nv = 1; nv <= 8; nv++)
    generic_functions_[nv - 1] = rt.function(generic, ("pkv_decode_partial_" + std::to_string(nv)).c_str());
}

// The tensor-core kernel serves where the device's shared memory per block holds it for the pool
// (not head_dim 256 on sm_86/sm_89's 99 KB); the CUDA-core kernel serves there instead. Both need
// F16/BF16/Q8_0/Q4_0 pages of head_dim 64, 128 or 256; the tensor-core kernel FP8 K and V pages
// too. The generic kernel serves the rest (F32 pages, FP8 with another format).
KernelFamily KernelChoice::family(const PoolGeometry &g) {
  const uint32_t D = g.head_dim;
  auto specialised = [](pkv_format f) { return f != PKV_FORMAT_F32 && !is_fp8(f); };
  const bool fp8 = fp8_pages(g);
  if (!((D == 64 || D == 128 || D == 256) && ((specialised(g.k.format) && specialised(g.v.format)) || fp8)))
    return KernelFamily::generic;
  const KernelFamily f = best_ == KernelFamily::tensor_core && !tensor_core_fits(g) ? KernelFamily::cuda_core : best_;
  return fp8 && f != KernelFamily::tensor_core ? KernelFamily::generic : f;
}

Function KernelChoice::cuda_core_function(const PoolGeometry &g) {
  Function &fn = cuda_core_functions_[g.head_dim / 128][g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16];
  if (!fn)
    fn = rt_.function(cuda_core_, ("pkv_decode_cuda_core_" + std::to_string(g.head_dim) + "_" +
                                   std::to_string(int(g.k.format)) + "_" + std::to_string(int(g.v.format))).c_str());
  return fn;
}

// The tensor-core kernel of a tile kind for the pool, looked up once: the most stages whose largest
// block (two wide row tiles, one narrow) fits the device's shared memory, pkv_mma_stages, else
// pkv_mma_fewer_stages; none when neither fits. Kept only once every call for it succeeded, so a
// failed one is made again by the next call, not taken for a kernel that does not fit.
Function KernelChoice::tensor_core_function(const PoolGeometry &g, Tile tile) {
  const unsigned d = g.head_dim / 128, kf = g.k.format - PKV_FORMAT_F16, vf = g.v.format - PKV_FORMAT_F16;
  Function &kept = tensor_core_functions_[tile][d][kf][vf];
  if (kept) return kept;
  Function fn = nullptr;
  uint8_t fitting = 0;
  const std::string formats =
      std::to_string(g.head_dim) + "_" + std::to_string(int(g.k.format)) + "_" + std::to_string(int(g.v.format));
  const Shape largest{tile, tile != kWide ? 1u : 2u};
  static const char *const prefix[kTiles] = {"pkv_decode_mma16_", "pkv_decode_mma8_", "pkv_decode_mma8x2_",
                                             "pkv_decode_mma8x4_", "pkv_decode_mmag_"};
  for (uint32_t stages : {pkv_mma_stages(g.head_dim, fp8_pages(g)), pkv_mma_fewer_stages(g.head_dim, sixteen_bit_pages(g))}) {
    if (!stages) break;
    const std::string name = prefix[tile] + formats + "_" + std::to_string(stages);
    fn = rt_.function(tensor_core_, name.c_str());
    const unsigned bytes = largest.shared_bytes(g, stages);
    if (fits_shared_memory(fn, bytes, name)) {
      rt_.check(rt_.dev->tensor_cores()->set_shared_limit(fn, int(bytes)), (" " + name).c_str());
      fitting = uint8_t(stages);
      if (tile == kNarrow1 && stages == 3 && four_block_variant(g))
        if (Function four = four_block_function(name + "_4blocks", bytes)) fn = four;
      break;
    }
  }
  stages_[tile][d][kf][vf] = fitting;
  kept = fn;
  return fn;
}

// The narrow head_dim 128 kernels with quantized K and Q4_0 V come in a four-block variant too (128
// registers): bound by instruction issue, they gain from the fourth block's warps, and the planner
// fills them (docs/perf/decisions.md).
bool KernelChoice::four_block_variant(const PoolGeometry &g) const {
  return policy_.four_block && g.head_dim == 128 && is_quantized(g.k.format) && g.v.format == PKV_FORMAT_Q4_0;
}

// The variant, where four of its blocks fit a multiprocessor (else null: the three-block kernel
// keeps its registers).
Function KernelChoice::four_block_function(const std::string &name, unsigned bytes) {
  Function fn = rt_.function(tensor_core_, name.c_str());
  rt_.check(rt_.dev->tensor_cores()->set_shared_limit(fn, int(bytes)), (" " + name).c_str());
  int blocks = 0;
  rt_.check(rt_.dev->tensor_cores()->occupancy(&blocks, fn, PKV_MMA_WARPS * 32, bytes));
  return blocks >= 4 ? fn : nullptr;
}

// The tensor-core kernel's stage count for the pool and tile, 0 when no block of it fits the device.
unsigned KernelChoice::stages(const PoolGeometry &g, Tile tile) {
  tensor_core_function(g, tile);
  return stages_[tile][g.head_dim / 128][g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16];
}

uint32_t KernelChoice::extend_q_parts(const PoolGeometry &g, pkv_format q_format) {
  if (is_quantized(g.k.format)) return 1;
  return q_format == (g.k.format == PKV_FORMAT_BF16 ? PKV_FORMAT_BF16 : PKV_FORMAT_F16) ? 1 : 2;
}

Function KernelChoice::extend(const PoolGeometry &g, uint32_t q_parts) {
  const uint32_t D = g.head_dim;
  // Float K with quantized V stays on the decode kernels, which keep V's values exact (a widened
  // value rounded to f16 would pass the precision float K keeps). So does Q4_0 K below head_dim 256:
  // there the decode kernels' int8 MMAs beat widening its rows (H100, head_dim 128 prefills of Q4_0
  // pages: 764 against 967 us; Q8_0 even, F16 1.9x faster on this kernel; docs/perf/decisions.md).
  const bool formats = g.k.format != PKV_FORMAT_F32 && g.v.format != PKV_FORMAT_F32 &&
                       is_fp8(g.k.format) == is_fp8(g.v.format) &&
                       (is_quantized(g.k.format) || !is_quantized(g.v.format)) &&
                       (g.k.format != PKV_FORMAT_Q4_0 || D == 256);
  if (!extend_ || policy_.extend_tiles == ExtendTiles::never || !formats || !(D == 64 || D == 128 || D == 256)) return nullptr;
  Looked &kept = extend_functions_[D / 128][g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16][q_parts - 1];
  if (kept.done) return kept.fn;
  const std::string name = "pkv_extend_mma_" + std::to_string(D) + "_" + std::to_string(int(g.k.format)) + "_" +
                           std::to_string(int(g.v.format)) + "_" + std::to_string(q_parts);
  Function fn = rt_.function(extend_, name.c_str());
  const unsigned bytes = pkv_extend_shared_bytes(D, uint32_t(g.k.format), uint32_t(g.v.format), q_parts);
  if (fits_shared_memory(fn, bytes, name)) {
    rt_.check(rt_.dev->tensor_cores()->set_shared_limit(fn, int(bytes)), (" " + name).c_str());
    kept.fn = fn;
  }
  kept.done = true;
  return kept.fn;
}

// One tile a multiprocessor: a 64-token chunk over a 128K context (32 tiles on an H100's 132
// multiprocessors) took 3.4x the blocks' time there (F16, head_dim 128; docs/perf/decisions.md).
bool KernelChoice::extend_fills(uint64_t tiles) const {
  return policy_.extend_tiles == ExtendTiles::always || tiles >= sms_;
}

// The wide tile and the narrow one of one n-tile serve every batch; the others where they fit.
bool KernelChoice::tensor_core_fits(const PoolGeometry &g) { return stages(g, kWide) != 0 && stages(g, kNarrow1) != 0; }

// Whether `dynamic` bytes of shared memory and f's own arrays fit what a block may opt in to on
// this device, or under the policy's lower limit (a large GPU then runs a small one's choices).
bool KernelChoice::fits_shared_memory(Function f, unsigned dynamic, const std::string &name) {
  int per_block = 0, own = 0;
  rt_.check(rt_.dev->tensor_cores()->shared_per_block(&per_block));
  rt_.check(rt_.dev->tensor_cores()->static_shared(f, &own), (" " + name).c_str());
  if (policy_.shared_limit) per_block = std::min(per_block, policy_.shared_limit);
  return int64_t(dynamic) + own <= per_block;
}

KernelChoice::Shape KernelChoice::shape(const PoolGeometry &g, uint32_t rows) {
  if (policy_.tiles >= TileSet::narrow && rows <= PKV_MMA_NARROW_ROWS) return {kNarrow1, 1};
  if (policy_.tiles >= TileSet::ntiles && is_quantized(g.k.format) && is_quantized(g.v.format) && g.head_dim <= 128) {
    const Tile tile = rows <= 2 * PKV_MMA_NARROW_ROWS ? kNarrow2 : kNarrow4;
    if (tile == kNarrow4 && group_tile(g)) return {kGroup4, 1};
    if (stages(g, tile)) return {tile, 1};
  }
  return {kWide, rows <= PKV_MMA_ROWS ? 1u : 2u};
}

// The group tile serves Q4_0 K and V at head_dim 128 where the image has it (sm_90a): faster than
// Narrow<4> there, no faster with Q8_0 pages (docs/perf/decisions.md).
bool KernelChoice::group_tile(const PoolGeometry &g) {
  return group_tiles_ && g.head_dim == 128 && g.k.format == PKV_FORMAT_Q4_0 && g.v.format == PKV_FORMAT_Q4_0 &&
         stages(g, kGroup4);
}

// Blocks of the tensor-core kernel a multiprocessor holds at once, for the pool and shape.
uint32_t KernelChoice::blocks_per_sm(const PoolGeometry &g, Shape shape) {
  uint32_t &n = blocks_per_sm_[shape.tile + kTiles * (shape.mtiles - 1)][g.head_dim / 128]
                              [g.k.format - PKV_FORMAT_F16][g.v.format - PKV_FORMAT_F16];
  if (!n) {
    int blocks = 0;
    rt_.check(rt_.dev->tensor_cores()->occupancy(&blocks, tensor_core_function(g, shape.tile),
                                                 shape.mtiles * PKV_MMA_WARPS * 32,
                                                 shape.shared_bytes(g, stages(g, shape.tile))));
    n = uint32_t(std::max(1, blocks));
  }
  return n;
}

// Multiprocessors, times the tensor-core kernel's blocks on each.
uint32_t KernelChoice::workers(const PoolGeometry &g, uint32_t rows) {
  if (family(g) != KernelFamily::tensor_core) return sms_;
  return sms_ * blocks_per_sm(g, shape(g, rows));
}

// Float pages in the narrow tile: the kernel waits on memory, and a multiprocessor's share of the
// bandwidth needs about 64 KB in flight (a block has all its stages but the computing one loading):
// blocks beyond that only split the share. Quantized pages are bound by instruction issue, and the
// wide tile does twice the tensor-core work a byte (one block a multiprocessor measured 7% slower on
// speculative verify of 4 tokens): every block counts.
uint32_t KernelChoice::full_rate_workers(const PoolGeometry &g, uint32_t rows) {
  if (family(g) != KernelFamily::tensor_core || !float_pages(g)) return workers(g, rows);
  const Shape s = shape(g, rows);
  if (!s.narrow()) return workers(g, rows);
  const uint64_t in_flight = uint64_t(stages(g, s.tile) - 1) * stage_bytes(g);
  const uint64_t blocks = (kTensorCoreBytesInFlight + in_flight - 1) / in_flight;
  return sms_ * uint32_t(std::min<uint64_t>(blocks_per_sm(g, s), blocks));
}

PlanLimits KernelChoice::plan_limits(const PoolGeometry &g) {
  return chosen_plan_bounds(g.max_sequences, g.kv_heads, workers(g, 1)); // the most blocks at once
}

DecodeConfig KernelChoice::config(const PoolGeometry &g, uint32_t rows) {
  const uint32_t D = g.head_dim;
  DecodeConfig c;
  c.family = family(g);
  // A block streams a chunk a stage at a time: short chunks over many multiprocessors finish sooner
  // than long ones over few, and the merge of a few partials is cheap.
  c.plan.fixed_cost_tokens = kGpuChunkTokens;
  c.plan.granule_tokens = kGpuChunkTokens;
  c.plan.workers = workers(g, rows);
  c.plan.full_rate_workers = full_rate_workers(g, rows);
  c.plan.limits = plan_limits(g);
  switch (c.family) {
  case KernelFamily::tensor_core: {
    const Shape s = shape(g, rows);
    c.kernel = tensor_core_function(g, s.tile);
    c.tile = s.tile;
    c.stages = stages(g, s.tile);
    c.blocks_per_sm = blocks_per_sm(g, s);
    c.mtiles = s.mtiles;
    c.row_tiles = (rows + s.rows() - 1) / s.rows();
    c.threads[0] = s.mtiles * PKV_MMA_WARPS * 32;
    c.shared_bytes = s.shared_bytes(g, c.stages);
    // Blocks that each serve all of a KV head's query rows take balanced plans: the launch is then
    // one block for each full-rate worker, which takes its items in turn.
    c.plan.balance = rows <= s.rows() ? policy_.plan : Balance::never;
    // A record per (chunk, KV head): a block finds its item in one read.
    c.plan.record_per_head = true;
    break;
  }
  case KernelFamily::cuda_core: {
    c.kernel = cuda_core_function(g);
    // Shared-memory row strides as the CUDA-core kernel lays them out: data then scales, 16-byte aligned.
    auto stride = [](const PlaneLayout &l) { return unsigned(align16(l.row_data_bytes + l.row_scale_bytes)); };
    const unsigned bdx = D / 8, row_bytes = stride(g.k) + stride(g.v), max_threads = PKV_CUDA_CORE_MAX_THREADS;
    // Whole warps (wavefronts on AMD: 32 or 64 lanes, as the runtime says): the row reductions shuffle.
    unsigned bdy = std::min(rows, max_threads / bdx), bdz = 1;
    while ((bdx * bdy * bdz) % warp_ != 0) bdz *= 2;
    while (bdx * bdy * bdz > max_threads) { // an odd group too large for that: fewer heads
      bdy -= 1;
      bdz = 1;
      while ((bdx * bdy * bdz) % warp_ != 0) bdz *= 2;
    }
    auto staged = [&](unsigned z) { return PKV_CUDA_CORE_STAGES * PKV_CUDA_CORE_TT * z * row_bytes; };
    while (bdx * bdy * bdz * 2 <= max_threads && staged(bdz * 2) <= kCudaCoreSharedLimit) bdz *= 2;
    c.stages = PKV_CUDA_CORE_STAGES;
    c.threads[0] = bdx, c.threads[1] = bdy, c.threads[2] = bdz;
    c.shared_bytes = std::max(staged(bdz), bdz * bdy * (D + 2) * 4);
    c.row_tiles = (rows + bdy - 1) / bdy;
    break;
  }
  default:
    c.kernel = generic_functions_[D / 32 - 1];
    c.threads[0] = PKV_DECODE_WARPS * 32;
    c.row_tiles = (rows + PKV_HEAD_TILE - 1) / PKV_HEAD_TILE;
    break;
  }
  return c;
}

} // namespace gpu
} // namespace pkv
