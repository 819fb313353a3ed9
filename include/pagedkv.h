/*
 * pagedkv: a paged K/V cache runtime for LLM inference engines.
 *
 * The K/V cache of many ragged sequences lives in fixed-size pages; sequences are value handles that
 * detect stale use; new K/V rows are appended per step; decode runs paged attention over the pages.
 *
 * This header is the whole public API. It is C99 and compiles as C and C++ with no other header.
 *
 * Sections:
 *   1. Version and export macros
 *   2. Status codes and errors
 *   3. Enumerations (backends, formats, memory kinds)
 *   4. Contexts (a backend, a device, a stream)
 *   5. Pools and sequences
 *  5a. FP8 scales
 *   6. Append, write and read of K/V rows
 *   7. Decode
 *  7a. Attention variants (sliding window, soft-capping, sinks, ALiBi) and releasing early pages
 *   8. Statistics and format helpers
 *   9. Export and import of sequences; the pool's memory for transfer engines
 *  10. Extend: attention for many new tokens per sequence (chunked prefill, prefix hits, trees)
 *  11. Function table for runtime loaders
 *
 * Conventions
 *   - Every function returns a pkv_status (PKV_OK = 0). On failure nothing changed, and
 *     pkv_last_error() gives this thread's detail text. No C++ exception crosses the boundary.
 *   - Argument structs begin with `struct_size`; initialise them with their PKV_*_INIT macro. Structs
 *     only grow at the end: the library reads the fields the caller's struct_size covers and rejects a
 *     struct_size smaller than the first release's layout.
 *   - Enums are 32-bit signed ints. Their *_MIN_ and *_MAX_ members only fix that range, so any value
 *     a caller passes is a value of the enum in C++ too and is rejected cleanly, never undefined.
 *
 * Threads
 *   - pkv_last_error() is per thread.
 *   - A pool's bookkeeping calls (pkv_seq_*, pkv_append, pkv_pool_stats) are safe to call from several
 *     threads at once; each takes the pool's lock.
 *   - pkv_write, pkv_read, pkv_decode and pkv_extend also take the pool's lock; their device work is ordered by the
 *     context's stream.
 *   - Contexts and pools are destroyed by one thread when no other call on them is in flight.
 */
#ifndef PAGEDKV_H
#define PAGEDKV_H

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------------------------------------------
 * 1. Version and export macros
 * ------------------------------------------------------------------------------------------------- */
#define PKV_VERSION_MAJOR 0
#define PKV_VERSION_MINOR 1
#define PKV_VERSION_PATCH 0
#define PKV_VERSION_NUMBER (PKV_VERSION_MAJOR * 10000 + PKV_VERSION_MINOR * 100 + PKV_VERSION_PATCH)

#define PKV_STRINGIFY_(x) #x
#define PKV_STRINGIFY(x) PKV_STRINGIFY_(x)
#define PKV_VERSION_STRING                                                                          \
  PKV_STRINGIFY(PKV_VERSION_MAJOR) "." PKV_STRINGIFY(PKV_VERSION_MINOR) "." PKV_STRINGIFY(PKV_VERSION_PATCH)

/* PKV_API marks exported functions. Building the library defines PKV_BUILDING; a Windows program that
 * links the DLL's import library defines PKV_DLL. Static linking needs neither. */
#if defined(_WIN32)
#if defined(PKV_BUILDING) && defined(PKV_SHARED)
#define PKV_API __declspec(dllexport)
#elif defined(PKV_DLL)
#define PKV_API __declspec(dllimport)
#else
#define PKV_API
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define PKV_API __attribute__((visibility("default")))
#else
#define PKV_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* PKV_VERSION_NUMBER of the library actually loaded (may differ from the header compiled against). */
PKV_API uint32_t pkv_version(void);
PKV_API const char *pkv_version_string(void);

/* ---------------------------------------------------------------------------------------------------
 * 2. Status codes and errors
 * ------------------------------------------------------------------------------------------------- */
typedef enum pkv_status {
  PKV_OK = 0,
  PKV_ERR_INVALID_ARGUMENT = 1, /* a NULL, an out-of-range value, an inconsistent combination */
  PKV_ERR_STRUCT_SIZE = 2,      /* struct_size smaller than this library knows, or not set */
  PKV_ERR_STALE_HANDLE = 3,     /* zero handle, freed handle, or a handle from another pool */
  PKV_ERR_OUT_OF_PAGES = 4,     /* the pool has too few free pages: nothing was appended */
  PKV_ERR_OUT_OF_SEQUENCES = 5, /* every sequence slot of the pool is in use */
  PKV_ERR_OUT_OF_MEMORY = 6,    /* host or device memory exhausted */
  PKV_ERR_UNSUPPORTED = 7,      /* not supported by this build, backend, or shape */
  PKV_ERR_NO_DEVICE = 8,        /* the backend's runtime or device was not found */
  PKV_ERR_BACKEND = 9,          /* the device runtime reported an error */
  PKV_ERR_VERSION = 10,         /* a version the library does not provide was asked for */
  PKV_ERR_INTERNAL = 11,        /* a bug in pagedkv: please report the last-error text */
  PKV_STATUS_MIN_ = -0x7fffffff - 1,
  PKV_STATUS_MAX_ = 0x7fffffff
} pkv_status;

/* A static, never-NULL text naming a status and what it means; unknown values are named so. */
PKV_API const char *pkv_status_string(pkv_status status);

/* This thread's detail text for the last failed call (which argument, what was expected). Empty after a
 * call that succeeded. Never NULL; the pointer stays valid for the thread's lifetime and its text
 * changes with the thread's next pagedkv call. */
PKV_API const char *pkv_last_error(void);

/* ---------------------------------------------------------------------------------------------------
 * 3. Enumerations
 * ------------------------------------------------------------------------------------------------- */
typedef enum pkv_backend {
  PKV_BACKEND_AUTO = 0, /* the environment variable PKV_BACKEND (auto|cpu|cuda|hip), else the first that works */
  PKV_BACKEND_CPU = 1,
  PKV_BACKEND_CUDA = 2,
  PKV_BACKEND_HIP = 3,
  PKV_BACKEND_MIN_ = -0x7fffffff - 1,
  PKV_BACKEND_MAX_ = 0x7fffffff
} pkv_backend;

/* Element formats. Pages may use any of them; q, out and source rows use F32, F16 or BF16.
 * Q8_0 and Q4_0 follow ggml's arithmetic in groups of 32 values along head_dim with an fp16 scale.
 * FP8_E4M3 and FP8_E5M2 are the OCP 8-bit floats, one byte a value, stored through the pool's FP8
 * scales (section 5a): E4M3 has 4 exponent bits (bias 7) and 3 mantissa bits, largest 448, no
 * infinities, NaN S.1111.111; E5M2 has 5 (bias 15) and 2, largest 57344, infinities and NaNs as in
 * IEEE 754. A float becomes FP8 rounded to nearest even; a magnitude past the largest finite value
 * (an infinity too) saturates to it; a NaN stays NaN (S.1111.111 in both). */
typedef enum pkv_format {
  PKV_FORMAT_INVALID = 0,
  PKV_FORMAT_F32 = 1,
  PKV_FORMAT_F16 = 2,
  PKV_FORMAT_BF16 = 3,
  PKV_FORMAT_Q8_0 = 4,
  PKV_FORMAT_Q4_0 = 5,
  PKV_FORMAT_FP8_E4M3 = 6,
  PKV_FORMAT_FP8_E5M2 = 7,
  PKV_FORMAT_MIN_ = -0x7fffffff - 1,
  PKV_FORMAT_MAX_ = 0x7fffffff
} pkv_format;

/* Where a caller's pointer points. The CPU backend's device memory is host memory.
 * PKV_MEMORY_HOST_PINNED is host memory the caller has page-locked (cuMemHostAlloc, cudaHostRegister,
 * hipHostMalloc, ...): a GPU backend's DMA engines copy it directly and asynchronously, where plain
 * host memory goes through the library's own pinned buffers. Every call that takes host memory takes
 * it too (only pkv_seq_export and pkv_seq_import copy it differently). */
typedef enum pkv_memory {
  PKV_MEMORY_HOST = 0,
  PKV_MEMORY_DEVICE = 1,
  PKV_MEMORY_HOST_PINNED = 2,
  PKV_MEMORY_MIN_ = -0x7fffffff - 1,
  PKV_MEMORY_MAX_ = 0x7fffffff
} pkv_memory;

PKV_API const char *pkv_backend_name(pkv_backend backend); /* "auto", "cpu", "cuda", "hip" or "unknown" */
PKV_API const char *pkv_format_name(pkv_format format);    /* "f32", "f16", ... or "unknown" */

/* ---------------------------------------------------------------------------------------------------
 * 4. Contexts
 * ------------------------------------------------------------------------------------------------- */
typedef struct pkv_context pkv_context;

typedef struct pkv_context_desc {
  uint32_t struct_size;
  pkv_backend backend; /* PKV_BACKEND_AUTO: see pkv_backend */
  int32_t device;      /* device ordinal for GPU backends */
  uint32_t threads;    /* CPU backend: its worker threads, 0: one per hardware thread. GPU backends:
                        * the threads that pack a large write from host memory for its transfer,
                        * 0: 4 or the hardware's if fewer */
  void *stream;        /* GPU backends: the engine's CUstream / hipStream_t, or NULL for the library's own */
} pkv_context_desc;
#define PKV_CONTEXT_DESC_INIT { (uint32_t)sizeof(pkv_context_desc), PKV_BACKEND_AUTO, 0, 0, NULL }

PKV_API pkv_status pkv_context_create(const pkv_context_desc *desc, pkv_context **out);
/* Destroying a context with live pools is refused (PKV_ERR_INVALID_ARGUMENT). NULL is accepted. */
PKV_API pkv_status pkv_context_destroy(pkv_context *ctx);
PKV_API pkv_status pkv_context_backend(const pkv_context *ctx, pkv_backend *out);
/* Waits for all work enqueued on the context's stream. */
PKV_API pkv_status pkv_context_synchronize(pkv_context *ctx);
/* Measures the read bandwidth of the context's device in GB/s (1e9 bytes/s): the best of several
 * passes of a read-only kernel over `bytes` (0: 2 GiB on a GPU, 512 MiB on the CPU), far larger than
 * the caches; more than 2^48 bytes fails with PKV_ERR_OUT_OF_MEMORY. Decode is memory-bound, so this
 * is the figure its speed is judged against. Blocks. */
PKV_API pkv_status pkv_context_read_bandwidth(pkv_context *ctx, uint64_t bytes, double *gb_per_s);

/* What a backend offers in this build on this machine, without creating a context. */
typedef struct pkv_backend_info {
  uint32_t struct_size;
  pkv_backend backend;
  int32_t compiled;     /* 1 when built into this library */
  int32_t device_count; /* devices usable now; 0 when none (detail says why) */
  char detail[256];     /* device names or the reason none is usable; NUL-terminated */
} pkv_backend_info;
#define PKV_BACKEND_INFO_INIT { (uint32_t)sizeof(pkv_backend_info), PKV_BACKEND_AUTO, 0, 0, { 0 } }

PKV_API pkv_status pkv_backend_query(pkv_backend backend, pkv_backend_info *info);

/* ---------------------------------------------------------------------------------------------------
 * 5. Pools and sequences
 *
 * A pool holds `pages` pages; one page id addresses that page in every layer, for K and for V. A page
 * holds `page_size` consecutive tokens of one sequence, laid out [kv_head][slot][head_dim].
 * ------------------------------------------------------------------------------------------------- */
typedef struct pkv_pool pkv_pool;

/* A sequence handle: a value (slot + generation + pool tag). The zero handle is never valid; a freed
 * handle, or one from another pool, is reported as PKV_ERR_STALE_HANDLE, never silently reused:
 *   - a freed handle stays stale for its pool's lifetime: a slot whose 32-bit generation would wrap
 *     (after 2^31 reuses) is retired, never handed out again (pkv_seq_alloc then has one slot fewer);
 *   - a handle of another live pool is always refused: live pools never share a tag, so a process
 *     holds at most 4095 pools at once (pkv_pool_create fails with PKV_ERR_UNSUPPORTED past that);
 *   - a handle of a destroyed pool is refused until 4094 more pools have been created after it, when
 *     its tag may come back. */
typedef struct pkv_seq {
  uint64_t id;
} pkv_seq;

typedef struct pkv_pool_desc {
  uint32_t struct_size;
  uint32_t layers;          /* >= 1 */
  uint32_t kv_heads;        /* >= 1 */
  uint32_t head_dim;        /* a multiple of 32, 32..256 */
  uint32_t page_size;       /* tokens per page: a power of two, 1..1024 (default 16) */
  uint32_t pages;           /* capacity in pages, >= 1 */
  uint32_t max_sequences;   /* live sequences at once, 1..1048576 (default 256) */
  pkv_format k_format;      /* F32, F16, BF16, Q8_0, Q4_0, FP8_E4M3 or FP8_E5M2 (default F16) */
  pkv_format v_format;      /* chosen independently of k_format (default F16) */
  uint32_t page_order_seed; /* 0: free pages handed out lowest id first; else shuffled with this seed */
  uint32_t max_sequence_length; /* tokens one sequence may hold (capped at pages * page_size); 0: that
                                   cap. Sizes the page table: max_sequences * ceil(this / page_size) * 4 B */
} pkv_pool_desc;
#define PKV_POOL_DESC_INIT                                                                          \
  { (uint32_t)sizeof(pkv_pool_desc), 0, 0, 0, 16, 0, 256, PKV_FORMAT_F16, PKV_FORMAT_F16, 0, 0 }

PKV_API pkv_status pkv_pool_create(pkv_context *ctx, const pkv_pool_desc *desc, pkv_pool **out);
/* Frees the pages and invalidates every handle. NULL is accepted. */
PKV_API pkv_status pkv_pool_destroy(pkv_pool *pool);

/* A new, empty sequence. */
PKV_API pkv_status pkv_seq_alloc(pkv_pool *pool, pkv_seq *out);
/* Returns the sequence's pages at once (pages shared with a fork stay with it); the handle is stale. */
PKV_API pkv_status pkv_seq_free(pkv_pool *pool, pkv_seq seq);
/* A new sequence with the parent's tokens. Pages are shared by reference count; a holder that appends
 * into a partly filled page still shared with another sequence first copies it (copy on write), and
 * that copy counts as one page of its append. */
PKV_API pkv_status pkv_seq_fork(pkv_pool *pool, pkv_seq parent, pkv_seq *child);
/* Rolls the sequence back to new_length <= its length; pages past it return to the pool at once. */
PKV_API pkv_status pkv_seq_truncate(pkv_pool *pool, pkv_seq seq, uint32_t new_length);
PKV_API pkv_status pkv_seq_length(pkv_pool *pool, pkv_seq seq, uint32_t *out);

/* ---------------------------------------------------------------------------------------------------
 * 5a. FP8 scales
 *
 * An FP8 plane (a k_format or v_format of FP8_E4M3 or FP8_E5M2) has a float scale for each layer and
 * KV head, given by the engine (a checkpoint's calibrated k_scale and v_scale; a per-tensor scale is
 * the same for every KV head of a layer). With s the scale of the row's layer and KV head:
 *   - pkv_write stores a value x as the code fp8(x / s), x / s rounded to float32 first;
 *   - pkv_read gives a code c as value(c) * s, rounded to float32, then to dst_format;
 *   - pkv_decode and pkv_extend attend over value(c) * s (K's scale and V's).
 * Scales are finite and > 0; each is 1.0 until set. A new pool's scales are set with one
 * pkv_pool_set_scales over all its layers, before any row is written (pkv_pool_desc keeps its
 * layout). A scale set later applies to the codes already stored (they are not rewritten), so set a
 * layer's scales before its rows are written. Planes of
 * the other formats have no scales. Sequence images and page spans hold the codes, not the scales:
 * a pool that imports them reads them with its own.
 * ------------------------------------------------------------------------------------------------- */
typedef struct pkv_scales_args {
  uint32_t struct_size;
  uint32_t first_layer;
  uint32_t layer_count;  /* layers [first_layer, first_layer + layer_count); 0: to the last layer */
  uint32_t per_head;     /* 0: a scale per layer ([layer_count]); 1: [layer_count][kv_heads] */
  const float *k_scales; /* NULL: K's scales stay; else host memory of the shape per_head says */
  const float *v_scales; /* NULL: V's scales stay */
} pkv_scales_args;
#define PKV_SCALES_ARGS_INIT { (uint32_t)sizeof(pkv_scales_args), 0, 0, 0, NULL, NULL }

/* Sets scales, every value checked before any changes. Work enqueued before the call reads the old
 * scales, work enqueued after it the new ones (a GPU backend waits for its stream). */
PKV_API pkv_status pkv_pool_set_scales(pkv_pool *pool, const pkv_scales_args *args);
/* The scales of layers [first_layer, first_layer + layer_count) (layer_count 0: to the last layer)
 * into k_scales and v_scales (host memory, [layers][kv_heads] each; either may be NULL); a plane of
 * another format gives 1.0. */
PKV_API pkv_status pkv_pool_get_scales(pkv_pool *pool, uint32_t first_layer, uint32_t layer_count, float *k_scales,
                                       float *v_scales);

/* ---------------------------------------------------------------------------------------------------
 * 6. Append, write and read
 * ------------------------------------------------------------------------------------------------- */

/* Adds n_new[i] token slots to seqs[i], for i < count. Transactional: either every sequence gets its
 * pages and its length advances, or nothing changes: PKV_ERR_INVALID_ARGUMENT when a sequence would
 * pass max_sequence_length (checked first), else PKV_ERR_OUT_OF_PAGES when the pool is short.
 * A sequence may appear only once per call. The new slots hold no K/V until pkv_write fills them. */
PKV_API pkv_status pkv_append(pkv_pool *pool, const pkv_seq *seqs, const uint32_t *n_new, uint32_t count);

/* Fills K/V rows of one layer: for each i < count, rows for the newest n_tokens[i] positions of
 * seqs[i], i.e. positions [length - n_tokens[i], length). Rows are packed over the batch:
 * k and v are [sum n_tokens][kv_heads][head_dim] in src_format (F32, F16 or BF16), and are quantized
 * into the page format (Q8_0/Q4_0 with ggml's arithmetic, FP8 through its scales). Host rows are copied before the call
 * returns. The target positions must not lie in a page shared with another sequence. */
typedef struct pkv_write_args {
  uint32_t struct_size;
  uint32_t layer;
  const pkv_seq *seqs;
  const uint32_t *n_tokens;
  uint32_t count;
  pkv_format src_format;
  pkv_memory memory; /* where k and v live */
  const void *k;
  const void *v;
} pkv_write_args;
#define PKV_WRITE_ARGS_INIT                                                                         \
  { (uint32_t)sizeof(pkv_write_args), 0, NULL, NULL, 0, PKV_FORMAT_F32, PKV_MEMORY_HOST, NULL, NULL }

PKV_API pkv_status pkv_write(pkv_pool *pool, const pkv_write_args *args);

/* Reads rows of one layer back, dequantized to dst_format (F32, F16 or BF16): positions
 * [start, start + count) of seq into k and/or v, each [count][kv_heads][head_dim] (either may be NULL).
 * Synchronous: the data is in place when the call returns. */
typedef struct pkv_read_args {
  uint32_t struct_size;
  uint32_t layer;
  pkv_seq seq;
  uint32_t start;
  uint32_t count;
  pkv_format dst_format;
  pkv_memory memory; /* where k and v live */
  void *k;
  void *v;
} pkv_read_args;
#define PKV_READ_ARGS_INIT                                                                          \
  { (uint32_t)sizeof(pkv_read_args), 0, { 0 }, 0, 0, PKV_FORMAT_F32, PKV_MEMORY_HOST, NULL, NULL }

PKV_API pkv_status pkv_read(pkv_pool *pool, const pkv_read_args *args);

/* ---------------------------------------------------------------------------------------------------
 * 7. Decode
 *
 * For each sequence b < count and query head h < q_heads:
 *   out[b][t][h] = softmax(scale * q[b][t][h] . K^T) V over the sequence's tokens, where K and V are
 *   those of KV head h / (q_heads / kv_heads) (grouped-query attention).
 * With q_tokens = T > 1 (speculative verification), query token t of a sequence of length L attends
 * positions [0, L - T + t]: the cached context and the new tokens up to itself. An empty sequence
 * gives out = 0 and lse = -infinity; any other must hold at least q_tokens tokens. A sequence may
 * appear more than once in one batch (each entry has its own q and out rows).
 * ------------------------------------------------------------------------------------------------- */
/* The most query heads a decode takes: with at most 8 query tokens, every row count and offset a
 * backend computes from them stays far inside 32 bits. */
#define PKV_MAX_Q_HEADS 1024

typedef struct pkv_decode_args {
  uint32_t struct_size;
  uint32_t layer;
  const pkv_seq *seqs;
  uint32_t count;       /* batch size */
  uint32_t q_heads;     /* a multiple of the pool's kv_heads, at most PKV_MAX_Q_HEADS */
  uint32_t q_tokens;    /* query tokens per sequence, 1..8: the newest q_tokens positions, already
                           appended and written; token i sees the context up to and including itself */
  float scale;          /* softmax scale; 0 selects 1/sqrt(head_dim) */
  pkv_format q_format;  /* F32, F16 or BF16 */
  pkv_format out_format;/* F32, F16 or BF16 */
  pkv_memory memory;    /* where q, out and lse live */
  const void *q;        /* [count][q_tokens][q_heads][head_dim] */
  void *out;            /* [count][q_tokens][q_heads][head_dim] */
  float *lse;           /* NULL, or [count][q_tokens][q_heads] floats whatever q_format and out_format
                           are: natural-log sum of exp(scale q.k) */
  uint32_t chunk_pages; /* 0: the planner splits contexts; N: each split-K chunk covers at most N pages
                           (UINT32_MAX: no split); results agree within rounding either way */
  /* Attention variants (section 7a); each is off at its zero value. */
  const float *sinks;        /* NULL, or [q_heads] where `memory` says: a sink logit per query head */
  const float *alibi_slopes; /* NULL, or [q_heads] where `memory` says: an ALiBi slope per query head */
  uint32_t window;           /* 0, or a sliding window of this many positions */
  float softcap;             /* 0, or the logits' soft cap */
} pkv_decode_args;
#define PKV_DECODE_ARGS_INIT                                                                        \
  { (uint32_t)sizeof(pkv_decode_args), 0, NULL, 0, 0, 1, 0.0f, PKV_FORMAT_F32, PKV_FORMAT_F32,       \
    PKV_MEMORY_HOST, NULL, NULL, NULL, 0, NULL, NULL, 0, 0.0f }

PKV_API pkv_status pkv_decode(pkv_pool *pool, const pkv_decode_args *args);

/* Decode inside a captured CUDA graph. pkv_decode_prepare does everything of pkv_decode except the
 * attention itself: it applies queued page-table changes and puts the batch's split-K plan (its
 * sequences, lengths and chunks) into the pool's plan buffer on the device; q, out and lse are not
 * read. A pkv_decode of the same batch (same sequences with the same lengths, same q_tokens and
 * chunk_pages) that follows then only launches kernels: no upload, no allocation, no host
 * synchronisation, and every address it reads is fixed for the pool's life.
 *
 * So an engine on the CUDA backend with memory = PKV_MEMORY_DEVICE may capture its decode calls in a
 * graph on the context's stream (pkv_context_desc.stream): call pkv_decode_prepare, capture the
 * pkv_decode calls of the step, and later, after appending and writing new tokens, call
 * pkv_decode_prepare with the new state of the batch and replay the graph: the replay decodes the
 * prepared batch. Keep count, q_heads, q_tokens, the formats and the q/out/lse buffers of the capture.
 * A pkv_decode that would need an upload while its stream is capturing fails with
 * PKV_ERR_INVALID_ARGUMENT and changes nothing. On the CPU backend pkv_decode_prepare only applies
 * the table changes. */
PKV_API pkv_status pkv_decode_prepare(pkv_pool *pool, const pkv_decode_args *args);

/* ---------------------------------------------------------------------------------------------------
 * 7a. Attention variants (pkv_decode_args and pkv_extend_args alike)
 *
 * Per call, so that each layer passes its own; any combination; each off at its zero value (so a
 * program built before they existed gets plain attention). For a query at position P (decode: token t
 * of T at P = L - T + t; extend: P = L_b - T_b + i), query head h and a position j it sees, in order:
 *   1. s = scale * q . k_j                               (scale as before: 0 selects 1/sqrt(head_dim))
 *   2. softcap > 0:        s = softcap * tanh(s / softcap)       (Gemma 2: scale first, then the cap)
 *   3. alibi_slopes:       s = s - alibi_slopes[h] * (P - j)
 *   4. window > 0:         positions j <= P - window are not seen: the query sees (P - window, P]
 *                          (besides causality and an extend's mask)
 *   5. sinks:              out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sinks[h])): the sink joins the
 *                          denominator once (however the backend splits the positions) and adds no value
 * lse is the natural log of that denominator: log(sum_j e^(s_j) [+ e^(sinks[h])]). A query that sees no
 * position (an empty decode sequence) gives out = 0 and lse = sinks[h], or -infinity without sinks.
 * Valid values: softcap finite and >= 0; every slope finite and >= 0; every sink finite (any sign);
 * any window. sinks and alibi_slopes (q_heads floats each) live where `memory` says, as q does: with
 * PKV_MEMORY_DEVICE they stay on the device (a model's weights; a captured graph reads them there)
 * and their values are the caller's to keep valid (a NaN gives NaN rows); in host memory they are
 * checked, and read before the call returns. Every backend runs every variant in pkv_decode and
 * pkv_extend.
 *
 * A sequence whose early positions no query will see again (every layer of the pool windowed) can give
 * their pages back with pkv_seq_release_before. An engine whose model mixes windowed and full layers
 * (Gemma 2/3, gpt-oss) keeps one pool for each kind of layer: docs/api.md shows how.
 * ------------------------------------------------------------------------------------------------- */

/* Releases positions [0, position) of seq: every page wholly before `position` returns to the pool at
 * once (a page still shared with a fork only loses this holder: the fork keeps it). The sequence's
 * length and its later pages stay. position <= the sequence's length; a position at or below an
 * earlier release changes nothing. Afterwards a pkv_decode, pkv_decode_prepare, pkv_extend, pkv_read or
 * pkv_write that needs a released position fails with PKV_ERR_INVALID_ARGUMENT (naming the sequence
 * and the position) and changes nothing, as do pkv_seq_truncate below `position` and, with
 * PKV_ERR_UNSUPPORTED, pkv_seq_export(_size) and pkv_seq_page_spans of the sequence (an image holds
 * every page). A fork of the sequence inherits its released positions. */
PKV_API pkv_status pkv_seq_release_before(pkv_pool *pool, pkv_seq seq, uint32_t position);

/* ---------------------------------------------------------------------------------------------------
 * 8. Statistics and format helpers
 * ------------------------------------------------------------------------------------------------- */
typedef struct pkv_pool_stats {
  uint32_t struct_size;
  uint32_t pages_total;
  uint32_t pages_free;
  uint32_t pages_shared;    /* pages held by more than one sequence */
  uint32_t sequences_live;
  uint32_t max_sequences;
  uint64_t tokens_live;     /* sum of the live sequences' lengths */
  uint64_t bytes_total;     /* device bytes of all pages, all layers, K and V */
  uint64_t bytes_per_page;  /* one page id: all layers, K and V, scales included */
  uint64_t bytes_per_token; /* K/V bytes one token stores over all layers, scales included */
} pkv_pool_stats;
#define PKV_POOL_STATS_INIT { (uint32_t)sizeof(pkv_pool_stats), 0, 0, 0, 0, 0, 0, 0, 0, 0 }

PKV_API pkv_status pkv_pool_get_stats(pkv_pool *pool, pkv_pool_stats *out);

/* Converts n values (a multiple of 32 for Q8_0/Q4_0) between F32 and another format's row encoding.
 * Q8_0 and Q4_0 use ggml's block layout (34- and 18-byte blocks: fp16 scale, then the quants), so
 * engines can import and export rows in the form they already use; FP8 rows are one code a value,
 * with no scale (a scale of 1). */
PKV_API pkv_status pkv_convert_from_f32(pkv_format dst_format, const float *src, size_t n, void *dst);
PKV_API pkv_status pkv_convert_to_f32(pkv_format src_format, const void *src, size_t n, float *dst);
/* Bytes n values take in a format's row encoding (0 when n is not valid for the format). */
PKV_API size_t pkv_format_row_bytes(pkv_format format, size_t n);

/* ---------------------------------------------------------------------------------------------------
 * 9. Export and import of sequences; the pool's memory for transfer engines
 *
 * An image is one sequence's K/V in the pool's own page format (quants and scales as stored), for a
 * range of layers: a 128-byte header (magic, version, geometry, formats, page size, length, layer
 * range and checksums; docs/design.md gives its fields) followed by the payload, the sequence's pages
 * [layer][page], each page of a layer its K part then its V part as the pool stores them. An engine
 * swaps a sequence out with pkv_seq_export + pkv_seq_free and back in with pkv_seq_import, which
 * gives bit-identical pages (docs/api.md); the image is also what a file saves.
 * ------------------------------------------------------------------------------------------------- */
#define PKV_SEQ_IMAGE_VERSION 1   /* the image version this library writes (and the newest it reads) */
#define PKV_SEQ_IMAGE_HEADER_BYTES 128

typedef struct pkv_export_args {
  uint32_t struct_size;
  pkv_seq seq;
  uint32_t first_layer;
  uint32_t layer_count; /* 0: every layer from first_layer on */
  pkv_memory memory;    /* where image lives; PKV_MEMORY_DEVICE images are 16-byte aligned */
  void *image;
  uint64_t image_bytes; /* bytes at image: at least what pkv_seq_export_size answers */
} pkv_export_args;
#define PKV_EXPORT_ARGS_INIT { (uint32_t)sizeof(pkv_export_args), { 0 }, 0, 0, PKV_MEMORY_HOST, NULL, 0 }

/* The bytes an export of args->seq and its layer range takes (args->memory, image and image_bytes
 * are not read): the header plus layers x pages x (K part + V part) bytes. */
PKV_API pkv_status pkv_seq_export_size(pkv_pool *pool, const pkv_export_args *args, uint64_t *bytes);

/* Writes the image of args->seq's layers [first_layer, first_layer + layer_count) into args->image.
 * Ordered on the context's stream after the work queued before it, and, on a GPU backend:
 *   - PKV_MEMORY_DEVICE and PKV_MEMORY_HOST_PINNED: asynchronous; the image is complete once the
 *     stream has run past the call (pkv_context_synchronize, or work the engine orders after it);
 *   - PKV_MEMORY_HOST: synchronous, through the library's pinned buffers: complete on return.
 * The CPU backend is synchronous for every memory kind. The sequence may be freed or written right
 * after the call: the stream runs the export first. Slots past the sequence's length in its last page
 * are exported as the page holds them. */
PKV_API pkv_status pkv_seq_export(pkv_pool *pool, const pkv_export_args *args);

typedef struct pkv_import_args {
  uint32_t struct_size;
  pkv_memory memory;    /* where image lives; PKV_MEMORY_DEVICE images are 16-byte aligned */
  const void *image;
  uint64_t image_bytes; /* bytes at image: at least the header's and the payload's */
} pkv_import_args;
#define PKV_IMPORT_ARGS_INIT { (uint32_t)sizeof(pkv_import_args), PKV_MEMORY_HOST, NULL, 0 }

/* A new sequence in this pool holding an image's tokens: its length, and in the image's layers the
 * image's pages bit for bit (the pool's other layers hold no K/V until pkv_write fills them). The
 * pool must have the image's geometry: layers, kv_heads, head_dim, page_size, k_format and v_format
 * (a mismatch is PKV_ERR_INVALID_ARGUMENT naming the field), and the length must fit its
 * max_sequence_length. A header or payload whose checksum does not match, a truncated image and an
 * unknown magic are PKV_ERR_INVALID_ARGUMENT; an image version newer than PKV_SEQ_IMAGE_VERSION is
 * PKV_ERR_VERSION. Transactional like pkv_append: on any failure no sequence is created and no page
 * taken (PKV_ERR_OUT_OF_SEQUENCES, PKV_ERR_OUT_OF_PAGES when the pool is short). Synchronous for every
 * memory kind: the payload's checksum is verified before the call returns, so the image may be
 * reused at once. Written in the stream's order: work queued before the call may still write the
 * image's memory (an export into it) and is waited for. */
PKV_API pkv_status pkv_seq_import(pkv_pool *pool, const pkv_import_args *args, pkv_seq *out);

/* Memory of the pool that a transfer engine (NIXL, UCX) may register and move pages in directly:
 * device memory on a GPU backend (a CUdeviceptr / hipDeviceptr_t), host memory on the CPU backend. */
typedef struct pkv_memory_region {
  uint64_t address;
  uint64_t bytes;
} pkv_memory_region;

/* The pool's regions: *count is set to how many there are (1 today: all pages, every layer, are one
 * allocation), and the first min(capacity, *count) are written to regions (NULL with capacity 0: the
 * count alone). The regions stay where they are for the pool's life. */
PKV_API pkv_status pkv_pool_regions(pkv_pool *pool, pkv_memory_region *regions, uint32_t capacity, uint32_t *count);

/* Where one K or V part of one page of one layer of a sequence lies. */
typedef struct pkv_page_span {
  uint32_t region; /* index in pkv_pool_regions' list */
  uint32_t layer;
  uint32_t index;  /* the page's place in the sequence: tokens [index * page_size, (index + 1) * page_size) */
  uint32_t part;   /* 0: K, 1: V (V's part follows K's in memory: offset + bytes) */
  uint64_t offset; /* bytes from the region's address */
  uint64_t bytes;
} pkv_page_span;

/* The spans of seq's pages in layers [first_layer, first_layer + layer_count) (layer_count 0: to the
 * last layer), in the order of an image's payload: [layer][page][K, V]. *count is set to their number
 * (2 x layers x the sequence's pages); spans NULL with capacity 0 asks for the count alone, else
 * capacity must hold them all. A transfer engine moves span i of one pool to span i of another's
 * sequence of the same length and formats; the decode side's queued page-table changes are applied
 * by its next pkv_write, pkv_read, pkv_decode or pkv_decode_prepare (docs/api.md, "Transfer engines"). */
PKV_API pkv_status pkv_seq_page_spans(pkv_pool *pool, pkv_seq seq, uint32_t first_layer, uint32_t layer_count,
                                      pkv_page_span *spans, uint64_t capacity, uint64_t *count);

/* ---------------------------------------------------------------------------------------------------
 * 10. Extend
 *
 * Attention for a ragged number of new query tokens per sequence over that sequence's pages: prefill
 * in chunks, the new prompt tokens of a sequence forked from a cached prefix, speculative chains or
 * trees of any length. For each entry b < count, the queries are rows [q_offsets[b], q_offsets[b+1])
 * of q (T_b = q_offsets[b+1] - q_offsets[b] of them, 0 <= T_b <= the sequence's length L_b): the
 * newest T_b positions of the sequence, already appended and written. Query i of entry b sits at
 * position P = L_b - T_b + i and, for each query head h (K and V of KV head h / (q_heads / kv_heads)):
 *   out[q_offsets[b] + i][h] = softmax(scale q . K^T) V over the positions it sees:
 *   - mask NULL (causal): positions [0, P];
 *   - with a mask: every position before the new tokens, [0, L_b - T_b), and new token j (position
 *     L_b - T_b + j) where bit j of the entry's row i is set.
 * An entry with T_b = 0 (an empty sequence has no other) has no rows and changes nothing. A sequence
 * may appear more than once in one call (each entry has its own rows).
 *
 * The mask (tree-shaped speculation): entry b's mask is T_b rows of ceil(T_b / 8) bytes at
 * mask + mask_offsets[b]; row i's bit j is byte j / 8, bit j % 8 (least significant first), and the
 * bits past T_b in a row's last byte are ignored. Row i must have bit i set (a query sees itself) and
 * no bit j > i (nor does it see a later new token), so the causal mask is the full lower triangle.
 * Entries may share a mask's bytes (the same tree for every sequence: equal offsets).
 *
 * The CPU backend computes extend in float32 with an online softmax, as decode; with T_b <= 8 it gives
 * the bits pkv_decode gives with q_tokens = T_b and chunk_pages = UINT32_MAX. The CUDA backend runs
 * an entry of 64 or more new tokens on a kernel of its own (tiles of 64 query rows on the tensor cores;
 * F16, BF16, Q8_0 and FP8 pages, Q4_0 K at head_dim 256; no mask or variant), the rest through its
 * decode kernels, 8 new tokens a work item, as the HIP backend runs every entry (docs/api.md says
 * which pairs take which).
 *
 * The attention variants of section 7a (a sliding window, logit soft-capping, attention sinks, ALiBi
 * slopes) apply here as in pkv_decode: the window on top of causality or the mask.
 * ------------------------------------------------------------------------------------------------- */
typedef struct pkv_extend_args {
  uint32_t struct_size;
  uint32_t layer;
  const pkv_seq *seqs;          /* [count] */
  uint32_t count;               /* entries */
  uint32_t q_heads;             /* a multiple of the pool's kv_heads, at most PKV_MAX_Q_HEADS */
  const uint32_t *q_offsets;    /* [count + 1], host memory: q_offsets[0] = 0, non-decreasing */
  float scale;                  /* softmax scale; 0 selects 1/sqrt(head_dim) */
  pkv_format q_format;          /* F32, F16 or BF16 */
  pkv_format out_format;        /* F32, F16 or BF16 */
  pkv_memory memory;            /* where q, out and lse live */
  const void *q;                /* [q_offsets[count]][q_heads][head_dim] */
  void *out;                    /* [q_offsets[count]][q_heads][head_dim] */
  float *lse;                   /* NULL, or [q_offsets[count]][q_heads]: natural-log sum of exp(scale q.k) */
  const uint8_t *mask;          /* NULL: causal; else host memory, the layout above */
  const uint64_t *mask_offsets; /* with a mask: [count], host memory: entry b's rows start at mask + this */
  uint64_t mask_bytes;          /* with a mask: the bytes at mask; every entry's rows lie inside them */
  /* Attention variants (section 7a); each is off at its zero value. */
  const float *sinks;           /* NULL, or [q_heads] where `memory` says: a sink logit per query head */
  const float *alibi_slopes;    /* NULL, or [q_heads] where `memory` says: an ALiBi slope per query head */
  uint32_t window;              /* 0, or a sliding window of this many positions */
  float softcap;                /* 0, or the logits' soft cap */
} pkv_extend_args;
#define PKV_EXTEND_ARGS_INIT                                                                        \
  { (uint32_t)sizeof(pkv_extend_args), 0, NULL, 0, 0, NULL, 0.0f, PKV_FORMAT_F32, PKV_FORMAT_F32,    \
    PKV_MEMORY_HOST, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, 0, 0.0f }

/* Whatever the entries' rows, a call attends at most PKV_MAX_EXTEND_ROWS query rows
 * (q_offsets[count] x q_heads), so that a backend counts them in 32 bits. */
#define PKV_MAX_EXTEND_ROWS 0xffffffffu

PKV_API pkv_status pkv_extend(pkv_pool *pool, const pkv_extend_args *args);

/* Extend inside a captured CUDA graph, as pkv_decode_prepare does for decode. pkv_extend_prepare does
 * everything of pkv_extend except the attention itself: it applies queued page-table changes and puts
 * the batch's plans (and its mask) on the device; q, out and lse are not read (they may be NULL). A
 * pkv_extend of the same batch (same sequences with the same lengths, q_offsets and mask) that follows
 * then only launches kernels, at addresses fixed for the pool's life for batches of its size.
 *
 * So an engine on the CUDA backend with memory = PKV_MEMORY_DEVICE may capture its extend calls (a
 * speculative verify step, a prefill chunk of a fixed shape) in a graph on the context's stream: call
 * pkv_extend_prepare, capture the step's pkv_extend calls, and later, after appending and writing the
 * new tokens, call pkv_extend_prepare with the new state of the batch and replay. Keep count, q_heads,
 * the token counts of q_offsets, the mask's size, the formats and the q/out/lse buffers of the
 * capture; the pool's last prepared batch is what its replays attend, so an engine that captured
 * several shapes prepares the one it replays. An extend that would need an upload while its stream is
 * capturing fails with PKV_ERR_INVALID_ARGUMENT, one whose entries of fewer than 64 new tokens (or any
 * entry with a mask or variant) would run on a decode kernel other than the tensor-core one with
 * PKV_ERR_UNSUPPORTED; either changes nothing. On the CPU backend pkv_extend_prepare only applies the
 * table changes. */
PKV_API pkv_status pkv_extend_prepare(pkv_pool *pool, const pkv_extend_args *args);

/* ---------------------------------------------------------------------------------------------------
 * 11. Function table for runtime loaders
 *
 * A program that opens the library at run time (dlopen, LoadLibrary, FFI) needs one symbol,
 * pkv_get_api, and calls everything else through the table it returns; include/pagedkv_loader.h does
 * this for C and C++. The table is append-only: a function added later goes at the end under a new
 * PKV_API_VERSION, and no entry is ever moved, removed or retyped, so a library offering version N
 * serves every caller that asks for a version from 1 to N. Entries are named after the functions
 * without their pkv_ prefix; version 1's follow this header's order. docs/abi.md states the rules.
 * ------------------------------------------------------------------------------------------------- */
#define PKV_API_VERSION 7

typedef struct pkv_api {
  uint32_t struct_size; /* sizeof the library's table */
  uint32_t api_version; /* the newest version the library offers: entries up to it are set */
  /* version 1 */
  uint32_t (*version)(void);
  const char *(*version_string)(void);
  const char *(*status_string)(pkv_status status);
  const char *(*last_error)(void);
  const char *(*backend_name)(pkv_backend backend);
  const char *(*format_name)(pkv_format format);
  pkv_status (*context_create)(const pkv_context_desc *desc, pkv_context **out);
  pkv_status (*context_destroy)(pkv_context *ctx);
  pkv_status (*context_backend)(const pkv_context *ctx, pkv_backend *out);
  pkv_status (*context_synchronize)(pkv_context *ctx);
  pkv_status (*context_read_bandwidth)(pkv_context *ctx, uint64_t bytes, double *gb_per_s);
  pkv_status (*backend_query)(pkv_backend backend, pkv_backend_info *info);
  pkv_status (*pool_create)(pkv_context *ctx, const pkv_pool_desc *desc, pkv_pool **out);
  pkv_status (*pool_destroy)(pkv_pool *pool);
  pkv_status (*seq_alloc)(pkv_pool *pool, pkv_seq *out);
  pkv_status (*seq_free)(pkv_pool *pool, pkv_seq seq);
  pkv_status (*seq_fork)(pkv_pool *pool, pkv_seq parent, pkv_seq *child);
  pkv_status (*seq_truncate)(pkv_pool *pool, pkv_seq seq, uint32_t new_length);
  pkv_status (*seq_length)(pkv_pool *pool, pkv_seq seq, uint32_t *out);
  pkv_status (*append)(pkv_pool *pool, const pkv_seq *seqs, const uint32_t *n_new, uint32_t count);
  pkv_status (*write)(pkv_pool *pool, const pkv_write_args *args);
  pkv_status (*read)(pkv_pool *pool, const pkv_read_args *args);
  pkv_status (*decode)(pkv_pool *pool, const pkv_decode_args *args);
  pkv_status (*pool_get_stats)(pkv_pool *pool, pkv_pool_stats *out);
  pkv_status (*convert_from_f32)(pkv_format dst_format, const float *src, size_t n, void *dst);
  pkv_status (*convert_to_f32)(pkv_format src_format, const void *src, size_t n, float *dst);
  size_t (*format_row_bytes)(pkv_format format, size_t n);
  /* version 2 */
  pkv_status (*decode_prepare)(pkv_pool *pool, const pkv_decode_args *args);
  /* version 3 */
  pkv_status (*seq_export_size)(pkv_pool *pool, const pkv_export_args *args, uint64_t *bytes);
  pkv_status (*seq_export)(pkv_pool *pool, const pkv_export_args *args);
  pkv_status (*seq_import)(pkv_pool *pool, const pkv_import_args *args, pkv_seq *out);
  pkv_status (*pool_regions)(pkv_pool *pool, pkv_memory_region *regions, uint32_t capacity, uint32_t *count);
  pkv_status (*seq_page_spans)(pkv_pool *pool, pkv_seq seq, uint32_t first_layer, uint32_t layer_count,
                               pkv_page_span *spans, uint64_t capacity, uint64_t *count);
  /* version 4 */
  pkv_status (*extend)(pkv_pool *pool, const pkv_extend_args *args);
  /* version 5 */
  pkv_status (*seq_release_before)(pkv_pool *pool, pkv_seq seq, uint32_t position);
  /* version 6 */
  pkv_status (*pool_set_scales)(pkv_pool *pool, const pkv_scales_args *args);
  pkv_status (*pool_get_scales)(pkv_pool *pool, uint32_t first_layer, uint32_t layer_count, float *k_scales,
                                float *v_scales);
  /* version 7 */
  pkv_status (*extend_prepare)(pkv_pool *pool, const pkv_extend_args *args);
} pkv_api;

/* Sets *out to the library's table when it offers `version` (from 1 to the library's PKV_API_VERSION;
 * pass the PKV_API_VERSION of the header compiled against). Any other version gives PKV_ERR_VERSION,
 * with a last-error text naming the version asked for and the versions offered. The table is static
 * and valid while the library stays loaded. pkv_get_api itself is not in the table: whoever holds
 * the table has already resolved it. */
PKV_API pkv_status pkv_get_api(uint32_t version, const pkv_api **out);

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_H */
