// The decode plan: how each sequence's context is cut into split-K chunks. Plain data computed on the
// host from the batch's lengths; every backend runs the same plan, so split and unsplit runs compare.
#pragma once

#include <cstdint>
#include <vector>

namespace pkv {

constexpr uint32_t kNoPart = UINT32_MAX;
constexpr uint32_t kAllHeads = UINT32_MAX; // a chunk of every KV head of its sequence
constexpr uint32_t kNoSeq = UINT32_MAX;    // a balanced plan's filler: its worker has no piece that round

struct DecodeChunk {
  uint32_t seq;         // index in the batch
  uint32_t token_begin; // [token_begin, token_end) of that sequence; page-aligned boundaries
  uint32_t token_end;
  uint32_t part;        // where a split sequence's chunk leaves its partial result; kNoPart when the
                        // sequence has this one chunk and writes the result itself
  uint32_t head;        // kAllHeads, or the one KV head of a balanced plan's piece
  uint32_t first_part;  // the part of the first chunk of its sequence (and head), when split
  uint32_t siblings;    // chunks its sequence (and head) has, itself included
};

// Two shapes. Uniform (workers 0): each sequence is cut into chunks of at most chunk_tokens, every
// chunk an item for each KV head, in sequence order. Balanced (workers K): every (sequence, KV head)
// is cut into pieces so that K workers get equal shares of the batch's tokens; chunk j * K + w is
// worker w's j-th piece (kNoSeq where it has fewer), for backends whose K workers take items w,
// w + K, ... in turn. A pair's pieces are in token order and take consecutive parts.
struct DecodePlan {
  uint32_t chunk_tokens = 0;         // longest chunk
  uint32_t parts = 0;                // chunks of split sequences
  uint32_t workers = 0;              // balanced: the workers it was cut for; 0: uniform
  uint64_t generation = 0;           // differs between any two plans a process makes
  std::vector<uint32_t> seq_chunks;  // uniform: count + 1 offsets: sequence b owns chunks [seq_chunks[b],
                                     // seq_chunks[b+1]), at least one (an empty sequence's is empty)
  std::vector<DecodeChunk> chunks;
};

// What a backend can hold of a plan: a GPU keeps plans in fixed device buffers (so a captured graph
// keeps reading the same addresses); chunks grow beyond the requested size until the plan fits.
struct PlanLimits {
  uint32_t chunks = UINT32_MAX;
  uint32_t parts = UINT32_MAX;
  uint32_t pieces = UINT32_MAX; // a balanced plan's chunks, fillers included
};

// Whether the backend may be given a balanced plan: never (it runs uniform chunks only), where the
// planner finds it cheaper, or always (to test and compare it).
enum class Balance : uint32_t { never, cheaper, always };

struct PlanRequest {
  const uint32_t *lengths;
  uint32_t count;
  uint32_t page_size;
  uint32_t kv_heads;
  uint32_t chunk_pages; // 0: choose; UINT32_MAX: never split
  uint32_t workers;     // units that run work items at once (threads, thread blocks)
  uint32_t full_rate_workers; // how many of them already run at the full rate (<= workers)
  uint32_t min_chunk_tokens; // shorter chunks cost more in merging than they gain in parallelism
  uint32_t granule_tokens;   // a work item's unit of tokens (a GPU block's stage): chunks are whole ones
  PlanLimits limits;
  Balance balance;           // balanced plans are cut for full_rate_workers
};

DecodePlan make_plan(const PlanRequest &req);

// The most chunks and parts a plan of the planner's own choice has for a batch of up to
// max_sequences: a GPU backend sizes its plan buffers by this, so chosen plans always fit.
PlanLimits chosen_plan_bounds(uint32_t max_sequences, uint32_t kv_heads, uint32_t workers);

// The last plan made and what it was made from: an engine decodes every layer of a step with the same
// batch, so all but the first layer's call reuse it.
class PlanCache {
 public:
  const DecodePlan &get(const PlanRequest &req);

 private:
  DecodePlan plan_;
  std::vector<uint32_t> lengths_;
  uint32_t page_size_ = 0, kv_heads_ = 0, chunk_pages_ = 0, workers_ = 0, full_rate_workers_ = 0, min_chunk_tokens_ = 0,
           granule_tokens_ = 0;
  PlanLimits limits_;
  Balance balance_ = Balance::never;
  bool valid_ = false;
};

} // namespace pkv
