#include "plan_buffer.hpp"

#include <cstddef>

#include "../kernels/kernel_params.h"
#include "../error.hpp"

namespace pkv {
namespace gpu {

namespace {

#define PKV_SAME_FIELD(f) offsetof(PlanRecord, f) == offsetof(PkvRecord, f)
static_assert(sizeof(PlanRecord) == sizeof(PkvRecord) && PKV_SAME_FIELD(seq) && PKV_SAME_FIELD(token_begin) &&
                  PKV_SAME_FIELD(token_end) && PKV_SAME_FIELD(part) && PKV_SAME_FIELD(slot) &&
                  PKV_SAME_FIELD(length) && PKV_SAME_FIELD(first_part) && PKV_SAME_FIELD(siblings) &&
                  PKV_SAME_FIELD(head) && PKV_SAME_FIELD(start) && PKV_SAME_FIELD(q_row) && PKV_SAME_FIELD(tokens) &&
                  PKV_SAME_FIELD(mask_stride) && PKV_SAME_FIELD(new_begin) && PKV_SAME_FIELD(mask),
              "plan records cross to the device as they are");
#undef PKV_SAME_FIELD
static_assert(kNoPart == UINT32_MAX && kAllHeads == UINT32_MAX, "the kernels' markers");

} // namespace

PlanLayout plan_layout(uint32_t max_sequences, uint32_t max_records) {
  PlanLayout l;
  l.seq_chunks = align16(sizeof(PkvPlanHeader));
  l.records = l.seq_chunks + align16(4ull * (max_sequences + 1));
  l.bytes = l.records + uint64_t(max_records) * sizeof(PkvRecord);
  return l;
}

void upload_plan(Staging &staging, const PlanPlace &place, const DecodePlan &plan, uint32_t count) {
  const PlanLayout l = place.layout();
  if (plan.records.size() > place.max_records || count > place.max_sequences)
    fail(PKV_ERR_INTERNAL, "a plan of %zu records for %u sequences exceeds its plan buffer", plan.records.size(), count);
  const PkvPlanHeader header{uint32_t(plan.records.size()), count, plan.parts, 0};
  Upload up;
  up.place(0, &header, sizeof header);
  up.place(l.seq_chunks, plan.seq_chunks.data(), plan.seq_chunks.size() * 4);
  up.place(l.records, plan.records.data(), plan.records.size() * sizeof(PlanRecord));
  staging.send(up, place.at);
}

} // namespace gpu
} // namespace pkv
