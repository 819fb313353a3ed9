// The measurements, one file each: decode against the padded baseline (decode.cpp), append
// throughput (append.cpp), host overhead (overhead.cpp), sequence images (transfer.cpp), extend
// (extend.cpp). Each returns its rows' results; a skipped or
// failed measurement says why in its result rather than throwing.
#pragma once

#include "common.hpp"
#include "workloads.hpp"

#include <string>
#include <vector>

namespace bench {

// ---------------------------------------------------------------------------------------------
// Decode: one row per workload, paged against the contiguous padded baseline.

struct DecodeResult {
  const Workload *w = nullptr;
  std::string status = "ok", reason, base_reason;
  uint64_t bytes = 0, base_bytes = 0;
  uint32_t copies = 0, base_copies = 0;
  double us = 0, min_us = 0, gbs = 0, pct = 0, base_us = 0, ratio = 0;
};

DecodeResult measure_decode(Env &e, const Workload &w);

// ---------------------------------------------------------------------------------------------
// Append throughput: 1 token to each of 128 sequences per step, and a 4K-token prefill chunk into
// one sequence; host F16 source, gqa4-d128, pkv_write (+ synchronize) timed.

struct AppendItem {
  pkv_format fmt;
  bool prefill;
};
// The rows in run order, and each one's id (append-step128/gqa4-d128/f16, ...).
std::vector<AppendItem> append_items();
std::string append_id(const AppendItem &it);

struct AppendResult {
  std::string id, status = "ok", reason;
  pkv_format fmt = PKV_FORMAT_INVALID;
  uint32_t rows = 0; // rows (tokens) per timed call
  double us = 0, rows_per_s = 0, src_gbs = 0, page_gbs = 0;
  double copy_us = 0, copy_gbs = 0; // the plain copy of the source's bytes into device memory
};

AppendResult measure_append(Env &e, const AppendItem &it);

// ---------------------------------------------------------------------------------------------
// Host overhead: ns per pool operation, us per decode call on a tiny batch (1 sequence, 16 tokens).

struct OverheadItem {
  const char *id, *what, *unit;
};
extern const OverheadItem kOverhead[7];

struct OverheadResult {
  std::string id, what, unit, status = "ok", reason;
  double value = 0;
};

// The items whose id contains filter (all with an empty one).
std::vector<OverheadResult> measure_overhead(Env &e, const std::string &filter);

// ---------------------------------------------------------------------------------------------
// Sequence images: pkv_seq_export / pkv_seq_import of one sequence of 32 layers (gqa4-d128, pages of
// 16) to and from host memory (pinned on a GPU) and device memory, against a plain copy of the same
// bytes in the same direction.

struct TransferItem {
  const char *op, *where; // "export"/"import", "host"/"device"
  bool device, to_image;
};
extern const TransferItem kTransfers[4];

struct TransferResult {
  const TransferItem *item = nullptr;
  std::string id, status = "ok", reason;
  uint64_t bytes = 0;
  double us = 0, gbs = 0, copy_us = 0, copy_gbs = 0, pct = 0;
};

TransferResult measure_transfer(Env &e, const TransferItem &it, const Formats &f, uint32_t tokens);

// ---------------------------------------------------------------------------------------------
// Extend: pkv_extend of `count` sequences' `fresh` new tokens over `cached` ones (pages of 16, host q
// and out), causal or with random tree masks; FLOPs counted as 4 x q_heads x head_dim per
// position a query sees (its q.k and its p.v, each a multiply and an add per value).

struct ExtendItem {
  const char *name;
  uint32_t count, cached, fresh;
  bool prefix; // the sequences are forks of one cached prefix
  bool tree;   // random tree masks rather than causal attention
};
extern const ExtendItem kExtends[4];     // the default run's (sized for a CPU)
extern const ExtendItem kExtendsFull[6]; // --full's

struct ExtendResult {
  const ExtendItem *item = nullptr;
  std::string id, status = "ok", reason;
  double us = 0, flops = 0, tflops = 0;
};

ExtendResult measure_extend(Env &e, const ExtendItem &it, const Shape &s, const Formats &f);

} // namespace bench
