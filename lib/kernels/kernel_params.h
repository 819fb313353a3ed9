/* The arguments of the CUDA kernels: plain structs, fixed-width fields only, so the host compiler and
 * nvcc lay them out alike. Each kernel takes one of them by value. */
#ifndef PKV_CUDA_KERNEL_PARAMS_H
#define PKV_CUDA_KERNEL_PARAMS_H

#include <stdint.h>

/* Where a row of one format lives inside a page part (lib/format.hpp's PlaneLayout). */
typedef struct PkvPlane {
  uint32_t format; /* pkv_format */
  uint32_t row_data_bytes;
  uint32_t row_scale_bytes;
  uint32_t reserved;
  uint64_t scale_offset;
} PkvPlane;

typedef struct PkvPool {
  uint64_t base;        /* the pages */
  uint64_t table;       /* uint32_t [max_sequences][table_stride] */
  uint64_t block_bytes; /* one (layer, page) block: K part then V part */
  uint64_t k_bytes;     /* the V part starts here */
  uint32_t layers, kv_heads, head_dim, page_size, pages, table_stride, max_sequences;
  uint32_t page_shift; /* log2(page_size): tokens to pages by shifts */
  PkvPlane k, v;
  uint64_t scales;     /* float [2][layers][kv_heads]: K's then V's FP8 scales */
} PkvPool;

typedef struct PkvTableEntry {
  uint32_t seq_slot, index, page;
} PkvTableEntry;

typedef struct PkvTableParams {
  PkvPool pool;
  uint64_t entries; /* PkvTableEntry [count] */
  uint32_t count;
  uint32_t reserved;
} PkvTableParams;

typedef struct PkvRowSlot {
  uint32_t page, slot;
} PkvRowSlot;

/* Scatter (rows into pages) and gather (pages into rows). */
typedef struct PkvRowsParams {
  PkvPool pool;
  uint64_t slots; /* PkvRowSlot [rows] */
  uint64_t k, v;  /* [rows][kv_heads][head_dim] in `format`; gather skips a zero pointer */
  uint32_t rows, layer, format, reserved;
} PkvRowsParams;

typedef struct PkvPageCopy {
  uint32_t src, dst;
} PkvPageCopy;

typedef struct PkvCopyParams {
  PkvPool pool;
  uint64_t copies; /* PkvPageCopy [count] */
  uint32_t count, reserved;
} PkvCopyParams;

/* A sequence image's payload (lib/seq_image.hpp): blocks (layer, page), [layer][page] over `count`
 * pages from layer first_layer, copied between the pool and `payload`, which holds the `blocks`
 * blocks from first_block on; the checksum terms of the payload's words are added to the uint64_t at
 * `sum`. */
typedef struct PkvImageParams {
  PkvPool pool;
  uint64_t pages;       /* uint32_t [count]: the sequence's pages */
  uint64_t payload;     /* block first_block's bytes, the later blocks after it */
  uint64_t sum;
  uint64_t first_block, blocks;
  uint32_t count, first_layer;
  uint32_t to_image;    /* 1: pool to payload (export); 0: payload to pool (import) */
  uint32_t reserved;
} PkvImageParams;

/* A plan record (lib/plan.hpp's PlanRecord): a chunk of a sequence, every KV head's for the CUDA-core
 * and generic kernels (the grid gives the head), one KV head's for the tensor-core kernel, whose items
 * are (record, row tile); seq UINT32_MAX: a balanced plan's filler, which its block skips. */
typedef struct PkvRecord {
  uint32_t seq, token_begin, token_end;
  uint32_t part; /* a split sequence's partial-result slot; UINT32_MAX: the sequence's only chunk */
  /* The sequence's own, repeated in each of its chunks so that a block reads its item in one go: */
  uint32_t slot;       /* page-table row */
  uint32_t length;     /* the positions from `start` the plan covers */
  uint32_t first_part; /* part of the first chunk of the sequence (and head), when split */
  uint32_t siblings;   /* how many chunks the sequence (and head) has */
  uint32_t head;       /* the KV head (tensor-core kernel); UINT32_MAX: every one */
  uint32_t start;      /* the sequence's position of token 0: token t lies at position start + t */
  uint32_t q_row;      /* the record's first query token's row of q, out and lse ([row][q_heads]) */
  uint32_t tokens;     /* its query tokens: token i (of rows q_row + i) sees [0, length - tokens + i] */
  /* An extend's tree mask (mask_stride 0: causal): token i's row of bits is mask_stride bytes at
   * PkvDecodeParams.mask + mask + i * mask_stride; bit j covers the sequence's position new_begin + j. */
  uint32_t mask_stride;
  uint32_t new_begin;
  uint64_t mask;
} PkvRecord;

/* The start of a pool's plan buffer. The arrays after it sit at offsets fixed by the pool's capacity
 * (max_sequences, most chunks), so a captured kernel keeps finding them as batches change. */
typedef struct PkvPlanHeader {
  uint32_t n_records, count, parts, reserved;
} PkvPlanHeader;

/* Decode: partial attention per (chunk, KV head, tile of query rows); split sequences are merged by
 * the last block to finish one of their chunks (the tensor-core kernel) or by a merge kernel. */
typedef struct PkvDecodeParams {
  PkvPool pool;
  uint64_t plan;       /* PkvPlanHeader, in the pool's plan buffer */
  uint64_t records;    /* PkvRecord [n_records] */
  uint64_t seq_chunks; /* uint32_t [count + 1] */
  uint64_t q, out, lse;
  uint64_t part_out;   /* float [parts][q_tokens][q_heads][head_dim] */
  uint64_t part_lse;   /* float [parts][q_tokens][q_heads] */
  uint64_t counters;   /* uint32_t [parts][kv_heads][row_tiles], zero between calls: finished chunks */
  uint32_t layer, count, q_heads, n_chunks; /* count and chunks as planned on the host (CUDA-core, generic kernels) */
  uint32_t q_tokens;   /* the most query tokens a record has (the rows of a part per query head) */
  uint32_t row_tiles;  /* blocks' tiles of query rows per KV head */
  uint32_t q_format, out_format;
  float scale;
  uint32_t mtiles;     /* tensor-core kernel: tiles of PKV_MMA_ROWS query rows a block serves, 1 or 2 */
  uint32_t q_aligned;  /* q is 16-byte aligned: rows are read 16 bytes at a time */
  /* The attention variants (pagedkv.h section 7a; lib/kernels/variants.cuh), each off at zero: */
  uint32_t window;     /* a query at position P sees (P - window, P] */
  float softcap;       /* s = softcap * tanh(s / softcap) */
  uint32_t transform;  /* 1: window, softcap or slopes change scores (every round masks) */
  uint64_t sinks;      /* float [q_heads] on the device: a sink logit per query head */
  uint64_t slopes;     /* float [q_heads] on the device: an ALiBi slope per query head */
  uint64_t mask;       /* an extend's tree masks on the device (PkvRecord.mask counts from here) */
} PkvDecodeParams;

/* The tensor-core extend (extend_tensor_core.cu): a block attends one tile of PKV_EXTEND_ROWS query
 * rows (a sequence's new tokens times its KV head's GQA group, token-major) causally over the
 * sequence's positions, reading each stage of K and V rows once for all of them. */
#define PKV_EXTEND_ROWS 64  /* query rows a block: 16 a warp */
#define PKV_EXTEND_KEYS 64  /* positions a stage */
#define PKV_EXTEND_STAGES 2
typedef struct PkvExtendItem {
  uint32_t slot;   /* page-table row */
  uint32_t length; /* the sequence's positions; its new tokens are the last `tokens` of them */
  uint32_t tokens;
  uint32_t q_row;  /* the first new token's row of q, out and lse ([row][q_heads]) */
  uint32_t head;   /* the KV head */
  uint32_t tile;   /* the block's rows: tile * PKV_EXTEND_ROWS on, of tokens * group */
  uint32_t reserved[2];
} PkvExtendItem;

typedef struct PkvExtendParams {
  PkvPool pool;
  uint64_t items; /* PkvExtendItem [count], a block each */
  uint64_t q, out, lse;
  uint32_t count, layer, q_heads, q_format, out_format;
  float scale;
} PkvExtendParams;

/* A stage's row of a plane of format `format` (pkv_format numbers): F16 and BF16 rows as the MMAs take
 * them, padded by 16 bytes (a matrix load's eight rows then fall in different banks); Q8_0, Q4_0 and
 * FP8 rows as the pages hold them (data, then a quantized row's f16 group scales), to 16 bytes, widened
 * to padded F16 rows in a buffer of their own before the MMAs. */
static constexpr int pkv_extend_wide(uint32_t format) { return format == 2 || format == 3; }
static constexpr uint32_t pkv_extend_row_bytes(uint32_t head_dim, uint32_t format) {
  return pkv_extend_wide(format) ? 2 * head_dim + 16
         : format == 5           ? (head_dim / 2 + head_dim / 16 + 15) / 16 * 16
         : format == 4           ? (head_dim + head_dim / 16 + 15) / 16 * 16
                                 : head_dim;
}
/* Shared memory of a block: the stages' K and V rows, the widened K and V rows where a plane is not
 * F16 or BF16, then q in `q_parts` parts (padded 16-bit rows). */
static constexpr uint32_t pkv_extend_shared_bytes(uint32_t head_dim, uint32_t k_format, uint32_t v_format,
                                                  uint32_t q_parts) {
  return PKV_EXTEND_KEYS * (PKV_EXTEND_STAGES * (pkv_extend_row_bytes(head_dim, k_format) +
                                                 pkv_extend_row_bytes(head_dim, v_format)) +
                            (2 - pkv_extend_wide(k_format) - pkv_extend_wide(v_format)) * (2 * head_dim + 16)) +
         q_parts * PKV_EXTEND_ROWS * (2 * head_dim + 16);
}

/* A read-only pass over `bytes` (a multiple of 16) for the bandwidth measurement. */
typedef struct PkvReadParams {
  uint64_t data;
  uint64_t bytes;
  uint64_t sink; /* uint32_t, written only if the xor of everything read is a value nobody expects */
} PkvReadParams;

/* The generic decode kernel (decode_generic.cu): query heads one block serves (a larger GQA group
 * takes several blocks) and warps per block. */
#define PKV_HEAD_TILE 8
#define PKV_DECODE_WARPS 4

/* The specialised kernels (decode_cuda_core.cu): tokens per z-slice of a tile, shared-memory stages
 * in flight, most threads a block has. */
#define PKV_CUDA_CORE_TT 4
#define PKV_CUDA_CORE_STAGES 4
#define PKV_CUDA_CORE_MAX_THREADS 256

/* The tensor-core kernels (decode_tensor_core.cu): warps per tile of query rows, each warp taking
 * PKV_MMA_TOKENS tokens of a shared-memory stage; query rows a tile: PKV_MMA_ROWS for the wide tile
 * (a block serves one or two), PKV_MMA_NARROW_ROWS for the narrow one (one a block). */
#define PKV_MMA_WARPS 4
#define PKV_MMA_TOKENS 16
#define PKV_MMA_ROWS 16
#define PKV_MMA_NARROW_ROWS 8

/* Bytes the K (or V) rows of one stage of the tensor-core kernel take in shared memory (PKV_MMA_WARPS x
 * PKV_MMA_TOKENS rows): float rows as the page holds them with 16 bytes of padding after every 8
 * rows, quantized rows (data then scales) each padded to an odd number of 16-byte units; either way
 * the eight rows one matrix load or one quad of lanes reads fall in different banks. constexpr (every
 * includer is C++): lib/kernels/tensor_core/stage_layout.cuh checks its own layout against it at
 * compile time. */
static constexpr uint32_t pkv_mma_part_bytes(uint32_t data_and_scale_bytes, int quantized) {
  const uint32_t tokens = PKV_MMA_WARPS * PKV_MMA_TOKENS, units = (data_and_scale_bytes + 15) / 16;
  if (quantized) return tokens * (units % 2 ? units : units + 1) * 16;
  return tokens * data_and_scale_bytes + tokens / 8 * 16;
}

/* Bytes of the tensor-core kernel's widened stage where the pages are FP8 (0 otherwise): the K and V
 * rows of the stage being computed, widened to F16 rows in the float layout above. */
static constexpr uint32_t pkv_mma_widened_bytes(uint32_t head_dim, int fp8) {
  return fp8 ? 2 * pkv_mma_part_bytes(2 * head_dim, 0) : 0;
}

/* Bytes of one row tile's q fragments in the tensor-core kernel's shared memory (rows: the tile's
 * query rows): float K two 16-bit parts a value; quantized K two int8 parts a value and a float
 * scale a (row, 32-value group), or (f16_q: the narrow tile of several n-tiles) one f16 a value. */
static constexpr uint32_t pkv_mma_q_bytes(uint32_t head_dim, uint32_t rows, int k_quantized, int f16_q) {
  if (f16_q) return head_dim * rows * 2;
  if (k_quantized) return head_dim * rows * 2 + head_dim / 32 * rows * 4;
  return head_dim * rows * 4;
}

/* Bytes of one row tile's area where the tensor-core kernel's warps combine their results: the
 * outputs of `outputs` warps (each warp's, or one for the group tile, whose warps hold one output;
 * rows of head_dim + 8 floats: the padding spreads a column's rows over the banks), every warp's
 * maxima and sums. */
static constexpr uint32_t pkv_mma_combine_bytes(uint32_t head_dim, uint32_t rows, uint32_t outputs) {
  return (outputs * rows * (head_dim + 8) + 2 * PKV_MMA_WARPS * rows) * 4;
}

/* Shared-memory stages per block of the tensor-core kernel: two for head_dim 256 (a stage is large),
 * three otherwise (F16/BF16 pages of head_dim 128 then fit two blocks a multiprocessor, not three,
 * and measured faster: more bytes in flight per block). Those take 112 KB a block, more than sm_86
 * and sm_89 give (99 KB), so their kernels are compiled with two stages as well, for the host to
 * take where three do not fit (0: no such kernel). FP8 pages of head_dim 128 take two: a stage is
 * half an F16 one and its round waits on the widening, not on memory, so a third block a
 * multiprocessor (which two stages leave room for) hides more than a third stage (H100 A/B,
 * docs/perf/decisions.md). */
static inline uint32_t pkv_mma_stages(uint32_t head_dim, int fp8_pages) {
  return head_dim >= 256 || (head_dim == 128 && fp8_pages) ? 2 : 3;
}
static inline uint32_t pkv_mma_fewer_stages(uint32_t head_dim, int sixteen_bit_pages) {
  return head_dim == 128 && sixteen_bit_pages ? 2 : 0;
}

#endif
