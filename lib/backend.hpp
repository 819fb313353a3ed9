// The one interface a backend implements: device memory, page copies, the scatter of new rows into
// pages, the gather of rows back out, decode, extend, sequence images out and in, and a synchronize. Arguments are plain data; the pool
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

// A sequence's image payload (lib/seq_image.hpp): the blocks (layer, page) of layers
// [first_layer, first_layer + layers) of `count` pages, [layer][page], each block_bytes as the pool
// stores it, between the pool and caller memory. Payload word i (of 8 bytes) counts in the payload
// checksum as image_word_term(word, i).
struct ImageTransfer {
  const uint32_t *pages; // host array of `count` page ids, in the sequence's order
  uint32_t count;
  uint32_t first_layer, layers;
  pkv_memory memory; // HOST, HOST_PINNED or DEVICE
};

// Export: the encoded header at `image`, then the payload; the payload checksum goes into the header
// at kImagePayloadChecksumAt (where the header holds 0).
struct ExportArgs : ImageTransfer {
  void *image;
  const uint8_t *header; // host, kImageHeaderBytes
};

// Import: the payload (the image past its header) into the pages.
struct ImportArgs : ImageTransfer {
  const void *payload;
};

// The kernel families a backend may decode with: the CPU's own loop; on a GPU the generic kernel
// (any format and head_dim), the CUDA-core kernel and the tensor-core kernel (F16/BF16/Q8_0/Q4_0
// pages, head_dim 64, 128 and 256).
enum class KernelFamily : uint32_t { cpu, generic, cuda_core, tensor_core };

// How a backend runs a pool's decode for a number of query rows a KV head serves: its kernel and
// launch shape, and the planner's inputs. Plain data, decided once and kept by the pool's plan cache.
struct DecodeConfig {
  KernelFamily family = KernelFamily::cpu;
  void *kernel = nullptr;   // the backend's handle of the kernel function (null for the CPU)
  uint32_t tile = 0;        // the tensor-core kernel's tile kind (its own numbering)
  uint32_t stages = 0;      // K/V stages a block keeps in shared memory (0: not staged)
  uint32_t blocks_per_sm = 0; // blocks a multiprocessor holds at once (0: not a GPU kernel)
  uint32_t row_tiles = 1;   // workers a (chunk, KV head) takes: its query rows over a block's
  uint32_t mtiles = 1;      // the tensor-core kernel's wide row tiles a block
  uint32_t threads[3] = {1, 1, 1}; // a block's shape
  uint32_t shared_bytes = 0;
  PlanConfig plan;
};

// The most query tokens a decode attends per sequence (pkv_decode_args.q_tokens): a plan record's
// tokens, also where a GPU backend runs an extend's new tokens as records of the decode's kernels.
constexpr uint32_t kMaxQueryTokens = 8;

// The attention variants of a decode or extend (pagedkv.h, section 7a), checked; all zero: plain
// attention.
struct AttentionVariants {
  const float *sinks = nullptr;  // host, [q_heads], or null
  const float *slopes = nullptr; // host, [q_heads] ALiBi slopes, or null
  uint32_t window = 0;           // a query at position p sees (p - window, p]; 0: no window
  float softcap = 0.0f;

  bool any() const { return sinks || slopes || window || softcap != 0.0f; }
  // The first position a query at `position` sees.
  uint64_t first_seen(uint64_t position) const { return window && position >= window ? position + 1 - window : 0; }
  // Where a plan covering a query at `position` starts: the first position of the page holding the
  // first one it sees (chunks stay whole pages; a page holding a position still seen is never
  // released), the kernels hiding the few before the window.
  uint32_t plan_start(uint64_t position, uint32_t page_size) const {
    const uint64_t first = first_seen(position);
    return uint32_t(first - first % page_size);
  }
};

// One layer's attention for a batch; sequence b's pages are the page-table row seq_slots[b]. Query
// token t of q_tokens attends positions [0, length - q_tokens + t] (less what its window hides). The
// plan covers them from the page where the window of the sequence's first query token begins (0
// without a window): its records' token ranges count from their `start`, and their `length` is the
// sequence's length less it.
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
  AttentionVariants variants;
  const DecodeConfig *config; // the backend's, for this pool and batch shape
  const DecodePlan *plan;     // made from config.plan
  // The pool's plan buffer (PoolGeometry::plan) already holds this plan, so the call need not upload it.
  bool plan_resident;
};

// One layer's attention for the new tokens of a batch (pkv_extend): entry b's queries are rows
// [q_offsets[b], q_offsets[b + 1]) of q, the newest positions of the sequence whose pages are the
// page-table row seq_slots[b] and whose length is lengths[b]. Without a mask query i of T sees
// positions [0, length - T + i]; with one, new token j only where its row's bit j is set (the
// layout of pkv_extend_args, checked: each row sees itself and no later new token).
struct ExtendBatch {
  TableUpdates table;
  uint32_t layer, count, q_heads;
  float scale;
  pkv_format q_format, out_format;
  pkv_memory memory;
  const void *q;
  void *out;
  float *lse;
  const uint32_t *seq_slots; // host, count
  const uint32_t *lengths;   // host, count
  const uint32_t *q_offsets; // host, count + 1
  const uint8_t *mask;       // host, or null: causal
  const uint64_t *mask_offsets; // host, count (with a mask)
  uint64_t mask_bytes;          // the mask's bytes, every entry's rows among them
  AttentionVariants variants;
  const DecodeConfig *config; // the backend's decode configuration for kMaxQueryTokens tokens a record
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual pkv_backend kind() const = 0;
  // The kernel and plan configuration for a pool's decode with `rows` query rows a KV head. The
  // pool asks once per shape and keeps the answer.
  virtual DecodeConfig decode_config(const PoolGeometry &g, uint32_t rows) = 0;
  // The bytes of a pool's plan buffer (0: the backend keeps no plan buffer).
  virtual uint64_t plan_buffer_bytes(const PoolGeometry &) { return 0; }

  // Zeroed memory (by the time work queued after the call runs), so that slots appended but never
  // written read as zeros on every backend. Throws PKV_ERR_OUT_OF_MEMORY when the device has too
  // little.
  virtual DevPtr alloc(uint64_t bytes) = 0;
  virtual void release(DevPtr ptr) noexcept = 0;
  // `bytes` of host memory into device memory, after the work queued before and before the work
  // queued after; src may be reused on return.
  virtual void write_device(DevPtr dst, const void *src, uint64_t bytes) = 0;

  virtual void copy_pages(const PoolGeometry &g, const PageCopy *copies, uint32_t n) = 0;
  virtual void scatter(const PoolGeometry &g, const ScatterArgs &args) = 0;
  // Synchronous: the rows are in place on return.
  virtual void gather(const PoolGeometry &g, const GatherArgs &args) = 0;
  // Applies the batch's table changes and puts its plan into the pool's plan buffer, launching
  // nothing: a decode of the same batch that follows needs no upload.
  virtual void prepare_decode(const PoolGeometry &g, const DecodeBatch &batch) = 0;
  // Asynchronous where the memory allows (pkv_seq_export's promises); the pages may be reused once it
  // returns: later work on the stream runs after it.
  virtual void export_image(const PoolGeometry &g, const ExportArgs &args) = 0;
  // Synchronous: the pages hold the payload on return; returns the payload's checksum.
  virtual uint64_t import_image(const PoolGeometry &g, const ImportArgs &args) = 0;
  // `bytes` of caller memory into host memory, after the work queued before; synchronous.
  virtual void read_caller(void *dst, const void *src, pkv_memory memory, uint64_t bytes) = 0;
  virtual void decode(const PoolGeometry &g, const DecodeBatch &batch) = 0;
  // pkv_extend. A backend that has no extend yet refuses it (PKV_ERR_UNSUPPORTED) before it
  // applies the table changes or touches anything.
  virtual void extend(const PoolGeometry &g, const ExtendBatch &batch) = 0;
  // Applies the batch's table changes and puts its plans on the device, launching nothing: an extend
  // of the same batch that follows needs no upload (pkv_extend_prepare).
  virtual void prepare_extend(const PoolGeometry &g, const ExtendBatch &batch) = 0;
  virtual void synchronize() = 0;
  // GB/s of a read-only pass over `bytes` (0: the backend's default size), best of several passes.
  virtual double read_bandwidth(uint64_t bytes) = 0;
};

} // namespace pkv
