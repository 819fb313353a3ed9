// The decode planner (lib/plan.cpp, compiled in: it is internal), checked by the properties a plan
// must have rather than by the chunk sizes it picks: every sequence's chunks tile its context exactly
// at page boundaries, parts are numbered compactly, chosen plans fit the bounds a GPU sizes its plan
// buffer by, chosen chunks are whole multiples of the backend's granule, an explicit chunk
// size is kept unless the plan would not fit, and the shapes the planner promises (a uniform batch
// fills the workers, short sequences beside a long one stay whole, short items run on every worker).
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <csetjmp>
extern "C" {
#include <cmocka.h>
#include "tu_run.h"
}

#include <algorithm>
#include <vector>

#include "backend.hpp"
#include "plan.hpp"
#include "plan_cache.hpp"
extern "C" {
#include "testutil.h"
}

namespace {

using namespace pkv;

struct Batch {
  std::vector<uint32_t> lengths;
  uint32_t page_size, kv_heads, workers;
  uint32_t full_rate_workers = 0; // 0: all workers
  uint32_t granule_tokens = 64;    // a GPU block's stage
  bool record_per_head = false;
  std::vector<uint32_t> slots = {}; // page-table rows; empty: 1000 + the batch index

  uint32_t slot(uint32_t s) const { return slots.empty() ? 1000 + s : slots[s]; }
};

PlanConfig config(const Batch &b, PlanLimits limits, Balance balance) {
  PlanConfig c;
  c.workers = b.workers;
  c.full_rate_workers = b.full_rate_workers ? b.full_rate_workers : b.workers;
  c.fixed_cost_tokens = 64;
  c.granule_tokens = b.granule_tokens;
  c.limits = limits;
  c.balance = balance;
  c.record_per_head = b.record_per_head;
  return c;
}

DecodePlan plan_of(const Batch &b, uint32_t chunk_pages, PlanLimits limits, Balance balance = Balance::never) {
  std::vector<uint32_t> slots(b.lengths.size());
  for (uint32_t s = 0; s < slots.size(); s++) slots[s] = b.slot(s);
  return make_plan(config(b, limits, balance),
                   {b.lengths.data(), slots.data(), uint32_t(b.lengths.size()), b.page_size, b.kv_heads, chunk_pages});
}

// A record's copies of its sequence's page-table row and length.
void check_sequence_copy(const Batch &b, const PlanRecord &r) {
  if (r.seq == kNoSeq) {
    assert_int_equal(r.slot, 0);
    assert_int_equal(r.length, 0);
    return;
  }
  assert_int_equal(r.slot, b.slot(r.seq));
  assert_int_equal(r.length, b.lengths[r.seq]);
}

// Chunks in sequence order, each sequence's contiguous from 0 to its length (one empty chunk for an
// empty sequence), boundaries on pages, none longer than chunk_tokens; parts 0.. in order over split
// sequences, kNoPart for whole ones; each chunk one record of every KV head, or, where the backend
// takes a record per KV head, one for each in head order, alike but for the head.
void check_tiles(const Batch &b, const DecodePlan &p) {
  const uint32_t count = uint32_t(b.lengths.size());
  assert_int_equal(p.seq_chunks.size(), count + 1);
  assert_int_equal(p.seq_chunks[0], 0);
  assert_int_equal(p.seq_chunks[count], p.chunks());
  assert_int_equal(p.workers, 0);
  const uint32_t per_chunk = b.record_per_head ? b.kv_heads : 1;
  assert_int_equal(p.records_per_chunk, per_chunk);
  assert_int_equal(p.records.size(), uint64_t(p.chunks()) * per_chunk);
  for (size_t i = 0; i < p.records.size(); i++) {
    const PlanRecord &r = p.records[i], &first = p.records[i - i % per_chunk];
    check_sequence_copy(b, r);
    assert_int_equal(r.head, b.record_per_head ? uint32_t(i % per_chunk) : kAllHeads);
    assert_int_equal(r.seq, first.seq);
    assert_int_equal(r.token_begin, first.token_begin);
    assert_int_equal(r.token_end, first.token_end);
    assert_int_equal(r.part, first.part);
    assert_int_equal(r.first_part, first.first_part);
    assert_int_equal(r.siblings, first.siblings);
  }
  uint32_t next_part = 0;
  for (uint32_t s = 0; s < count; s++) {
    const uint32_t first = p.seq_chunks[s], last = p.seq_chunks[s + 1];
    assert_true(last > first);
    const bool split = last - first > 1;
    uint32_t at = 0;
    for (uint32_t c = first; c < last; c++) {
      const PlanRecord &ch = p.chunk(c);
      assert_int_equal(ch.seq, s);
      assert_int_equal(ch.token_begin, at);
      assert_true(ch.token_end >= ch.token_begin);
      assert_true(ch.token_end - ch.token_begin <= p.chunk_tokens);
      if (ch.token_end != b.lengths[s]) assert_int_equal(ch.token_end % b.page_size, 0);
      assert_true(ch.token_end > ch.token_begin || b.lengths[s] == 0);
      assert_int_equal(ch.first_part, split ? p.chunk(first).part : kNoPart);
      assert_int_equal(ch.siblings, last - first);
      assert_int_equal(ch.part, split ? next_part++ : kNoPart);
      at = ch.token_end;
    }
    assert_int_equal(at, b.lengths[s]);
  }
  assert_int_equal(p.parts, next_part);
}

// A balanced plan over the whole groups of KV heads among `full_rate` workers: chunk j * workers + w
// is worker w's j-th piece, fillers (kNoSeq) only after a worker's pieces; worker w serves KV head
// w % kv_heads, its group's workers the same tokens of the same sequence in each round; each
// (sequence, KV head) pair's pieces tile its context in token order at granule boundaries (one
// empty piece for an empty sequence), a split pair's on consecutive parts (every part used once); no
// worker's granules exceed an equal share of the batch's over the groups.
void check_balanced(const Batch &b, const DecodePlan &p, uint32_t full_rate) {
  const uint32_t count = uint32_t(b.lengths.size());
  const uint32_t groups = std::max<uint32_t>(1, full_rate / b.kv_heads), workers = groups * b.kv_heads;
  assert_int_equal(p.workers, workers);
  assert_int_equal(p.records.size() % workers, 0);
  assert_int_equal(p.records_per_chunk, 1);
  const uint64_t granule = (b.granule_tokens + b.page_size - 1) / b.page_size * b.page_size;
  uint64_t total = 0;
  for (uint32_t len : b.lengths) total += (len + granule - 1) / granule;
  const uint64_t share = std::max<uint64_t>(1, (total + groups - 1) / groups);
  std::vector<std::vector<const PlanRecord *>> pair(uint64_t(count) * b.kv_heads);
  for (uint32_t w = 0; w < workers; w++) {
    uint64_t granules = 0;
    bool filler = false;
    for (size_t c = w; c < p.records.size(); c += workers) {
      const PlanRecord &ch = p.records[c], &lead = p.records[c - w % b.kv_heads]; // the group's first worker's
      check_sequence_copy(b, ch);
      assert_int_equal(ch.seq, lead.seq);
      assert_int_equal(ch.token_begin, lead.token_begin);
      assert_int_equal(ch.token_end, lead.token_end);
      if (ch.seq == kNoSeq) {
        filler = true;
        continue;
      }
      assert_false(filler);
      assert_true(ch.seq < count);
      assert_int_equal(ch.head, w % b.kv_heads);
      granules += (ch.token_end - ch.token_begin + granule - 1) / granule;
      pair[uint64_t(ch.seq) * b.kv_heads + ch.head].push_back(&ch);
    }
    assert_true(granules <= share);
  }
  std::vector<int> part_used(p.parts, 0);
  for (uint32_t s = 0; s < count; s++) {
    for (uint32_t h = 0; h < b.kv_heads; h++) {
      std::vector<const PlanRecord *> pieces = pair[uint64_t(s) * b.kv_heads + h];
      assert_true(!pieces.empty());
      std::sort(pieces.begin(), pieces.end(),
                [](const PlanRecord *x, const PlanRecord *y) { return x->token_begin < y->token_begin; });
      const bool split = pieces.size() > 1;
      uint32_t at = 0;
      for (size_t k = 0; k < pieces.size(); k++) {
        const PlanRecord &ch = *pieces[k];
        assert_int_equal(ch.token_begin, at);
        assert_true(ch.token_end > ch.token_begin || b.lengths[s] == 0);
        assert_true(ch.token_end - ch.token_begin <= p.chunk_tokens);
        if (ch.token_end != b.lengths[s]) assert_int_equal(ch.token_end % granule, 0);
        assert_int_equal(ch.siblings, pieces.size());
        assert_int_equal(ch.first_part, split ? pieces[0]->part : kNoPart);
        assert_int_equal(ch.part, split ? pieces[0]->part + k : kNoPart);
        if (split) {
          assert_true(ch.part < p.parts);
          part_used[ch.part]++;
        }
        at = ch.token_end;
      }
      assert_int_equal(at, b.lengths[s]);
    }
  }
  for (int used : part_used) assert_int_equal(used, 1);
}

Batch random_batch(tu_rng *r) {
  Batch b;
  b.page_size = 1u << tu_below(r, 8); // 1..128
  b.kv_heads = 1 + tu_below(r, 16);
  b.workers = 1 + tu_below(r, 600);
  if (tu_below(r, 2)) b.full_rate_workers = 1 + tu_below(r, b.workers);
  b.granule_tokens = tu_below(r, 2) ? 64 : 1 + tu_below(r, 300);
  b.record_per_head = tu_below(r, 2);
  const uint32_t count = 1 + tu_below(r, 64);
  for (uint32_t i = 0; i < count; i++) b.slots.push_back(tu_below(r, 1u << 20));
  for (uint32_t i = 0; i < count; i++) {
    // Mostly short, some empty, a few long: the ragged batches engines decode.
    const uint32_t kind = tu_below(r, 8);
    b.lengths.push_back(kind == 0 ? 0 : kind == 1 ? 1 + tu_below(r, 200000) : 1 + tu_below(r, 5000));
  }
  return b;
}

void test_random_plans_tile_and_fit(void **) {
  tu_rng r = tu_rng_make(tu_seed());
  for (int round = 0; round < 300; round++) {
    const Batch b = random_batch(&r);
    const PlanLimits bounds = chosen_plan_bounds(uint32_t(b.lengths.size()), b.kv_heads, b.workers);
    const DecodePlan chosen = plan_of(b, 0, bounds);
    check_tiles(b, chosen);
    // In whole granules (a GPU block's stage: a partial one costs a whole one).
    const uint32_t granule_pages = (b.granule_tokens + b.page_size - 1) / b.page_size;
    assert_int_equal(chosen.chunk_tokens % (granule_pages * b.page_size), 0);
    assert_true(chosen.chunks() <= bounds.chunks);
    assert_true(chosen.parts <= bounds.parts);
    // A chosen plan needs no coarsening: it is the same when made without limits.
    const DecodePlan free_plan = plan_of(b, 0, PlanLimits{});
    assert_int_equal(free_plan.chunk_tokens, chosen.chunk_tokens);
    assert_int_equal(free_plan.chunks(), chosen.chunks());

    // An explicit chunk size is kept when its plan fits, else coarsened until it does.
    const uint32_t pages = 1 + tu_below(&r, 64);
    const DecodePlan forced = plan_of(b, pages, PlanLimits{});
    check_tiles(b, forced);
    assert_int_equal(forced.chunk_tokens, pages * b.page_size);
    const PlanLimits tight{uint32_t(b.lengths.size()) + tu_below(&r, 8), 1 + tu_below(&r, 8)};
    const DecodePlan coarse = plan_of(b, pages, tight);
    check_tiles(b, coarse);
    assert_true(coarse.chunks() <= tight.chunks);
    assert_true(coarse.parts <= tight.parts);
    assert_true(coarse.chunk_tokens >= pages * b.page_size);
  }
}

uint32_t chunks_of_seq(const DecodePlan &p, uint32_t s) { return p.seq_chunks[s + 1] - p.seq_chunks[s]; }

void test_uniform_batch_fills_workers(void **) {
  tu_rng r = tu_rng_make(tu_seed());
  for (int round = 0; round < 50; round++) {
    Batch b;
    b.page_size = 16;
    b.kv_heads = 1u << tu_below(&r, 4);
    // Workers a whole number of times the batch: one round of equal chunks fills them exactly.
    const uint32_t count = 1 + tu_below(&r, 32), slots = count * (2 + tu_below(&r, 7));
    b.workers = slots * b.kv_heads;
    b.lengths.assign(count, 16 * (4096 + tu_below(&r, 4096))); // long enough that every split pays
    const DecodePlan p = plan_of(b, 0, PlanLimits{});
    check_tiles(b, p);
    assert_int_equal(p.chunks(), slots);
    for (uint32_t s = 0; s < count; s++) assert_int_equal(chunks_of_seq(p, s), slots / count);

    // Where a part of the workers already runs at the full rate, one round over just those.
    const uint32_t full_rate_slots = count * (1 + tu_below(&r, slots / count));
    b.full_rate_workers = full_rate_slots * b.kv_heads;
    const DecodePlan q = plan_of(b, 0, PlanLimits{});
    check_tiles(b, q);
    assert_int_equal(q.chunks(), full_rate_slots);
  }
}

void test_short_beside_long_stay_whole(void **) {
  tu_rng r = tu_rng_make(tu_seed());
  for (int round = 0; round < 50; round++) {
    Batch b;
    b.page_size = 16;
    b.kv_heads = 1u << tu_below(&r, 4);
    b.workers = (32 + tu_below(&r, 100)) * b.kv_heads;
    const uint32_t shorts = 1 + tu_below(&r, 8), short_len = 16 * (1 + tu_below(&r, 16));
    b.lengths.push_back(16 * 4096 + tu_below(&r, 16 * 4096));
    b.lengths.insert(b.lengths.end(), shorts, short_len);
    const DecodePlan p = plan_of(b, 0, PlanLimits{});
    check_tiles(b, p);
    assert_true(chunks_of_seq(p, 0) > 1);
    for (uint32_t s = 1; s <= shorts; s++) assert_int_equal(chunks_of_seq(p, s), 1);
  }
}

// Short items are bound by their latency, not by a share of the bandwidth: 4K + 7 x 256 tokens
// with twice the full-rate workers (float head_dim 128 on the H200) runs more, shorter items over all
// the workers (16-page chunks, 10% faster) rather than one round of 29-page chunks over the full-rate
// ones.
void test_short_items_use_every_worker(void **) {
  tu_rng r = tu_rng_make(tu_seed());
  for (uint32_t kv_heads = 1; kv_heads <= 16; kv_heads *= 2) {
    Batch b;
    b.page_size = 16;
    b.kv_heads = kv_heads;
    b.full_rate_workers = 16 * kv_heads + tu_below(&r, kv_heads); // 16 chunks a round
    b.workers = 2 * b.full_rate_workers;
    b.lengths.push_back(4096);
    b.lengths.insert(b.lengths.end(), 7, 256);
    const DecodePlan p = plan_of(b, 0, PlanLimits{});
    check_tiles(b, p);
    const uint64_t items = uint64_t(p.chunks()) * b.kv_heads;
    assert_true(items > b.full_rate_workers);
    assert_true(items <= b.workers);
    for (uint32_t s = 1; s <= 7; s++) assert_int_equal(chunks_of_seq(p, s), 1);
  }
}

// A backend that answers decode_config only: what the plan cache asks of it.
class ConfigBackend final : public Backend {
 public:
  PlanConfig plan;
  uint32_t asked = 0;
  pkv_backend kind() const override { return PKV_BACKEND_CPU; }
  DecodeConfig decode_config(const PoolGeometry &, uint32_t rows) override {
    asked++;
    DecodeConfig c;
    c.plan = plan;
    c.row_tiles = rows; // tells the configurations of different shapes apart
    return c;
  }
  DevPtr alloc(uint64_t) override { fail_msg("unexpected alloc"); return 0; }
  void release(DevPtr) noexcept override {}
  void write_device(DevPtr, const void *, uint64_t) override { fail_msg("unexpected write_device"); }
  void copy_pages(const PoolGeometry &, const PageCopy *, uint32_t) override { fail_msg("unexpected copy_pages"); }
  void scatter(const PoolGeometry &, const ScatterArgs &) override { fail_msg("unexpected scatter"); }
  void gather(const PoolGeometry &, const GatherArgs &) override { fail_msg("unexpected gather"); }
  void prepare_decode(const PoolGeometry &, const DecodeBatch &) override { fail_msg("unexpected prepare_decode"); }
  void prepare_extend(const PoolGeometry &, const ExtendBatch &) override { fail_msg("unexpected prepare_extend"); }
  void decode(const PoolGeometry &, const DecodeBatch &) override { fail_msg("unexpected decode"); }
  void extend(const PoolGeometry &, const ExtendBatch &) override { fail_msg("unexpected extend"); }
  void export_image(const PoolGeometry &, const ExportArgs &) override { fail_msg("unexpected export_image"); }
  uint64_t import_image(const PoolGeometry &, const ImportArgs &) override {
    fail_msg("unexpected import_image");
    return 0;
  }
  void read_caller(void *, const void *, pkv_memory, uint64_t) override { fail_msg("unexpected read_caller"); }
  void synchronize() override {}
  double read_bandwidth(uint64_t) override { return 0.0; }
};

// The cache asks the backend once per shape; its plan stays resident while nothing it was made from
// changes (lengths, page-table rows, starts, query tokens, chunk size, the configuration's plan
// part), and is the plan make_plan makes, its records carrying the starts and query rows.
void test_cache_reuses_same_batch(void **) {
  Batch b{{1000, 70000, 0, 5}, 16, 8, 264};
  std::vector<uint32_t> slots = {3, 1, 4, 2}, starts = {0, 0, 0, 0};
  uint32_t q_tokens = 1;
  ConfigBackend backend;
  backend.plan = config(b, PlanLimits{}, Balance::never);
  const PoolGeometry g{};
  PlanCache cache;
  auto get = [&](uint32_t rows, uint32_t chunk_pages) -> const PlanCache::Entry & {
    return cache.get(backend, g, rows,
                     {b.lengths.data(), slots.data(), 4, b.page_size, b.kv_heads, chunk_pages, starts.data(), q_tokens});
  };
  auto expect_resident = [&](uint32_t rows, uint32_t chunk_pages, bool resident) {
    const PlanCache::Entry &e = get(rows, chunk_pages);
    assert_int_equal(e.resident, resident);
    assert_int_equal(e.config.row_tiles, rows);
    b.slots = slots;
    DecodePlan fresh = plan_of(b, chunk_pages, PlanLimits{});
    for (PlanRecord &r : fresh.records)
      if (r.seq != kNoSeq) r.start = starts[r.seq], r.q_row = r.seq * q_tokens, r.tokens = q_tokens;
    assert_int_equal(e.plan.records.size(), fresh.records.size());
    assert_memory_equal(e.plan.records.data(), fresh.records.data(), fresh.records.size() * sizeof(PlanRecord));
    cache.set_resident(true);
  };
  expect_resident(4, 0, false);
  expect_resident(4, 0, true);
  assert_int_equal(backend.asked, 1);
  expect_resident(8, 0, true); // another shape, the same plan configuration
  assert_int_equal(backend.asked, 2);
  expect_resident(4, 0, true);
  assert_int_equal(backend.asked, 2);
  b.lengths[1]++;
  expect_resident(4, 0, false);
  std::swap(slots[0], slots[2]);
  expect_resident(4, 0, false);
  expect_resident(4, 4, false);
  expect_resident(4, 4, true);
  starts[1] = 32; // a window moved on
  expect_resident(4, 4, false);
  expect_resident(4, 4, true);
  q_tokens = 3; // speculative tokens: each sequence's rows move
  expect_resident(4, 4, false);
  expect_resident(4, 4, true);
  // A failed backend call leaves the plan buffer unknown.
  cache.set_resident(false);
  assert_false(get(4, 4).resident);
}

void test_random_balanced_plans(void **) {
  tu_rng r = tu_rng_make(tu_seed());
  for (int round = 0; round < 300; round++) {
    const Batch b = random_batch(&r);
    const uint32_t workers = b.full_rate_workers ? b.full_rate_workers : b.workers;
    check_balanced(b, plan_of(b, 0, PlanLimits{}, Balance::always), workers);
    // Within the bounds a GPU sizes its plan buffer by, or a uniform plan that fits them.
    const PlanLimits bounds = chosen_plan_bounds(uint32_t(b.lengths.size()), b.kv_heads, b.workers);
    const DecodePlan chosen = plan_of(b, 0, bounds, Balance::cheaper);
    if (chosen.workers) {
      check_balanced(b, chosen, workers);
      assert_true(chosen.chunks() <= bounds.records);
      assert_true(chosen.parts <= bounds.parts);
    } else {
      check_tiles(b, chosen);
      assert_true(chosen.chunks() <= bounds.chunks);
    }
    // An explicit chunk size is a uniform plan's.
    check_tiles(b, plan_of(b, 1 + tu_below(&r, 64), PlanLimits{}, Balance::always));
  }
}

// A balanced plan's groups are whole: 8 x 32K tokens of 8 KV heads over 132 full-rate workers of
// 264 (float head_dim 128 on the H200) is 16 groups, 128 workers; of 4 KV heads (head_dim 256),
// 33 groups, 132 workers. The planner's choice keeps short items uniform: their latency, not a share
// of the bandwidth, bounds them; and a batch that fills the workers exactly.
void test_balanced_groups_are_whole(void **) {
  for (uint32_t kv_heads : {8u, 4u}) {
    Batch b{std::vector<uint32_t>(8, 32768), 16, kv_heads, 264, 132};
    check_balanced(b, plan_of(b, 0, PlanLimits{}, Balance::always), 132);
  }
  Batch small{{1024}, 16, 8, 264, 132};
  check_tiles(small, plan_of(small, 0, PlanLimits{}, Balance::cheaper));
  Batch ragged{{4096, 256, 256, 256, 256, 256, 256, 256}, 16, 8, 264, 132};
  check_tiles(ragged, plan_of(ragged, 0, PlanLimits{}, Balance::cheaper));
  Batch even{std::vector<uint32_t>(33, 32768), 16, 4, 132, 132};
  check_tiles(even, plan_of(even, 0, PlanLimits{}, Balance::cheaper));
}

} // namespace

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_plans_tile_and_fit),
      cmocka_unit_test(test_uniform_batch_fills_workers),
      cmocka_unit_test(test_short_beside_long_stay_whole),
      cmocka_unit_test(test_short_items_use_every_worker),
      cmocka_unit_test(test_cache_reuses_same_batch),
      cmocka_unit_test(test_random_balanced_plans),
      cmocka_unit_test(test_balanced_groups_are_whole),
  };
  return tu_run_tests(tests, NULL, NULL);
}
