#include "pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <unordered_set>

#include "error.hpp"
#include "plan.hpp"

using pkv::fail;

namespace {

pkv::PoolGeometry make_geometry(const pkv_pool_desc &d) {
  pkv::PoolGeometry g{};
  g.layers = d.layers;
  g.kv_heads = d.kv_heads;
  g.head_dim = d.head_dim;
  g.page_size = d.page_size;
  g.pages = d.pages;
  g.max_sequences = d.max_sequences;
  const uint64_t max_length = d.max_sequence_length ? d.max_sequence_length : uint64_t(d.pages) * d.page_size;
  g.table_stride = uint32_t(std::min<uint64_t>(d.pages, (max_length + d.page_size - 1) / d.page_size));
  g.k = pkv::make_plane_layout(d.k_format, d.kv_heads, d.page_size, d.head_dim);
  g.v = pkv::make_plane_layout(d.v_format, d.kv_heads, d.page_size, d.head_dim);
  g.block_bytes = g.k.bytes + g.v.bytes;
  return g;
}

// The variants' fields of pkv_decode_args and pkv_extend_args.
template <class Args> pkv::AttentionVariants variants_of(const Args &a) {
  pkv::AttentionVariants v;
  v.sinks = a.sinks;
  v.slopes = a.alibi_slopes;
  v.window = a.window;
  v.softcap = a.softcap;
  return v;
}

} // namespace

pkv_pool::DeviceMemory::DeviceMemory(pkv_context *c, pkv::PoolGeometry *geometry) : ctx(c), g(geometry) {
  pkv::Backend &b = *ctx->backend;
  g->base = g->table = g->plan = g->scales = 0;
  try {
    std::lock_guard<std::mutex> device(ctx->mu); // released before the handler takes it again
    g->base = b.alloc(g->total_bytes());
    g->table = b.alloc(g->table_bytes());
    g->scales = b.alloc(g->scales_bytes());
    const uint64_t plan_bytes = b.plan_buffer_bytes(*g);
    if (plan_bytes) g->plan = b.alloc(plan_bytes);
  } catch (...) {
    release();
    throw;
  }
}

pkv_pool::DeviceMemory::~DeviceMemory() { release(); }

void pkv_pool::DeviceMemory::release() noexcept {
  std::lock_guard<std::mutex> device(ctx->mu);
  for (pkv::DevPtr p : {g->plan, g->scales, g->table, g->base})
    if (p) ctx->backend->release(p);
  g->base = g->table = g->plan = g->scales = 0;
}

pkv_pool::pkv_pool(pkv_context *ctx, const pkv_pool_desc &desc)
    : ctx_(ctx), geometry_(make_geometry(desc)), memory_(ctx, &geometry_), handles_(desc.max_sequences),
      pages_(desc.pages, desc.page_order_seed), seqs_(desc.max_sequences),
      max_length_(std::min<uint64_t>(desc.max_sequence_length ? desc.max_sequence_length : UINT32_MAX,
                                     uint64_t(desc.pages) * desc.page_size)),
      scales_(geometry_.scales_bytes() / 4, 1.0f) {
  {
    std::lock_guard<std::mutex> device(ctx_->mu);
    ctx_->backend->write_device(geometry_.scales, scales_.data(), geometry_.scales_bytes());
  }
  ctx_->pools++;
}

pkv_pool::~pkv_pool() { ctx_->pools--; }

void pkv_pool::reserve_pending(size_t more) {
  if (pending_.size() + more <= pending_.capacity()) return;
  // Beyond one change per page-table cell the queue holds overwritten ones (appends and truncates with
  // no device call between): dropping those first keeps it bounded.
  if (pending_.size() > uint64_t(geometry_.max_sequences) * geometry_.table_stride) table_updates();
  pending_.reserve(std::max(pending_.size() + more, 2 * pending_.capacity()));
}

pkv::TableUpdates pkv_pool::table_updates() {
  if (pending_.empty()) return {};
  // Walk from the newest entry and keep each (slot, index) once: devices apply them in parallel.
  std::vector<pkv::TableEntry> compact;
  std::unordered_set<uint64_t> seen;
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it)
    if (seen.insert(uint64_t(it->seq_slot) << 32 | it->index).second) compact.push_back(*it);
  std::reverse(compact.begin(), compact.end());
  // The compacted list stays queued until a backend call has applied it.
  pending_.swap(compact);
  return {pending_.data(), uint32_t(pending_.size())};
}

std::vector<uint32_t> pkv_pool::resolve_batch(const pkv_seq *seqs, uint32_t count, const char *what, bool unique) {
  std::vector<uint32_t> slots(count);
  for (uint32_t i = 0; i < count; i++) {
    if (handles_.live_slot(seqs[i], &slots[i])) continue;
    char name[64]; // named only for the error: a batch of live handles formats nothing
    std::snprintf(name, sizeof name, "%s[%u]", what, i);
    handles_.resolve(seqs[i], name);
  }
  if (unique) {
    std::vector<uint32_t> sorted = slots;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) {
      const uint32_t first = uint32_t(std::find(slots.begin(), slots.end(), *dup) - slots.begin());
      const uint32_t second = uint32_t(std::find(slots.begin() + first + 1, slots.end(), *dup) - slots.begin());
      fail(PKV_ERR_INVALID_ARGUMENT, "%s[%u] and %s[%u] are the same sequence: each may appear once per call", what,
           first, what, second);
    }
  }
  return slots;
}

void pkv_pool::drop_pages(Sequence &s, uint32_t keep) {
  while (s.pages.size() > keep) {
    if (s.pages.back() != kReleasedPage) pages_.release(s.pages.back());
    s.pages.pop_back();
  }
}

void pkv_pool::check_held(const Sequence &s, uint64_t first, uint32_t index, const char *call) {
  if (first >= s.released) return;
  char name[32];
  if (index == kSingle) std::snprintf(name, sizeof name, "seq");
  else std::snprintf(name, sizeof name, "seqs[%u]", index);
  fail(PKV_ERR_INVALID_ARGUMENT, "%s: the %s needs position %llu, but positions below %u were released "
       "(pkv_seq_release_before)", name, call, (unsigned long long)first, s.released);
}

void pkv_pool::check_whole(const Sequence &s, const char *call) {
  if (s.released)
    fail(PKV_ERR_UNSUPPORTED, "%s: the sequence's positions below %u were released (pkv_seq_release_before), and an "
         "image or span list covers every page of a sequence", call, s.released);
}

pkv::RowTransfer pkv_pool::transfer(uint32_t layer, const std::vector<pkv::RowSlot> &slots, pkv_format format,
                                    pkv_memory memory) {
  return {table_updates(), layer, uint32_t(slots.size()), format, memory, slots.data()};
}

pkv::RowSlot pkv_pool::slot_of(const Sequence &s, uint32_t position) const {
  return {s.pages[position / geometry_.page_size], position % geometry_.page_size};
}

namespace {

[[noreturn]] void fail_full(const pkv::HandleTable &h) {
  if (h.retired())
    fail(PKV_ERR_OUT_OF_SEQUENCES, "all %u sequence slots are in use (%u of them retired: their handles' generation "
         "counter reached its end)", h.capacity(), h.retired());
  fail(PKV_ERR_OUT_OF_SEQUENCES, "all %u sequence slots are in use", h.capacity());
}

} // namespace

pkv_seq pkv_pool::alloc() {
  std::lock_guard<std::mutex> lock(mu_);
  if (handles_.full()) fail_full(handles_);
  uint32_t slot;
  const pkv_seq seq = handles_.acquire(&slot);
  seqs_[slot] = Sequence{};
  return seq;
}

void pkv_pool::free(pkv_seq seq) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint32_t slot = handles_.resolve(seq, "seq");
  Sequence &s = seqs_[slot];
  drop_pages(s, 0);
  tokens_live_ -= s.length;
  s = Sequence{};
  handles_.release(slot);
}

pkv_seq pkv_pool::fork(pkv_seq parent) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint32_t from = handles_.resolve(parent, "parent");
  if (handles_.full()) fail_full(handles_);
  Sequence copy = seqs_[from];
  uint32_t slot;
  reserve_pending(copy.pages.size()); // so that nothing below throws
  const pkv_seq child = handles_.acquire(&slot);
  for (uint32_t i = 0; i < copy.pages.size(); i++) {
    if (copy.pages[i] == kReleasedPage) continue;
    pages_.retain(copy.pages[i]);
    pending_.push_back({slot, i, copy.pages[i]});
  }
  tokens_live_ += copy.length;
  seqs_[slot] = std::move(copy);
  return child;
}

void pkv_pool::truncate(pkv_seq seq, uint32_t new_length) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence &s = seqs_[handles_.resolve(seq, "seq")];
  if (new_length > s.length)
    fail(PKV_ERR_INVALID_ARGUMENT, "new_length %u is past the sequence's length %u", new_length, s.length);
  if (new_length < s.released)
    fail(PKV_ERR_INVALID_ARGUMENT, "new_length %u is below the sequence's released positions (pkv_seq_release_before "
         "%u): free the sequence instead", new_length, s.released);
  drop_pages(s, pages_for(new_length));
  tokens_live_ -= s.length - new_length;
  s.length = new_length;
}

void pkv_pool::release_before(pkv_seq seq, uint32_t position) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence &s = seqs_[handles_.resolve(seq, "seq")];
  if (position > s.length)
    fail(PKV_ERR_INVALID_ARGUMENT, "position %u is past the sequence's length %u", position, s.length);
  // The device's page-table row keeps the old ids; no call reads below s.released again.
  for (uint32_t i = 0; i < position / geometry_.page_size; i++)
    if (s.pages[i] != kReleasedPage) {
      pages_.release(s.pages[i]);
      s.pages[i] = kReleasedPage;
    }
  s.released = std::max(s.released, position);
}

uint32_t pkv_pool::length(pkv_seq seq) {
  std::lock_guard<std::mutex> lock(mu_);
  return seqs_[handles_.resolve(seq, "seq")].length;
}

void pkv_pool::append(const pkv_seq *seqs, const uint32_t *n_new, uint32_t count) {
  if (count == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<uint32_t> slots = resolve_batch(seqs, count, "seqs", true);

  // Count every page first, so that a batch which does not fit changes nothing.
  std::vector<uint8_t> copy_last(count, 0);
  std::vector<uint32_t> new_pages(count);
  uint64_t need = 0, n_copies = 0;
  for (uint32_t i = 0; i < count; i++) {
    const Sequence &s = seqs_[slots[i]];
    const uint64_t end = uint64_t(s.length) + n_new[i];
    if (end > max_length_)
      fail(PKV_ERR_INVALID_ARGUMENT, "seqs[%u]: length %u + n_new %u passes the pool's longest sequence, %llu tokens",
           i, s.length, n_new[i], (unsigned long long)max_length_);
    // Appending into a partly filled page that a fork also holds: this sequence takes a private copy.
    copy_last[i] = n_new[i] > 0 && s.length % geometry_.page_size != 0 && pages_.refs(s.pages.back()) > 1;
    new_pages[i] = pages_for(end) - uint32_t(s.pages.size());
    need += new_pages[i] + copy_last[i];
    n_copies += copy_last[i];
  }
  if (need > pages_.free())
    fail(PKV_ERR_OUT_OF_PAGES, "the batch needs %llu new pages and the pool has %u free of %u; nothing was appended",
         (unsigned long long)need, pages_.free(), pages_.total());

  // Every allocation before the first page is taken: from here on only the copy can fail, and its
  // failure gives the pages back.
  std::vector<uint32_t> fresh;
  fresh.reserve(need);
  std::vector<pkv::PageCopy> copies;
  copies.reserve(n_copies);
  for (uint32_t i = 0; i < count; i++) {
    Sequence &s = seqs_[slots[i]];
    s.pages.reserve(pages_for(uint64_t(s.length) + n_new[i]));
  }
  reserve_pending(need);

  pages_.take(uint32_t(need), &fresh);
  // Sequence i takes its copy-on-write page (if any), then its new pages, from fresh in batch order.
  size_t next = 0;
  for (uint32_t i = 0; i < count; i++) {
    if (copy_last[i]) copies.push_back({seqs_[slots[i]].pages.back(), fresh[next++]});
    next += new_pages[i];
  }
  if (!copies.empty()) {
    try {
      std::lock_guard<std::mutex> device(ctx_->mu);
      ctx_->backend->copy_pages(geometry_, copies.data(), uint32_t(copies.size()));
    } catch (...) {
      // Last taken, first given back: the free list is as it was, so a retry takes the same pages.
      for (auto p = fresh.rbegin(); p != fresh.rend(); ++p) pages_.release(*p);
      throw;
    }
  }

  next = 0;
  for (uint32_t i = 0; i < count; i++) {
    Sequence &s = seqs_[slots[i]];
    if (copy_last[i]) {
      pages_.release(s.pages.back());
      s.pages.back() = fresh[next++];
      pending_.push_back({slots[i], uint32_t(s.pages.size() - 1), s.pages.back()});
    }
    for (uint32_t k = 0; k < new_pages[i]; k++) {
      pending_.push_back({slots[i], uint32_t(s.pages.size()), fresh[next]});
      s.pages.push_back(fresh[next++]);
    }
    s.length += n_new[i];
    tokens_live_ += n_new[i];
  }
}

void pkv_pool::write(const pkv_write_args &a) {
  if (a.count == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<uint32_t> slots = resolve_batch(a.seqs, a.count, "seqs", true);
  std::vector<pkv::RowSlot> targets;
  for (uint32_t i = 0; i < a.count; i++) {
    const Sequence &s = seqs_[slots[i]];
    if (a.n_tokens[i] > s.length)
      fail(PKV_ERR_INVALID_ARGUMENT, "n_tokens[%u] is %u but the sequence holds %u tokens: append first", i,
           a.n_tokens[i], s.length);
    if (a.n_tokens[i] > 0) check_held(s, s.length - a.n_tokens[i], i, "write");
    for (uint32_t pos = s.length - a.n_tokens[i]; pos < s.length; pos++) {
      const pkv::RowSlot at = slot_of(s, pos);
      if (pages_.refs(at.page) > 1)
        fail(PKV_ERR_INVALID_ARGUMENT, "seqs[%u]: position %u lies in a page shared with a forked sequence; "
             "only positions appended since the fork can be written", i, pos);
      targets.push_back(at);
    }
  }
  if (targets.empty()) return;
  if (targets.size() > UINT32_MAX) // a backend counts a call's rows in 32 bits
    fail(PKV_ERR_INVALID_ARGUMENT, "the call writes %llu rows: at most %u in one call", (unsigned long long)targets.size(),
         UINT32_MAX);
  std::lock_guard<std::mutex> device(ctx_->mu);
  ctx_->backend->scatter(geometry_, {transfer(a.layer, targets, a.src_format, a.memory), a.k, a.v});
  pending_.clear();
}

void pkv_pool::read(const pkv_read_args &a) {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence &s = seqs_[handles_.resolve(a.seq, "seq")];
  if (uint64_t(a.start) + a.count > s.length)
    fail(PKV_ERR_INVALID_ARGUMENT, "positions [%u, %llu) are past the sequence's length %u", a.start,
         (unsigned long long)a.start + a.count, s.length);
  if (a.count == 0) return;
  check_held(s, a.start, kSingle, "read");
  std::vector<pkv::RowSlot> sources(a.count);
  for (uint32_t i = 0; i < a.count; i++) sources[i] = slot_of(s, a.start + i);
  std::lock_guard<std::mutex> device(ctx_->mu);
  ctx_->backend->gather(geometry_, {transfer(a.layer, sources, a.dst_format, a.memory), a.k, a.v});
  pending_.clear();
}

void pkv_pool::decode(const pkv_decode_args &a) { run_decode(a, true); }

void pkv_pool::decode_prepare(const pkv_decode_args &a) { run_decode(a, false); }

void pkv_pool::run_decode(const pkv_decode_args &a, bool launch) {
  if (a.count == 0) return;

  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<uint32_t> slots = resolve_batch(a.seqs, a.count, "seqs", false);
  const pkv::AttentionVariants variants = variants_of(a);
  // The plan covers what the queries see, from the first page a window leaves (so a chunk's pages stay
  // whole; the backend hides what lies before the window) to the end, as spans[i] positions from
  // starts[i].
  std::vector<uint32_t> lengths(a.count), starts(a.count), spans(a.count);
  for (uint32_t i = 0; i < a.count; i++) {
    const Sequence &s = seqs_[slots[i]];
    lengths[i] = s.length;
    if (lengths[i] == 0) continue;
    if (lengths[i] < a.q_tokens)
      fail(PKV_ERR_INVALID_ARGUMENT, "seqs[%u] holds %u tokens, fewer than q_tokens %u: append and write the query "
           "tokens first", i, lengths[i], a.q_tokens);
    check_held(s, variants.first_seen(lengths[i] - a.q_tokens), i, "decode");
    starts[i] = variants.plan_start(lengths[i] - a.q_tokens, geometry_.page_size);
    spans[i] = lengths[i] - starts[i];
  }
  pkv::Backend &backend = *ctx_->backend;
  std::lock_guard<std::mutex> device(ctx_->mu);
  const uint32_t rows = a.q_tokens * (a.q_heads / geometry_.kv_heads);
  const pkv::PlanCache::Entry &planned =
      plans_.get(backend, geometry_, rows, {spans.data(), slots.data(), a.count, geometry_.page_size,
                                            geometry_.kv_heads, a.chunk_pages, starts.data(), a.q_tokens});

  pkv::DecodeBatch batch{};
  batch.table = table_updates();
  batch.layer = a.layer;
  batch.count = a.count;
  batch.q_heads = a.q_heads;
  batch.q_tokens = a.q_tokens;
  batch.scale = a.scale != 0.0f ? a.scale : 1.0f / std::sqrt(float(geometry_.head_dim));
  batch.q_format = a.q_format;
  batch.out_format = a.out_format;
  batch.memory = a.memory;
  batch.q = a.q;
  batch.out = a.out;
  batch.lse = a.lse;
  batch.seq_slots = slots.data();
  batch.lengths = lengths.data();
  batch.variants = variants;
  batch.config = &planned.config;
  batch.plan = &planned.plan;
  batch.plan_resident = planned.resident;
  plans_.set_resident(false); // unknown until the call below succeeds
  if (launch) backend.decode(geometry_, batch);
  else backend.prepare_decode(geometry_, batch);
  pending_.clear();
  plans_.set_resident(true);
}

void pkv_pool::extend(const pkv_extend_args &a) { run_extend(a, true); }

void pkv_pool::extend_prepare(const pkv_extend_args &a) { run_extend(a, false); }

void pkv_pool::run_extend(const pkv_extend_args &a, bool launch) {
  if (a.count == 0) return;

  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<uint32_t> slots = resolve_batch(a.seqs, a.count, "seqs", false);
  const pkv::AttentionVariants variants = variants_of(a);
  std::vector<uint32_t> lengths(a.count);
  for (uint32_t i = 0; i < a.count; i++) {
    lengths[i] = seqs_[slots[i]].length;
    const uint32_t n = a.q_offsets[i + 1] - a.q_offsets[i];
    if (n > lengths[i])
      fail(PKV_ERR_INVALID_ARGUMENT, "seqs[%u] holds %u tokens, fewer than its %u queries (q_offsets[%u] to [%u]): "
           "append and write the query tokens first", i, lengths[i], n, i, i + 1);
    if (n > 0) check_held(seqs_[slots[i]], variants.first_seen(lengths[i] - n), i, "extend");
  }
  pkv::ExtendBatch batch{};
  batch.table = table_updates();
  batch.layer = a.layer;
  batch.count = a.count;
  batch.q_heads = a.q_heads;
  batch.scale = a.scale != 0.0f ? a.scale : 1.0f / std::sqrt(float(geometry_.head_dim));
  batch.q_format = a.q_format;
  batch.out_format = a.out_format;
  batch.memory = a.memory;
  batch.q = a.q;
  batch.out = a.out;
  batch.lse = a.lse;
  batch.seq_slots = slots.data();
  batch.lengths = lengths.data();
  batch.q_offsets = a.q_offsets;
  batch.mask = a.mask;
  batch.mask_offsets = a.mask_offsets;
  batch.mask_bytes = a.mask_bytes;
  batch.variants = variants;
  std::lock_guard<std::mutex> device(ctx_->mu);
  batch.config = &plans_.config(*ctx_->backend, geometry_, pkv::kMaxQueryTokens * (a.q_heads / geometry_.kv_heads));
  if (launch) ctx_->backend->extend(geometry_, batch);
  else ctx_->backend->prepare_extend(geometry_, batch);
  pending_.clear();
}

void pkv_pool::set_scales(const pkv_scales_args &a) {
  std::lock_guard<std::mutex> lock(mu_);
  const pkv::PoolGeometry &g = geometry_;
  std::vector<float> next = scales_; // whole before anything changes: a failed upload keeps the old ones
  for (int v = 0; v < 2; v++) {
    const float *given = v ? a.v_scales : a.k_scales;
    if (!given) continue;
    for (uint32_t l = 0; l < a.layer_count; l++)
      for (uint32_t h = 0; h < g.kv_heads; h++)
        next[g.scale_index(v, a.first_layer + l, h)] = given[a.per_head ? size_t(l) * g.kv_heads + h : l];
  }
  std::lock_guard<std::mutex> device(ctx_->mu);
  ctx_->backend->write_device(g.scales, next.data(), g.scales_bytes());
  scales_.swap(next);
}

void pkv_pool::get_scales(uint32_t first, uint32_t count, float *k, float *v) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t heads = geometry_.kv_heads;
  for (int plane = 0; plane < 2; plane++) {
    float *out = plane ? v : k;
    if (out) std::copy_n(&scales_[geometry_.scale_index(plane, first, 0)], size_t(count) * heads, out);
  }
}

pkv_pool_stats pkv_pool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  pkv_pool_stats st{};
  st.struct_size = sizeof st;
  st.pages_total = pages_.total();
  st.pages_free = pages_.free();
  st.pages_shared = pages_.shared();
  st.sequences_live = handles_.live();
  st.max_sequences = handles_.capacity();
  st.tokens_live = tokens_live_;
  st.bytes_total = geometry_.total_bytes();
  st.bytes_per_page = uint64_t(geometry_.layers) * geometry_.block_bytes;
  st.bytes_per_token = uint64_t(geometry_.layers) * (geometry_.k.bytes_per_token() + geometry_.v.bytes_per_token());
  return st;
}

uint64_t pkv_pool::export_size(pkv_seq seq, uint32_t first, uint32_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence &s = seqs_[handles_.resolve(seq, "seq")];
  check_whole(s, "pkv_seq_export_size");
  return pkv::make_image_header(geometry_, s.length, uint32_t(s.pages.size()), first, count).image_bytes();
}

void pkv_pool::export_seq(const pkv_export_args &a, uint32_t first, uint32_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence &s = seqs_[handles_.resolve(a.seq, "seq")];
  check_whole(s, "pkv_seq_export");
  const pkv::ImageHeader h = pkv::make_image_header(geometry_, s.length, uint32_t(s.pages.size()), first, count);
  if (a.image_bytes < h.image_bytes())
    fail(PKV_ERR_INVALID_ARGUMENT, "image_bytes is %llu but the sequence's image takes %llu bytes (pkv_seq_export_size)",
         (unsigned long long)a.image_bytes, (unsigned long long)h.image_bytes());
  uint8_t header[pkv::kImageHeaderBytes];
  pkv::encode_image_header(h, header);
  pkv::ExportArgs e{};
  e.pages = s.pages.data();
  e.count = uint32_t(s.pages.size());
  e.first_layer = first;
  e.layers = count;
  e.memory = a.memory;
  e.image = a.image;
  e.header = header;
  std::lock_guard<std::mutex> device(ctx_->mu);
  ctx_->backend->export_image(geometry_, e);
}

pkv_seq pkv_pool::import_seq(const pkv_import_args &a) {
  std::lock_guard<std::mutex> lock(mu_);
  pkv::Backend &backend = *ctx_->backend;
  uint8_t header[pkv::kImageHeaderBytes];
  {
    std::lock_guard<std::mutex> device(ctx_->mu);
    backend.read_caller(header, a.image, a.memory, sizeof header);
  }
  const pkv::ImageHeader h = pkv::decode_image_header(header, a.image_bytes);
  pkv::check_image_fits(h, geometry_);
  if (h.length > max_length_)
    fail(PKV_ERR_INVALID_ARGUMENT, "the image holds %u tokens, more than the pool's longest sequence, %llu tokens",
         h.length, (unsigned long long)max_length_);
  if (handles_.full()) fail_full(handles_);
  if (h.pages > pages_.free())
    fail(PKV_ERR_OUT_OF_PAGES, "the image needs %u pages and the pool has %u free of %u; nothing was imported", h.pages,
         pages_.free(), pages_.total());

  // Every allocation before the pages are taken; from there only the copy can fail, and its failure
  // (or a payload that does not match its checksum) gives them back.
  std::vector<uint32_t> taken;
  taken.reserve(h.pages);
  reserve_pending(h.pages);
  pages_.take(h.pages, &taken);
  try {
    pkv::ImportArgs in{};
    in.pages = taken.data();
    in.count = h.pages;
    in.first_layer = h.first_layer;
    in.layers = h.layer_count;
    in.memory = a.memory;
    in.payload = static_cast<const uint8_t *>(a.image) + pkv::kImageHeaderBytes;
    std::lock_guard<std::mutex> device(ctx_->mu);
    const uint64_t sum = backend.import_image(geometry_, in);
    if (sum != h.payload_checksum)
      fail(PKV_ERR_INVALID_ARGUMENT, "the image's payload sums to %016llx but its header says %016llx: the payload is "
           "corrupted; nothing was imported", (unsigned long long)sum, (unsigned long long)h.payload_checksum);
  } catch (...) {
    // Last taken, first given back: the free list is as it was.
    for (auto p = taken.rbegin(); p != taken.rend(); ++p) pages_.release(*p);
    throw;
  }

  uint32_t slot;
  const pkv_seq seq = handles_.acquire(&slot);
  for (uint32_t i = 0; i < h.pages; i++) pending_.push_back({slot, i, taken[i]});
  seqs_[slot] = Sequence{h.length, 0, std::move(taken)};
  tokens_live_ += h.length;
  return seq;
}

uint32_t pkv_pool::regions(pkv_memory_region *out, uint32_t capacity) const {
  if (capacity > 0) out[0] = {geometry_.base, geometry_.total_bytes()};
  return 1;
}

uint64_t pkv_pool::page_spans(pkv_seq seq, uint32_t first, uint32_t count, pkv_page_span *spans, uint64_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence &s = seqs_[handles_.resolve(seq, "seq")];
  check_whole(s, "pkv_seq_page_spans");
  const uint64_t n = 2ull * count * s.pages.size();
  if (!spans) return n;
  if (capacity < n)
    fail(PKV_ERR_INVALID_ARGUMENT, "capacity is %llu but the sequence has %llu spans in layers [%u, %llu)",
         (unsigned long long)capacity, (unsigned long long)n, first, (unsigned long long)first + count);
  for (uint32_t l = first; l < first + count; l++)
    for (uint32_t i = 0; i < s.pages.size(); i++) {
      const uint64_t at = geometry_.block_offset(l, s.pages[i]);
      *spans++ = {0, l, i, 0, at, geometry_.k.bytes};
      *spans++ = {0, l, i, 1, at + geometry_.k.bytes, geometry_.v.bytes};
    }
  return n;
}
