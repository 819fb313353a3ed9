// The C boundary: every public function checks its arguments, runs, and turns whatever went wrong
// into a status plus this thread's last-error text. No exception leaves this file.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>

#include "backend_select.hpp"
#include "context.hpp"
#include "error.hpp"
#include "format.hpp"
#include "guard.hpp"
#include "pool.hpp"

using pkv::fail;
using pkv::guarded;

namespace {

void check_pointer(const void *p, const char *what) {
  if (!p) fail(PKV_ERR_INVALID_ARGUMENT, "%s is NULL", what);
}

// What the boundary knows of each argument struct: its INIT defaults, and its size as first released,
// up to the end of its last field then. A caller's struct may be that old (fields it lacks keep their
// defaults) or newer and larger (fields this library does not know are not read).
template <class T> struct StructInfo;
#define PKV_STRUCT_INFO(T, INIT, FIRST_LAST_FIELD)                                                   \
  template <> struct StructInfo<T> {                                                                \
    static constexpr const char *init = #INIT;                                                      \
    static constexpr size_t first_size = offsetof(T, FIRST_LAST_FIELD) + sizeof(T::FIRST_LAST_FIELD); \
    static T defaults() { return T INIT; }                                                          \
  };
PKV_STRUCT_INFO(pkv_context_desc, PKV_CONTEXT_DESC_INIT, stream)
PKV_STRUCT_INFO(pkv_backend_info, PKV_BACKEND_INFO_INIT, detail)
PKV_STRUCT_INFO(pkv_pool_desc, PKV_POOL_DESC_INIT, max_sequence_length)
PKV_STRUCT_INFO(pkv_write_args, PKV_WRITE_ARGS_INIT, v)
PKV_STRUCT_INFO(pkv_read_args, PKV_READ_ARGS_INIT, v)
PKV_STRUCT_INFO(pkv_decode_args, PKV_DECODE_ARGS_INIT, chunk_pages)
PKV_STRUCT_INFO(pkv_pool_stats, PKV_POOL_STATS_INIT, bytes_per_token)
PKV_STRUCT_INFO(pkv_export_args, PKV_EXPORT_ARGS_INIT, image_bytes)
PKV_STRUCT_INFO(pkv_import_args, PKV_IMPORT_ARGS_INIT, image_bytes)
PKV_STRUCT_INFO(pkv_extend_args, PKV_EXTEND_ARGS_INIT, mask_bytes)
PKV_STRUCT_INFO(pkv_scales_args, PKV_SCALES_ARGS_INIT, v_scales)
#undef PKV_STRUCT_INFO

template <class T> T read_struct(const T *p, const char *what) {
  check_pointer(p, what);
  using Info = StructInfo<T>;
  if (p->struct_size < Info::first_size)
    fail(PKV_ERR_STRUCT_SIZE, "%s->struct_size is %u, this library needs at least %u: initialise it with %s", what,
         p->struct_size, unsigned(Info::first_size), Info::init);
  T copy = Info::defaults();
  std::memcpy(&copy, p, std::min<size_t>(p->struct_size, sizeof(T)));
  return copy;
}

// Output structs: the caller sets struct_size; the library fills the part both know.
template <class T> void write_struct(T *dst, const T &src, const char *what) {
  const uint32_t size = read_struct(dst, what).struct_size;
  T out = src;
  out.struct_size = size;
  std::memcpy(dst, &out, std::min<size_t>(size, sizeof(T)));
}

bool power_of_two(uint32_t x) { return x != 0 && (x & (x - 1)) == 0; }

void check_page_format(pkv_format f, const char *what) {
  if (!pkv::is_page_format(f))
    fail(PKV_ERR_INVALID_ARGUMENT, "%s is %d: expected one of f32, f16, bf16, q8_0, q4_0, fp8_e4m3, fp8_e5m2", what,
         int(f));
}

// n values of a row in `f`: a multiple of 32 for quantized formats, and bytes that fit in size_t.
void check_row_count(pkv_format f, size_t n) {
  if (n == 0 || pkv::row_bytes(f, n) != 0) return;
  if (pkv::is_quantized(f)) fail(PKV_ERR_INVALID_ARGUMENT, "n is %zu: %s rows hold a multiple of 32 values", n, pkv_format_name(f));
  fail(PKV_ERR_INVALID_ARGUMENT, "n is %zu: a %s row of that many values has more bytes than size_t holds", n,
       pkv_format_name(f));
}

constexpr uint32_t kMaxKvHeads = 4096;
constexpr uint64_t kMaxBandwidthBytes = uint64_t(1) << 48; // 256 TiB

// pkv_pool_set_scales' scales for `count` layers: only for FP8 planes, each finite and > 0.
void check_scales(const pkv::PoolGeometry &g, uint32_t count, const pkv_scales_args &a) {
  if (a.per_head > 1) fail(PKV_ERR_INVALID_ARGUMENT, "args->per_head is %u: expected 0 (a scale per layer) or 1", a.per_head);
  const size_t n = size_t(count) * (a.per_head ? g.kv_heads : 1);
  for (int plane = 0; plane < 2; plane++) {
    const float *given = plane ? a.v_scales : a.k_scales;
    const pkv_format f = (plane ? g.v : g.k).format;
    const char *name = plane ? "v_scales" : "k_scales";
    if (!given) continue;
    if (!pkv::is_fp8(f))
      fail(PKV_ERR_INVALID_ARGUMENT, "args->%s is set but the pool's %s pages are %s: only FP8 pages have scales", name,
           plane ? "V" : "K", pkv_format_name(f));
    for (size_t i = 0; i < n; i++)
      if (!(given[i] > 0.0f) || std::isinf(given[i]))
        fail(PKV_ERR_INVALID_ARGUMENT, "args->%s[%zu] is %g: a scale is finite and > 0", name, i, double(given[i]));
  }
}

void check_pool_desc(const pkv_pool_desc &d) {
  if (d.layers == 0) fail(PKV_ERR_INVALID_ARGUMENT, "desc->layers is 0");
  if (d.kv_heads == 0 || d.kv_heads > kMaxKvHeads)
    fail(PKV_ERR_INVALID_ARGUMENT, "desc->kv_heads is %u: expected 1..%u", d.kv_heads, kMaxKvHeads);
  if (d.head_dim == 0 || d.head_dim % pkv::kGroup != 0 || d.head_dim > 256)
    fail(PKV_ERR_INVALID_ARGUMENT, "desc->head_dim is %u: expected a multiple of 32 from 32 to 256", d.head_dim);
  if (!power_of_two(d.page_size) || d.page_size > 1024)
    fail(PKV_ERR_INVALID_ARGUMENT, "desc->page_size is %u: expected a power of two from 1 to 1024", d.page_size);
  if (d.pages == 0) fail(PKV_ERR_INVALID_ARGUMENT, "desc->pages is 0");
  if (d.max_sequences == 0 || d.max_sequences > pkv::HandleTable::kMaxSlots)
    fail(PKV_ERR_INVALID_ARGUMENT, "desc->max_sequences is %u: expected 1..%u", d.max_sequences,
         pkv::HandleTable::kMaxSlots);
  check_page_format(d.k_format, "desc->k_format");
  check_page_format(d.v_format, "desc->v_format");
  const uint64_t block = pkv::make_plane_layout(d.k_format, d.kv_heads, d.page_size, d.head_dim).bytes +
                         pkv::make_plane_layout(d.v_format, d.kv_heads, d.page_size, d.head_dim).bytes;
  if (uint64_t(d.layers) * d.pages > std::numeric_limits<uint64_t>::max() / block)
    fail(PKV_ERR_OUT_OF_MEMORY, "%u layers x %u pages x %llu bytes does not fit in 64 bits", d.layers, d.pages,
         (unsigned long long)block);
}

// The pool's calls: what the arguments alone decide (shape, range, NULL) is checked here, before the
// pool runs; the pool checks what its state decides (handles, lengths, shared pages, free pages and
// sequence slots). With count 0 a call checks nothing after count and the pool returns at once.

void check_layer(const pkv::PoolGeometry &g, uint32_t layer) {
  if (layer >= g.layers) fail(PKV_ERR_INVALID_ARGUMENT, "layer %u is out of range: the pool has %u layers", layer, g.layers);
}

void check_io_format(pkv_format f, const char *what) {
  if (!pkv::is_io_format(f))
    fail(PKV_ERR_INVALID_ARGUMENT, "%s is %s (%d): expected f32, f16 or bf16", what, pkv_format_name(f), int(f));
}

void check_memory(pkv_memory m) {
  if (m != PKV_MEMORY_HOST && m != PKV_MEMORY_DEVICE && m != PKV_MEMORY_HOST_PINNED)
    fail(PKV_ERR_INVALID_ARGUMENT, "memory is %d: expected PKV_MEMORY_HOST, PKV_MEMORY_HOST_PINNED or PKV_MEMORY_DEVICE",
         int(m));
}

// Pinned host memory is host memory to every call but export and import, which copy it directly.
pkv_memory host_or_device(pkv_memory m) { return m == PKV_MEMORY_DEVICE ? m : PKV_MEMORY_HOST; }

// Layers [first, first + count) of the pool, count 0 meaning to its last layer; returns the count.
uint32_t check_layer_range(const pkv::PoolGeometry &g, uint32_t first, uint32_t count) {
  if (first >= g.layers)
    fail(PKV_ERR_INVALID_ARGUMENT, "first_layer %u is out of range: the pool has %u layers", first, g.layers);
  if (count == 0) return g.layers - first;
  if (uint64_t(first) + count > g.layers)
    fail(PKV_ERR_INVALID_ARGUMENT, "layers [%u, %llu) pass the pool's %u layers", first,
         (unsigned long long)first + count, g.layers);
  return count;
}

// An image's memory: device images are 16-byte aligned (GPU copies move 16 bytes at a time).
void check_image(pkv_memory memory, const void *image) {
  check_memory(memory);
  check_pointer(image, "image");
  if (memory == PKV_MEMORY_DEVICE && uintptr_t(image) % 16 != 0)
    fail(PKV_ERR_INVALID_ARGUMENT, "image (%p) is device memory that is not 16-byte aligned", image);
}

// A batch names each sequence at most once, so it holds at most max_sequences of them; checked before
// the pool sizes per-sequence arrays by count.
void check_batch_count(const pkv::PoolGeometry &g, uint32_t count) {
  if (count > g.max_sequences)
    fail(PKV_ERR_INVALID_ARGUMENT, "count is %u but the pool holds at most %u sequences, each once per call", count,
         g.max_sequences);
}

// Speculative verification checks a handful of draft tokens at once.

void check_append_args(const pkv::PoolGeometry &g, const pkv_seq *seqs, const uint32_t *n_new, uint32_t count) {
  if (count == 0) return;
  check_pointer(seqs, "seqs");
  check_pointer(n_new, "n_new");
  check_batch_count(g, count);
}

void check_write_args(const pkv::PoolGeometry &g, const pkv_write_args &a) {
  check_layer(g, a.layer);
  check_io_format(a.src_format, "src_format");
  check_memory(a.memory);
  if (a.count == 0) return;
  check_pointer(a.seqs, "seqs");
  check_pointer(a.n_tokens, "n_tokens");
  check_pointer(a.k, "k");
  check_pointer(a.v, "v");
  check_batch_count(g, a.count);
}

void check_read_args(const pkv::PoolGeometry &g, const pkv_read_args &a) {
  check_layer(g, a.layer);
  check_io_format(a.dst_format, "dst_format");
  check_memory(a.memory);
  if (!a.k && !a.v) fail(PKV_ERR_INVALID_ARGUMENT, "k and v are both NULL: nothing to read into");
}

// What decode and extend share: the layer, query heads, scale, formats and memory.
void check_attention_args(const pkv::PoolGeometry &g, uint32_t layer, uint32_t q_heads, float scale,
                          pkv_format q_format, pkv_format out_format, pkv_memory memory) {
  check_layer(g, layer);
  if (q_heads == 0 || q_heads % g.kv_heads != 0)
    fail(PKV_ERR_INVALID_ARGUMENT, "q_heads %u is not a positive multiple of the pool's kv_heads %u", q_heads,
         g.kv_heads);
  if (q_heads > PKV_MAX_Q_HEADS)
    fail(PKV_ERR_INVALID_ARGUMENT, "q_heads is %u: at most %u query heads", q_heads, unsigned(PKV_MAX_Q_HEADS));
  if (!(scale >= 0.0f) || std::isinf(scale))
    fail(PKV_ERR_INVALID_ARGUMENT, "scale %g is not a finite value >= 0 (0 selects 1/sqrt(head_dim))", double(scale));
  check_io_format(q_format, "q_format");
  check_io_format(out_format, "out_format");
  check_memory(memory);
}

// The attention variants (pagedkv.h, section 7a), q_heads already checked: a finite softcap >= 0,
// finite slopes >= 0 and finite sinks (read where they are host memory); any window.
void check_variants(uint32_t q_heads, const float *sinks, const float *slopes, float softcap, pkv_memory memory) {
  if (!(softcap >= 0.0f) || std::isinf(softcap))
    fail(PKV_ERR_INVALID_ARGUMENT, "softcap %g is not a finite value >= 0 (0: no soft-capping)", double(softcap));
  if (memory == PKV_MEMORY_DEVICE) return;
  for (uint32_t h = 0; h < q_heads; h++) {
    if (sinks && !std::isfinite(sinks[h]))
      fail(PKV_ERR_INVALID_ARGUMENT, "sinks[%u] is %g: a sink logit is finite", h, double(sinks[h]));
    if (slopes && !(slopes[h] >= 0.0f && std::isfinite(slopes[h])))
      fail(PKV_ERR_INVALID_ARGUMENT, "alibi_slopes[%u] is %g: an ALiBi slope is finite and >= 0", h, double(slopes[h]));
  }
}

// launch: pkv_decode, which reads q and writes out; pkv_decode_prepare touches neither.
void check_decode_args(const pkv::PoolGeometry &g, const pkv_decode_args &a, bool launch) {
  check_attention_args(g, a.layer, a.q_heads, a.scale, a.q_format, a.out_format, a.memory);
  check_variants(a.q_heads, a.sinks, a.alibi_slopes, a.softcap, a.memory);
  if (a.q_tokens == 0 || a.q_tokens > pkv::kMaxQueryTokens)
    fail(PKV_ERR_INVALID_ARGUMENT, "q_tokens is %u: expected 1 to %u query tokens per sequence", a.q_tokens,
         pkv::kMaxQueryTokens);
  if (a.count == 0) return;
  check_pointer(a.seqs, "seqs");
  if (launch) {
    check_pointer(a.q, "q");
    check_pointer(a.out, "out");
  }
}

// Entry b's mask rows (n of them, ceil(n / 8) bytes each) lie within the mask's bytes, and row i
// sees itself and no later new token.
void check_mask(const pkv_extend_args &a, uint32_t b, uint32_t n) {
  const uint64_t row_bytes = (uint64_t(n) + 7) / 8, bytes = n * row_bytes, at = a.mask_offsets[b];
  if (at > a.mask_bytes || bytes > a.mask_bytes - at)
    fail(PKV_ERR_INVALID_ARGUMENT, "entry %u's mask is %u rows of %llu bytes at mask_offsets[%u] = %llu, past "
         "mask_bytes %llu", b, n, (unsigned long long)row_bytes, b, (unsigned long long)at,
         (unsigned long long)a.mask_bytes);
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *row = a.mask + at + i * row_bytes;
    if (!(row[i / 8] >> (i % 8) & 1))
      fail(PKV_ERR_INVALID_ARGUMENT, "entry %u's mask row %u lacks its own bit %u: a query sees itself", b, i, i);
    for (uint32_t j = i + 1; j < n; j++)
      if (row[j / 8] >> (j % 8) & 1)
        fail(PKV_ERR_INVALID_ARGUMENT, "entry %u's mask row %u sets bit %u: a query sees no later new token", b, i, j);
  }
}

// launch: pkv_extend, which reads q and writes out; pkv_extend_prepare touches neither.
void check_extend_args(const pkv::PoolGeometry &g, const pkv_extend_args &a, bool launch) {
  check_attention_args(g, a.layer, a.q_heads, a.scale, a.q_format, a.out_format, a.memory);
  check_variants(a.q_heads, a.sinks, a.alibi_slopes, a.softcap, a.memory);
  if (a.count == 0) return;
  check_pointer(a.seqs, "seqs");
  check_pointer(a.q_offsets, "q_offsets");
  if (a.q_offsets[0] != 0) fail(PKV_ERR_INVALID_ARGUMENT, "q_offsets[0] is %u: expected 0", a.q_offsets[0]);
  for (uint32_t b = 0; b < a.count; b++)
    if (a.q_offsets[b + 1] < a.q_offsets[b])
      fail(PKV_ERR_INVALID_ARGUMENT, "q_offsets[%u] = %u is less than q_offsets[%u] = %u: offsets never decrease",
           b + 1, a.q_offsets[b + 1], b, a.q_offsets[b]);
  const uint64_t total = a.q_offsets[a.count];
  if (total * a.q_heads > PKV_MAX_EXTEND_ROWS)
    fail(PKV_ERR_INVALID_ARGUMENT, "%llu queries x %u query heads is more than the %llu query rows a call takes",
         (unsigned long long)total, a.q_heads, (unsigned long long)PKV_MAX_EXTEND_ROWS);
  if (total > 0 && launch) {
    check_pointer(a.q, "q");
    check_pointer(a.out, "out");
  }
  if (!a.mask) return;
  check_pointer(a.mask_offsets, "mask_offsets");
  for (uint32_t b = 0; b < a.count; b++) check_mask(a, b, a.q_offsets[b + 1] - a.q_offsets[b]);
}

pkv_pool &pool_ref(pkv_pool *pool) {
  check_pointer(pool, "pool");
  return *pool;
}

// The attention entry points: the arguments read and checked (launch: the call reads q and writes
// out; a prepare touches neither), q and out's memory kind resolved, then the pool's step run.
template <class Args>
pkv_status attention_call(const char *function, pkv_pool *pool, const Args *args, bool launch,
                          void (*check)(const pkv::PoolGeometry &, const Args &, bool),
                          void (pkv_pool::*step)(const Args &)) {
  return guarded(function, [&] {
    pkv_pool &p = pool_ref(pool);
    Args a = read_struct(args, "args");
    check(p.geometry(), a, launch);
    a.memory = host_or_device(a.memory);
    (p.*step)(a);
  });
}

} // namespace

extern "C" {

PKV_API uint32_t pkv_version(void) { return PKV_VERSION_NUMBER; }

PKV_API const char *pkv_version_string(void) { return PKV_VERSION_STRING; }

PKV_API const char *pkv_status_string(pkv_status status) {
  switch (status) {
  case PKV_OK: return "PKV_OK: success";
  case PKV_ERR_INVALID_ARGUMENT: return "PKV_ERR_INVALID_ARGUMENT: an argument is NULL, out of range or inconsistent";
  case PKV_ERR_STRUCT_SIZE: return "PKV_ERR_STRUCT_SIZE: struct_size is not set or too small";
  case PKV_ERR_STALE_HANDLE: return "PKV_ERR_STALE_HANDLE: the sequence handle is zero, freed or from another pool";
  case PKV_ERR_OUT_OF_PAGES: return "PKV_ERR_OUT_OF_PAGES: the pool has too few free pages";
  case PKV_ERR_OUT_OF_SEQUENCES: return "PKV_ERR_OUT_OF_SEQUENCES: every sequence slot is in use";
  case PKV_ERR_OUT_OF_MEMORY: return "PKV_ERR_OUT_OF_MEMORY: host or device memory exhausted";
  case PKV_ERR_UNSUPPORTED: return "PKV_ERR_UNSUPPORTED: not supported by this build, backend or shape";
  case PKV_ERR_NO_DEVICE: return "PKV_ERR_NO_DEVICE: the backend's runtime or device was not found";
  case PKV_ERR_BACKEND: return "PKV_ERR_BACKEND: the device runtime reported an error";
  case PKV_ERR_VERSION: return "PKV_ERR_VERSION: the requested version is not provided";
  case PKV_ERR_INTERNAL: return "PKV_ERR_INTERNAL: internal error";
  default: return "unknown pkv_status value";
  }
}

PKV_API const char *pkv_last_error(void) { return pkv::last_error(); }

PKV_API const char *pkv_backend_name(pkv_backend backend) {
  switch (backend) {
  case PKV_BACKEND_AUTO: return "auto";
  case PKV_BACKEND_CPU: return "cpu";
  case PKV_BACKEND_CUDA: return "cuda";
  case PKV_BACKEND_HIP: return "hip";
  default: return "unknown";
  }
}

PKV_API const char *pkv_format_name(pkv_format format) {
  switch (format) {
  case PKV_FORMAT_F32: return "f32";
  case PKV_FORMAT_F16: return "f16";
  case PKV_FORMAT_BF16: return "bf16";
  case PKV_FORMAT_Q8_0: return "q8_0";
  case PKV_FORMAT_Q4_0: return "q4_0";
  case PKV_FORMAT_FP8_E4M3: return "fp8_e4m3";
  case PKV_FORMAT_FP8_E5M2: return "fp8_e5m2";
  default: return "unknown";
  }
}

PKV_API pkv_status pkv_context_create(const pkv_context_desc *desc, pkv_context **out) {
  return guarded(__func__, [&] {
    const pkv_context_desc d = read_struct(desc, "desc");
    check_pointer(out, "out");
    auto ctx = std::make_unique<pkv_context>();
    ctx->backend = pkv::create_backend(d);
    *out = ctx.release();
  });
}

PKV_API pkv_status pkv_context_destroy(pkv_context *ctx) {
  return guarded(__func__, [&] {
    if (!ctx) return;
    if (ctx->pools > 0)
      fail(PKV_ERR_INVALID_ARGUMENT, "the context still has %u live pools: destroy them first", unsigned(ctx->pools));
    delete ctx;
  });
}

PKV_API pkv_status pkv_context_backend(const pkv_context *ctx, pkv_backend *out) {
  return guarded(__func__, [&] {
    check_pointer(ctx, "ctx");
    check_pointer(out, "out");
    *out = ctx->backend->kind();
  });
}

PKV_API pkv_status pkv_context_synchronize(pkv_context *ctx) {
  return guarded(__func__, [&] {
    check_pointer(ctx, "ctx");
    std::lock_guard<std::mutex> device(ctx->mu);
    ctx->backend->synchronize();
  });
}

PKV_API pkv_status pkv_context_read_bandwidth(pkv_context *ctx, uint64_t bytes, double *gb_per_s) {
  return guarded(__func__, [&] {
    check_pointer(ctx, "ctx");
    check_pointer(gb_per_s, "gb_per_s");
    // Checked for every backend before any of them sizes a buffer by it (a GPU's rounding to 16
    // bytes plus its 16 spare ones would wrap near 2^64).
    if (bytes > kMaxBandwidthBytes)
      fail(PKV_ERR_OUT_OF_MEMORY, "bytes is %llu: no device has a buffer of more than %llu bytes",
           (unsigned long long)bytes, (unsigned long long)kMaxBandwidthBytes);
    std::lock_guard<std::mutex> device(ctx->mu);
    *gb_per_s = ctx->backend->read_bandwidth(bytes);
  });
}

PKV_API pkv_status pkv_backend_query(pkv_backend backend, pkv_backend_info *info) {
  return guarded(__func__, [&] {
    pkv_backend_info filled = read_struct(info, "info");
    pkv::query_backend(backend, &filled);
    write_struct(info, filled, "info");
  });
}

PKV_API pkv_status pkv_pool_create(pkv_context *ctx, const pkv_pool_desc *desc, pkv_pool **out) {
  return guarded(__func__, [&] {
    check_pointer(ctx, "ctx");
    const pkv_pool_desc d = read_struct(desc, "desc");
    check_pointer(out, "out");
    check_pool_desc(d);
    *out = new pkv_pool(ctx, d);
  });
}

PKV_API pkv_status pkv_pool_destroy(pkv_pool *pool) {
  return guarded(__func__, [&] { delete pool; });
}

PKV_API pkv_status pkv_seq_alloc(pkv_pool *pool, pkv_seq *out) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    check_pointer(out, "out");
    *out = p.alloc();
  });
}

PKV_API pkv_status pkv_seq_free(pkv_pool *pool, pkv_seq seq) {
  return guarded(__func__, [&] { pool_ref(pool).free(seq); });
}

PKV_API pkv_status pkv_seq_fork(pkv_pool *pool, pkv_seq parent, pkv_seq *child) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    check_pointer(child, "child");
    *child = p.fork(parent);
  });
}

PKV_API pkv_status pkv_seq_truncate(pkv_pool *pool, pkv_seq seq, uint32_t new_length) {
  return guarded(__func__, [&] { pool_ref(pool).truncate(seq, new_length); });
}

PKV_API pkv_status pkv_seq_release_before(pkv_pool *pool, pkv_seq seq, uint32_t position) {
  return guarded(__func__, [&] { pool_ref(pool).release_before(seq, position); });
}

PKV_API pkv_status pkv_seq_length(pkv_pool *pool, pkv_seq seq, uint32_t *out) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    check_pointer(out, "out");
    *out = p.length(seq);
  });
}

PKV_API pkv_status pkv_append(pkv_pool *pool, const pkv_seq *seqs, const uint32_t *n_new, uint32_t count) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    check_append_args(p.geometry(), seqs, n_new, count);
    p.append(seqs, n_new, count);
  });
}

PKV_API pkv_status pkv_write(pkv_pool *pool, const pkv_write_args *args) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    pkv_write_args a = read_struct(args, "args");
    check_write_args(p.geometry(), a);
    a.memory = host_or_device(a.memory);
    p.write(a);
  });
}

PKV_API pkv_status pkv_read(pkv_pool *pool, const pkv_read_args *args) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    pkv_read_args a = read_struct(args, "args");
    check_read_args(p.geometry(), a);
    a.memory = host_or_device(a.memory);
    p.read(a);
  });
}

PKV_API pkv_status pkv_decode(pkv_pool *pool, const pkv_decode_args *args) {
  return attention_call(__func__, pool, args, true, check_decode_args, &pkv_pool::decode);
}

PKV_API pkv_status pkv_decode_prepare(pkv_pool *pool, const pkv_decode_args *args) {
  return attention_call(__func__, pool, args, false, check_decode_args, &pkv_pool::decode_prepare);
}

PKV_API pkv_status pkv_extend(pkv_pool *pool, const pkv_extend_args *args) {
  return attention_call(__func__, pool, args, true, check_extend_args, &pkv_pool::extend);
}

PKV_API pkv_status pkv_extend_prepare(pkv_pool *pool, const pkv_extend_args *args) {
  return attention_call(__func__, pool, args, false, check_extend_args, &pkv_pool::extend_prepare);
}

PKV_API pkv_status pkv_pool_get_stats(pkv_pool *pool, pkv_pool_stats *out) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    write_struct(out, p.stats(), "out");
  });
}

PKV_API pkv_status pkv_pool_set_scales(pkv_pool *pool, const pkv_scales_args *args) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    pkv_scales_args a = read_struct(args, "args");
    const pkv::PoolGeometry &g = p.geometry();
    a.layer_count = check_layer_range(g, a.first_layer, a.layer_count);
    check_scales(g, a.layer_count, a);
    p.set_scales(a);
  });
}

PKV_API pkv_status pkv_pool_get_scales(pkv_pool *pool, uint32_t first_layer, uint32_t layer_count, float *k_scales,
                                       float *v_scales) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    const uint32_t count = check_layer_range(p.geometry(), first_layer, layer_count);
    p.get_scales(first_layer, count, k_scales, v_scales);
  });
}

PKV_API pkv_status pkv_seq_export_size(pkv_pool *pool, const pkv_export_args *args, uint64_t *bytes) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    const pkv_export_args a = read_struct(args, "args");
    check_pointer(bytes, "bytes");
    const uint32_t count = check_layer_range(p.geometry(), a.first_layer, a.layer_count);
    *bytes = p.export_size(a.seq, a.first_layer, count);
  });
}

PKV_API pkv_status pkv_seq_export(pkv_pool *pool, const pkv_export_args *args) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    const pkv_export_args a = read_struct(args, "args");
    const uint32_t count = check_layer_range(p.geometry(), a.first_layer, a.layer_count);
    check_image(a.memory, a.image);
    p.export_seq(a, a.first_layer, count);
  });
}

PKV_API pkv_status pkv_seq_import(pkv_pool *pool, const pkv_import_args *args, pkv_seq *out) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    const pkv_import_args a = read_struct(args, "args");
    check_pointer(out, "out");
    check_image(a.memory, a.image);
    if (a.image_bytes < pkv::kImageHeaderBytes)
      fail(PKV_ERR_INVALID_ARGUMENT, "image_bytes is %llu, less than the %u bytes of an image's header",
           (unsigned long long)a.image_bytes, pkv::kImageHeaderBytes);
    *out = p.import_seq(a);
  });
}

PKV_API pkv_status pkv_pool_regions(pkv_pool *pool, pkv_memory_region *regions, uint32_t capacity, uint32_t *count) {
  return guarded(__func__, [&] {
    const pkv_pool &p = pool_ref(pool);
    check_pointer(count, "count");
    if (!regions && capacity > 0) fail(PKV_ERR_INVALID_ARGUMENT, "regions is NULL but capacity is %u", capacity);
    *count = p.regions(regions, capacity);
  });
}

PKV_API pkv_status pkv_seq_page_spans(pkv_pool *pool, pkv_seq seq, uint32_t first_layer, uint32_t layer_count,
                                      pkv_page_span *spans, uint64_t capacity, uint64_t *count) {
  return guarded(__func__, [&] {
    pkv_pool &p = pool_ref(pool);
    check_pointer(count, "count");
    const uint32_t n = check_layer_range(p.geometry(), first_layer, layer_count);
    if (!spans && capacity > 0)
      fail(PKV_ERR_INVALID_ARGUMENT, "spans is NULL but capacity is %llu", (unsigned long long)capacity);
    *count = p.page_spans(seq, first_layer, n, spans, capacity);
  });
}

PKV_API pkv_status pkv_convert_from_f32(pkv_format dst_format, const float *src, size_t n, void *dst) {
  return guarded(__func__, [&] {
    check_page_format(dst_format, "dst_format");
    check_pointer(src, "src");
    check_pointer(dst, "dst");
    check_row_count(dst_format, n);
    pkv::encode_ggml_row(dst_format, src, n, dst);
  });
}

PKV_API pkv_status pkv_convert_to_f32(pkv_format src_format, const void *src, size_t n, float *dst) {
  return guarded(__func__, [&] {
    check_page_format(src_format, "src_format");
    check_pointer(src, "src");
    check_pointer(dst, "dst");
    check_row_count(src_format, n);
    pkv::decode_ggml_row(src_format, src, n, dst);
  });
}

PKV_API size_t pkv_format_row_bytes(pkv_format format, size_t n) {
  return pkv::is_page_format(format) ? pkv::row_bytes(format, n) : 0;
}

} // extern "C"
