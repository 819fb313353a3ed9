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

const PlanCache::Entry &PlanCache::get(Backend &backend, const PoolGeometry &g, uint32_t rows, const PlanBatch &batch) {
  const DecodeConfig &c = config(backend, g, rows);
  const bool same = valid_ && c.plan == planned_ && batch.chunk_pages == chunk_pages_ &&
                    lengths_.size() == batch.count && std::equal(lengths_.begin(), lengths_.end(), batch.lengths) &&
                    std::equal(slots_.begin(), slots_.end(), batch.slots);
  entry_.config = c;
  if (same) return entry_;
  valid_ = false; // stays so if make_plan throws
  entry_.resident = false;
  entry_.plan = make_plan(c.plan, batch);
  planned_ = c.plan;
  lengths_.assign(batch.lengths, batch.lengths + batch.count);
  slots_.assign(batch.slots, batch.slots + batch.count);
  chunk_pages_ = batch.chunk_pages;
  valid_ = true;
  return entry_;
}

} // namespace pkv
