// Limits that take too long or too much memory to reach through the API, checked on the library's
// internal parts (linked from its objects):
// - the CPU decode of a chunk that ends within one block of 2^32 tokens (a sequence of UINT32_MAX
//   tokens would need a pool of 2^32 rows): its block loop must end and see every token once. The page
//   table maps every page of the sequence to one real page, so no pool of that size is needed;
// - a sequence slot whose generation counter reaches its end (after 2^31 reuses) is retired, never
//   handed out again, so no handle of it comes back to life; handles with an even generation (never
//   handed out) are refused.
// The library's headers before cmocka's, whose fail() macro would rename pkv::fail.
#include "cpu/cpu_attention.hpp"
#include "error.hpp"
#include "handle_table.hpp"

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <csetjmp>
extern "C" {
#include <cmocka.h>
#include "tu_run.h"
}

#if !defined(_WIN32)
#include <unistd.h>
#endif

#include <cmath>
#include <vector>

namespace {

using namespace pkv;

void chunk_ending_near_2_to_the_32(const char *variant) {
  const uint32_t page_size = 1024, head_dim = 32, tokens = 41;
  PoolGeometry g{};
  g.layers = 1;
  g.kv_heads = 1;
  g.head_dim = head_dim;
  g.page_size = page_size;
  g.pages = 1;
  g.max_sequences = 1;
  g.table_stride = uint32_t((uint64_t(1) << 32) / page_size);
  g.k = make_plane_layout(PKV_FORMAT_F32, 1, page_size, head_dim);
  g.v = g.k;
  g.block_bytes = g.k.bytes + g.v.bytes;
  std::vector<float> block(g.block_bytes / 4, 0.0f); // K rows 0, V rows 1: every score 0, output 1
  for (size_t i = g.k.bytes / 4; i < block.size(); i++) block[i] = 1.0f;
  std::vector<uint32_t> table(g.table_stride, 0); // every page of the sequence is page 0
  g.base = DevPtr(uintptr_t(block.data()));
  g.table = DevPtr(uintptr_t(table.data()));

  const uint32_t length = UINT32_MAX;
  std::vector<float> q(head_dim, 0.5f), out(head_dim, NAN);
  float lse = NAN;
  AttendScratch scratch;
  const TokenView view{0, length, nullptr, 0};
  const AttendTask task{&g, 0, 0, table.data(), length - tokens, length, 1, 1, q.data(), &view, 1.0f, 0.0f, nullptr,
                        out.data(), &lse, &scratch};
  const AttendKernel kernel = attend_kernel(variant);
  assert_non_null(kernel.run);
#if !defined(_WIN32)
  alarm(30); // a loop that never ends stops the program here (elsewhere meson's timeout does)
#endif
  kernel.run(task);
#if !defined(_WIN32)
  alarm(0);
#endif
  for (uint32_t d = 0; d < head_dim; d++)
    if (std::fabs(out[d] - 1.0f) > 1e-6f) fail_msg("%s: out[%u] is %g, want 1", kernel.name, d, double(out[d]));
  if (std::fabs(lse - std::log(float(tokens))) > 1e-5f)
    fail_msg("%s: lse %g, want log(%u) = %g: tokens missed or repeated", kernel.name, double(lse), tokens,
             std::log(double(tokens)));
}

void test_chunk_near_2_to_the_32(void **) {
  chunk_ending_near_2_to_the_32(nullptr);
  chunk_ending_near_2_to_the_32("generic");
}

void assert_stale(const HandleTable &h, pkv_seq s) {
  uint32_t slot;
  if (h.live_slot(s, &slot)) fail_msg("handle 0x%016llx is live again (slot %u)", (unsigned long long)s.id, slot);
  try {
    h.resolve(s, "seq");
    fail_msg("resolve accepted 0x%016llx", (unsigned long long)s.id);
  } catch (const Error &e) {
    assert_int_equal(e.status, PKV_ERR_STALE_HANDLE);
  }
}

void test_generation_end_retires_slot(void **) {
  HandleTable h(2, UINT32_MAX - 3); // generations start at 0xfffffffc
  uint32_t slot;
  std::vector<pkv_seq> old;
  old.push_back(h.acquire(&slot)); // slot 0 at 0xfffffffd
  assert_int_equal(slot, 0);
  h.release(slot);
  old.push_back(h.acquire(&slot)); // 0xffffffff: the last generation
  assert_int_equal(slot, 0);
  h.release(slot);
  assert_int_equal(h.retired(), 1);
  assert_int_equal(h.live(), 0);
  for (pkv_seq s : old) assert_stale(h, s);
  // The only slot left is the other one; once it is in use, the table is full.
  const pkv_seq other = h.acquire(&slot);
  assert_int_equal(slot, 1);
  assert_true(h.full());
  assert_int_equal(h.live(), 1);
  for (pkv_seq s : old) assert_stale(h, s);
  // The retired slot's handles, with every generation a wrap could give it, stay refused.
  for (uint32_t gen : {0u, 1u, 2u, 3u, UINT32_MAX - 2, UINT32_MAX})
    assert_stale(h, pkv_seq{(old[0].id & ~(uint64_t(UINT32_MAX) << HandleTable::kSlotBits)) |
                            uint64_t(gen) << HandleTable::kSlotBits});
  // A forged handle of a free slot with its current (even) generation is no handle at all.
  h.release(slot);
  const uint64_t even = (other.id & ~(uint64_t(UINT32_MAX) << HandleTable::kSlotBits)) |
                        uint64_t((other.id >> HandleTable::kSlotBits & UINT32_MAX) + 1) << HandleTable::kSlotBits;
  assert_stale(h, pkv_seq{even});
}

} // namespace

int main() {
  const CMUnitTest tests[] = {cmocka_unit_test(test_chunk_near_2_to_the_32),
                              cmocka_unit_test(test_generation_end_retires_slot)};
  return tu_run_tests(tests, nullptr, nullptr);
}
