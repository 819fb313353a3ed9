// The CPU backend's attention of query rows of one KV head over a range of a sequence's positions
// (decode's chunks, extend's blocks of new tokens): online softmax over blocks of tokens, every query
// row against each K/V row decoded once. Compiled for any processor of the target, on x86-64 (GCC
// or Clang) for AVX2 with FMA and F16C and for AVX-512 too (the widest the processor runs is taken
// at run time), and on aarch64 for NEON too (every ARMv8-A processor has it: taken by default).
#pragma once

#include <cstdint>
#include <vector>

#include "../backend.hpp"

namespace pkv {

// The CPU backend's device pointers are host addresses.
inline uint8_t *host(DevPtr p) { return reinterpret_cast<uint8_t *>(uintptr_t(p)); }

// Which positions one query token (at position end - 1) sees: those in [begin, end) (begin: its
// window's start); with a mask row, of those from `mask_from` on only the ones whose bit
// (position - mask_from) is set (bit j: byte j / 8, bit j % 8).
struct TokenView {
  uint64_t begin, end;
  const uint8_t *mask_row; // null: every position below end
  uint64_t mask_from;
};

// A worker thread's buffers, kept between calls: once warm, an item allocates nothing.
struct AttendScratch {
  std::vector<float> q, acc, keys, values, m, l, scores;
  std::vector<TokenView> views;
  std::vector<float> out, lse; // extend's rows before they are stored in the output format
};

// Query rows of one KV head against positions [begin, end) of one sequence's pages: the rows'
// normalised output and log-sum-exp over what each sees there, positions below `begin` never read.
// The scores are scaled, soft-capped and ALiBi-biased as pagedkv.h (section 7a) says; a sink joins
// once the partial results are whole (add_sink). Rows are query tokens times the
// KV head's group of query heads: row r is token r / group's head r % group. Decode runs a chunk of
// a sequence for its query tokens, extend a block of a sequence's new tokens over all it sees.
struct AttendTask {
  const PoolGeometry *g;
  uint32_t layer, kv_head;
  const uint32_t *pages; // the sequence's page-table row
  uint64_t begin, end;
  uint32_t tokens, group;
  const float *q;         // [tokens * group][head_dim]
  const TokenView *views; // [tokens]
  float scale;
  float softcap;       // 0: none
  const float *slopes; // the ALiBi slopes of the KV head's group of query heads, [group], or null
  float *out; // [tokens * group][head_dim]
  float *lse; // [tokens * group]
  AttendScratch *scratch;
};

// The FP8 scale of a plane's rows of (layer, head) (the CPU's scales are host memory); 1 for the
// other formats.
inline float plane_scale(const PoolGeometry &g, bool v, uint32_t layer, uint32_t head) {
  if (!is_fp8((v ? g.v : g.k).format)) return 1.0f;
  return reinterpret_cast<const float *>(host(g.scales))[g.scale_index(v, layer, head)];
}

// The page-table row of a sequence slot (the CPU's table is host memory).
inline const uint32_t *page_row(const PoolGeometry &g, uint32_t seq_slot) {
  return reinterpret_cast<const uint32_t *>(host(g.table)) + size_t(seq_slot) * g.table_stride;
}

// Rows [first, first + tokens) of q ([rows][q_heads][head_dim] in `format`), the heads of KV head
// kv_head's group, as floats [tokens][group][head_dim] into dst.
void load_queries(const PoolGeometry &g, pkv_format format, const void *q, uint64_t first, uint32_t tokens,
                  uint32_t q_heads, uint32_t kv_head, std::vector<float> &dst);

// Joins a sink logit to a row's softmax (pagedkv.h, section 7a): out ([D]) and *lse, whole over the
// positions the row sees, become those of the softmax whose denominator also holds e^sink.
void add_sink(float *out, uint32_t D, float *lse, float sink);

struct AttendKernel {
  void (*run)(const AttendTask &task);
  const char *name; // "AVX-512", "AVX2 + FMA + F16C", "NEON" or "generic"
};

// The variant for `want`, PKV_CPU_KERNEL's value: null or empty, the widest this processor runs; a
// variant's name (attend_kernel_names), that one (to test each and for A/B runs of one binary), or
// where this processor cannot run it its name alone (run null); a name this build lacks, neither.
AttendKernel attend_kernel(const char *want);
// The names PKV_CPU_KERNEL may take in this build, for error texts.
const char *attend_kernel_names();

} // namespace pkv
