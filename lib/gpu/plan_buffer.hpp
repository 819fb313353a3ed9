// A pool's plan buffer on the device: the header, the batch's sequences' chunk offsets and the plan's
// records (which carry their sequences' page-table rows, lengths and starts), each at an offset fixed
// by the pool's capacity,
// so that a captured kernel keeps finding them as batches change.
#pragma once

#include <cstdint>

#include "../backend.hpp"
#include "staging.hpp"

namespace pkv {
namespace gpu {

struct PlanLayout {
  uint64_t seq_chunks, records, bytes;
};

PlanLayout plan_layout(uint32_t max_sequences, uint32_t max_records);

// Where a plan buffer lies and what it holds: the pool's (max_sequences as the pool's) or an
// extend's of its own.
struct PlanPlace {
  DevPtr at;
  uint32_t max_sequences, max_records;
  PlanLayout layout() const { return plan_layout(max_sequences, max_records); }
};

// Sends a plan of `count` sequences into the plan buffer `place`, in one transfer.
void upload_plan(Staging &staging, const PlanPlace &place, const DecodePlan &plan, uint32_t count);

} // namespace gpu
} // namespace pkv
