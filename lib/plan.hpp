// The decode plan: how each sequence's context is cut into split-K chunks. Plain data computed on the
// host from the batch's lengths; every backend runs the same plan, so split and unsplit runs compare.
#pragma once

#include <cstdint>
#include <vector>

namespace pkv {

struct DecodeChunk {
  uint32_t seq;         // index in the batch
  uint32_t token_begin; // [token_begin, token_end) of that sequence; page-aligned boundaries
  uint32_t token_end;
};

struct DecodePlan {
  uint32_t chunk_tokens = 0;         // longest chunk
  std::vector<uint32_t> seq_chunks;  // count + 1 offsets: sequence b owns chunks [seq_chunks[b], seq_chunks[b+1])
  std::vector<DecodeChunk> chunks;
};

struct PlanRequest {
  const uint32_t *lengths;
  uint32_t count;
  uint32_t page_size;
  uint32_t kv_heads;
  uint32_t chunk_pages; // 0: choose; UINT32_MAX: never split
  uint32_t workers;     // units that run work items at once (threads, multiprocessors)
  uint32_t min_chunk_tokens; // shorter chunks cost more in merging than they gain in parallelism
};

DecodePlan make_plan(const PlanRequest &req);

// The last plan made and what it was made from: an engine decodes every layer of a step with the same
// batch, so all but the first layer's call reuse it.
class PlanCache {
 public:
  const DecodePlan &get(const PlanRequest &req);

 private:
  DecodePlan plan_;
  std::vector<uint32_t> lengths_;
  uint32_t page_size_ = 0, kv_heads_ = 0, chunk_pages_ = 0, workers_ = 0, min_chunk_tokens_ = 0;
  bool valid_ = false;
};

} // namespace pkv
