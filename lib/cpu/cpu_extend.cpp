#include "cpu_extend.hpp"

#include <algorithm>

#include "../format.hpp"

namespace pkv {

void make_extend_blocks(const PoolGeometry &g, const ExtendBatch &b, std::vector<ExtendBlock> *blocks) {
  const uint32_t group = b.q_heads / g.kv_heads, per_block = std::max(1u, kExtendBlockRows / group);
  blocks->clear();
  for (uint32_t e = 0; e < b.count; e++) {
    const uint32_t n = b.q_offsets[e + 1] - b.q_offsets[e];
    const uint64_t before = uint64_t(b.lengths[e]) - n; // positions before the new tokens
    for (uint32_t first = 0; first < n; first += per_block) {
      const uint32_t tokens = std::min(per_block, n - first);
      blocks->push_back({e, first, tokens, before + first + tokens});
    }
  }
  std::stable_sort(blocks->begin(), blocks->end(),
                   [](const ExtendBlock &x, const ExtendBlock &y) { return x.cost > y.cost; });
}

void extend_block(const PoolGeometry &g, const ExtendBatch &b, const ExtendBlock &block, uint32_t kv_head,
                  AttendKernel kernel, AttendScratch &scratch) {
  const uint32_t D = g.head_dim, group = b.q_heads / g.kv_heads, e = block.entry;
  const uint32_t n = b.q_offsets[e + 1] - b.q_offsets[e], mask_row_bytes = (n + 7) / 8;
  const uint64_t before = uint64_t(b.lengths[e]) - n, first_row = uint64_t(b.q_offsets[e]) + block.first;
  load_queries(g, b.q_format, b.q, first_row, block.tokens, b.q_heads, kv_head, scratch.q);
  scratch.views.resize(block.tokens);
  for (uint32_t i = 0; i < block.tokens; i++) {
    const uint32_t token = block.first + i;
    const uint8_t *row = b.mask ? b.mask + b.mask_offsets[e] + uint64_t(token) * mask_row_bytes : nullptr;
    scratch.views[i] = {b.variants.first_seen(before + token), before + token + 1, row, before};
  }
  const size_t rows = size_t(block.tokens) * group;
  scratch.out.resize(rows * D);
  scratch.lse.resize(rows);
  const float *slopes = b.variants.slopes ? b.variants.slopes + size_t(kv_head) * group : nullptr;
  // From the block's first token's window start: what the block sees, and no position before.
  kernel.run({&g, b.layer, kv_head, page_row(g, b.seq_slots[e]), scratch.views[0].begin,
              before + block.first + block.tokens, block.tokens, group, scratch.q.data(), scratch.views.data(), b.scale,
              b.variants.softcap, slopes, scratch.out.data(), scratch.lse.data(), &scratch});
  if (b.variants.sinks)
    for (size_t r = 0; r < rows; r++)
      add_sink(&scratch.out[r * D], D, &scratch.lse[r], b.variants.sinks[size_t(kv_head) * group + r % group]);

  // A token's heads of this KV head are consecutive rows of out and lse.
  const size_t out_elem = io_elem_bytes(b.out_format);
  for (uint32_t i = 0; i < block.tokens; i++) {
    const uint64_t at = (first_row + i) * b.q_heads + uint64_t(kv_head) * group;
    store_io(b.out_format, &scratch.out[size_t(i) * group * D], size_t(group) * D,
             static_cast<uint8_t *>(b.out) + at * D * out_elem);
    if (b.lse) std::copy_n(&scratch.lse[size_t(i) * group], group, b.lse + at);
  }
}

} // namespace pkv
