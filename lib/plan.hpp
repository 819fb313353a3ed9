// The decode plan: how each sequence's context is cut into split-K chunks, as the device-ready
// records a backend runs. Plain data computed on the host from the batch's lengths and a backend's
// plan configuration; every backend runs the same kind of plan, so split and unsplit runs compare.
//
// Words: a chunk is a token range of one sequence; an item is a chunk for one KV head, what one
// worker (a thread, a thread block) computes at a time; a record is what a backend reads of an item
// or a chunk; a round is one item for each worker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pkv {

constexpr uint32_t kNoPart = UINT32_MAX;
constexpr uint32_t kAllHeads = UINT32_MAX; // a record of every KV head of its chunk
constexpr uint32_t kNoSeq = UINT32_MAX;    // a balanced plan's filler: its worker has no item that round

// One record, laid out as the GPU kernels read it (PkvRecord in lib/kernels/kernel_params.h): the
// sequence's own page-table row and length repeat in each of its records, so that a worker reads its
// item in one go.
struct PlanRecord {
  uint32_t seq;         // index in the batch; kNoSeq for a filler
  uint32_t token_begin; // [token_begin, token_end) of that sequence; page-aligned boundaries
  uint32_t token_end;
  uint32_t part;        // where a split sequence's chunk leaves its partial result; kNoPart when the
                        // sequence has this one chunk and writes the result itself
  uint32_t slot;        // the sequence's page-table row (0 for a filler)
  uint32_t length;      // the positions the plan covers of the sequence (0 for a filler)
  uint32_t first_part;  // the part of the first chunk of its sequence (and head), when split
  uint32_t siblings;    // chunks its sequence (and head) has, itself included
  uint32_t head;        // kAllHeads, or the one KV head of the item
  uint32_t start;       // the sequence's position that token 0 of the ranges is (a window's first page)
  uint32_t q_row;       // the first query token's row of q, out and lse
  uint32_t tokens;      // query tokens: token i (row q_row + i) sees [0, length - tokens + i]
  // A GPU extend's tree mask (PkvRecord's; the planner leaves it 0: causal).
  uint32_t mask_stride;
  uint32_t new_begin;
  uint64_t mask;
};

// What a backend can hold of a plan: a GPU keeps plans in fixed device buffers (so a captured graph
// keeps reading the same addresses); chunks grow beyond the requested size until the plan fits.
struct PlanLimits {
  uint32_t chunks = UINT32_MAX;
  uint32_t parts = UINT32_MAX;
  uint32_t records = UINT32_MAX;

  bool operator==(const PlanLimits &o) const { return chunks == o.chunks && parts == o.parts && records == o.records; }
};

// Whether the backend may be given a balanced plan: never (it runs uniform chunks only), where the
// planner finds it cheaper, or always (to test and compare it).
enum class Balance : uint32_t { never, cheaper, always };

// The planner's part of a backend's decode configuration (Backend::decode_config): fixed for a pool
// and a number of query rows a KV head serves.
struct PlanConfig {
  uint32_t workers = 1;           // workers that run items at once (threads; multiprocessors x blocks)
  uint32_t full_rate_workers = 1; // how many of them already run at the full rate (<= workers)
  uint32_t fixed_cost_tokens = 1; // an item's fixed cost, in tokens: shorter chunks cost more in
                                  // merging than they gain in parallelism
  uint32_t granule_tokens = 1;    // an item's unit of tokens (a GPU block's stage): chunks are whole ones
  PlanLimits limits;
  Balance balance = Balance::never; // balanced plans are cut for full_rate_workers
  bool record_per_head = false;     // a uniform plan's chunk is a record for each KV head (else one
                                    // record with head kAllHeads)

  bool operator==(const PlanConfig &o) const {
    return workers == o.workers && full_rate_workers == o.full_rate_workers && fixed_cost_tokens == o.fixed_cost_tokens &&
           granule_tokens == o.granule_tokens && limits == o.limits && balance == o.balance &&
           record_per_head == o.record_per_head;
  }
};

// A batch to plan.
struct PlanBatch {
  const uint32_t *lengths; // count: the positions to cover of each sequence
  const uint32_t *slots;   // count: the sequences' page-table rows, copied into the records
  uint32_t count;
  uint32_t page_size;
  uint32_t kv_heads;
  uint32_t chunk_pages; // 0: choose; UINT32_MAX: never split
  const uint32_t *starts = nullptr; // count: where each sequence's positions start (copied into the
                                    // records, not planned by: page-aligned), or null: all 0
  // The query tokens of each sequence, copied into the records: `q_tokens` for every one, sequence b's
  // from row b * q_tokens (decode); or, where `q_rows` is set, `tokens[b]` from row q_rows[b] (an
  // extend's blocks of new tokens).
  uint32_t q_tokens = 1;
  const uint32_t *q_rows = nullptr, *tokens = nullptr;
};

// Two shapes. Uniform (workers 0): each sequence is cut into chunks of at most chunk_tokens, in
// sequence order; each chunk is `records_per_chunk` records (one per KV head, or one of every KV
// head). Balanced (workers K): every (sequence, KV head) is cut into items so that K workers get
// equal shares of the batch's tokens; record j * K + w is worker w's j-th item (kNoSeq where it has
// fewer), for backends whose K workers take records w, w + K, ... in turn. A pair's items are in
// token order and take consecutive parts.
struct DecodePlan {
  uint32_t chunk_tokens = 0;      // longest chunk
  uint32_t parts = 0;             // chunks of split sequences
  uint32_t workers = 0;           // balanced: the workers it was cut for; 0: uniform
  uint32_t records_per_chunk = 1; // uniform: kv_heads or 1; balanced: 1 (each record is an item)
  std::vector<uint32_t> seq_chunks; // uniform: count + 1 offsets: sequence b owns chunks [seq_chunks[b],
                                    // seq_chunks[b+1]), at least one (an empty sequence's is empty)
  std::vector<PlanRecord> records;

  uint32_t chunks() const { return uint32_t(records.size() / records_per_chunk); }
  const PlanRecord &chunk(uint32_t c) const { return records[size_t(c) * records_per_chunk]; }
};

DecodePlan make_plan(const PlanConfig &config, const PlanBatch &batch);

// The most chunks, parts and records a plan of the planner's own choice has for a batch of up to
// max_sequences: a GPU backend sizes its plan buffers by this, so chosen plans always fit.
PlanLimits chosen_plan_bounds(uint32_t max_sequences, uint32_t kv_heads, uint32_t workers);

} // namespace pkv
