// Allocation, thread and GPU runtime call failure injection over every public entry point (built
// with -Dfault_injection=true; lib/fault.hpp). Each scenario is one call on a fresh fixture: a context
// and a pool holding a written sequence, a fork of it sharing a partial page, a sequence appended but
// not written, an empty one and a freed handle, with page-table changes still queued. Scenarios run
// on two targets: the backend PKV_BACKEND names through the API (the CPU, with worker threads, by
// default; cuda or hip on a GPU), and the GPU backend's host code over the stand-in device
// (fake_device.hpp), where only calls that reach the backend run. For each kind of point the target
// has (host allocations; threads on the CPU; GPU runtime calls on a GPU or the stand-in), the
// scenario's call first runs unharmed, counting the points it reaches (P) and recording what it
// leaves (the pool's statistics, every sequence's length, every row read back, the call's outputs;
// on the stand-in, which computes nothing, the copies and launches the call asked of it).
// Then for every N in 1..P, once with only point N failing and once with every point from N on
// failing, on a fresh fixture:
//   - the call succeeds and leaves exactly what the unharmed run left (a host allocation or thread
//     failure was absorbed; a GPU call's never may be), or
//   - it fails with PKV_ERR_OUT_OF_MEMORY and a last-error text, leaves the fixture exactly as it was
//     and writes no output handle, and the same call then succeeds, leaving what the unharmed run left
//     (on the stand-in: asking exactly what the unharmed call asked);
//   - nothing leaks: under LeakSanitizer (checked after every scenario), and on the stand-in no
//     device memory, pinned buffer, stream, event or module outlives its context.
// PKV_FAULT_SCENARIO=<name> runs one scenario (on both targets; "fake/<name>" on one); each prints its
// points, and the program the totals.
#include "args.h"
#include "context.hpp"
#include "failure.hpp"
#include "fake_device.hpp"
#include "fault.hpp"
#include "gpu/gpu_backend.hpp"
#include "guard.hpp"
#include "pagedkv.h"

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <csetjmp>
extern "C" {
#include <cmocka.h>
#include "tu_run.h"
}

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

extern "C" int __lsan_do_recoverable_leak_check() __attribute__((weak));

namespace {

namespace fault = pkv::fault;

// head_dim 64 of F16 K and Q8_0 V: the tensor-core decode on CUDA and the stand-in.
constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeadDim = 64, kPageSize = 4, kQHeads = 4, kQTokens = 2;
constexpr uint32_t kRow = kKvHeads * kHeadDim;

// Where a scenario runs: the backend PKV_BACKEND names, through the API, or the GPU backend over the
// stand-in device.
enum class Target { api, fake };
Target g_target = Target::api;
pkv_backend g_backend = PKV_BACKEND_CPU;

struct World {
  FakeLedger ledger; // the stand-in devices' (Target::fake)
  pkv_context *ctx = nullptr;
  pkv_pool *pool = nullptr;
  pkv_seq a{}, fork{}, unwritten{}, empty{}, freed{};
  // What a scenario's call creates or writes.
  pkv_context *new_ctx = nullptr;
  pkv_pool *new_pool = nullptr;
  pkv_pool *side_pool = nullptr; // a scenario's pool beside the fixture's: FP8 pages, or a long sequence's
  pkv_seq side_seq{};
  pkv_seq new_seq{};
  std::vector<float> k, v; // a scenario's input rows or q
  std::vector<uint8_t> out;
  uint32_t a_from = 0; // a's rows read back from here on (a scenario releases those before)
};

pkv_pool_desc pool_desc() {
  return pu_desc(kLayers, kKvHeads, kHeadDim, kPageSize, 24, 6, PKV_FORMAT_F16, PKV_FORMAT_Q8_0);
}

pkv_context_desc context_desc() {
  pkv_context_desc d = PKV_CONTEXT_DESC_INIT;
  d.backend = g_backend;
  d.threads = 3;
  return d;
}

// pkv_context_create, on the stand-in device where the target is.
pkv_status context_create(World &w, pkv_backend backend, pkv_context **out) {
  if (g_target == Target::fake)
    return pkv::guarded("pkv_context_create", [&] {
      auto ctx = std::make_unique<pkv_context>();
      ctx->backend = pkv::make_gpu_backend(std::unique_ptr<pkv::gpu::Device>(new FakeDevice(&w.ledger)), nullptr, 0);
      *out = ctx.release();
    });
  pkv_context_desc d = context_desc();
  d.backend = backend;
  return pkv_context_create(&d, out);
}

void ok(pkv_status st, const char *what) {
  if (st != PKV_OK) test_failure("fixture: %s failed: %s", what, pkv_last_error());
}

std::vector<float> rows(uint32_t n, float base) {
  std::vector<float> r(size_t(n) * kRow);
  for (size_t i = 0; i < r.size(); i++) r[i] = base + float(i % 61) * 0.125f - 3.0f;
  return r;
}

void write_seq(pkv_pool *pool, pkv_seq s, uint32_t n, float base) {
  for (uint32_t layer = 0; layer < kLayers; layer++) {
    const std::vector<float> k = rows(n, base + float(layer)), v = rows(n, base - float(layer));
    const pkv_write_args w = pu_write_args(layer, &s, &n, 1, PKV_FORMAT_F32, k.data(), v.data());
    ok(pkv_write(pool, &w), "write");
  }
}

void set_up(World &w) {
  const pkv_pool_desc pd = pool_desc();
  ok(context_create(w, g_backend, &w.ctx), "context");
  ok(pkv_pool_create(w.ctx, &pd, &w.pool), "pool");
  ok(pkv_seq_alloc(w.pool, &w.a), "alloc");
  const uint32_t ten = 10, six = 6;
  ok(pkv_append(w.pool, &w.a, &ten, 1), "append");
  write_seq(w.pool, w.a, 10, 1.0f);
  ok(pkv_seq_fork(w.pool, w.a, &w.fork), "fork");
  ok(pkv_seq_alloc(w.pool, &w.unwritten), "alloc");
  ok(pkv_append(w.pool, &w.unwritten, &six, 1), "append");
  ok(pkv_seq_alloc(w.pool, &w.empty), "alloc");
  ok(pkv_seq_alloc(w.pool, &w.freed), "alloc");
  ok(pkv_seq_free(w.pool, w.freed), "free");
}

// Returns what the stand-in devices left alive ("1 stream"), or empty.
std::string tear_down(World &w) {
  if (w.new_pool) ok(pkv_pool_destroy(w.new_pool), "destroy");
  if (w.side_pool) ok(pkv_pool_destroy(w.side_pool), "destroy");
  if (w.pool) ok(pkv_pool_destroy(w.pool), "destroy");
  if (w.new_ctx) ok(pkv_context_destroy(w.new_ctx), "destroy");
  if (w.ctx) ok(pkv_context_destroy(w.ctx), "destroy");
  std::string alive = w.ledger.alive();
  w = World{};
  return alive;
}

// Everything a call could change, read through the API with no fault armed (rows only where the
// backend computes: not on the stand-in).
struct Snapshot {
  pkv_pool_stats stats = PKV_POOL_STATS_INIT;
  std::vector<uint32_t> lengths;
  std::vector<uint16_t> kv; // every sequence's K and V rows of every layer, as F16
  bool new_ctx = false, new_pool = false;
  uint64_t new_seq = 0;
  std::vector<uint8_t> out;
  FakeVector<FakeString> new_pool_decode; // on the stand-in: what a decode on a created pool asks of it
  std::vector<float> scales;              // the pools' FP8 scales, K's and V's

  // The first part that differs from o, or null.
  const char *differs(const Snapshot &o) const {
    if (std::memcmp(&stats, &o.stats, sizeof stats) != 0) return "the pool's statistics";
    if (lengths != o.lengths) return "a sequence's length";
    if (kv != o.kv) return "the rows read back";
    if (new_ctx != o.new_ctx || new_pool != o.new_pool) return "a created object";
    if (new_seq != o.new_seq) return "the handle given out";
    if (out != o.out) return "the call's output";
    if (new_pool_decode != o.new_pool_decode) return "what a decode on the created pool asks of the device";
    if (scales != o.scales) return "the FP8 scales";
    return nullptr;
  }
  bool operator==(const Snapshot &o) const { return differs(o) == nullptr; }
};

// On the stand-in, a pool's decode configuration shows only in its decodes: what the first
// decode_prepare on a created pool asks of the device (its plan, made for the kernel chosen).
FakeVector<FakeString> decode_on_new_pool(World &w) {
  pkv_seq s{};
  const uint32_t n = 9;
  ok(pkv_seq_alloc(w.new_pool, &s), "alloc");
  ok(pkv_append(w.new_pool, &s, &n, 1), "append");
  std::vector<float> q(size_t(kQTokens) * kQHeads * kHeadDim), out(q.size());
  pkv_decode_args a = pu_decode_args(0, &s, 1, kQHeads, q.data(), out.data(), nullptr);
  a.q_tokens = kQTokens;
  w.ledger.writes.clear();
  w.ledger.recording = true;
  ok(pkv_decode_prepare(w.new_pool, &a), "decode_prepare");
  w.ledger.recording = false;
  return std::move(w.ledger.writes);
}

Snapshot snapshot(World &w, bool with_out) {
  Snapshot s;
  ok(pkv_pool_get_stats(w.pool, &s.stats), "stats");
  for (pkv_seq q : {w.a, w.fork, w.unwritten, w.empty, w.new_seq}) {
    uint32_t n = UINT32_MAX;
    if (pkv_seq_length(w.pool, q, &n) != PKV_OK) n = UINT32_MAX;
    s.lengths.push_back(n);
    if (n == UINT32_MAX || n == 0 || g_target == Target::fake) continue;
    const uint32_t from = q.id == w.a.id ? w.a_from : 0;
    for (uint32_t layer = 0; layer < kLayers; layer++) {
      std::vector<uint16_t> k(size_t(n - from) * kRow), v(size_t(n - from) * kRow);
      const pkv_read_args r = pu_read_args(layer, q, from, n - from, PKV_FORMAT_F16, k.data(), v.data());
      ok(pkv_read(w.pool, &r), "read");
      s.kv.insert(s.kv.end(), k.begin(), k.end());
      s.kv.insert(s.kv.end(), v.begin(), v.end());
    }
  }
  s.new_ctx = w.new_ctx != nullptr;
  s.new_pool = w.new_pool != nullptr;
  s.new_seq = w.new_seq.id & ((uint64_t(1) << 52) - 1); // without the pool's tag: each fixture is a new pool
  if (with_out && g_target == Target::api) s.out = w.out;
  for (pkv_pool *pool : {w.pool, w.side_pool}) {
    if (!pool) continue;
    std::vector<float> k(kLayers * kKvHeads), v(kLayers * kKvHeads);
    ok(pkv_pool_get_scales(pool, 0, 0, k.data(), v.data()), "get_scales");
    s.scales.insert(s.scales.end(), k.begin(), k.end());
    s.scales.insert(s.scales.end(), v.begin(), v.end());
  }
  if (w.new_pool && g_target == Target::fake) s.new_pool_decode = decode_on_new_pool(w);
  return s;
}

// Every attention variant at once.
template <class Args> void set_variants(Args &a) {
  static const float sinks[kQHeads] = {0.5f, -1.0f, 2.0f, 0.0f}, slopes[kQHeads] = {0.5f, 0.25f, 0.125f, 0.0f};
  a.window = 3;
  a.softcap = 2.0f;
  a.sinks = sinks;
  a.alibi_slopes = slopes;
}

pkv_status decode(World &w, bool launch, bool variants = false) {
  const pkv_seq batch[4] = {w.a, w.fork, w.unwritten, w.empty};
  pkv_decode_args a = pu_decode_args(0, batch, 4, kQHeads, w.k.data(), w.out.data(),
                                     reinterpret_cast<float *>(w.out.data()) + 4 * kQTokens * kQHeads * kHeadDim);
  a.q_tokens = kQTokens;
  a.chunk_pages = 1; // split: the chunks' partials and their merge
  if (variants) set_variants(a);
  return launch ? pkv_decode(w.pool, &a) : pkv_decode_prepare(w.pool, &a);
}

// New tokens of a, the fork, the unwritten sequence and the empty one, 6 queries in all, causal or
// with a tree mask: the second of a's three sees the first, the third only itself.
constexpr uint32_t kExtendQueries = 6;
constexpr size_t kExtendOut = kExtendQueries * kQHeads * (kHeadDim + 1) * sizeof(float);

// An extend of `count` entries of `seqs` whose new tokens `offsets` gives, q from w.k, out and lse
// (after out) into w.out.
pkv_extend_args extend_args(World &w, const pkv_seq *seqs, uint32_t count, const uint32_t *offsets) {
  return pu_extend_args(0, seqs, count, kQHeads, offsets, w.k.data(), w.out.data(),
                        reinterpret_cast<float *>(w.out.data()) + size_t(offsets[count]) * kQHeads * kHeadDim);
}

pkv_status extend(World &w, bool masked, bool variants, bool launch = true) {
  static const uint32_t offsets[5] = {0, 3, 5, 6, 6};
  static const uint8_t mask[6] = {1, 3, 4, 1, 3, 1};
  static const uint64_t mask_offsets[4] = {0, 3, 5, 6};
  const pkv_seq batch[4] = {w.a, w.fork, w.unwritten, w.empty};
  pkv_extend_args a = extend_args(w, batch, 4, offsets);
  a.layer = 1;
  if (masked) {
    a.mask = mask;
    a.mask_offsets = mask_offsets;
    a.mask_bytes = sizeof mask;
  }
  if (variants) set_variants(a);
  return launch ? pkv_extend(w.pool, &a) : pkv_extend_prepare(w.pool, &a);
}

// An extend of 66 new tokens of a 70-token sequence in a pool of F16 pages beside the fixture's:
// the GPU backend's extend kernel (entries of 64 or more new tokens, F16/BF16 pages).
constexpr uint32_t kTilesTokens = 66, kTilesLength = 70;
constexpr size_t kTilesOut = kTilesTokens * kQHeads * (kHeadDim + 1) * sizeof(float);

void long_sequence(World &w) {
  const pkv_pool_desc d = pu_desc(kLayers, kKvHeads, kHeadDim, kPageSize, 24, 2, PKV_FORMAT_F16, PKV_FORMAT_F16);
  ok(pkv_pool_create(w.ctx, &d, &w.side_pool), "pool");
  ok(pkv_seq_alloc(w.side_pool, &w.side_seq), "alloc");
  uint32_t n = kTilesLength;
  ok(pkv_append(w.side_pool, &w.side_seq, &n, 1), "append");
  write_seq(w.side_pool, w.side_seq, kTilesLength, 0.25f);
  w.k = rows(kTilesTokens * kQHeads / kKvHeads, 0.5f);
}

pkv_status extend_tiles(World &w, bool launch = true) {
  static const uint32_t offsets[2] = {0, kTilesTokens};
  const pkv_extend_args a = extend_args(w, &w.side_seq, 1, offsets);
  return launch ? pkv_extend(w.side_pool, &a) : pkv_extend_prepare(w.side_pool, &a);
}

// Where a scenario's call runs: through the API only (it reads, or touches no context or pool), on
// the CPU backend only (the GPU backends refuse it), or on the stand-in too (every call that may
// change a context or pool); a call that only releases cannot fail, so a GPU call failing under it
// is absorbed.
enum class Reach { api, cpu, device, release };

// A scenario's inputs and output buffer are made by `prepare`, before a fault is armed: the call
// itself allocates nothing of the test's (operator new counts every allocation in the process).
struct Scenario {
  const char *name;
  size_t out_bytes;
  void (*prepare)(World &);
  pkv_status (*call)(World &);
  bool same_out; // whether the call's output is the same on every run (a timing is not)
  Reach reach;
};

template <class T> void put(World &w, const T &x) { std::memcpy(w.out.data(), &x, sizeof x); }

void two_row_sets(World &w) {
  w.k = rows(6, 2.0f);
  w.v = rows(6, -2.0f);
}

void queries(World &w) { w.k = rows(4 * kQTokens * kQHeads / kKvHeads, 0.5f); }

constexpr size_t kDecodeOut = 4 * kQTokens * kQHeads * (kHeadDim + 1) * sizeof(float);

// The image of the written sequence (10 tokens, 3 pages of both layers) fits in this many bytes.
constexpr size_t kImageBytes = 16384;

pkv_export_args export_of(World &w, void *image, pkv_memory memory = PKV_MEMORY_HOST) {
  pkv_export_args a = PKV_EXPORT_ARGS_INIT;
  a.seq = w.a;
  a.memory = memory;
  a.image = image;
  a.image_bytes = kImageBytes;
  return a;
}

// The written sequence's image, in w.k, for an import to read.
void image_of_a(World &w) {
  w.k.assign(kImageBytes / sizeof(float), 0.0f);
  const pkv_export_args a = export_of(w, w.k.data());
  ok(pkv_seq_export(w.pool, &a), "export");
}

// An export, and an import of the image image_of_a made, from host memory said to be pinned or not
// (the stand-in copies any host memory; the GPU backend copies pinned memory without staging). The
// export is waited for, so its output is complete.
pkv_status export_into_out(World &w, pkv_memory memory) {
  const pkv_export_args a = export_of(w, w.out.data(), memory);
  const pkv_status st = pkv_seq_export(w.pool, &a);
  return st == PKV_OK ? pkv_context_synchronize(w.ctx) : st;
}

pkv_status import_from_k(World &w, pkv_memory memory) {
  pkv_import_args a = PKV_IMPORT_ARGS_INIT;
  a.memory = memory;
  a.image = w.k.data();
  a.image_bytes = kImageBytes;
  return pkv_seq_import(w.pool, &a, &w.new_seq);
}

const Scenario kScenarios[] = {
    {"context_create", 0, nullptr, [](World &w) { return context_create(w, g_backend, &w.new_ctx); }, true, Reach::device},
    {"context_create_auto", 0, nullptr, [](World &w) { return context_create(w, PKV_BACKEND_AUTO, &w.new_ctx); }, true, Reach::api},
    {"context_destroy", 0, [](World &w) { ok(context_create(w, g_backend, &w.new_ctx), "context"); },
     [](World &w) {
       const pkv_status st = pkv_context_destroy(w.new_ctx);
       if (st == PKV_OK) w.new_ctx = nullptr;
       return st; }, true, Reach::release},
    {"context_backend", sizeof(pkv_backend), nullptr, [](World &w) {
       pkv_backend b = PKV_BACKEND_AUTO;
       const pkv_status st = pkv_context_backend(w.ctx, &b);
       put(w, b);
       return st; }, true, Reach::api},
    {"context_synchronize", 0, nullptr, [](World &w) { return pkv_context_synchronize(w.ctx); }, true, Reach::device},
    {"context_read_bandwidth", sizeof(double), nullptr, [](World &w) {
       double gbs = 0;
       const pkv_status st = pkv_context_read_bandwidth(w.ctx, 1 << 20, &gbs);
       put(w, gbs);
       return st; }, false, Reach::device},
    {"backend_query", sizeof(pkv_backend_info), nullptr, [](World &w) {
       pkv_backend_info info = PKV_BACKEND_INFO_INIT;
       const pkv_status st = pkv_backend_query(PKV_BACKEND_CPU, &info);
       put(w, info);
       return st; }, true, Reach::api},
    {"pool_create", 0, [](World &w) { ok(context_create(w, g_backend, &w.new_ctx), "context"); }, [](World &w) {
       const pkv_pool_desc d = pool_desc(); // the context's first pool: the decode kernels are chosen
       return pkv_pool_create(w.new_ctx, &d, &w.new_pool); }, true, Reach::device},
    {"seq_alloc", 0, nullptr, [](World &w) { return pkv_seq_alloc(w.pool, &w.new_seq); }, true, Reach::device},
    {"seq_free", 0, nullptr, [](World &w) { return pkv_seq_free(w.pool, w.a); }, true, Reach::device},
    {"seq_fork", 0, nullptr, [](World &w) { return pkv_seq_fork(w.pool, w.fork, &w.new_seq); }, true, Reach::device},
    {"seq_truncate", 0, nullptr, [](World &w) { return pkv_seq_truncate(w.pool, w.a, 3); }, true, Reach::device},
    {"seq_length", 4, nullptr, [](World &w) {
       uint32_t n = 0;
       const pkv_status st = pkv_seq_length(w.pool, w.fork, &n);
       put(w, n);
       return st; }, true, Reach::api},
    {"append_copy_on_write", 0, nullptr, [](World &w) {
       const pkv_seq s[3] = {w.a, w.fork, w.empty};
       const uint32_t n[3] = {3, 2, 9};
       return pkv_append(w.pool, s, n, 3); }, true, Reach::device},
    {"write", 0, two_row_sets, [](World &w) {
       const uint32_t n = 6;
       const pkv_write_args a = pu_write_args(1, &w.unwritten, &n, 1, PKV_FORMAT_F32, w.k.data(), w.v.data());
       return pkv_write(w.pool, &a); }, true, Reach::device},
    {"read", 10 * kRow * 4 * 2, nullptr, [](World &w) {
       const pkv_read_args a = pu_read_args(1, w.fork, 0, 10, PKV_FORMAT_F32, w.out.data(), w.out.data() + 10 * kRow * 4);
       return pkv_read(w.pool, &a); }, true, Reach::device},
    {"decode", kDecodeOut, queries, [](World &w) { return decode(w, true); }, true, Reach::device},
    {"decode_prepare", kDecodeOut, queries, [](World &w) { return decode(w, false); }, true, Reach::device},
    {"decode_variants", kDecodeOut, queries, [](World &w) { return decode(w, true, true); }, true, Reach::device},
    {"extend", kExtendOut, queries, [](World &w) { return extend(w, false, false); }, true, Reach::device},
    {"extend_variants", kExtendOut, queries, [](World &w) { return extend(w, false, true); }, true, Reach::device},
    {"extend_masked", kExtendOut, queries, [](World &w) { return extend(w, true, true); }, true, Reach::device},
    {"extend_tiles", kTilesOut, long_sequence, [](World &w) { return extend_tiles(w); }, true, Reach::device},
    {"extend_prepare", kExtendOut, queries, [](World &w) { return extend(w, true, false, false); }, true,
     Reach::device},
    {"extend_tiles_prepare", kTilesOut, long_sequence, [](World &w) { return extend_tiles(w, false); }, true,
     Reach::device},
    // a's first two pages (of 4 tokens), shared with the fork: only dereferenced.
    {"seq_release_before", 0, [](World &w) { w.a_from = 9; }, [](World &w) {
       return pkv_seq_release_before(w.pool, w.a, 9); }, true, Reach::device},
    {"seq_export_size", 8, nullptr, [](World &w) {
       const pkv_export_args a = export_of(w, nullptr);
       uint64_t n = 0;
       const pkv_status st = pkv_seq_export_size(w.pool, &a, &n);
       put(w, n);
       return st; }, true, Reach::api},
    {"seq_export", kImageBytes, nullptr, [](World &w) { return export_into_out(w, PKV_MEMORY_HOST); }, true,
     Reach::device},
    {"seq_export_pinned", kImageBytes, nullptr, [](World &w) { return export_into_out(w, PKV_MEMORY_HOST_PINNED); },
     true, Reach::device},
    {"seq_import", 0, image_of_a, [](World &w) { return import_from_k(w, PKV_MEMORY_HOST); }, true, Reach::device},
    {"seq_import_pinned", 0, image_of_a, [](World &w) { return import_from_k(w, PKV_MEMORY_HOST_PINNED); }, true,
     Reach::device},
    {"pool_regions", sizeof(pkv_memory_region) + 4, nullptr, [](World &w) {
       pkv_memory_region r{};
       uint32_t n = 0;
       const pkv_status st = pkv_pool_regions(w.pool, &r, 1, &n);
       r.address = 0; // where the pool is differs between fixtures
       put(w, r);
       std::memcpy(w.out.data() + sizeof r, &n, 4);
       return st; }, true, Reach::api},
    {"seq_page_spans", 2 * kLayers * 3 * sizeof(pkv_page_span), nullptr, [](World &w) {
       uint64_t n = 0;
       return pkv_seq_page_spans(w.pool, w.fork, 0, 0, reinterpret_cast<pkv_page_span *>(w.out.data()),
                                 2 * kLayers * 3, &n); }, true, Reach::api},
    // A pool of FP8 pages beside the fixture's, its scales set per KV head.
    {"pool_set_scales", 0, [](World &w) {
       const pkv_pool_desc d = pu_desc(kLayers, kKvHeads, kHeadDim, kPageSize, 24, 6, PKV_FORMAT_FP8_E4M3,
                                       PKV_FORMAT_FP8_E5M2);
       ok(pkv_pool_create(w.ctx, &d, &w.side_pool), "pool");
       w.k = rows(1, 4.0f); // positive values, kRow of them
     }, [](World &w) {
       pkv_scales_args a = PKV_SCALES_ARGS_INIT;
       a.per_head = 1;
       a.k_scales = w.k.data();
       a.v_scales = w.k.data() + kLayers * kKvHeads;
       return pkv_pool_set_scales(w.side_pool, &a); }, true, Reach::device},
    {"pool_get_stats", sizeof(pkv_pool_stats), nullptr, [](World &w) {
       pkv_pool_stats st = PKV_POOL_STATS_INIT;
       const pkv_status r = pkv_pool_get_stats(w.pool, &st);
       put(w, st);
       return r; }, true, Reach::api},
    {"convert", 64 + kRow * 4, queries, [](World &w) { // 36 bytes of Q4_0, then the floats back
       pkv_status st = pkv_convert_from_f32(PKV_FORMAT_Q4_0, w.k.data(), kRow, w.out.data());
       if (st == PKV_OK) st = pkv_convert_to_f32(PKV_FORMAT_Q4_0, w.out.data(), kRow, reinterpret_cast<float *>(w.out.data() + 64));
       return st; }, true, Reach::api},
    {"get_api", sizeof(void *), nullptr, [](World &w) {
       const pkv_api *api = nullptr;
       const pkv_status st = pkv_get_api(PKV_API_VERSION, &api);
       put(w, api);
       return st; }, true, Reach::api},
    {"pool_destroy", 0, nullptr, [](World &w) {
       const pkv_status st = pkv_pool_destroy(w.pool);
       if (st == PKV_OK) w.pool = nullptr;
       return st; }, true, Reach::release},
};

struct Totals {
  uint64_t points[3] = {0, 0, 0}; // points reached, by kind
  uint64_t runs = 0, failures = 0;
} g_totals;

const char *kind_name(fault::Kind k) {
  return k == fault::Kind::host_alloc ? "host allocation" : k == fault::Kind::thread ? "thread" : "GPU call";
}

// The scenario's call on a fresh fixture with point `nth` of `kind` armed (0: none fails).
struct Outcome {
  pkv_status status;
  std::string error;
  uint64_t reached;
  bool fired;
  Snapshot after;
  FakeVector<FakeString> writes; // what the call (or its retry) asked of the stand-in
};

// The fixture before the call, read in a World of its own: reading rows applies the page-table
// changes the fixture leaves queued, which the call must meet.
Snapshot fixture_state(const Scenario &sc) {
  World w;
  set_up(w);
  if (sc.prepare) sc.prepare(w);
  const Snapshot s = snapshot(w, false);
  tear_down(w);
  return s;
}

// The call, recording what it asks of the stand-in.
pkv_status call(const Scenario &sc, World &w, FakeVector<FakeString> *writes) {
  w.ledger.writes.clear();
  w.ledger.recording = true;
  const pkv_status st = sc.call(w);
  w.ledger.recording = false;
  *writes = std::move(w.ledger.writes);
  return st;
}

Outcome run(const Scenario &sc, const Snapshot &fixture, fault::Kind kind, uint64_t nth, bool persistent) {
  World w;
  set_up(w);
  Outcome o;
  if (sc.prepare) sc.prepare(w);
  w.out.assign(sc.out_bytes, 0);
  fault::arm(kind, nth, persistent);
  o.status = call(sc, w, &o.writes);
  fault::disarm();
  o.reached = fault::reached();
  o.fired = fault::fired();
  o.error = pkv_last_error();
  const char *how = persistent ? "and every one after" : "alone";
  if (w.pool) { // else destroyed by the call: nothing left to read
    o.after = snapshot(w, sc.same_out);
    if (o.status != PKV_OK) {
      const Snapshot failed = snapshot(w, false); // a failed call's outputs are undefined
      const pkv_status retry = call(sc, w, &o.writes);
      if (retry != PKV_OK) test_failure("%s: the retry after the failure failed too: %s", sc.name, pkv_last_error());
      o.after = snapshot(w, sc.same_out);
      if (!(failed == fixture)) {
        tear_down(w);
        test_failure("%s: %s %llu failing (%s) returned %s but changed %s", sc.name, kind_name(kind),
                     (unsigned long long)nth, how, pkv_status_string(o.status), failed.differs(fixture));
      }
    }
  }
  const std::string alive = tear_down(w);
  if (!alive.empty())
    test_failure("%s: %s %llu failing (%s): %s outlived the context", sc.name, kind_name(kind), (unsigned long long)nth,
                 how, alive.c_str());
  return o;
}

// The kinds of point a target has. On a GPU, its calls alone: the same host code's allocations are
// the stand-in's to cover.
std::vector<fault::Kind> kinds() {
  if (g_target == Target::fake) return {fault::Kind::host_alloc, fault::Kind::gpu_call};
  if (g_backend == PKV_BACKEND_CPU) return {fault::Kind::host_alloc, fault::Kind::thread};
  return {fault::Kind::gpu_call};
}

const char *first_difference(const FakeVector<FakeString> &a, const FakeVector<FakeString> &b) {
  for (size_t i = 0; i < a.size(); i++)
    if (i >= b.size() || a[i] != b[i]) return a[i].c_str();
  return "(none)";
}

void torture(const Scenario &sc) {
  const Snapshot fixture = fixture_state(sc);
  for (fault::Kind kind : kinds()) {
    const Outcome clean = run(sc, fixture, kind, 0, false);
    if (clean.status != PKV_OK) test_failure("%s: fails with no fault armed: %s", sc.name, clean.error.c_str());
    g_totals.points[int(kind)] += clean.reached;
    uint64_t failed = 0;
    for (bool persistent : {false, true}) {
      for (uint64_t n = 1; n <= clean.reached; n++) {
        const Outcome o = run(sc, fixture, kind, n, persistent);
        const char *how = persistent ? "and every one after" : "alone";
        g_totals.runs++;
        if (o.status == PKV_OK) {
          if (o.fired && kind == fault::Kind::gpu_call && sc.reach != Reach::release)
            test_failure("%s: GPU call %llu failing (%s): the call succeeded, the failure unreported", sc.name,
                         (unsigned long long)n, how);
          if (!(o.after == clean.after) || o.writes != clean.writes)
            test_failure("%s: %s %llu failing (%s): the call succeeded but left another result than without the fault",
                         sc.name, kind_name(kind), (unsigned long long)n, how);
          continue;
        }
        failed++;
        if (o.status != PKV_ERR_OUT_OF_MEMORY)
          test_failure("%s: %s %llu failing (%s): %s (%s), expected PKV_ERR_OUT_OF_MEMORY", sc.name, kind_name(kind),
                       (unsigned long long)n, how, pkv_status_string(o.status), o.error.c_str());
        if (o.error.empty()) test_failure("%s: %s %llu failing: no last-error text", sc.name, kind_name(kind), (unsigned long long)n);
        if (!o.fired) test_failure("%s: failed (%s) though no fault fired", sc.name, o.error.c_str());
        if (!(o.after == clean.after))
          test_failure("%s: %s %llu failing (%s): the retry left another result than the call without faults (%s)",
                       sc.name, kind_name(kind), (unsigned long long)n, how, o.after.differs(clean.after));
        if (o.writes != clean.writes)
          test_failure("%s: %s %llu failing (%s: %s): the retry asked the device for %zu copies and launches, the "
                       "call without faults %zu; the first that differs: \"%s\" (without faults: \"%s\")",
                       sc.name, kind_name(kind), (unsigned long long)n, how, o.error.c_str(), o.writes.size(),
                       clean.writes.size(), first_difference(o.writes, clean.writes),
                       first_difference(clean.writes, o.writes));
      }
    }
    g_totals.failures += failed;
    print_message("    %-29s %-15s %3llu points, %3llu failing runs\n", sc.name, kind_name(kind),
                  (unsigned long long)clean.reached, (unsigned long long)failed);
  }
  if (__lsan_do_recoverable_leak_check && __lsan_do_recoverable_leak_check() != 0)
    test_failure("%s: LeakSanitizer found leaks (above)", sc.name);
}

// A scenario on a target, named "cpu/decode", "fake/decode".
struct Case {
  Scenario sc;
  Target target;
  char name[48];
};

void scenario_test(void **state) {
  static TestFailure found;
  const Case &c = *static_cast<const Case *>(*state);
  g_target = c.target;
  try {
    torture(c.sc);
    return;
  } catch (const TestFailure &f) {
    found = f;
  }
  fail_msg("%s", found.text);
}

} // namespace

int main() {
  const char *backend = std::getenv("PKV_BACKEND");
  for (pkv_backend b : {PKV_BACKEND_CPU, PKV_BACKEND_CUDA, PKV_BACKEND_HIP})
    if (backend && std::strcmp(backend, pkv_backend_name(b)) == 0) g_backend = b;
  const char *only = std::getenv("PKV_FAULT_SCENARIO");
  std::vector<Case> cases;
  for (Target target : {Target::api, Target::fake})
    for (const Scenario &sc : kScenarios) {
      if (target == Target::fake && (sc.reach == Reach::api || sc.reach == Reach::cpu)) continue;
      if (sc.reach == Reach::cpu && g_backend != PKV_BACKEND_CPU) continue;
      Case c{sc, target, {}};
      std::snprintf(c.name, sizeof c.name, "%s/%s", target == Target::fake ? "fake" : pkv_backend_name(g_backend),
                    sc.name);
      if (!only || std::strcmp(only, sc.name) == 0 || std::strcmp(only, c.name) == 0) cases.push_back(c);
    }
  std::vector<CMUnitTest> tests;
  for (Case &c : cases) {
    c.sc.name = c.name;
    tests.push_back(CMUnitTest{c.name, scenario_test, nullptr, nullptr, &c});
  }
  if (tests.empty()) {
    std::fprintf(stderr, "PKV_FAULT_SCENARIO=%s names no scenario\n", only);
    return 1;
  }
  const int failed = tu_run_group("faults", tests.data(), tests.size(), nullptr, nullptr);
  std::printf("# fault injection: %zu scenarios, %llu host allocation, %llu thread and %llu GPU call points, %llu runs "
              "with a fault armed, %llu of them failed cleanly and were retried\n",
              tests.size(), (unsigned long long)g_totals.points[0], (unsigned long long)g_totals.points[1],
              (unsigned long long)g_totals.points[2], (unsigned long long)g_totals.runs,
              (unsigned long long)g_totals.failures);
  return failed;
}
