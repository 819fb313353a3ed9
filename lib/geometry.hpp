// Where every byte of a pool lives: plain data shared by the pool and every backend.
#pragma once

#include <cstdint>

#include "format.hpp"

namespace pkv {

// Device memory as the backend sees it: a host pointer for the CPU, a CUdeviceptr for CUDA.
using DevPtr = uint64_t;

// Pages are stored layer-major: block (layer, page) holds the page's K part, then its V part.
// Each sequence slot owns one row of the page table: table[slot * table_stride + i] is the page that
// holds the slot's tokens [i * page_size, (i + 1) * page_size).
struct PoolGeometry {
  uint32_t layers, kv_heads, head_dim, page_size, pages;
  uint32_t max_sequences, table_stride;
  PlaneLayout k, v;
  uint64_t block_bytes; // k.bytes + v.bytes
  DevPtr base;          // the pages
  DevPtr table;         // uint32_t [max_sequences][table_stride]
  DevPtr plan;          // the backend's decode plan buffer, or 0 (Backend::plan_buffer_bytes)
  DevPtr scales;        // float [2][layers][kv_heads]: K's then V's FP8 scales (1 for other formats)

  uint64_t scale_index(bool v, uint32_t layer, uint32_t head) const {
    return (uint64_t(v) * layers + layer) * kv_heads + head;
  }
  uint64_t scales_bytes() const { return uint64_t(2) * layers * kv_heads * 4; }

  uint64_t block_offset(uint32_t layer, uint32_t page) const {
    return (uint64_t(layer) * pages + page) * block_bytes;
  }
  DevPtr k_part(uint32_t layer, uint32_t page) const { return base + block_offset(layer, page); }
  DevPtr v_part(uint32_t layer, uint32_t page) const { return k_part(layer, page) + k.bytes; }
  uint64_t total_bytes() const { return uint64_t(layers) * pages * block_bytes; }
  uint64_t table_bytes() const { return uint64_t(max_sequences) * table_stride * 4; }
};

} // namespace pkv
