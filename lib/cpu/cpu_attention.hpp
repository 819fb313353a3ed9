// The CPU backend's decode of one chunk for one KV head: online softmax over blocks of tokens, every
// query row of the KV head's group against each K/V row decoded once. Compiled twice: for any
// processor of the target, and (x86-64, GCC or Clang) for AVX2 with FMA, taken at run time
// where the processor has them.
#pragma once

#include <cstdint>
#include <vector>

#include "../backend.hpp"

namespace pkv {

// The CPU backend's device pointers are host addresses.
inline uint8_t *host(DevPtr p) { return reinterpret_cast<uint8_t *>(uintptr_t(p)); }

// A worker thread's buffers, kept between calls: once warm, a decode's chunks allocate nothing.
struct AttendScratch {
  std::vector<float> q, acc, keys, values, m, l, scores;
};

// One chunk of one sequence for the query rows of one KV head (every query token times every head
// of the group): the chunk's normalised output and its log-sum-exp per row. Query token q sees
// positions below length - q_tokens + q + 1.
struct ChunkTask {
  const PoolGeometry *g;
  const DecodeBatch *b;
  const PlanRecord *chunk;
  uint32_t kv_head;
  float *out; // [q_tokens * group][head_dim]
  float *lse; // [q_tokens * group]
  AttendScratch *scratch;
};

struct AttendKernel {
  void (*run)(const ChunkTask &task);
  const char *name; // "AVX2 + FMA" or "generic"
};

// The variant for `want`, PKV_CPU_KERNEL's value: null or empty, the widest this processor runs;
// "generic", the portable one (for A/B runs of one binary); any other value, none (run null).
AttendKernel attend_kernel(const char *want);

} // namespace pkv
