// The GPU backend's switches for A/B runs and tests, one per axis of its decode choices, read from
// the environment once when a context is created (docs/environment.md).
#pragma once

#include <cstdint>
#include <string>

#include "../backend.hpp"

namespace pkv {
namespace gpu {

// The tensor-core kernel's tiles of query rows, each kind allowing the ones before it.
enum class TileSet : uint32_t {
  wide,     // wide tiles only
  narrow,   // and the narrow tile of one n-tile
  ntiles,   // and narrow tiles of 2 and 4 n-tiles (quantized K and V)
  all,      // and the group tile (sm_90a)
};

// Which of an extend's long entries the extend kernel takes (where it serves them).
enum class ExtendTiles : uint32_t {
  filling, // those of a call whose tiles fill the device once; a call of fewer takes decode's blocks
  always,  // every one
  never,   // none: decode's blocks take every entry
};

struct DecodePolicy {
  bool family_set = false;                      // PKV_KERNEL_FAMILY
  KernelFamily family = KernelFamily::tensor_core; // when family_set
  TileSet tiles = TileSet::all;                 // PKV_TENSOR_CORE_TILES
  bool four_block = true;                       // PKV_FOUR_BLOCK
  Balance plan = Balance::never;                // PKV_PLAN
  int shared_limit = 0;                         // PKV_SHARED_LIMIT (bytes a block); 0: the device's
  ExtendTiles extend_tiles = ExtendTiles::filling; // PKV_EXTEND_KERNEL
  std::string tensor_core_switch; // the first tensor-core-only switch set ("PKV_FOUR_BLOCK=off"), or empty
};

// Throws PKV_ERR_INVALID_ARGUMENT, naming the variable, for a value it does not know.
DecodePolicy read_decode_policy();

} // namespace gpu
} // namespace pkv
