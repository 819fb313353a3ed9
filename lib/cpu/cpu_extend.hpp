// The CPU backend's extend (pkv_extend): a batch's new tokens cut into blocks of query tokens, each
// block of each KV head one work item that attends over every position its rows see, with the
// decode's attention (cpu_attention.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "../backend.hpp"
#include "cpu_attention.hpp"

namespace pkv {

// Query tokens [first, first + tokens) of an entry's new tokens; cost: the positions its last token
// sees (what the block's attention reads).
struct ExtendBlock {
  uint32_t entry, first, tokens;
  uint64_t cost;
};

// The batch's blocks, costliest first, so that the workers, taking items in order, end together:
// blocks of up to kExtendBlockRows query rows (tokens x the KV head's group; at least one token).
constexpr uint32_t kExtendBlockRows = 64;
void make_extend_blocks(const PoolGeometry &g, const ExtendBatch &b, std::vector<ExtendBlock> *blocks);

// One block for one KV head: its queries loaded, attended, and stored as out and lse rows.
void extend_block(const PoolGeometry &g, const ExtendBatch &b, const ExtendBlock &block, uint32_t kv_head,
                  AttendKernel kernel, AttendScratch &scratch);

} // namespace pkv
