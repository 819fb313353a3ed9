#include "plan.hpp"

#include <algorithm>

namespace pkv {

namespace {

// Work items per worker that keep every worker busy despite uneven lengths.
constexpr uint64_t kItemsPerWorker = 4;

uint64_t pages_of(uint64_t tokens, uint32_t page_size) { return (tokens + page_size - 1) / page_size; }

// Split only as far as needed to give every worker a few (sequence, KV head, chunk) items, never
// below the backend's shortest worthwhile chunk: a long sequence then gets proportionally more
// chunks, and short ones beside it stay whole.
uint64_t choose_chunk_pages(const PlanRequest &req) {
  uint64_t total_pages = 0;
  for (uint32_t b = 0; b < req.count; b++) total_pages += pages_of(req.lengths[b], req.page_size);
  const uint64_t want_items = std::max<uint64_t>(1, uint64_t(req.workers) * kItemsPerWorker);
  const uint64_t chunks_wanted = (want_items + req.kv_heads - 1) / req.kv_heads;
  const uint64_t min_pages = pages_of(req.min_chunk_tokens, req.page_size);
  return std::max<uint64_t>(min_pages, (total_pages + chunks_wanted - 1) / std::max<uint64_t>(1, chunks_wanted));
}

} // namespace

DecodePlan make_plan(const PlanRequest &req) {
  const uint64_t chunk_pages = req.chunk_pages ? req.chunk_pages : choose_chunk_pages(req);
  const uint64_t chunk_tokens = std::min<uint64_t>(UINT32_MAX, chunk_pages * req.page_size);
  DecodePlan plan;
  plan.chunk_tokens = uint32_t(chunk_tokens);
  plan.seq_chunks.reserve(req.count + 1);
  for (uint32_t b = 0; b < req.count; b++) {
    plan.seq_chunks.push_back(uint32_t(plan.chunks.size()));
    for (uint64_t t = 0; t < req.lengths[b]; t += chunk_tokens)
      plan.chunks.push_back({b, uint32_t(t), uint32_t(std::min<uint64_t>(req.lengths[b], t + chunk_tokens))});
  }
  plan.seq_chunks.push_back(uint32_t(plan.chunks.size()));
  return plan;
}

const DecodePlan &PlanCache::get(const PlanRequest &req) {
  const bool same = valid_ && req.page_size == page_size_ && req.kv_heads == kv_heads_ &&
                    req.chunk_pages == chunk_pages_ && req.workers == workers_ &&
                    req.min_chunk_tokens == min_chunk_tokens_ && lengths_.size() == req.count &&
                    std::equal(lengths_.begin(), lengths_.end(), req.lengths);
  if (same) return plan_;
  valid_ = false; // stays so if make_plan throws
  plan_ = make_plan(req);
  lengths_.assign(req.lengths, req.lengths + req.count);
  page_size_ = req.page_size;
  kv_heads_ = req.kv_heads;
  chunk_pages_ = req.chunk_pages;
  workers_ = req.workers;
  min_chunk_tokens_ = req.min_chunk_tokens;
  valid_ = true;
  return plan_;
}

} // namespace pkv
