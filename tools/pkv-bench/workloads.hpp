// The matrix (docs/benchmarks.md, "Workloads"): shapes, K/V format pairs, workload templates, and
// the workloads they expand to.
#pragma once

#include "pagedkv.h"

#include <cstdint>
#include <string>
#include <vector>

namespace bench {

struct Shape {
  const char *name;
  uint32_t hq, hkv, d;
  bool main; // the quantized formats run on the main shapes only
};
extern const Shape kShapes[4];

struct Formats {
  pkv_format k, v;
  const char *name;
  bool quant;
};
extern const Formats kFormats[7];

// Bytes one row of d values takes in a page format (scales included), from the format's definition.
uint64_t row_bytes(pkv_format f, uint32_t d);
uint64_t token_bytes(const Shape &s, pkv_format k, pkv_format v);

// The format of queries and outputs: BF16 for BF16 pools, F16 otherwise.
pkv_format io_format(const Formats &f);

// The attention variants (pagedkv.h, section 7a) a decode row asks for: none; `scores`, every one
// that changes scores or the softmax (Gemma 2's soft cap of 50, ALiBi slopes, a sink a head); or a
// window of 4096 positions alone. A row with variants is measured against the plain decode of the
// same paged batch.
enum class Variant { none, scores, window4K };
constexpr uint32_t kBenchWindow = 4096;

// Batches are written in tools/batch_notation.hpp ("8x4K", "1x4K+7x256", "32~16..4K").
struct Tmpl {
  const char *name;                 // "%s" is replaced by the batch
  std::vector<std::string> batches;
  unsigned shapes, formats;         // bit i selects kShapes[i] / kFormats[i]
  std::vector<uint32_t> pages;      // page sizes
  std::vector<uint32_t> qtokens;    // query tokens per sequence
  const char *cpu_note;             // full matrix: what the default (CPU) run does instead
  Variant variant = Variant::none;
};

// The whole matrix: what a GPU runs (--full).
std::vector<Tmpl> full_matrix();
// The subset that fits a 2-core CPU in a few minutes (the default run).
std::vector<Tmpl> cpu_matrix();

struct Workload {
  std::string id, name, batch, group;
  const Shape *shape;
  const Formats *fmt;
  uint32_t page, qtok;
  std::vector<uint32_t> lens;
  const char *cpu_note;
  Variant variant;
};

std::vector<Workload> expand(const std::vector<Tmpl> &tmpls);

// "8x4096", "1x4096+7x256"; more than three runs of equal lengths: "32 in 16..3998".
std::string lengths_summary(const std::vector<uint32_t> &lens);

} // namespace bench
