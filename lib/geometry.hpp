// Where every byte of a pool lives: plain data shared by the pool and every backend.
#pragma once

#include <cstdint>

#include "format.hpp"

namespace pkv {

// Device memory as the backend sees it: a host pointer for the CPU, a CUdeviceptr for CUDA.
using DevPtr = uint64_t;

// Pages are stored layer-major: block (layer, page) holds the page's K part, then its V part.
struct PoolGeometry {
  uint32_t layers, kv_heads, head_dim, page_size, pages;
  PlaneLayout k, v;
  uint64_t block_bytes; // k.bytes + v.bytes
  DevPtr base;

  uint64_t block_offset(uint32_t layer, uint32_t page) const {
    return (uint64_t(layer) * pages + page) * block_bytes;
  }
  DevPtr k_part(uint32_t layer, uint32_t page) const { return base + block_offset(layer, page); }
  DevPtr v_part(uint32_t layer, uint32_t page) const { return k_part(layer, page) + k.bytes; }
  uint64_t total_bytes() const { return uint64_t(layers) * pages * block_bytes; }
};

} // namespace pkv
