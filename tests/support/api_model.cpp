// The model-checked call driver of tests/support/api_model.h.
#include "api_model.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <vector>

#include "args.h"
#include "failure.hpp"
#include "pagedkv.h"

namespace {

// Bytes as a stream of small choices; 0 once they run out.
struct Bytes {
  const uint8_t *p;
  size_t n;
  uint32_t next(uint32_t below) {
    if (below <= 1) return 0;
    uint32_t v = 0;
    for (uint32_t span = 1; span < below && n; span <<= 8) v = v << 8 | (n--, *p++);
    return v % below;
  }
};

constexpr uint32_t kReleased = UINT32_MAX;

struct MSeq {
  pkv_seq h;
  uint32_t len = 0;
  uint32_t released = 0;        // positions below it were released (pkv_seq_release_before)
  std::vector<uint32_t> pages;  // model page ids, kReleased where released
  std::vector<int32_t> rows;    // [position * layers + layer]: the value written, or 0 if unknown
};

class Model {
 public:
  Model(Bytes &in) : in_(in) {
    d_ = PKV_POOL_DESC_INIT;
    d_.layers = 1 + in.next(2);
    d_.kv_heads = 1 + in.next(2);
    d_.head_dim = 32;
    d_.page_size = 1u << in.next(4);
    d_.pages = 1 + in.next(24);
    d_.max_sequences = 1 + in.next(6);
    const pkv_format formats[3] = {PKV_FORMAT_F32, PKV_FORMAT_F16, PKV_FORMAT_BF16};
    d_.k_format = formats[in.next(3)];
    d_.v_format = formats[in.next(3)];
    d_.max_sequence_length = in.next(3) == 0 ? in.next(64) : 0;
    d_.page_order_seed = in.next(2);
    max_len_ = std::min<uint64_t>(d_.max_sequence_length ? d_.max_sequence_length : UINT32_MAX,
                                  uint64_t(d_.pages) * d_.page_size);
    pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
    cd.backend = PKV_BACKEND_CPU;
    cd.threads = 1 + in.next(2);
    if (pkv_context_create(&cd, &ctx_) != PKV_OK) test_failure("context: %s", pkv_last_error());
    if (pkv_pool_create(ctx_, &d_, &pool_) != PKV_OK) test_failure("pool: %s", pkv_last_error());
    ref_.assign(d_.pages, 0);
    row_ = size_t(d_.kv_heads) * d_.head_dim;
  }
  ~Model() {
    pkv_pool_destroy(pool_);
    pkv_context_destroy(ctx_);
  }

  // One call and the checks after it.
  void step(uint32_t call) {
    call_ = call;
    switch (in_.next(12)) {
    case 0: alloc(); break;
    case 1: free_one(); break;
    case 2: fork(); break;
    case 3: truncate(); break;
    case 4: append(); break;
    case 5: write(); break;
    case 6: read(); break;
    case 7: decode(); break;
    case 8: swap(); break;
    case 9: release_before(); break;
    case 10: extend(); break;
    default: bad_call(); break;
    }
    check_state();
  }

 private:
  // A handle: a live one, a freed one, the zero handle, or a live one with one bit flipped.
  pkv_seq pick() {
    const uint32_t k = in_.next(uint32_t(live_.size()) + 3);
    if (k < live_.size()) return live_[k].h;
    if (k == live_.size()) return dead_.empty() ? pkv_seq{0} : dead_[in_.next(uint32_t(dead_.size()))];
    if (k == live_.size() + 1 || live_.empty()) return pkv_seq{0};
    pkv_seq s = live_[in_.next(uint32_t(live_.size()))].h;
    s.id ^= uint64_t(1) << in_.next(64);
    return s;
  }
  MSeq *find(pkv_seq h) {
    for (MSeq &s : live_)
      if (s.h.id == h.id) return &s;
    return nullptr;
  }
  uint32_t pages_for(uint64_t tokens) const { return uint32_t((tokens + d_.page_size - 1) / d_.page_size); }
  uint32_t take_page() {
    for (uint32_t p = 0; p < ref_.size(); p++)
      if (ref_[p] == 0) {
        ref_[p] = 1;
        return p;
      }
    test_failure("call %u: the model ran out of pages", call_);
  }
  void drop_pages(MSeq &s, uint32_t keep) {
    while (s.pages.size() > keep) {
      if (s.pages.back() != kReleased) ref_[s.pages.back()]--;
      s.pages.pop_back();
    }
  }

  // The status must be `want`; a failure needs a text.
  void expect(pkv_status got, pkv_status want, const char *what) {
    if (got != want)
      test_failure("call %u (%s): got %s (%s), the model expects %s", call_, what, pkv_status_string(got),
               pkv_last_error(), pkv_status_string(want));
    if (got != PKV_OK && !pkv_last_error()[0]) test_failure("call %u (%s): failed with no text", call_, what);
  }

  void alloc() {
    pkv_seq h{};
    const pkv_status st = pkv_seq_alloc(pool_, &h);
    expect(st, live_.size() < d_.max_sequences ? PKV_OK : PKV_ERR_OUT_OF_SEQUENCES, "alloc");
    if (st != PKV_OK) return;
    if (h.id == 0 || find(h)) test_failure("call %u: alloc gave handle 0x%llx, zero or live", call_, (unsigned long long)h.id);
    for (pkv_seq d : dead_)
      if (d.id == h.id) test_failure("call %u: alloc gave a freed handle again", call_);
    MSeq s;
    s.h = h;
    live_.push_back(s);
  }

  void free_one() { free_one_of(pick()); }

  void free_one_of(pkv_seq h) {
    MSeq *s = find(h);
    expect(pkv_seq_free(pool_, h), s ? PKV_OK : PKV_ERR_STALE_HANDLE, "free");
    if (!s) return;
    drop_pages(*s, 0);
    dead_.push_back(h);
    live_.erase(live_.begin() + (s - live_.data()));
  }

  void fork() {
    const pkv_seq h = pick();
    MSeq *s = find(h);
    pkv_seq child{};
    const pkv_status want = !s ? PKV_ERR_STALE_HANDLE : live_.size() < d_.max_sequences ? PKV_OK : PKV_ERR_OUT_OF_SEQUENCES;
    const pkv_status st = pkv_seq_fork(pool_, h, &child);
    expect(st, want, "fork");
    if (st != PKV_OK) return;
    MSeq c = *s;
    c.h = child;
    for (uint32_t p : c.pages)
      if (p != kReleased) ref_[p]++;
    live_.push_back(c);
  }

  void truncate() {
    const pkv_seq h = pick();
    MSeq *s = find(h);
    const uint32_t n = in_.next(s ? s->len + 2 : 8);
    const bool fits = s && n <= s->len && n >= s->released;
    expect(pkv_seq_truncate(pool_, h, n), !s ? PKV_ERR_STALE_HANDLE : fits ? PKV_OK : PKV_ERR_INVALID_ARGUMENT,
           "truncate");
    if (!fits) return;
    drop_pages(*s, pages_for(n));
    s->len = n;
    s->rows.resize(size_t(n) * d_.layers);
  }

  // Releases the positions before a point: whole pages go, a shared one only loses this holder.
  void release_before() {
    const pkv_seq h = pick();
    MSeq *s = find(h);
    const uint32_t position = in_.next(s ? s->len + 2 : 8);
    const bool fits = s && position <= s->len;
    expect(pkv_seq_release_before(pool_, h, position), !s ? PKV_ERR_STALE_HANDLE : fits ? PKV_OK : PKV_ERR_INVALID_ARGUMENT,
           "release_before");
    if (!fits) return;
    for (uint32_t i = 0; i < position / d_.page_size; i++)
      if (s->pages[i] != kReleased) {
        ref_[s->pages[i]]--;
        s->pages[i] = kReleased;
      }
    s->released = std::max(s->released, position);
  }

  // Export, free, import: the rows come back in fresh pages under a new handle. Sometimes an image
  // corrupted in one payload byte is imported first, which must fail and change nothing. A sequence
  // with released positions has no image.
  void swap() {
    const pkv_seq h = pick();
    MSeq *s = find(h);
    pkv_export_args e = PKV_EXPORT_ARGS_INIT;
    e.seq = h;
    uint64_t bytes = 0;
    const pkv_status want = !s ? PKV_ERR_STALE_HANDLE : s->released ? PKV_ERR_UNSUPPORTED : PKV_OK;
    expect(pkv_seq_export_size(pool_, &e, &bytes), want, "export_size");
    std::vector<uint8_t> image(want == PKV_OK ? bytes : 256);
    e.image = image.data();
    e.image_bytes = image.size();
    expect(pkv_seq_export(pool_, &e), want, "export");
    if (want != PKV_OK) return;
    MSeq back = *s;
    free_one_of(h);
    pkv_import_args in = PKV_IMPORT_ARGS_INIT;
    in.image = image.data();
    in.image_bytes = bytes;
    // The pages are counted before the payload is summed.
    const bool fits = pages_for(back.len) <= free_pages();
    if (bytes > PKV_SEQ_IMAGE_HEADER_BYTES && in_.next(4) == 0) {
      image[PKV_SEQ_IMAGE_HEADER_BYTES + in_.next(uint32_t(bytes) - PKV_SEQ_IMAGE_HEADER_BYTES)] ^= 1;
      expect(pkv_seq_import(pool_, &in, &back.h), fits ? PKV_ERR_INVALID_ARGUMENT : PKV_ERR_OUT_OF_PAGES,
             "import of a corrupted image");
      return;
    }
    expect(pkv_seq_import(pool_, &in, &back.h), fits ? PKV_OK : PKV_ERR_OUT_OF_PAGES, "import");
    if (!fits) return;
    back.pages.clear();
    for (uint32_t i = 0; i < pages_for(back.len); i++) back.pages.push_back(take_page());
    live_.push_back(back);
  }

  // A batch of 1-3 handles, each with a count; the status the library owes it (stale before
  // repeated), and the model sequences.
  struct Batch {
    pkv_seq h[3];
    uint32_t n[3];
    MSeq *s[3];
    uint32_t count;
    bool stale, repeated;
  };
  Batch batch(uint32_t most_n) {
    Batch b{};
    b.count = 1 + in_.next(3);
    for (uint32_t i = 0; i < b.count; i++) {
      b.h[i] = pick();
      b.s[i] = find(b.h[i]);
      b.n[i] = in_.next(in_.next(8) == 0 ? 4 * most_n : most_n);
      b.stale |= !b.s[i];
      for (uint32_t j = 0; j < i; j++) b.repeated |= b.h[j].id == b.h[i].id;
    }
    return b;
  }

  void append() {
    Batch b = batch(2 * d_.page_size + 1);
    pkv_status want = PKV_OK;
    uint64_t need = 0;
    if (b.count > d_.max_sequences) want = PKV_ERR_INVALID_ARGUMENT;
    else if (b.stale) want = PKV_ERR_STALE_HANDLE;
    else if (b.repeated) want = PKV_ERR_INVALID_ARGUMENT;
    else {
      for (uint32_t i = 0; i < b.count && want == PKV_OK; i++) {
        const MSeq &s = *b.s[i];
        if (uint64_t(s.len) + b.n[i] > max_len_) want = PKV_ERR_INVALID_ARGUMENT;
        const bool cow = b.n[i] > 0 && s.len % d_.page_size != 0 && ref_[s.pages.back()] > 1;
        need += pages_for(uint64_t(s.len) + b.n[i]) - s.pages.size() + cow;
      }
      if (want == PKV_OK && need > free_pages()) want = PKV_ERR_OUT_OF_PAGES;
    }
    expect(pkv_append(pool_, b.h, b.n, b.count), want, "append");
    if (want != PKV_OK) return;
    for (uint32_t i = 0; i < b.count; i++) {
      MSeq &s = *b.s[i];
      if (b.n[i] > 0 && s.len % d_.page_size != 0 && ref_[s.pages.back()] > 1) {
        ref_[s.pages.back()]--;
        s.pages.back() = take_page();
      }
      while (s.pages.size() < pages_for(uint64_t(s.len) + b.n[i])) s.pages.push_back(take_page());
      s.len += b.n[i];
      s.rows.resize(size_t(s.len) * d_.layers, 0);
    }
  }

  void write() {
    Batch b = batch(6);
    const uint32_t layer = in_.next(d_.layers + (in_.next(8) == 0));
    pkv_status want = PKV_OK;
    size_t total = 0;
    if (layer >= d_.layers) want = PKV_ERR_INVALID_ARGUMENT;
    else if (b.count > d_.max_sequences) want = PKV_ERR_INVALID_ARGUMENT;
    else if (b.stale) want = PKV_ERR_STALE_HANDLE;
    else if (b.repeated) want = PKV_ERR_INVALID_ARGUMENT;
    else
      for (uint32_t i = 0; i < b.count; i++) {
        const MSeq &s = *b.s[i];
        if (b.n[i] > s.len) want = PKV_ERR_INVALID_ARGUMENT;
        for (uint32_t pos = s.len - std::min(b.n[i], s.len); pos < s.len; pos++)
          if (pos < s.released || ref_[s.pages[pos / d_.page_size]] > 1) want = PKV_ERR_INVALID_ARGUMENT;
        total += b.n[i];
      }
    // Row r's K elements are all one small integer (exact in every float format), V's its negative.
    std::vector<float> k(std::max<size_t>(total, 1) * row_), v(k.size());
    std::vector<int32_t> values(std::max<size_t>(total, 1));
    for (size_t r = 0; r < values.size(); r++) {
      values[r] = int32_t(1 + (next_value_++ % 200));
      std::fill(k.begin() + r * row_, k.begin() + (r + 1) * row_, float(values[r]));
      std::fill(v.begin() + r * row_, v.begin() + (r + 1) * row_, -float(values[r]));
    }
    const pkv_write_args a = pu_write_args(layer, b.h, b.n, b.count, PKV_FORMAT_F32, k.data(), v.data());
    expect(pkv_write(pool_, &a), want, "write");
    if (want != PKV_OK) return;
    size_t r = 0;
    for (uint32_t i = 0; i < b.count; i++)
      for (uint32_t pos = b.s[i]->len - b.n[i]; pos < b.s[i]->len; pos++) {
        // A written page may be shared by a fork made later: its rows are the fork's too.
        b.s[i]->rows[size_t(pos) * d_.layers + layer] = values[r++];
      }
  }

  void read() {
    const pkv_seq h = pick();
    MSeq *s = find(h);
    const uint32_t layer = in_.next(d_.layers), start = in_.next(s ? s->len + 1 : 4), count = in_.next(s ? s->len + 2 : 4);
    std::vector<float> k(std::max<size_t>(count, 1) * row_), v(k.size());
    const pkv_read_args a = pu_read_args(layer, h, start, count, PKV_FORMAT_F32, k.data(), v.data());
    const bool held = s && uint64_t(start) + count <= s->len && (count == 0 || start >= s->released);
    const pkv_status want = !s ? PKV_ERR_STALE_HANDLE : held ? PKV_OK : PKV_ERR_INVALID_ARGUMENT;
    expect(pkv_read(pool_, &a), want, "read");
  }

  void decode() {
    Batch b = batch(1);
    const uint32_t q_tokens = 1 + in_.next(2), q_heads = d_.kv_heads * (1 + in_.next(3));
    // Half the decodes windowed (a window of 1 to 2 pages): the first query sees from first_seen on.
    const uint32_t window = in_.next(2) ? 1 + in_.next(2 * d_.page_size) : 0;
    pkv_status want = b.stale ? PKV_ERR_STALE_HANDLE : PKV_OK;
    if (!b.stale)
      for (uint32_t i = 0; i < b.count; i++) {
        const uint32_t len = b.s[i]->len, first = len - q_tokens;
        const uint32_t first_seen = window && first + 1 > window ? first + 1 - window : 0;
        if (len != 0 && (len < q_tokens || first_seen < b.s[i]->released)) want = PKV_ERR_INVALID_ARGUMENT;
      }
    const size_t rows = size_t(b.count) * q_tokens * q_heads;
    std::vector<float> q(rows * d_.head_dim, 0.25f), out(rows * d_.head_dim, NAN), lse(rows, NAN);
    pkv_decode_args a = pu_decode_args(0, b.h, b.count, q_heads, q.data(), out.data(), lse.data());
    a.q_tokens = q_tokens;
    a.chunk_pages = in_.next(3);
    a.window = window;
    expect(pkv_decode(pool_, &a), want, "decode");
    if (want != PKV_OK) return;
    for (uint32_t i = 0; i < b.count; i++)
      for (size_t r = size_t(i) * q_tokens * q_heads; r < size_t(i + 1) * q_tokens * q_heads; r++) {
        const bool empty = b.s[i]->len == 0;
        if (empty ? !(std::isinf(lse[r]) && lse[r] < 0) : !std::isfinite(lse[r]))
          test_failure("call %u: decode of a sequence of %u tokens gave lse %g", call_, b.s[i]->len, double(lse[r]));
        for (uint32_t e = 0; e < d_.head_dim; e++) {
          const float o = out[r * d_.head_dim + e];
          if (empty ? o != 0.0f : !std::isfinite(o))
            test_failure("call %u: decode of a sequence of %u tokens gave %g", call_, b.s[i]->len, double(o));
        }
      }
  }

  // An extend of each entry's newest b.n tokens (up to a sequence's length, one past it now and then),
  // half of them windowed, half of them prepares: the same checks, nothing attended.
  void extend() {
    Batch b = batch(2 * d_.page_size);
    const uint32_t q_heads = d_.kv_heads * (1 + in_.next(3));
    const uint32_t window = in_.next(2) ? 1 + in_.next(2 * d_.page_size) : 0;
    const bool prepare = in_.next(2) != 0;
    pkv_status want = b.stale ? PKV_ERR_STALE_HANDLE : PKV_OK;
    uint32_t offsets[4] = {0};
    for (uint32_t i = 0; i < b.count; i++) {
      if (b.s[i] && in_.next(2)) b.n[i] = in_.next(b.s[i]->len + 2);
      offsets[i + 1] = offsets[i] + b.n[i];
      if (b.stale) continue;
      const uint32_t len = b.s[i]->len, first = len - b.n[i];
      const uint32_t first_seen = window && first >= window ? first + 1 - window : 0;
      if (b.n[i] > len || (b.n[i] > 0 && first_seen < b.s[i]->released)) want = PKV_ERR_INVALID_ARGUMENT;
    }
    const size_t rows = size_t(offsets[b.count]) * q_heads;
    std::vector<float> q(std::max<size_t>(rows, 1) * d_.head_dim, 0.25f), out(q.size(), NAN), lse(q.size(), NAN);
    pkv_extend_args a = pu_extend_args(0, b.h, b.count, q_heads, offsets, q.data(), out.data(), lse.data());
    a.window = window;
    expect(prepare ? pkv_extend_prepare(pool_, &a) : pkv_extend(pool_, &a), want, prepare ? "extend_prepare" : "extend");
    for (size_t r = 0; r < rows; r++) {
      const bool written = want == PKV_OK && !prepare;
      if (written ? !std::isfinite(lse[r]) : !std::isnan(lse[r]))
        test_failure("call %u: %s gave lse %g in row %zu", call_, prepare ? "extend_prepare" : "extend", double(lse[r]), r);
      for (uint32_t e = 0; e < d_.head_dim; e++)
        if (written ? !std::isfinite(out[r * d_.head_dim + e]) : !std::isnan(out[r * d_.head_dim + e]))
          test_failure("call %u: %s gave %g in row %zu", call_, prepare ? "extend_prepare" : "extend",
                       double(out[r * d_.head_dim + e]), r);
    }
  }

  // Arguments wrong in one way each: all refused, nothing changed.
  void bad_call() {
    const uint32_t n = 1;
    pkv_seq h = pick();
    switch (in_.next(4)) {
    case 0: expect(pkv_append(pool_, nullptr, &n, 1), PKV_ERR_INVALID_ARGUMENT, "append NULL"); break;
    case 1: expect(pkv_append(pool_, &h, &n, d_.max_sequences + 1), PKV_ERR_INVALID_ARGUMENT, "append count"); break;
    case 2: {
      float q[32], out[32];
      const pkv_decode_args a = pu_decode_args(0, &h, 1, PKV_MAX_Q_HEADS + d_.kv_heads, q, out, nullptr);
      expect(pkv_decode(pool_, &a), PKV_ERR_INVALID_ARGUMENT, "decode q_heads");
      break;
    }
    default: expect(pkv_seq_fork(pool_, h, nullptr), PKV_ERR_INVALID_ARGUMENT, "fork NULL"); break;
    }
  }

  uint32_t free_pages() const { return uint32_t(std::count(ref_.begin(), ref_.end(), 0u)); }

  void check_state() {
    pkv_pool_stats st = PKV_POOL_STATS_INIT;
    if (pkv_pool_get_stats(pool_, &st) != PKV_OK) test_failure("call %u: stats: %s", call_, pkv_last_error());
    uint64_t tokens = 0;
    for (const MSeq &s : live_) tokens += s.len;
    const uint32_t shared = uint32_t(std::count_if(ref_.begin(), ref_.end(), [](uint32_t r) { return r > 1; }));
    if (st.pages_free != free_pages() || st.pages_shared != shared || st.sequences_live != live_.size() ||
        st.tokens_live != tokens)
      test_failure("call %u: the pool has %u pages free, %u shared, %u sequences, %llu tokens; the model %u, %u, %u, %llu",
               call_, st.pages_free, st.pages_shared, st.sequences_live, (unsigned long long)st.tokens_live,
               free_pages(), shared, uint32_t(live_.size()), (unsigned long long)tokens);
    for (pkv_seq d : dead_) {
      uint32_t n;
      if (pkv_seq_length(pool_, d, &n) != PKV_ERR_STALE_HANDLE) test_failure("call %u: a freed handle is live", call_);
    }
    for (const MSeq &s : live_) {
      uint32_t n = 0;
      if (pkv_seq_length(pool_, s.h, &n) != PKV_OK || n != s.len)
        test_failure("call %u: a sequence's length is %u, the model's %u (%s)", call_, n, s.len, pkv_last_error());
      if (s.len == 0) continue;
      if (s.len == s.released) continue;
      std::vector<float> k(size_t(s.len) * row_), v(k.size());
      for (uint32_t layer = 0; layer < d_.layers; layer++) {
        // Read into place: row pos at pos * row_, the released ones left out.
        const pkv_read_args a = pu_read_args(layer, s.h, s.released, s.len - s.released, PKV_FORMAT_F32,
                                             k.data() + size_t(s.released) * row_, v.data() + size_t(s.released) * row_);
        if (pkv_read(pool_, &a) != PKV_OK) test_failure("call %u: read: %s", call_, pkv_last_error());
        for (uint32_t pos = s.released; pos < s.len; pos++) {
          const int32_t want = s.rows[size_t(pos) * d_.layers + layer];
          if (!want) continue;
          for (size_t e = 0; e < row_; e++)
            if (k[pos * row_ + e] != float(want) || v[pos * row_ + e] != -float(want))
              test_failure("call %u: layer %u position %u reads K %g V %g, the model wrote %d", call_, layer, pos,
                       double(k[pos * row_ + e]), double(v[pos * row_ + e]), want);
        }
      }
    }
  }

  Bytes &in_;
  pkv_pool_desc d_;
  uint64_t max_len_;
  size_t row_;
  pkv_context *ctx_ = nullptr;
  pkv_pool *pool_ = nullptr;
  std::vector<uint32_t> ref_;
  std::vector<MSeq> live_;
  std::vector<pkv_seq> dead_;
  uint32_t call_ = 0, next_value_ = 0;
};

} // namespace

extern "C" int pkv_model_run(const uint8_t *data, size_t size, uint32_t *calls, char *why, size_t why_size) {
  Bytes in{data, size};
  *calls = 0;
  try {
    Model m(in);
    while (in.n > 0) m.step(++*calls);
  } catch (const TestFailure &e) {
    std::snprintf(why, why_size, "%s", e.text);
    return 1;
  }
  return 0;
}
