// The GPU backend's host code on a stand-in device (host memory; kernels launched into nothing):
// what pkv_decode_prepare puts into the pool's plan buffer, read back and checked against the
// contract the kernels read it by (lib/kernels/kernel_params.h): the header, and records that carry
// their sequences' page-table rows, lengths and starts and cover every (sequence, KV head)'s context
// exactly once, in parts
// numbered as the merge expects, byte for byte the planner's records. Uniform and balanced plans,
// fillers included, for the tensor-core kernel (a record per KV head) and the CUDA-core kernel (a
// record per chunk); every transfer must stay inside the allocation it writes, as a real device
// would insist. Also the uploads themselves: an upload's pieces packed in ranges, and a write larger
// than a staging chunk landing whole. Runs without a GPU.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// The library's headers first: cmocka's fail() macro would rename pkv::fail.
#include "error.hpp"
#include "fake_device.hpp"
#include "gpu/gpu_backend.hpp"
#include "gpu/staging.hpp"
#include "kernels/kernel_params.h"
#include "plan.hpp"
extern "C" {
#include "testutil.h"
}

#include <cstdarg>
#include <cstddef>
#include <csetjmp>
extern "C" {
#include <cmocka.h>
#include "tu_run.h"
}

namespace {

using namespace pkv;

constexpr uint32_t kMaxSequences = 16, kPageSize = 16, kMaxTokens = 128 * 1024;

struct Setup {
  FakeDevice *device; // owned by the backend
  std::unique_ptr<Backend> backend;
  PoolGeometry g{};
};

// A backend on a fresh stand-in device, with the decode kernel family PKV_KERNEL_FAMILY names, and
// a pool geometry of one page whose plan buffer is the backend's size for it; `threads` pack uploads.
Setup make_setup(const char *family, uint32_t kv_heads, uint32_t head_dim, pkv_format format, uint32_t threads = 0,
                 FakeLedger *ledger = nullptr) {
  tu_set_env("PKV_KERNEL_FAMILY", family);
  auto device = std::make_unique<FakeDevice>(ledger);
  Setup s;
  s.device = device.get();
  try {
    s.backend = make_gpu_backend(std::move(device), nullptr, threads);
  } catch (const Error &e) {
    fail_msg("the backend on the stand-in device: %s", e.message.c_str());
  }
  PoolGeometry &g = s.g;
  g.layers = 1;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.page_size = kPageSize;
  g.pages = 1;
  g.max_sequences = kMaxSequences;
  g.table_stride = kMaxTokens / kPageSize;
  g.k = make_plane_layout(format, kv_heads, kPageSize, head_dim);
  g.v = make_plane_layout(format, kv_heads, kPageSize, head_dim);
  g.block_bytes = g.k.bytes + g.v.bytes;
  g.base = s.backend->alloc(g.total_bytes());
  g.table = s.backend->alloc(g.table_bytes());
  g.plan = s.backend->alloc(s.backend->plan_buffer_bytes(g));
  return s;
}

uint64_t align16(uint64_t n) { return (n + 15) / 16 * 16; }

// Puts the batch's plan, made as the pool makes it under the backend's configuration (with the
// balance asked for), on the stand-in device through prepare_decode and checks what arrived.
void check_upload(Setup &s, const std::vector<uint32_t> &lengths, Balance balance, bool per_head) {
  const PoolGeometry &g = s.g;
  const uint32_t count = uint32_t(lengths.size()), rows = 4; // GQA groups of 4, one query token
  Backend &b = *s.backend;
  DecodeConfig config = b.decode_config(g, rows);
  config.plan.balance = balance;
  assert_int_equal(config.plan.record_per_head, per_head);
  // Page-table rows in no particular order, none the batch index.
  std::vector<uint32_t> slots(count), starts(count);
  for (uint32_t i = 0; i < count; i++) slots[i] = (7 * i + 3) % kMaxSequences, starts[i] = (i % 5) * g.page_size;
  const DecodePlan plan =
      make_plan(config.plan, {lengths.data(), slots.data(), count, g.page_size, g.kv_heads, 0, starts.data(), 3});
  if ((balance == Balance::never) != (plan.workers == 0))
    fail_msg("kv_heads %u, head_dim %u, %zu sequences (the first %u tokens): a %s plan where a %s one was asked for",
             g.kv_heads, g.head_dim, lengths.size(), lengths[0], plan.workers ? "balanced" : "uniform",
             balance == Balance::never ? "uniform" : "balanced");

  DecodeBatch batch{};
  batch.count = count;
  batch.q_heads = rows * g.kv_heads;
  batch.q_tokens = 1;
  batch.q_format = batch.out_format = PKV_FORMAT_F32;
  batch.memory = PKV_MEMORY_DEVICE;
  batch.seq_slots = slots.data();
  batch.lengths = lengths.data();
  batch.config = &config;
  batch.plan = &plan;
  try {
    b.prepare_decode(g, batch);
  } catch (const Error &e) {
    fail_msg("prepare_decode of %zu records: %s", plan.records.size(), e.message.c_str());
  }

  // The buffer's arrays at the offsets its capacity fixes: header, sequence offsets, records.
  const uint64_t at_seq_chunks = align16(sizeof(PkvPlanHeader));
  const uint64_t at_records = at_seq_chunks + align16(4 * (kMaxSequences + 1));
  const uint8_t *buffer = s.device->at(g.plan, at_records);
  assert_non_null(buffer);
  PkvPlanHeader header;
  std::memcpy(&header, buffer, sizeof header);
  assert_int_equal(header.count, count);
  assert_int_equal(header.parts, plan.parts);
  assert_int_equal(header.n_records, per_head && !plan.workers ? plan.chunks() * g.kv_heads : plan.chunks());
  const uint8_t *record_bytes = s.device->at(g.plan + at_records, uint64_t(header.n_records) * sizeof(PkvRecord));
  assert_non_null(record_bytes);
  std::vector<PkvRecord> records(header.n_records);
  std::memcpy(records.data(), record_bytes, records.size() * sizeof(PkvRecord));
  assert_int_equal(header.n_records, plan.records.size());
  assert_memory_equal(record_bytes, plan.records.data(), plan.records.size() * sizeof(PlanRecord));

  // Each (sequence, KV head)'s records, in token order, tile [0, length): one record with part
  // kNoPart, or `siblings` records with parts first_part, first_part + 1, ...
  const uint32_t heads = per_head ? g.kv_heads : 1;
  std::vector<std::vector<PkvRecord>> by_pair(size_t(count) * heads);
  uint32_t fillers = 0;
  for (const PkvRecord &r : records) {
    if (r.seq == kNoSeq) {
      fillers++;
      continue;
    }
    assert_true(r.seq < count);
    assert_int_equal(r.slot, slots[r.seq]);
    assert_int_equal(r.length, lengths[r.seq]);
    assert_int_equal(r.start, starts[r.seq]);
    assert_int_equal(r.q_row, r.seq * 3); // q_tokens 3: sequence b's rows from 3 b
    assert_int_equal(r.tokens, 3);
    if (per_head) assert_true(r.head < g.kv_heads);
    else assert_int_equal(r.head, kAllHeads);
    by_pair[size_t(r.seq) * heads + (per_head ? r.head : 0)].push_back(r);
  }
  if (!plan.workers) assert_int_equal(fillers, 0);
  std::vector<bool> part_used(plan.parts, false);
  for (uint32_t seq = 0; seq < count; seq++)
    for (uint32_t h = 0; h < heads; h++) {
      std::vector<PkvRecord> &pieces = by_pair[size_t(seq) * heads + h];
      assert_false(pieces.empty());
      std::sort(pieces.begin(), pieces.end(),
                [](const PkvRecord &x, const PkvRecord &y) { return x.token_begin < y.token_begin; });
      uint32_t next = 0;
      for (size_t i = 0; i < pieces.size(); i++) {
        const PkvRecord &r = pieces[i];
        assert_int_equal(r.token_begin, next);
        assert_true(r.token_end > r.token_begin || lengths[seq] == 0);
        next = r.token_end;
        assert_int_equal(r.siblings, pieces.size());
        if (pieces.size() == 1) {
          assert_int_equal(r.part, kNoPart);
          continue;
        }
        assert_int_equal(r.part, pieces[0].first_part + i);
        assert_int_equal(r.first_part, pieces[0].first_part);
        assert_true(r.part < plan.parts);
        // A part is one (chunk, KV head)'s where the record is one KV head's; the CUDA-core kernel
        // index a chunk's part by KV head themselves.
        if (!per_head || plan.workers) {
          assert_false(part_used[r.part]);
          part_used[r.part] = true;
        }
      }
      assert_int_equal(next, lengths[seq]);
    }
}

// Batches with a long sequence beside short ones (balanced plans leave workers fillers there), a
// uniform one, one of a single sequence, and one with empty and sub-page sequences.
const std::vector<std::vector<uint32_t>> &batches() {
  static const std::vector<std::vector<uint32_t>> all = {
      {kMaxTokens, 8192, 8192, 8192, 8192, 8192, 8192, 8192},
      {4096, 256, 256, 256, 256, 256, 256, 256},
      std::vector<uint32_t>(8, 32768),
      {1024},
      {32768},
      {0, 1, 17, 1000, 5000, 40000},
  };
  return all;
}

void run_all(const char *kernel, bool per_head, const std::vector<Balance> &balances) {
  struct Shape {
    uint32_t kv_heads, head_dim;
    pkv_format format;
  };
  for (const Shape &shape : {Shape{8, 128, PKV_FORMAT_F16}, Shape{4, 256, PKV_FORMAT_Q4_0}, Shape{1, 64, PKV_FORMAT_Q8_0}}) {
    Setup s = make_setup(kernel, shape.kv_heads, shape.head_dim, shape.format);
    for (Balance balance : balances)
      for (const std::vector<uint32_t> &lengths : batches()) check_upload(s, lengths, balance, per_head);
  }
}

void tensor_core_uniform(void **) { run_all(nullptr, true, {Balance::never}); }
void tensor_core_balanced(void **) { run_all(nullptr, true, {Balance::always}); }
void cuda_core_uniform(void **) { run_all("cuda_core", false, {Balance::never}); }

// A balanced plan where a uniform one was uploaded before it, and back: the records are each
// plan's own, nothing left over from the other.
void alternating_plans(void **) {
  Setup s = make_setup(nullptr, 8, 128, PKV_FORMAT_F16);
  for (int round = 0; round < 2; round++)
    for (Balance balance : {Balance::always, Balance::never}) check_upload(s, batches()[0], balance, true);
}

// Random bytes, none of them zero, so that a piece that is not copied shows.
std::vector<uint8_t> random_bytes(tu_rng *rng, size_t n) {
  std::vector<uint8_t> b(n);
  for (uint8_t &x : b) x = uint8_t(1 + tu_below(rng, 255));
  return b;
}

// An upload of pieces with gaps between them (some pieces empty, some crossing kSendChunk
// boundaries; every other upload of kStreamUpload bytes or more, packed by streaming stores), read
// back in random windows: each window holds the pieces' bytes where they were placed and zeros
// between them, as a layout built here says.
void upload_ranges(void **) {
  tu_rng rng = tu_rng_make(tu_seed());
  for (int round = 0; round < 20; round++) {
    gpu::Upload up;
    std::vector<std::vector<uint8_t>> pieces;
    std::vector<uint8_t> want;
    const int n = 1 + int(tu_below(&rng, 6));
    for (int i = 0; i < n; i++) {
      size_t bytes = tu_below(&rng, 4) == 0 ? 0 : 1 + tu_below(&rng, uint32_t(gpu::kSendChunk + 1000));
      if (round % 2 && i == 0) bytes = gpu::kStreamUpload + tu_below(&rng, 1000);
      pieces.push_back(random_bytes(&rng, bytes));
      uint64_t at;
      if (tu_below(&rng, 2)) {
        at = up.add(pieces.back().data(), bytes);
      } else {
        at = align16(up.total() + tu_below(&rng, 5000));
        up.place(at, pieces.back().data(), bytes);
      }
      want.resize(std::max<size_t>(want.size(), at + bytes), 0);
      std::copy(pieces.back().begin(), pieces.back().end(), want.begin() + at);
    }
    assert_int_equal(up.total(), want.size());
    for (int w = 0; w < 8 && !want.empty(); w++) {
      const uint64_t begin = tu_below(&rng, uint32_t(want.size()));
      const uint64_t bytes = 1 + tu_below(&rng, uint32_t(want.size() - begin));
      std::vector<uint8_t> got(bytes + 2, 0xa5);
      up.copy_range(got.data() + 1, begin, bytes);
      assert_int_equal(got[0], 0xa5);
      assert_int_equal(got[bytes + 1], 0xa5);
      assert_memory_equal(got.data() + 1, want.data() + begin, bytes);
    }
  }
}

// A write lands whole, byte for byte, where it was sent, packed by the calling thread alone and by
// several: one of several chunks (and a last part of one; packed by streaming stores), and one of
// less than a chunk a thread. Its pieces are queued in order, whichever thread packed them.
void write_lands_whole(uint32_t threads, uint64_t bytes) {
  FakeLedger ledger;
  Setup s = make_setup(nullptr, 8, 128, PKV_FORMAT_F16, threads, &ledger);
  tu_rng rng = tu_rng_make(tu_seed());
  const DevPtr dst = s.backend->alloc(bytes);
  const std::vector<uint8_t> src = random_bytes(&rng, size_t(bytes));
  ledger.recording = true;
  try {
    s.backend->write_device(dst, src.data(), bytes);
    s.backend->synchronize();
  } catch (const Error &e) {
    fail_msg("the write: %s", e.message.c_str());
  }
  ledger.recording = false;
  assert_memory_equal(s.device->at(dst, bytes), src.data(), bytes);
  unsigned long long end = 0; // where the copies so far end
  for (const FakeString &w : ledger.writes) {
    unsigned long long at = 0, n = 0;
    assert_int_equal(std::sscanf(w.c_str(), "copy to %llu: %llu bytes", &at, &n), 2);
    if (at != end) fail_msg("with %u threads a copy to %llu followed copies ending at %llu", threads, at, end);
    end = at + n;
  }
  assert_int_equal(end, bytes);
  s.backend->release(dst);
}
void large_write_lands_whole(void **) {
  tu_rng rng = tu_rng_make(tu_seed() + 1);
  for (uint32_t threads : {1, 3}) {
    write_lands_whole(threads, gpu::kStreamUpload + 16 * (1 + tu_below(&rng, 1000)));
    write_lands_whole(threads, gpu::kSmallUpload + 1 + tu_below(&rng, uint32_t(gpu::kSendChunk)));
  }
}

} // namespace

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(tensor_core_uniform),
      cmocka_unit_test(tensor_core_balanced),
      cmocka_unit_test(cuda_core_uniform),
      cmocka_unit_test(alternating_plans),
      cmocka_unit_test(upload_ranges),
      cmocka_unit_test(large_write_lands_whole),
  };
  return tu_run_tests(tests, nullptr, nullptr);
}
