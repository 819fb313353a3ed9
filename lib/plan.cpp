#include "plan.hpp"

#include <algorithm>
#include <cmath>

namespace pkv {

namespace {

// The planner's inputs in one place.
struct PlanRequest {
  const uint32_t *lengths;
  uint32_t count, page_size, kv_heads, chunk_pages;
  uint32_t workers, full_rate_workers, min_chunk_tokens, granule_tokens;
  PlanLimits limits;
  Balance balance;
};

// The most rounds of work items the planner considers: past that, chunks are short enough.
constexpr uint64_t kMaxWaves = 4;

uint64_t pages_of(uint64_t tokens, uint32_t page_size) { return (tokens + page_size - 1) / page_size; }

// The workers that run at the full rate, at least one and at most all.
uint32_t full_rate_of(const PlanRequest &req) {
  return std::min(std::max<uint32_t>(1, req.workers), std::max<uint32_t>(1, req.full_rate_workers));
}

// The pages of a granule (a work item's unit of tokens): at least one.
uint64_t granule_pages(const PlanRequest &req) { return pages_of(std::max<uint32_t>(1, req.granule_tokens), req.page_size); }

// Chunks that run at once: every chunk is an item for each KV head.
uint64_t chunk_slots(uint64_t workers, uint32_t kv_heads) {
  return std::max<uint64_t>(1, workers / std::max<uint32_t>(1, kv_heads));
}

// Chunks of `chunk_pages` over the batch.
uint64_t chunks_of(const std::vector<uint64_t> &pages, uint64_t chunk_pages) {
  uint64_t n = 0;
  for (uint64_t p : pages) n += std::max<uint64_t>(1, (p + chunk_pages - 1) / chunk_pages);
  return n;
}

// The shortest chunk with which the batch's chunks number at most `cap`.
uint64_t shortest_chunk(const std::vector<uint64_t> &pages, uint64_t cap, uint64_t min_pages, uint64_t longest) {
  uint64_t lo = min_pages, hi = std::max(min_pages, longest); // chunks_of(hi) = count <= cap
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (chunks_of(pages, mid) <= cap) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Every worker runs one (chunk, KV head) item at a time. Costs are in the time a worker takes for a
// page when all workers run, an item's fixed cost taken as the shortest worthwhile chunk. A
// candidate chunk length (pages) whose items take `rounds` rounds over the workers costs the fixed
// cost each round, plus the longest of
//  - the batch's pages over all workers (the device's bandwidth), an eighth more where items run on
//    more workers than the full-rate ones (measured on the H200: one block a multiprocessor of float
//    head_dim 128 decodes single long sequences 4-9% faster than two with the same bytes; see
//    docs/perf/decisions.md);
//  - a worker's chain of items, each page at a lone worker's rate (full-rate over all workers): a
//    short item is bound by its own latency, so items in parallel finish sooner even where two share
//    a multiprocessor (4K + 7 x 256 tokens at head_dim 128: 16-page chunks 17.4 us, the 29-page
//    chunks of one round over the full-rate workers 19.3 us, H200);
//  - for long chunks (8 fixed costs or more: bound by bandwidth), the items a full-rate worker's
//    share of the device runs one after another (128K + 7 x 8K: 512-page chunks, two on some
//    multiprocessors, 221 us; two rounds of 183 pages 200 us; both: docs/perf/decisions.md);
// and a split sequence costs its partial results' writes and merge besides, two fixed costs (in the
// batch's average: splitting a few of its sequences costs less than splitting all).
// Candidates: for 1..kMaxWaves rounds over all workers, and one round over the full-rate workers,
// the shortest chunk that many items allow, and beside each the longer chunks that keep another
// sequence whole, each rounded up to whole granules (a GPU block's stage: a chunk's last stage costs
// a whole one; 4K + 7 x 256 tokens in 6-page chunks ran 13% slower than in 8-page ones, H200,
// docs/perf/decisions.md). The cheapest wins. One round of equal chunks fills
// the device exactly when the batch is uniform; long sequences get proportionally more chunks, and
// short ones beside them stay whole.
struct Choice {
  uint64_t chunk_pages;
  double cost; // in the time a worker takes for a page when all workers run
};

Choice choose_chunk_pages(const PlanRequest &req) {
  std::vector<uint64_t> sorted(req.count); // the sequences' pages, shortest first
  for (uint32_t b = 0; b < req.count; b++) sorted[b] = pages_of(req.lengths[b], req.page_size);
  std::sort(sorted.begin(), sorted.end());
  const uint64_t longest = sorted.empty() ? 1 : std::max<uint64_t>(1, sorted.back());
  const uint64_t fixed = pages_of(std::max<uint32_t>(1, req.min_chunk_tokens), req.page_size);
  const uint32_t workers = std::max<uint32_t>(1, req.workers), kv_heads = std::max<uint32_t>(1, req.kv_heads);
  const uint32_t full_rate = full_rate_of(req);
  const double lone = double(full_rate) / workers; // a lone worker's time for a page
  double pages = 0;
  for (uint64_t p : sorted) pages += double(p) * kv_heads;
  const uint64_t granule = granule_pages(req);
  auto whole = [&](uint64_t chunk) { return (chunk + granule - 1) / granule * granule; };
  uint64_t best = whole(std::max(fixed, longest));
  double best_cost = INFINITY;
  auto consider = [&](uint64_t chunk) {
    chunk = whole(chunk);
    const uint64_t items = chunks_of(sorted, chunk) * kv_heads;
    const uint64_t rounds = (items + workers - 1) / workers, in_turn = (items + full_rate - 1) / full_rate;
    const double bandwidth = pages / workers * (full_rate < workers && items > full_rate ? 1.125 : 1.0);
    const double chain = double(rounds * chunk) * lone;
    const double shares = chunk >= 8 * fixed ? double(in_turn * chunk) * lone : 0.0;
    const uint64_t splits = uint64_t(sorted.end() - std::upper_bound(sorted.begin(), sorted.end(), chunk));
    const double c = double(rounds * fixed) + std::max({bandwidth, chain, shares}) +
                     2.0 * double(fixed * splits) / std::max(1u, req.count);
    if (c < best_cost) best_cost = c, best = chunk;
  };
  // The chunk that needs `cap` chunks at most, and those longer that keep another sequence whole.
  auto consider_all = [&](uint64_t cap) {
    if (req.count > cap) return;
    const uint64_t lo = shortest_chunk(sorted, cap, fixed, longest);
    consider(lo);
    for (auto it = std::upper_bound(sorted.begin(), sorted.end(), lo); it != sorted.end();
         it = std::upper_bound(it, sorted.end(), *it))
      consider(*it);
  };
  for (uint64_t w = 1; w <= kMaxWaves; w++) consider_all(w * chunk_slots(workers, kv_heads));
  if (full_rate < workers) consider_all(chunk_slots(full_rate, kv_heads));
  return {best, best_cost};
}

struct Item {
  uint32_t seq, head, token_begin, token_end, worker;
};

// The batch's sequences in whole granules, dealt out to `groups` as equal shares of granules (the
// last may be shorter): a share that ends inside a sequence splits it. A group is kv_heads workers
// (group g's for KV head h: g * kv_heads + h), and its item of a sequence one item for each KV
// head, the same tokens on each, so that a page's KV heads, whose rows lie together in it, are read
// at about the same time: dealing each (sequence, KV head) pair's granules in turn measured up to
// 6% slower (H200, docs/perf/decisions.md). An empty sequence takes empty
// items, so their workers write its results. By pair, in token order.
std::vector<Item> deal(const PlanRequest &req, uint32_t groups, uint64_t *share) {
  struct Span {
    uint32_t token_begin, token_end, group;
  };
  const uint64_t granule = granule_pages(req) * req.page_size; // tokens
  uint64_t total = 0;
  for (uint32_t b = 0; b < req.count; b++) total += (uint64_t(req.lengths[b]) + granule - 1) / granule;
  *share = std::max<uint64_t>(1, (total + groups - 1) / groups);
  std::vector<Item> items;
  std::vector<Span> spans; // of one sequence
  uint32_t g = 0;
  uint64_t used = 0; // of group g's share
  for (uint32_t b = 0; b < req.count; b++) {
    const uint64_t length = req.lengths[b], n = (length + granule - 1) / granule;
    spans.clear();
    if (n == 0) spans.push_back({0, 0, std::min(g, groups - 1)});
    for (uint64_t at = 0; at < n;) {
      const uint64_t take = std::min(n - at, *share - used);
      spans.push_back({uint32_t(at * granule), uint32_t(std::min(length, (at + take) * granule)), g});
      at += take;
      used += take;
      if (used == *share) g++, used = 0;
    }
    for (uint32_t h = 0; h < req.kv_heads; h++)
      for (const Span &s : spans) items.push_back({b, h, s.token_begin, s.token_end, s.group * req.kv_heads + h});
  }
  return items;
}

// A balanced plan over the whole groups of KV heads among `full_rate` workers (record j * workers + w:
// worker w's j-th item) and its cost in choose_chunk_pages' units: each of a worker's items costs
// the fixed cost, its share's pages run at a lone worker's rate, and a split pair costs its partial
// results and merge as a split sequence does. False where it would not fit the limits.
bool balanced_plan(const PlanRequest &req, uint32_t full_rate, DecodePlan *plan, double *cost) {
  const uint32_t groups = uint32_t(chunk_slots(full_rate, req.kv_heads)), workers = groups * std::max<uint32_t>(1, req.kv_heads);
  uint64_t share = 0;
  const std::vector<Item> items = deal(req, groups, &share);
  std::vector<uint32_t> round(workers, 0);
  uint32_t rounds = 0;
  for (const Item &p : items) rounds = std::max(rounds, ++round[p.worker]);
  if (uint64_t(rounds) * workers > req.limits.records) return false;
  plan->workers = workers;
  plan->records.assign(uint64_t(rounds) * workers, {kNoSeq, 0, 0, kNoPart, 0, 0, kNoPart, 0, kAllHeads, 0, 0, 0, 0, 0, 0});
  std::fill(round.begin(), round.end(), 0);
  uint64_t split_pairs = 0;
  for (size_t i = 0, j; i < items.size(); i = j) {
    for (j = i + 1; j < items.size() && items[j].seq == items[i].seq && items[j].head == items[i].head;) j++;
    const uint32_t siblings = uint32_t(j - i), first = siblings > 1 ? plan->parts : kNoPart;
    split_pairs += siblings > 1;
    for (size_t k = i; k < j; k++) {
      const Item &p = items[k];
      plan->records[uint64_t(round[p.worker]++) * workers + p.worker] = {
          p.seq, p.token_begin, p.token_end, siblings > 1 ? plan->parts++ : kNoPart, 0, 0, first, siblings, p.head, 0, 0, 0, 0, 0, 0};
      plan->chunk_tokens = std::max(plan->chunk_tokens, p.token_end - p.token_begin);
    }
  }
  if (plan->parts > req.limits.parts) return false;
  const double lone = double(full_rate) / std::max<uint32_t>(1, req.workers);
  const double fixed = double(pages_of(std::max<uint32_t>(1, req.min_chunk_tokens), req.page_size));
  const double pairs = std::max(1.0, double(req.count) * req.kv_heads);
  *cost = rounds * fixed + double(share * granule_pages(req)) * lone + 2.0 * fixed * double(split_pairs) / pairs;
  return true;
}

struct Counts {
  uint64_t chunks = 0, parts = 0;
};

Counts count(const PlanRequest &req, uint64_t chunk_tokens) {
  Counts n;
  for (uint32_t b = 0; b < req.count; b++) {
    const uint64_t c = std::max<uint64_t>(1, (uint64_t(req.lengths[b]) + chunk_tokens - 1) / chunk_tokens);
    n.chunks += c;
    if (c > 1) n.parts += c;
  }
  return n;
}

// Fills in the records' copies of their sequences' page-table rows, lengths, starts and query rows,
// and, where the backend takes a record per KV head, turns each chunk into one for each.
void finish_records(const PlanConfig &config, const PlanBatch &batch, DecodePlan *plan) {
  for (PlanRecord &r : plan->records)
    if (r.seq != kNoSeq) {
      r.slot = batch.slots[r.seq], r.length = batch.lengths[r.seq], r.start = batch.starts ? batch.starts[r.seq] : 0;
      r.q_row = batch.q_rows ? batch.q_rows[r.seq] : r.seq * batch.q_tokens;
      r.tokens = batch.q_rows ? batch.tokens[r.seq] : batch.q_tokens;
    }
  if (plan->workers || !config.record_per_head) return;
  std::vector<PlanRecord> per_head;
  per_head.reserve(plan->records.size() * batch.kv_heads);
  for (PlanRecord r : plan->records)
    for (r.head = 0; r.head < batch.kv_heads; r.head++) per_head.push_back(r);
  plan->records.swap(per_head);
  plan->records_per_chunk = batch.kv_heads;
}

} // namespace

PlanLimits chosen_plan_bounds(uint32_t max_sequences, uint32_t kv_heads, uint32_t workers) {
  // A chosen plan has at most kMaxWaves rounds of chunks (`wanted`), or, when the batch has more
  // sequences than that, one chunk per sequence; parts belong to split sequences, so they are fewer
  // than `wanted`.
  const uint64_t wanted = kMaxWaves * chunk_slots(workers, kv_heads);
  PlanLimits l;
  l.chunks = uint32_t(std::min<uint64_t>(UINT32_MAX, max_sequences + wanted));
  l.parts = uint32_t(std::min<uint64_t>(UINT32_MAX, std::max<uint64_t>(2 * wanted, 512)));
  l.records = uint32_t(std::min<uint64_t>(UINT32_MAX, uint64_t(l.chunks) * std::max<uint32_t>(1, kv_heads)));
  return l;
}

DecodePlan make_plan(const PlanConfig &config, const PlanBatch &batch) {
  const PlanRequest req{batch.lengths,           batch.count,          batch.page_size,
                        batch.kv_heads,          batch.chunk_pages,    config.workers,
                        config.full_rate_workers, config.fixed_cost_tokens, config.granule_tokens,
                        config.limits,           config.balance};
  const Choice choice = req.chunk_pages ? Choice{req.chunk_pages, INFINITY} : choose_chunk_pages(req);
  if (req.balance != Balance::never && !req.chunk_pages && req.count) {
    DecodePlan balanced;
    double cost = INFINITY;
    if (balanced_plan(req, full_rate_of(req), &balanced, &cost) && (req.balance == Balance::always || cost < choice.cost)) {
      finish_records(config, batch, &balanced);
      return balanced;
    }
  }
  uint64_t chunk_pages = choice.chunk_pages;
  for (;;) {
    const Counts n = count(req, std::min<uint64_t>(UINT32_MAX, chunk_pages * req.page_size));
    if ((n.chunks <= req.limits.chunks && n.parts <= req.limits.parts) || chunk_pages >= UINT32_MAX) break;
    chunk_pages = std::min<uint64_t>(UINT32_MAX, chunk_pages * 2);
  }
  const uint64_t chunk_tokens = std::min<uint64_t>(UINT32_MAX, chunk_pages * req.page_size);
  DecodePlan plan;
  plan.chunk_tokens = uint32_t(chunk_tokens);
  plan.seq_chunks.reserve(req.count + 1);
  for (uint32_t b = 0; b < req.count; b++) {
    plan.seq_chunks.push_back(uint32_t(plan.records.size()));
    // An empty sequence gets one empty chunk, so whoever runs the chunk writes its result (0, -inf).
    const uint32_t siblings = uint32_t(std::max<uint64_t>(1, (uint64_t(req.lengths[b]) + chunk_tokens - 1) / chunk_tokens));
    const uint32_t first = siblings > 1 ? plan.parts : kNoPart;
    uint64_t t = 0;
    do {
      plan.records.push_back({b, uint32_t(t), uint32_t(std::min<uint64_t>(req.lengths[b], t + chunk_tokens)),
                              siblings > 1 ? plan.parts++ : kNoPart, 0, 0, first, siblings, kAllHeads, 0, 0, 0, 0, 0, 0});
      t += chunk_tokens;
    } while (t < req.lengths[b]);
  }
  plan.seq_chunks.push_back(uint32_t(plan.records.size()));
  finish_records(config, batch, &plan);
  return plan;
}

} // namespace pkv
