// The one interface a backend implements: device memory, page copies, the scatter of new rows into
// pages, the gather of rows back out, decode, and a synchronize. Arguments are plain data; the pool
// decides what to do and a backend only does it.
#pragma once

#include <cstdint>

#include "geometry.hpp"
#include "plan.hpp"
#include "pagedkv.h"

namespace pkv {

struct PageCopy {
  uint32_t src, dst; // whole pages, every layer, K and V
};

struct RowSlot {
  uint32_t page, slot;
};

// A page-table change, table[seq_slot][index] = page. The pool queues them as sequences gain pages
// (4 bytes of payload each, never a whole table) and hands them to the next scatter, gather or
// decode, which applies them, in order, before anything else it does.
struct TableEntry {
  uint32_t seq_slot, index, page;
};

struct TableUpdates {
  const TableEntry *entries = nullptr; // host array; no two entries share (seq_slot, index)
  uint32_t count = 0;
};

// Rows packed [rows][kv_heads][head_dim] in `format`, each going to (or coming from) one slot.
struct RowTransfer {
  TableUpdates table;
  uint32_t layer;
  uint32_t rows;
  pkv_format format; // F32, F16 or BF16
  pkv_memory memory;
  const RowSlot *slots; // host array of `rows` entries
};

struct ScatterArgs : RowTransfer {
  const void *k, *v;
};

struct GatherArgs : RowTransfer {
  void *k, *v; // either may be null
};

// One layer's attention for a batch; sequence b's pages are the page-table row seq_slots[b]. Query
// token t of q_tokens attends positions [0, length - q_tokens + t].
struct DecodeBatch {
  TableUpdates table;
  uint32_t layer, count, q_heads, q_tokens;
  float scale;
  pkv_format q_format, out_format;
  pkv_memory memory;
  const void *q;
  void *out;
  float *lse;
  const uint32_t *seq_slots; // host, count
  const uint32_t *lengths;   // host, count
  const DecodePlan *plan;
  // The pool's plan buffer (PoolGeometry::plan) already holds this plan for these seq_slots, so the
  // call need not upload it.
  bool plan_resident;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual pkv_backend kind() const = 0;
  // How many work items run at once for a pool's decode with `rows` query rows per KV head (threads;
  // multiprocessors times the decode kernel's blocks per multiprocessor), and the shortest chunk
  // worth a work item of its own: what the planner splits contexts by.
  virtual uint32_t workers(const PoolGeometry &g, uint32_t rows) = 0;
  // Of those, how many together already run at the backend's full rate (a GPU kernel bound by memory
  // bandwidth reaches it with fewer blocks than fit): more share that rate and add per-item costs.
  virtual uint32_t full_rate_workers(const PoolGeometry &g, uint32_t rows) { return workers(g, rows); }
  virtual uint32_t min_chunk_tokens() const = 0;
  // The tokens a work item takes at a time (a GPU block's stage): a chunk's partial last granule costs
  // a whole one, so the planner's chunks are whole granules. 1: any whole pages.
  virtual uint32_t chunk_granule_tokens() const { return 1; }
  // Whether decode takes balanced plans (DecodePlan::workers: its full-rate workers take items w,
  // w + workers, ... in turn, and items may be one KV head's) for `rows` query rows a KV head.
  virtual Balance plan_balance(const PoolGeometry &, uint32_t) { return Balance::never; }
  // What a pool's plan buffer holds, and its bytes (0: the backend keeps no plan buffer).
  virtual PlanLimits plan_limits(const PoolGeometry &) { return {}; }
  virtual uint64_t plan_buffer_bytes(const PoolGeometry &) { return 0; }

  // Throws PKV_ERR_OUT_OF_MEMORY when the device has too little. Memory need not be zeroed.
  virtual DevPtr alloc(uint64_t bytes) = 0;
  virtual void release(DevPtr ptr) noexcept = 0;

  virtual void copy_pages(const PoolGeometry &g, const PageCopy *copies, uint32_t n) = 0;
  virtual void scatter(const PoolGeometry &g, const ScatterArgs &args) = 0;
  // Synchronous: the rows are in place on return.
  virtual void gather(const PoolGeometry &g, const GatherArgs &args) = 0;
  // Applies the batch's table changes and puts its plan into the pool's plan buffer, launching
  // nothing: a decode of the same batch that follows needs no upload.
  virtual void prepare_decode(const PoolGeometry &g, const DecodeBatch &batch) = 0;
  virtual void decode(const PoolGeometry &g, const DecodeBatch &batch) = 0;
  virtual void synchronize() = 0;
  // GB/s of a read-only pass over `bytes` (0: the backend's default size), best of several passes.
  virtual double read_bandwidth(uint64_t bytes) = 0;
};

} // namespace pkv
