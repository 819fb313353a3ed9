#include "plan_cache.hpp"

#include <algorithm>

namespace pkv {

const DecodeConfig &PlanCache::config(Backend &backend, const PoolGeometry &g, uint32_t rows) {
  for (const auto &c : configs_)
    if (c.first == rows) return c.second;
  const DecodeConfig made = backend.decode_config(g, rows);
  configs_.emplace_back(rows, made);
  return configs_.back().second;
}

// Whether the batch's starts (null: all 0) are the cached plan's; lengths_ already compared equal in size.
bool PlanCache::same_starts(const PlanBatch &batch) const {
  for (uint32_t b = 0; b < batch.count; b++)
    if (starts_[b] != (batch.starts ? batch.starts[b] : 0)) return false;
  return true;
}

const PlanCache::Entry &PlanCache::get(Backend &backend, const PoolGeometry &g, uint32_t rows, const PlanBatch &batch) {
  const DecodeConfig &c = config(backend, g, rows);
  const bool same = valid_ && c.plan == planned_ && batch.chunk_pages == chunk_pages_ && batch.q_tokens == q_tokens_ &&
                    lengths_.size() == batch.count && std::equal(lengths_.begin(), lengths_.end(), batch.lengths) &&
                    std::equal(slots_.begin(), slots_.end(), batch.slots) && same_starts(batch);
  entry_.config = c;
  if (same) return entry_;
  valid_ = false; // stays so if make_plan throws
  entry_.resident = false;
  entry_.plan = make_plan(c.plan, batch);
  planned_ = c.plan;
  lengths_.assign(batch.lengths, batch.lengths + batch.count);
  slots_.assign(batch.slots, batch.slots + batch.count);
  if (batch.starts) starts_.assign(batch.starts, batch.starts + batch.count);
  else starts_.assign(batch.count, 0);
  chunk_pages_ = batch.chunk_pages;
  q_tokens_ = batch.q_tokens;
  valid_ = true;
  return entry_;
}

} // namespace pkv
