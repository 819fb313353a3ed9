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

// Sends a plan of `count` sequences (made under a configuration whose plans have at most
// `max_records` records) into the pool's plan buffer, in one transfer.
void upload_plan(Staging &staging, const PoolGeometry &g, const DecodePlan &plan, uint32_t max_records, uint32_t count);

} // namespace gpu
} // namespace pkv
