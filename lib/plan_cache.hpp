// The pool's last decode configuration and plan (a decode's: query rows by q_tokens): an engine
// decodes every layer of a step with the same batch, so all but the first layer's call reuse both,
// and, once a backend call has put the plan into the pool's plan buffer, need not upload it again.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.hpp"
#include "plan.hpp"

namespace pkv {

class PlanCache {
 public:
  struct Entry {
    DecodeConfig config;
    DecodePlan plan;
    bool resident = false; // the pool's plan buffer holds `plan`
  };

  // The configuration for `rows` query rows a KV head (asked of the backend once per shape), and the
  // plan of the batch under it: the cached one where nothing it was made from changed.
  const Entry &get(Backend &backend, const PoolGeometry &g, uint32_t rows, const PlanBatch &batch);
  // The configuration for `rows` query rows a KV head, asked of the backend once per shape.
  const DecodeConfig &config(Backend &backend, const PoolGeometry &g, uint32_t rows);
  // Whether the plan buffer holds the entry's plan: false before a backend call that may write it,
  // true once one succeeded.
  void set_resident(bool resident) { entry_.resident = resident; }

 private:
  bool same_starts(const PlanBatch &batch) const;

  std::vector<std::pair<uint32_t, DecodeConfig>> configs_; // by rows
  Entry entry_;
  PlanConfig planned_; // what entry_.plan was made from
  std::vector<uint32_t> lengths_, slots_, starts_;
  uint32_t chunk_pages_ = 0, q_tokens_ = 0;
  bool valid_ = false;
};

} // namespace pkv
